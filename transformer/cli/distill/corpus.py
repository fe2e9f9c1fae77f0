"""A corpus translated once into the prepared-data cache, in fixed chunks written whole, resumable.

An entry `<cache>/synthetic/<name>-<key[:16]>/` holds `translations.txt` (one line per input sentence, in
order), the companion files the caller gives (the aligned other side) and `entry.json` (the full key and
the line count), written last; it is built in a temporary directory and renamed into place, so the cache
never holds a partial corpus. While it is being made, each chunk of `chunk_sentences` sentences is
written whole (a temporary file renamed) into `.<name>-<key[:16]>.partial/`: an interrupted translation
resumes at the chunks still missing. The chunks are fixed (corpus order) and each is translated on its
own, so a resumed corpus equals an uninterrupted one. Under DDP each process translates the chunks of its
rank (chunk i: rank i % world size) and rank 0 writes the corpus once.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from data import cache
from transformer.disk import write_text, writing

log = logging.getLogger("train")

TRANSLATIONS = "translations.txt"
ENTRY = "entry.json"

ChunkTranslator = Callable[[int, Sequence[str]], list[str]]


@dataclass(frozen=True)
class Shard:
    """This process's place among the processes that translate together (DDP), and their barrier."""

    rank: int = 0
    world: int = 1
    barrier: Callable[[], None] = field(default=lambda: None)


def finished_entry(directory: Path, name: str, key: str) -> Path | None:
    """The complete entry of `key` (its directory), or None."""
    entry = directory / f"{name}-{key[:16]}"
    try:
        meta = json.loads((entry / ENTRY).read_text())
    except (OSError, ValueError):
        return None
    if meta.get("key") != key or not (entry / TRANSLATIONS).is_file():
        return None
    return entry


def translate_corpus(
    texts: Sequence[str],
    translate: ChunkTranslator,
    *,
    directory: Path,
    name: str,
    key: str,
    chunk_sentences: int,
    companions: Mapping[str, Sequence[str]] | None = None,
    shard: Shard = Shard(),
) -> Path:
    """The entry directory of `texts` translated by `translate(chunk index, chunk)`, from the cache or
    made now (this process's chunks; the whole corpus when alone). `companions`: more files of the entry,
    one line per text (e.g. the sources that the translations are aligned with)."""
    found = finished_entry(directory, name, key)
    if found is not None:
        log.info("%s: reusing the %d translations cached in %s (translated nothing)", name, len(texts), found)
        return found
    lock = cache.locked(directory / ".locks" / f"{name}-{key[:16]}.lock") if shard.world == 1 else None
    with lock or contextlib.nullcontext():
        found = finished_entry(directory, name, key)  # made by another process while this one waited
        if found is None:
            partial = directory / f".{name}-{key[:16]}.partial"
            _translate_chunks(texts, translate, partial, name, chunk_sentences, shard)
            shard.barrier()
            if shard.rank == 0:
                _assemble(texts, partial, directory / f"{name}-{key[:16]}", key, chunk_sentences, companions)
            shard.barrier()
            found = finished_entry(directory, name, key)
    if found is None:
        raise RuntimeError(f"{name}: the translated corpus was not written to {directory}")
    return found


def _chunk_path(partial: Path, index: int) -> Path:
    return partial / f"chunk-{index:06d}.txt"


def _read_chunk(path: Path, lines: int) -> list[str] | None:
    """A chunk's translations, or None when it is missing or not of `lines` lines."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    found = text.split("\n")[:-1]
    return found if len(found) == lines and text.endswith("\n") else None


def _translate_chunks(
    texts: Sequence[str],
    translate: ChunkTranslator,
    partial: Path,
    name: str,
    chunk_sentences: int,
    shard: Shard,
) -> None:
    """This process's chunks that are not written yet, each written whole as it is done."""
    chunks = math.ceil(len(texts) / chunk_sentences)
    bounds = [(i * chunk_sentences, min(len(texts), (i + 1) * chunk_sentences)) for i in range(chunks)]
    mine = [i for i in range(chunks) if i % shard.world == shard.rank]
    todo = [i for i in mine if _read_chunk(_chunk_path(partial, i), bounds[i][1] - bounds[i][0]) is None]
    if len(todo) < len(mine):
        log.info(
            "%s: resuming, %d of %d chunks already written in %s",
            name,
            len(mine) - len(todo),
            len(mine),
            partial,
        )
    sentences = sum(bounds[i][1] - bounds[i][0] for i in todo)
    where = f" (rank {shard.rank} of {shard.world})" if shard.world > 1 else ""
    log.info("%s: translating %d sentences in %d chunks%s", name, sentences, len(todo), where)
    partial.mkdir(parents=True, exist_ok=True)
    with _progress(name, sentences) as advance:
        for index in todo:
            start, stop = bounds[index]
            outputs = translate(index, texts[start:stop])
            if len(outputs) != stop - start:
                raise RuntimeError(f"{name}: chunk {index} gave {len(outputs)} lines for {stop - start}")
            text = "".join(f"{line}\n" for line in outputs)
            write_text(_chunk_path(partial, index), text, f"chunk {index} of the {name} translations")
            advance(stop - start)


@contextlib.contextmanager
def _progress(name: str, total: int) -> Iterator[Callable[[int], None]]:
    """`advance(sentences)`: a tqdm bar with its ETA on a terminal, else a log line per chunk with one."""
    if sys.stderr.isatty():
        with tqdm(total=total, desc=f"Translating ({name})", unit=" sentences", file=sys.stderr) as bar:
            yield bar.update
        return
    start, done = time.perf_counter(), 0

    def advance(sentences: int) -> None:
        nonlocal done
        done += sentences
        elapsed = time.perf_counter() - start
        eta = elapsed / done * (total - done) if done else 0.0
        log.info("%s: %d / %d sentences translated, %.0f s, ETA %.0f s", name, done, total, elapsed, eta)

    yield advance


def _assemble(
    texts: Sequence[str],
    partial: Path,
    entry: Path,
    key: str,
    chunk_sentences: int,
    companions: Mapping[str, Sequence[str]] | None,
) -> None:
    """Join the chunks into the entry (built under a temporary name, renamed into place), then drop them."""
    lines: list[str] = []
    for index in range(math.ceil(len(texts) / chunk_sentences)):
        count = min(len(texts), (index + 1) * chunk_sentences) - index * chunk_sentences
        chunk = _read_chunk(_chunk_path(partial, index), count)
        if chunk is None:
            raise RuntimeError(
                f"chunk {index} of {partial} is missing after every process translated its share"
            )
        lines.extend(chunk)
    tmp = entry.parent / f".{entry.name}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    with writing(tmp, f"the translated corpus ({len(lines)} lines)"):
        tmp.mkdir(parents=True)
        files = {TRANSLATIONS: lines, **(companions or {})}
        for file, content in files.items():
            (tmp / file).write_text("".join(f"{line}\n" for line in content), encoding="utf-8")
        meta = {"key": key, "lines": len(lines), "files": sorted(files)}
        (tmp / ENTRY).write_text(json.dumps(meta, indent=1) + "\n")  # last: marks it complete
        if entry.exists():  # a foreign or damaged entry of the same name
            shutil.rmtree(entry)
        os.rename(tmp, entry)
    shutil.rmtree(partial, ignore_errors=True)
    log.info("Wrote the translated corpus %s (%d lines)", entry, len(lines))
