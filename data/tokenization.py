"""BPE tokenizers (HuggingFace `tokenizers`): train on a split, save/load `tokenizer.json`, encode/decode.

Special tokens have fixed ids everywhere: <pad>=0, <s>=1, </s>=2, <unk>=3. Encoding adds <s> ... </s>;
decoding drops specials, stops at the first </s> and returns detokenized text (for sacreBLEU).
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

log = logging.getLogger(__name__)

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)  # their ids are their positions: 0, 1, 2, 3
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(4)
WORD_START = "▁"  # SentencePiece's visible space: marks word starts so decoding restores spaces exactly


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer (tests may pass a character-level fake)."""

    pad_id: int
    bos_id: int
    eos_id: int

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def tokenizer_from_json(text: str) -> Tokenizer:
    """A checkpoint's tokenizer: this project's BPE (`tokenizers` JSON), one side of an imported model's
    SentencePiece pair (`data.sentencepiece_pair`, OPUS-MT's) or an imported BERT's WordPiece
    (`data.wordpiece`), told apart by the text."""
    from data.sentencepiece_pair import SentencePieceSide
    from data.wordpiece import WordPieceTokenizer

    if SentencePieceSide.is_json(text):
        return SentencePieceSide.from_json(text)
    if WordPieceTokenizer.is_json(text):
        return WordPieceTokenizer.from_json(text)
    return BPETokenizer.from_json(text)


def corpus_encoder(tokenizer: Any) -> Any:
    """What encodes a split: `CorpusEncoder` (chunk reuse) for this project's BPE, else the tokenizer's own
    `encode_batch`."""
    return CorpusEncoder(tokenizer) if isinstance(tokenizer, BPETokenizer) else tokenizer


