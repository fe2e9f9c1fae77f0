"""Batches and text streams of `evaluate.py`: batches moved to the device with a progress bar, lines
translated from stdin or a file (plain text, or JSONL with prefixes and constraints: `translate_input`),
with their word alignments, metrics and report images handed to the configured loggers."""

from __future__ import annotations

import contextlib
import json
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
from transformer.cli.text_translation import Translation, check_target_lang, line_translator
from transformer.cli.translate_input import FORMATS, EntryParser, text_lines
from transformer.disk import writing_aside
from transformer.evaluation.n_best import n_best_lines
from transformer.inference.classifier import Classifier
from transformer.inference.languages import TargetLanguages
from transformer.inference.outputs import Prediction
from transformer.search.decoding import DecodingSettings

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
    targets: TargetLanguages | None = None,
) -> None:
    """Translate lines from stdin or a file to stdout or a file with `model` (one, or an ensemble): one
    output line per input line, or with decoding.n_best > 1 the n-best lines `id ||| hypothesis |||
    score` of every non-blank input line (id = its 0-based line number). translate.format=jsonl: one
    JSON object a line in (`translate_input`), one out; translate.alignments=FILE: Pharaoh lines.
    `targets`: what the checkpoint translates into (`target_languages`); translate.target_lang, or a JSONL
    line's target_lang, chooses one of a multilingual model's."""
    source, target, alignments = str(options.input), options.get("output"), options.get("alignments")
    form = str(options.get("format") or "text")
    if form not in FORMATS:
        raise ConfigError(f"translate.format must be one of {list(FORMATS)}, got {form!r}")
    if source != "-" and not Path(source).is_file():
        raise ConfigError(f"translate.input={source} is not a file (use - for stdin)")
    if decoding.alignments and alignments is None:
        raise ConfigError("decode.alignments=true with translate.input needs translate.alignments=FILE")
    for key, path in (("translate.output", target), ("translate.alignments", alignments)):
        if path not in (None, "-"):
            _check_output(key, Path(str(path)))
    targets = targets or TargetLanguages()
    target_lang = options.get("target_lang")
    check_target_lang(targets, target_lang, form)
    name = "stdin" if source == "-" else source
    interactive = source == "-" and sys.stdin.isatty()
    if interactive:
        log.info("Type a sentence and press Enter (Ctrl-D ends)")
    translate = line_translator(
        model, datamodule, decoding, device, name, alignments is not None, targets, target_lang
    )
    tokenizer = datamodule.tgt_tokenizer
    parse = (
        EntryParser(
            name, tokenizer.encode, (tokenizer.bos_id, tokenizer.eos_id), getattr(tokenizer, "unk_id", None)
        )
        if form == "jsonl"
        else None
    )
    with contextlib.ExitStack() as stack:
        reader = _reader(stack, source, name, interactive)

        # written aside and renamed at the end: a bad input line stops the run with the earlier files whole
        to_stdout = target in (None, "-")
        writer = sys.stdout if to_stdout else stack.enter_context(writing_aside(target, "translations"))
        side = None if alignments is None else stack.enter_context(writing_aside(alignments, "alignments"))
        stream_lines(
            reader,
            writer,
            translate,
            chunk_lines=1 if interactive else options.get("chunk_lines", 256),
            format_output=_output_format(form, decoding.n_best),
            parse=parse,
            blank=form == "jsonl" or decoding.n_best == 1,
            side=side,
        )


CLASSIFY_FORMATS = ("text", "jsonl")


def classify_stream(
    options: DictConfig,
    model: torch.nn.Module,
    datamodule: Any,
    labels: list[str] | None,
    device: torch.device,
) -> None:
    """Label lines from stdin or a file (one text a line) with a classification `model`, to stdout or a
    file: one output line per input line, blank for a blank line. classify.format=text: the label, a tab,
    then every class' probability as one JSON object (`positive\t{"negative": 0.1, "positive": 0.9}`);
    jsonl: `{"label": ..., "probabilities": {...}}` a line. Labelled by the inference API's `Classifier`
    with the datamodule's tokenizer and batching (as the checkpoint's split is scored) and the checkpoint's
    class names `labels`."""
    source, target = str(options.input), options.get("output")
    form = str(options.get("format") or "text")
    if form not in CLASSIFY_FORMATS:
        raise ConfigError(f"classify.format must be one of {list(CLASSIFY_FORMATS)}, got {form!r}")
    if source != "-" and not Path(source).is_file():
        raise ConfigError(f"classify.input={source} is not a file (use - for stdin)")
    if target not in (None, "-"):
        _check_output("classify.output", Path(str(target)))
    if not labels:
        raise ConfigError("classify.input: the checkpoint names no classes (no class_names): it cannot label")
    name = "stdin" if source == "-" else source
    interactive = source == "-" and sys.stdin.isatty()
    if interactive:
        log.info("Type a text and press Enter (Ctrl-D ends)")
    classifier = Classifier(
        model,
        datamodule.src_tokenizer,
        labels,
        max_len=datamodule.max_len,
        max_tokens=datamodule.eval_max_tokens,
        device=device,
    )

    def line(index: int, prediction: Prediction) -> list[str]:
        if form == "jsonl":
            item = {"label": prediction.label, "probabilities": prediction.probabilities}
            return [json.dumps(item, ensure_ascii=False) + "\n"]
        return [f"{prediction.label}\t{json.dumps(prediction.probabilities, ensure_ascii=False)}\n"]

    with contextlib.ExitStack() as stack:
        reader = _reader(stack, source, name, interactive)
        to_stdout = target in (None, "-")
        writer = sys.stdout if to_stdout else stack.enter_context(writing_aside(target, "labels"))
        stream_lines(
            reader,
            writer,
            classifier.predict,
            chunk_lines=1 if interactive else options.get("chunk_lines", 256),
            format_output=line,
            blank=True,
        )


