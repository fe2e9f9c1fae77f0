"""`aiayn-export`: a translation checkpoint -> a transformers or CTranslate2 directory.

    aiayn-export CKPT --to hf --output DIR [--force]
    aiayn-export CKPT --to ctranslate2 --output DIR [--quantization int8|int8_float32|float16|...] [--force]

Bad input (missing, truncated or unsafe checkpoint, a classification or masked-LM checkpoint, a setting
the target cannot express, an output directory that is not empty) ends with one `error:` line on
stderr, exit status 1, and nothing written; so does a full disk (the half-written directory is removed).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from transformer.interop.source import ExportError, check_output, write_failure

__all__ = ["OneLineParser", "main"]

TARGETS = {"hf": "transformers (MarianMTModel)", "ctranslate2": "CTranslate2"}


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors (an unknown choice, a value of the wrong type, a missing argument) are one
    `error:` line with the usage on it, exit status 1, as every user error of the project."""

    def error(self, message: str) -> NoReturn:
        usage = " ".join(self.format_usage().split())
        self.exit(1, f"error: {message} ({usage})\n")


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="aiayn-export",
        description="Export a translation checkpoint to Hugging Face transformers or CTranslate2.",
    )
    parser.add_argument("checkpoint", type=Path, help="a .ckpt file written by train.py")
    parser.add_argument("--to", required=True, choices=sorted(TARGETS), help="the target format")
    parser.add_argument("--output", required=True, type=Path, help="the directory to create")
    parser.add_argument(
        "--quantization",
        default=None,
        help="CTranslate2 weight type: int8, int8_float32, int8_float16, int8_bfloat16, int16, float16, "
        "bfloat16 or float32 (default: float32)",
    )
    parser.add_argument("--force", action="store_true", help="replace an output directory that is not empty")
    return parser


def _missing_dependency(module: str) -> str | None:
    try:
        importlib.import_module(module)
    except ImportError:
        return f"{module} is not installed: pip install -e '.[export]'"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from transformer.checkpoint import CheckpointError  # after parsing: --help stays fast

    try:
        if args.quantization is not None and args.to != "ctranslate2":
            raise ExportError("--quantization applies to --to ctranslate2 only")
        # before the slow part; checked again on writing
        check_output(args.output, force=args.force, keep=args.checkpoint)
        missing = _missing_dependency("transformers" if args.to == "hf" else "ctranslate2")
        if missing:
            raise ExportError(missing)
        from transformer.interop.source import load_source

        source = load_source(args.checkpoint)
        if args.to == "hf":
            from transformers.utils import logging as hf_logging

            from transformer.interop.export_hf import export_hf

            hf_logging.set_verbosity_error()
            hf_logging.disable_progress_bar()
            output = export_hf(source, args.output, force=args.force)
        else:
            from transformer.interop.ctranslate2 import export_ctranslate2

            output = export_ctranslate2(source, args.output, quantization=args.quantization, force=args.force)
    except (CheckpointError, ExportError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except Exception as err:  # a full disk (also as safetensors or CTranslate2 report it), or another OSError
        line = write_failure(err, args.output, f"cannot write {args.output}")
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr)
        return 1
    print(f"exported {args.checkpoint} to {TARGETS[args.to]}: {output.summary()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
