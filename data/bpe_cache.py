"""A trained BPE tokenizer on disk with the fingerprint of what it was trained on (`path` + ".fingerprint"):
reused while the training texts and settings are unchanged, retrained and replaced otherwise."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import tokenizers

from data import cache, sources, tokenization
from data.tokenization import BPETokenizer, write_text_atomically

log = logging.getLogger(__name__)


def bpe_fingerprint(texts: Iterable[str], **settings: object) -> str:
    """A hash of the training texts and settings: equal fingerprints give identical tokenizers."""
    digest = hashlib.sha256()
    digest.update(json.dumps({"tokenizers": tokenizers.__version__, **settings}, sort_keys=True).encode())
    for text in texts:
        digest.update(text.encode())
        digest.update(b"\n")
    return digest.hexdigest()


def load_or_train_bpe(
    path: str | Path,
    texts: Sequence[str],
    vocab_size: int,
    *,
    min_frequency: int = 2,
    show_progress: bool = False,
) -> BPETokenizer:
    """Load `path` when its stored fingerprint matches `texts` + settings, else train and save it there.

    The fingerprint lives next to it in `path` + ".fingerprint"; both files are replaced atomically.
    """
    path = Path(path)
    fingerprint = bpe_fingerprint(texts, vocab_size=vocab_size, min_frequency=min_frequency)
    tokenizer = load_bpe(path, fingerprint)
    if tokenizer is not None:
        return tokenizer
    log.info("Training BPE tokenizer (vocab_size=%d) on %d texts -> %s", vocab_size, len(texts), path)
    tokenizer = tokenization.train_bpe(  # through the module, as the DataModules call it (tests patch it)
        texts, vocab_size, min_frequency=min_frequency, show_progress=show_progress, length=len(texts)
    )
    save_bpe(tokenizer, path, fingerprint)
    return tokenizer


def load_bpe(path: str | Path, fingerprint: str) -> BPETokenizer | None:
    """The tokenizer saved at `path` by `save_bpe` with this `fingerprint`, else None."""
    path = Path(path)
    stamp = path.with_name(path.name + ".fingerprint")
    if path.is_file() and stamp.is_file() and stamp.read_text().strip() == fingerprint:
        log.info("Reusing tokenizer %s (training data and settings unchanged)", path)
        return BPETokenizer.load(path)
    return None


def save_bpe(tokenizer: BPETokenizer, path: str | Path, fingerprint: str) -> None:
    """Write `tokenizer` to `path` and `fingerprint` (what it was trained on) to `path` + ".fingerprint"."""
    path = Path(path)
    tokenizer.save(path)
    # written last: a stamp always describes a complete tokenizer file
    write_text_atomically(path.with_name(path.name + ".fingerprint"), fingerprint + "\n")


def shared_bpe(path: Path, fingerprint: str, lock: Path, train: Callable[[], BPETokenizer]) -> BPETokenizer:
    """The tokenizer saved at `path` with `fingerprint`, else the one `train` makes, saved there: one
    process trains while the others wait on `lock`, then load its file. A failed write (e.g. a full disk)
    is a `DataError` naming `path`."""
    tokenizer = load_bpe(path, fingerprint)
    if tokenizer is not None:
        return tokenizer
    with cache.locked(lock):
        tokenizer = load_bpe(path, fingerprint)  # trained by another process while this one waited
        if tokenizer is None:
            tokenizer = train()
            try:
                save_bpe(tokenizer, path, fingerprint)
            except OSError as err:  # e.g. a full disk
                raise sources.DataError(f"cannot write {path}: {err.strerror or err}") from err
    return tokenizer