def _reader(stack: contextlib.ExitStack, source: str, name: str, interactive: bool) -> Iterable[str]:
    """The input lines of `source` (a file, or - for stdin), decoded strictly (`text_lines`) unless typed
    at a terminal."""
    if source != "-":
        return text_lines(stack.enter_context(open(source, "rb")), name)
    binary = None if interactive else getattr(sys.stdin, "buffer", None)
    return sys.stdin if binary is None else text_lines(binary, name)


def _check_output(key: str, path: Path) -> None:
    """ConfigError unless `path` can be written as a file: an existing folder, not a directory itself."""
    if path.is_dir():
        raise ConfigError(f"{key}={path} is a directory (give the path of a file to write)")
    if not path.parent.is_dir():
        raise ConfigError(f"{key}={path}: the folder {path.parent} does not exist (create it first)")


def _output_format(form: str, n_best: int) -> Callable[[int, Translation], tuple[list[str], list[str]]]:
    """The lines one input line gets: (output lines, alignment lines)."""

    def text(index: int, translation: Translation) -> tuple[list[str], list[str]]:
        aligned = translation.alignments or []
        if n_best > 1:
            return n_best_lines(index, translation.hypotheses), [f"{index} ||| {a}\n" for a in aligned]
        return _one_line(index, translation.hypotheses[0][0]), [f"{a}\n" for a in aligned[:1]]

    def jsonl(index: int, translation: Translation) -> tuple[list[str], list[str]]:
        aligned = translation.alignments
        best, score = translation.hypotheses[0]
        item: dict[str, Any] = {"translation": best, "score": score}
        if aligned is not None:
            item["alignment"] = aligned[0]
        if n_best > 1:
            item["n_best"] = [
                {"translation": text, "score": value, **({"alignment": aligned[k]} if aligned else {})}
                for k, (text, value) in enumerate(translation.hypotheses)
            ]
        item["unsatisfiable"] = translation.unsatisfiable
        return [json.dumps(item, ensure_ascii=False) + "\n"], [f"{aligned[0]}\n"] if aligned else []

    return jsonl if form == "jsonl" else text


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
    translate_texts: Callable[[list[Any]], list[Any]],
    *,
    chunk_lines: int,
    format_output: Callable[[int, Any], list[str] | tuple[list[str], list[str]]] = _one_line,
    parse: Callable[[int, str], Any] | None = None,
    blank: bool | None = None,
    side: TextIO | None = None,
) -> int:
    """Translate `reader`'s lines in chunks, writing each input line's output lines (flushed per chunk).

    `format_output(line number, translation)` gives the lines written for one input line (default: the
    text on one line), or a pair (lines for `writer`, lines for `side`). `parse(line number from 1,
    text)` turns a non-blank line into what `translate_texts` takes (default: the stripped text). Blank
    lines never reach `translate_texts`: they answer with a blank line (in `side` too) when `blank`
    (default: with the default format), else with nothing; chunk_lines=1 answers each line as soon as it
    is read (interactive use). Returns the number of input lines answered.
    """
    if isinstance(chunk_lines, bool) or not isinstance(chunk_lines, int) or chunk_lines < 1:
        raise ValueError(f"translate.chunk_lines must be an integer >= 1, got {chunk_lines!r}")
    written = 0
    blank = format_output is _one_line if blank is None else blank

    def flush(lines: list[str]) -> None:
        nonlocal written
        texts = [line.strip() for line in lines]
        wanted = [i for i, text in enumerate(texts) if text]
        items = [parse(written + i + 1, texts[i]) if parse else texts[i] for i in wanted]
        outputs = [(["\n"], ["\n"]) if blank else ([], []) for _ in lines]
        if wanted:
            for i, translation in zip(wanted, translate_texts(items), strict=True):
                lines_out = format_output(written + i, translation)
                outputs[i] = lines_out if isinstance(lines_out, tuple) else (lines_out, [])
        writer.write("".join(line for output, _ in outputs for line in output))
        writer.flush()
        if side is not None:
            side.write("".join(line for _, output in outputs for line in output))
            side.flush()
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
