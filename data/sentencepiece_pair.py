"""OPUS-MT's (Marian's) tokenizers: a source and a target SentencePiece model over one vocabulary.

A Marian model directory holds `source.spm` and `target.spm` (SentencePiece models that cut text into
pieces) and `vocab.json` (piece -> model id; `target_vocab.json` too when the vocabularies are separate).
`SentencePiecePair` reads them with the maintained `sentencepiece` package and encodes and decodes as
transformers' `MarianTokenizer` does, token for token and character for character:

- a source sentence is its source pieces' ids, then </s> (no <s>); a leading language code such as `>>fra<<`
  (multilingual models) is one token of its own; `language_labels` lists a multilingual vocabulary's codes
  as the target-language labels of `data.labels` (issue 65);
- a target sentence is its target pieces' ids, then </s>; the decoder starts from the pad token;
- a piece missing from the vocabulary is <unk>; decoding stops at the first </s>, drops special tokens and
  joins the pieces with SentencePiece's decoder (the source model's for a shared vocabulary, as Marian).

Its special ids are the vocabulary's own (OPUS-MT: </s> = 0, <unk> = 1, <pad> = the last id), not this
project's fixed 0-3 of `data.tokenization`. `SentencePieceSide` puts one side of a pair behind the data
pipeline's tokenizer interface (`data.tokenization.Tokenizer`), framed as the pipeline frames sentences:
a source as Marian's encoder reads it, a target as [start] pieces </s> (the decoder reads all but the last,
the loss scores all but the first).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from data.labels import LanguageLabels

__all__ = ["SentencePiecePair", "SentencePieceSide"]

EOS, UNK, PAD = "</s>", "<unk>", "<pad>"
WORD_START = "▁"


def _processor(model: bytes) -> Any:
    import sentencepiece

    processor = sentencepiece.SentencePieceProcessor()
    processor.LoadFromSerializedProto(model)
    return processor


class SentencePiecePair:
    """Source and target SentencePiece models and the vocabulary (or vocabularies) that give model ids."""

    def __init__(
        self,
        source_model: bytes,
        target_model: bytes,
        vocab: Mapping[str, int],
        target_vocab: Mapping[str, int] | None = None,
    ) -> None:
        for name, table in (("vocabulary", vocab), ("target vocabulary", target_vocab or {})):
            if not isinstance(table, Mapping) or not all(
                isinstance(k, str) and isinstance(i, int) and not isinstance(i, bool) and i >= 0
                for k, i in table.items()
            ):
                raise ValueError(f"the {name} is not a mapping of pieces to ids")
        for token in (EOS, UNK, PAD):
            if token not in vocab:
                raise ValueError(f"the vocabulary has no {token!r} token")
        self.source_model, self.target_model = source_model, target_model
        self.vocab = dict(vocab)
        self.target_vocab = dict(target_vocab) if target_vocab is not None else None
        self._source, self._target = _processor(source_model), _processor(target_model)
        self._pieces = {i: piece for piece, i in (self.target_vocab or self.vocab).items()}
        target = self.target_vocab or self.vocab
        self.pad_id, self.eos_id, self.unk_id = target[PAD], target[EOS], target[UNK]
        self.bos_id = self.pad_id  # the decoder's first input (Marian has no <s>)
        self._specials = {target[token] for token in (EOS, UNK, PAD)}

    @property
    def vocab_size(self) -> int:
        return len(self.target_vocab or self.vocab)

    @classmethod
    def from_directory(cls, directory: str | Path) -> SentencePiecePair:
        """Read a Marian directory's source.spm, target.spm, vocab.json (and target_vocab.json when its
        tokenizer_config.json says `separate_vocabs`); a missing file raises FileNotFoundError naming it."""
        directory = Path(directory)
        config_file = directory / "tokenizer_config.json"
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        files = ["source.spm", "target.spm", "vocab.json"]
        if config.get("separate_vocabs"):
            files.append("target_vocab.json")
        for name in files:
            if not (directory / name).is_file():
                raise FileNotFoundError(f"{directory / name}: a Marian tokenizer needs {', '.join(files)}")
        vocab = json.loads((directory / "vocab.json").read_text(encoding="utf-8"))
        target_vocab = None
        if config.get("separate_vocabs"):
            target_vocab = json.loads((directory / "target_vocab.json").read_text(encoding="utf-8"))
        source, target = (directory / "source.spm").read_bytes(), (directory / "target.spm").read_bytes()
        return cls(source, target, vocab, target_vocab)

    def language_labels(self) -> LanguageLabels | None:
        """The target-language labels of a multilingual (one-to-many, many-to-many) OPUS-MT vocabulary:
        every `>>code<<` piece of the source vocabulary (the form MarianTokenizer's
        `supported_language_codes` lists), by code (`>>fra<<` -> "fra"); None when there are fewer than two,
        since a model with one target language takes its sentences without a label."""
        codes = {piece[2:-2]: piece for piece in self.vocab if _is_label(piece)}
        return LanguageLabels(codes) if len(codes) > 1 else None

    def to_state(self) -> dict[str, Any]:
        """Plain data for a checkpoint (`from_state` reverses it)."""
        return {
            "source_model": base64.b64encode(self.source_model).decode("ascii"),
            "target_model": base64.b64encode(self.target_model).decode("ascii"),
            "vocab": self.vocab,
            "target_vocab": self.target_vocab,
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> SentencePiecePair:
        return cls(
            base64.b64decode(state["source_model"]),
            base64.b64decode(state["target_model"]),
            state["vocab"],
            state.get("target_vocab"),
        )

    def encode_source(self, text: str) -> list[int]:
        """Model ids of a source sentence: [language code], its pieces, then </s>."""
        codes: list[int] = []
        unk = self.vocab[UNK]
        if text.startswith(">>") and (end := text.find("<<")) != -1:  # as Marian: any >>...<< prefix
            codes, text = [self.vocab.get(text[: end + 2], unk)], text[end + 2 :]
        pieces = self._source.encode(text, out_type=str)
        return [*codes, *(self.vocab.get(piece, unk) for piece in pieces), self.vocab[EOS]]

    def encode(self, text: str) -> list[int]:
        """A target sentence's model ids: its target pieces, then </s> (the decoder starts from pad)."""
        vocab = self.target_vocab or self.vocab
        pieces = self._target.encode(text, out_type=str)
        return [*(vocab.get(piece, self.unk_id) for piece in pieces), self.eos_id]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of target ids: up to the first </s>, specials dropped, pieces joined by SentencePiece."""
        pieces = []
        for i in ids:
            if i == self.eos_id:
                break
            if i not in self._specials:
                pieces.append(self._pieces.get(i, UNK))
        decoder = self._target if self.target_vocab is not None else self._source  # as Marian decodes
        return decoder.decode_pieces(pieces).replace(WORD_START, " ").strip()


def _is_label(piece: str) -> bool:
    """Whether a vocabulary piece is a language code, `>>xxx<<` (one word, something between the marks)."""
    marked = piece.startswith(">>") and piece.endswith("<<") and len(piece) > 4
    return marked and not any(map(str.isspace, piece))


class SentencePieceSide:
    """The "src" or "tgt" side of a `SentencePiecePair` as the data pipeline's tokenizer: encode frames a
    sentence for its side, decode reads target ids back to text, to_json is the checkpoint's form."""

    def __init__(self, pair: SentencePiecePair, side: str) -> None:
        if side not in ("src", "tgt"):
            raise ValueError(f"side must be 'src' or 'tgt', got {side!r}")
        self.pair, self.side = pair, side
        self.pad_id, self.bos_id, self.eos_id = pair.pad_id, pair.bos_id, pair.eos_id
        self.unk_id = pair.unk_id

    @property
    def vocab_size(self) -> int:
        return len(self.pair.vocab) if self.side == "src" else self.pair.vocab_size

    def encode(self, text: str) -> list[int]:
        """src: pieces then </s> (Marian's encoder input); tgt: the start token, pieces, </s>."""
        if self.side == "src":
            return self.pair.encode_source(text)
        return [self.bos_id, *self.pair.encode(text)]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(text) for text in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return self.pair.decode(list(ids))

    def decode_batch(self, batch: Sequence[Sequence[int]]) -> list[str]:
        return [self.decode(ids) for ids in batch]

    def to_json(self) -> str:
        return json.dumps({"sentencepiece_pair": self.pair.to_state(), "side": self.side}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> SentencePieceSide:
        data = json.loads(text)
        return cls(SentencePiecePair.from_state(data["sentencepiece_pair"]), data["side"])

    @staticmethod
    def is_json(text: str) -> bool:
        """Whether a checkpoint's tokenizer text is a side of a SentencePiece pair (not `tokenizers` JSON)."""
        return text.lstrip().startswith('{"sentencepiece_pair"')
