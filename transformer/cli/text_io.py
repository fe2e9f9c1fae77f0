"""Batches and text streams of `evaluate.py`: batches moved to the device with a progress bar, lines
translated from stdin or a file, metrics and report images handed to the configured loggers."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, TextIO

import hydra
import torch
from omegaconf import DictConfig
from tqdm import tqdm

from transformer.cli.errors import ConfigError
from transformer.decoding import decode
from transformer.evaluation.restore import RestoredModel

log = logging.getLogger("evaluate")


def on_device(batches: Iterable[Mapping[str, Any]], device: torch.device) -> Iterator[dict[str, Any]]:
    for batch in batches:
        yield {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def progress(batches: Iterable[Any], total: int, desc: str, enabled: bool) -> Iterable[Any]:
    return tqdm(batches, total=total, desc=desc, unit="batch", file=sys.stderr, disable=not enabled)


def translate_stream(
    options: DictConfig, restored: RestoredModel, datamodule: Any, decoding: Any, device: torch.device
) -> None:
    """Translate lines from stdin or a file to stdout or a file, one output line per input line."""
    source, target = str(options.input), options.get("output")
    if source != "-" and not Path(source).is_file():
        raise ConfigError(f"translate.input={source} is not a file (use - for stdin)")
    interactive = source == "-" and sys.stdin.isatty()
    if interactive:
        log.info("Type a sentence and press Enter (Ctrl-D ends)")

    def translate_texts(texts: list[str]) -> list[str]:
        datamodule.predict_texts = texts
        outputs = [""] * len(texts)
        for batch in on_device(datamodule.predict_dataloader(), device):
            ids = decode(restored.model, batch["src"], decoding).tolist()
            for index, text in zip(batch["id"].tolist(), datamodule.tgt_tokenizer.decode_batch(ids)):
                outputs[index] = text
        return outputs

    with contextlib.ExitStack() as stack:
        reader = sys.stdin if source == "-" else stack.enter_context(open(source, encoding="utf-8"))
        writer = (
            sys.stdout
            if target in (None, "-")
            else stack.enter_context(open(str(target), "w", encoding="utf-8"))
        )
        chunk = 1 if interactive else options.get("chunk_lines", 256)
        stream_lines(reader, writer, translate_texts, chunk_lines=chunk)


def log_to_loggers(cfg: DictConfig, metrics: Mapping[str, float], files: Mapping[str, Path]) -> None:
    """Metrics (and, for wandb, the report's images) to the loggers configured with `logger=...`."""
    for name, node in (cfg.get("logger") or {}).items():
        if node is None:
            continue
        logger = hydra.utils.instantiate(node, _convert_="all")
        logger.log_metrics(dict(metrics))
        images = {key: path for key, path in files.items() if path.suffix == ".png"}
        if images and hasattr(logger, "log_image"):
            for key, path in sorted(images.items()):
                logger.log_image(key=f"eval/{key}", images=[str(path)])
        log.info("Logged metrics%s to logger %s", " and images" if images else "", name)
        if hasattr(logger, "finalize"):
            logger.finalize("success")
        if name == "wandb" and hasattr(logger, "experiment"):
            logger.experiment.finish()


def stream_lines(
    reader: Iterable[str],
    writer: TextIO,
    translate_texts: Callable[[list[str]], list[str]],
    *,
    chunk_lines: int,
) -> int:
    """Translate `reader`'s lines in chunks, writing one output line per input line (flushed per chunk).

    Blank lines stay blank without reaching `translate_texts`; chunk_lines=1 answers each line as
    soon as it is read (interactive use). Returns the number of lines written.
    """
    if isinstance(chunk_lines, bool) or not isinstance(chunk_lines, int) or chunk_lines < 1:
        raise ValueError(f"translate.chunk_lines must be an integer >= 1, got {chunk_lines!r}")
    written = 0

    def flush(lines: list[str]) -> None:
        nonlocal written
        texts = [line.strip() for line in lines]
        wanted = [i for i, text in enumerate(texts) if text]
        outputs = [""] * len(lines)
        if wanted:
            for i, text in zip(wanted, translate_texts([texts[i] for i in wanted]), strict=True):
                outputs[i] = " ".join(text.splitlines())  # one line out per line in
        writer.write("".join(f"{text}\n" for text in outputs))
        writer.flush()
        written += len(outputs)

    lines: list[str] = []
    for line in reader:
        lines.append(line.rstrip("\r\n"))
        if len(lines) >= chunk_lines:
            flush(lines)
            lines = []
    if lines:
        flush(lines)
    return written
