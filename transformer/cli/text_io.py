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
from transformer.evaluation.n_best import n_best_lines
from transformer.evaluation.scoring import n_best_texts
from transformer.search.decoding import DecodingSettings, search

log = logging.getLogger("evaluate")


def on_device(batches: Iterable[Mapping[str, Any]], device: torch.device) -> Iterator[dict[str, Any]]:
    for batch in batches:
        yield {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def progress(batches: Iterable[Any], total: int, desc: str, enabled: bool) -> Iterable[Any]:
    return tqdm(batches, total=total, desc=desc, unit="batch", file=sys.stderr, disable=not enabled)


def translate_stream(
    options: DictConfig,
    model: torch.nn.Module,
    datamodule: Any,
    decoding: DecodingSettings,
    device: torch.device,
) -> None:
    """Translate lines from stdin or a file to stdout or a file with `model` (one, or an ensemble): one
    output line per input line, or with decoding.n_best > 1 the n-best lines `id ||| hypothesis |||
    score` of every non-blank input line (id = its 0-based line number)."""
    source, target = str(options.input), options.get("output")
    if source != "-" and not Path(source).is_file():
        raise ConfigError(f"translate.input={source} is not a file (use - for stdin)")
    interactive = source == "-" and sys.stdin.isatty()
    if interactive:
        log.info("Type a sentence and press Enter (Ctrl-D ends)")

    config = model.config

    def translate_texts(texts: list[str]) -> list[list[tuple[str, float]]]:
        datamodule.predict_texts = texts
        outputs: list[list[tuple[str, float]]] = [[] for _ in texts]
        for batch in on_device(datamodule.predict_dataloader(), device):
            tokens, scores = search(model, batch["src"], decoding)
            lists = n_best_texts(
                tokens, scores, datamodule.tgt_tokenizer.decode_batch, config.eos_id, config.pad_id
            )
            for index, hypotheses in zip(batch["id"].tolist(), lists):
                outputs[index] = hypotheses
        return outputs

    with contextlib.ExitStack() as stack:
        reader = sys.stdin if source == "-" else stack.enter_context(open(source, encoding="utf-8"))
        writer = (
            sys.stdout
            if target in (None, "-")
            else stack.enter_context(open(str(target), "w", encoding="utf-8"))
        )
        chunk = 1 if interactive else options.get("chunk_lines", 256)
        if decoding.n_best > 1:
            stream_lines(reader, writer, translate_texts, chunk_lines=chunk, format_output=n_best_lines)
        else:
            stream_lines(
                reader,
                writer,
                lambda texts: [hyps[0][0] for hyps in translate_texts(texts)],
                chunk_lines=chunk,
            )


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


def _one_line(index: int, text: str) -> list[str]:
    return [" ".join(text.splitlines()) + "\n"]  # one line out per line in


def stream_lines(
    reader: Iterable[str],
    writer: TextIO,
    translate_texts: Callable[[list[str]], list[Any]],
    *,
    chunk_lines: int,
    format_output: Callable[[int, Any], list[str]] = _one_line,
) -> int:
    """Translate `reader`'s lines in chunks, writing each input line's output lines (flushed per chunk).

    `format_output(line number, translation)` gives the lines written for one input line (default: the
    text on one line). Blank lines stay blank (no n-best lines) without reaching `translate_texts`;
    chunk_lines=1 answers each line as soon as it is read (interactive use). Returns the number of
    input lines answered.
    """
    if isinstance(chunk_lines, bool) or not isinstance(chunk_lines, int) or chunk_lines < 1:
        raise ValueError(f"translate.chunk_lines must be an integer >= 1, got {chunk_lines!r}")
    written = 0
    blank = format_output is _one_line  # a blank line answers with a blank line; no n-best lines

    def flush(lines: list[str]) -> None:
        nonlocal written
        texts = [line.strip() for line in lines]
        wanted = [i for i, text in enumerate(texts) if text]
        outputs = [["\n"] if blank else [] for _ in lines]
        if wanted:
            for i, translation in zip(wanted, translate_texts([texts[i] for i in wanted]), strict=True):
                outputs[i] = format_output(written + i, translation)
        writer.write("".join(line for output in outputs for line in output))
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