class BPETokenizer:
    """A trained `tokenizers.Tokenizer` with the project's special tokens, BOS/EOS and detokenization."""

    pad_id, bos_id, eos_id, unk_id = PAD_ID, BOS_ID, EOS_ID, UNK_ID

    def __init__(self, tokenizer: tokenizers.Tokenizer) -> None:
        for expected_id, token in enumerate(SPECIAL_TOKENS):
            if tokenizer.token_to_id(token) != expected_id:
                raise ValueError(
                    f"special token {token!r} has id {tokenizer.token_to_id(token)}, expected {expected_id}"
                )
        self.tokenizer = tokenizer

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` as [BOS, ..., EOS]."""
        return self.tokenizer.encode(text).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [encoding.ids for encoding in self.tokenizer.encode_batch(list(texts))]

    def tokens(self, text: str) -> list[str]:
        """The subword strings of `text` (for inspection and reports)."""
        return self.tokenizer.encode(text).tokens

    def word_continuations(self) -> list[int]:
        """Ids of the pieces that continue the word before them: no word-start mark and a letter or digit
        first (punctuation is split off by the pre-tokenizer, so a piece like "." is not one)."""
        specials = set(self.tokenizer.get_added_tokens_decoder())
        return sorted(
            i
            for piece, i in self.tokenizer.get_vocab().items()
            if i not in specials and not piece.startswith(WORD_START) and piece[:1].isalnum()
        )

    def decode(self, ids: Iterable[int]) -> str:
        """Detokenized text of `ids` up to the first EOS, special tokens removed."""
        return self.tokenizer.decode(self._until_eos(ids), skip_special_tokens=True)

    def decode_batch(self, batch: Iterable[Iterable[int]]) -> list[str]:
        return self.tokenizer.decode_batch([self._until_eos(ids) for ids in batch], skip_special_tokens=True)

    def _until_eos(self, ids: Iterable[int]) -> list[int]:
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)  # tensors and arrays too
        return ids[: ids.index(EOS_ID)] if EOS_ID in ids else ids

    def to_json(self) -> str:
        return self.tokenizer.to_str()

    @classmethod
    def from_json(cls, text: str) -> BPETokenizer:
        return cls(tokenizers.Tokenizer.from_str(text))

    def save(self, path: str | Path) -> None:
        """Write `tokenizer.json` atomically (a reader never sees a half-written file)."""
        write_text_atomically(Path(path), self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> BPETokenizer:
        return cls(tokenizers.Tokenizer.from_file(str(path)))

    def __repr__(self) -> str:
        return f"BPETokenizer(vocab_size={self.vocab_size})"


class BPEDropout:
    """BPE-dropout (Provilkov et al., 2020): `tokenizer`'s segmentation with every merge skipped with
    probability `p`, so a word comes out in one of its many subword splits (subword regularization).

    The merge loop is re-implemented here so that the draws come from a generator the caller seeds
    (`tokenizers`' own dropout cannot be seeded). It is the same loop: repeatedly apply the
    best-ranked merge among adjacent pieces (leftmost on ties), each candidate first dropped with
    probability `p`; stop when none is left. At p=0 it reproduces `tokenizer.encode` exactly.
    """

    def __init__(self, tokenizer: BPETokenizer, p: float) -> None:
        if not 0.0 <= p < 1.0:
            raise ValueError(f"BPE-dropout probability must be in [0, 1), got {p}")
        backend = tokenizer.tokenizer
        model = json.loads(backend.to_str())["model"]
        plain = {"continuing_subword_prefix": None, "end_of_word_suffix": None, "byte_fallback": False}
        if model.get("type") != "BPE" or any(model.get(key, value) != value for key, value in plain.items()):
            raise ValueError("BPE-dropout needs a plain BPE model (as train_bpe makes)")
        self.p = p
        self._vocab: dict[str, int] = model["vocab"]
        # merges are "a b" strings in older tokenizer.json files, [a, b] pairs in newer ones
        self._ranks = {
            tuple(pair.split(" ", 1) if isinstance(pair, str) else pair): rank
            for rank, pair in enumerate(model["merges"])
        }
        self._normalize = backend.normalizer.normalize_str if backend.normalizer else (lambda text: text)
        self._pre_tokenize = backend.pre_tokenizer.pre_tokenize_str
        # added tokens (a tag, a target-language label) are cut out of the text first and kept whole,
        # as `tokenizers` does; the text between them is normalized and pre-tokenized on its own
        self._added = {token.content: i for i, token in backend.get_added_tokens_decoder().items()}
        longest_first = sorted(self._added, key=len, reverse=True)
        self._added_pattern = (
            re.compile("(" + "|".join(map(re.escape, longest_first)) + ")") if self._added else None
        )

    def words(self, text: str) -> list[str]:
        """The pre-tokenized words of `text` (normalized) and its added tokens: BPE merges within each."""
        parts = [text] if self._added_pattern is None else self._added_pattern.split(text)
        words: list[str] = []
        for k, part in enumerate(parts):
            if k % 2:  # an added token (the pattern's group)
                words.append(part)
            elif part:
                words += [word for word, _ in self._pre_tokenize(self._normalize(part))]
        return words

    def encode(self, text: str, rng: np.random.Generator) -> list[int]:
        """[BOS, ..., EOS] ids of `text`, segmented with dropout drawn from `rng`."""
        return self.encode_words(self.words(text), rng)

    def encode_words(self, words: Sequence[str], rng: np.random.Generator) -> list[int]:
        """As `encode`, for words already pre-tokenized with `words` (cache them: it is the slow part)."""
        ids = [BOS_ID]
        for word in words:
            if word in self._added:  # one token, never segmented (pre-tokenized words never equal one)
                ids.append(self._added[word])
                continue
            ids.extend(self._vocab.get(piece, UNK_ID) for piece in self._segment(word, rng))
        ids.append(EOS_ID)
        return ids

    def _segment(self, word: str, rng: np.random.Generator) -> list[str]:
        pieces = list(word)
        while len(pieces) > 1:
            candidates = [
                (rank, i)
                for i in range(len(pieces) - 1)
                if (rank := self._ranks.get((pieces[i], pieces[i + 1]))) is not None
            ]
            if self.p and candidates:
                kept = rng.random(len(candidates)) >= self.p
                candidates = [candidate for candidate, keep in zip(candidates, kept) if keep]
            if not candidates:
                break
            _, i = min(candidates)
            pieces[i : i + 2] = [pieces[i] + pieces[i + 1]]
        return pieces


def train_bpe(
    texts: Iterable[str],
    vocab_size: int,
    *,
    min_frequency: int = 2,
    show_progress: bool = False,
    length: int | None = None,
    extra_special_tokens: Sequence[str] = (),
) -> BPETokenizer:
    """Train a BPE model on `texts` (NFKC-normalized, split at spaces and punctuation).

    The vocabulary can end up smaller than `vocab_size` when the corpus has fewer merges to offer.
    `extra_special_tokens` (e.g. the tag of tagged back-translation) get the ids after the four fixed
    ones: each is one token wherever it occurs in a text, never split by BPE, and dropped by `decode`.
    """
    if vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must exceed the {len(SPECIAL_TOKENS)} special tokens, got {vocab_size}")
    tokenizer = _pipeline()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[*SPECIAL_TOKENS, *extra_special_tokens],
        show_progress=show_progress,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=length)
    tokenizer.post_processor = _post_processor()
    return BPETokenizer(tokenizer)


def _pipeline() -> tokenizers.Tokenizer:
    """An untrained tokenizer with the project's normalizer, pre-tokenizer and decoder."""
    tokenizer = tokenizers.Tokenizer(models.BPE(unk_token=UNK))
    tokenizer.normalizer = normalizers.NFKC()
    # Metaspace keeps spaces as "▁" so decode(encode(x)) == x; punctuation is split off so that
    # "Hund." and "Hund" share one token.
    metaspace = pre_tokenizers.Metaspace(replacement=WORD_START, prepend_scheme="always")
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([metaspace, pre_tokenizers.Punctuation()])
    tokenizer.decoder = decoders.Metaspace(replacement=WORD_START, prepend_scheme="always")
    return tokenizer


def _post_processor() -> processors.PostProcessor:
    return processors.TemplateProcessing(
        single=f"{BOS} $A {EOS}", special_tokens=[(BOS, BOS_ID), (EOS, EOS_ID)]
    )


_UNSEEN = object()  # CorpusEncoder: a chunk not encoded yet


class CorpusEncoder:
    """`tokenizer.encode_batch` for a corpus, about ten times faster: the ids of each space-separated chunk
    of text are computed once, by the tokenizer itself, and reused.

    Exact for the pipeline `train_bpe` builds: NFKC, then pieces split at spaces (each starting with "▁")
    and at punctuation, then BPE on each piece. A text that is chunks joined by single spaces, each
    chunk left unchanged by NFKC and free of "▁" and of special tokens, has the pieces of its chunks
    encoded alone, so its ids are BOS + the chunks' ids + EOS. (NFKC cannot act across the spaces: a
    space is a starter that composes with nothing.) Every other text, and every text of a tokenizer
    with another pipeline, is encoded whole. At most `max_chunks` chunks are remembered.
    """

    def __init__(self, tokenizer: BPETokenizer, max_chunks: int = 1_000_000) -> None:
        self.tokenizer = tokenizer
        self.max_chunks = max_chunks
        backend = tokenizer.tokenizer
        self._exact = _structure(backend) == _structure(_reference())
        self._specials = [token.content for token in backend.get_added_tokens_decoder().values()]
        self._special_starts = {special[0] for special in self._specials}  # a quick first check
        self._chunks: dict[str, list[int] | None] = {}  # None: a chunk that NFKC changes

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text as [BOS, ..., EOS], equal to `tokenizer.encode_batch(texts)`."""
        texts = list(texts)
        if not self._exact:
            return self.tokenizer.encode_batch(texts)
        result: list[list[int] | None] = [None] * len(texts)  # None: encoded whole, at the end
        pending: list[tuple[int, list[str]]] = []  # texts with chunks seen for the first time
        unseen: set[str] = set()
        for i, text in enumerate(texts):
            chunks = self._split(text)
            if chunks is not None:
                ids = self._assemble(chunks, self._chunks, unseen)
                if ids is _UNSEEN:
                    pending.append((i, chunks))
                else:
                    result[i] = ids  # type: ignore[assignment]
        if pending:
            learned = self._learn(sorted(unseen))
            chunks_ids = self._chunks

            def lookup(chunk: str, default: object) -> object:
                return learned.get(chunk, chunks_ids.get(chunk, default))

            for i, chunks in pending:
                ids = self._assemble(chunks, lookup, unseen)
                result[i] = None if ids is _UNSEEN else ids  # type: ignore[assignment]
        whole = [i for i, ids in enumerate(result) if ids is None]
        for i, ids in zip(whole, self.tokenizer.encode_batch([texts[i] for i in whole])):
            result[i] = ids
        return result  # type: ignore[return-value]  # every None was replaced

    def _split(self, text: str) -> list[str] | None:
        """The chunks of `text`, or None when it must be encoded whole."""
        chunks = text.split(" ")
        if "" in chunks or WORD_START in text:
            return None
        if any(start in text for start in self._special_starts) and any(s in text for s in self._specials):
            return None
        return chunks

    def _assemble(self, chunks: list[str], known: Any, unseen: set[str]) -> list[int] | object | None:
        """BOS + the chunks' ids + EOS; None if NFKC changes a chunk, `_UNSEEN` if some chunks are new
        (added to `unseen`). `known`: a dict of chunk ids, or a function like its `get`."""
        get = known.get if isinstance(known, dict) else known
        ids = [BOS_ID]
        complete = True
        for chunk in chunks:
            piece = get(chunk, _UNSEEN)
            if piece is None:
                return None
            if piece is _UNSEEN:
                complete = False
                unseen.add(chunk)
            elif complete:
                ids += piece
        if not complete:
            return _UNSEEN
        ids.append(EOS_ID)
        return ids

    def _learn(self, chunks: list[str]) -> dict[str, list[int] | None]:
        """Encode `chunks` alone; remembered while there is room, returned in any case."""
        backend = self.tokenizer.tokenizer
        plain = [chunk for chunk in chunks if backend.normalizer.normalize_str(chunk) == chunk]
        learned: dict[str, list[int] | None] = dict.fromkeys(chunks)
        encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
        for chunk, encoding in zip(plain, encode(plain, add_special_tokens=False)):
            learned[chunk] = encoding.ids
        if len(self._chunks) + len(learned) <= self.max_chunks:
            self._chunks.update(learned)
        return learned


def _structure(tokenizer: tokenizers.Tokenizer) -> list[object]:
    """Everything of a tokenizer's JSON but its vocabulary and merges: what `CorpusEncoder` relies on."""
    settings = json.loads(tokenizer.to_str())
    model = {key: value for key, value in settings["model"].items() if key not in ("vocab", "merges")}
    keys = ("normalizer", "pre_tokenizer", "post_processor", "truncation", "padding", "added_tokens")
    return [model, *(settings[key] for key in keys)]


def _reference() -> tokenizers.Tokenizer:
    """The pipeline `train_bpe` makes, with only the special tokens (for `_structure`)."""
    tokenizer = _pipeline()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.post_processor = _post_processor()
    return tokenizer


def write_text_atomically(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file in its directory (a reader never sees a half-written
    file); an OSError names the file (in the words of transformer.disk)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as err:  # named in the words of transformer.disk (one line for a full disk)
        err.add_note(f"while writing {path.name} to {path}")
        raise
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException as err:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(err, Exception):
            err.add_note(f"while writing {path.name} of {len(text.encode()) / 1e3:.1f} kB to {path}")
        raise
