"""BERT's WordPiece tokenizer (an imported BERT-family model's) behind the data pipeline's interface.

A BERT directory holds `tokenizer.json` (the whole `tokenizers` pipeline) or only `vocab.txt` (one token
a line, its id the line number) with the settings of `tokenizer_config.json` (`do_lower_case`,
`strip_accents`, `tokenize_chinese_chars`). Either is read with `tokenizers` (BertNormalizer,
BertPreTokenizer, WordPiece with "##" continuations) and encodes as transformers' `BertTokenizerFast`:
a sentence is [CLS] pieces [SEP]. [CLS] is the pipeline's BOS (the classifier pools position 0), [SEP]
its EOS, [PAD] its pad; the ids are the vocabulary's own (bert-base: [PAD] 0, [UNK] 100, [CLS] 101,
[SEP] 102), not the fixed 0-3 of `data.tokenization`, and the datamodule takes them from the tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors

__all__ = ["WordPieceTokenizer"]

_SPECIALS = {"cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]", "unk_token": "[UNK]"}


def _token_name(value: Any, default: str) -> str:
    """A special token from tokenizer_config.json: a string, or an added-token dict with its "content"."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) and value else default


class WordPieceTokenizer:
    """A `tokenizers` WordPiece pipeline whose encoding is [CLS] pieces [SEP], with the special ids of
    its vocabulary. `vocab_size` is the model's (its embedding rows), at least the tokenizer's size: a
    model may pad its vocabulary beyond the tokens its tokenizer can produce."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, specials: Mapping[str, str], vocab_size: int) -> None:
        ids = {}
        for role, token in specials.items():
            token_id = tokenizer.token_to_id(token)
            if token_id is None:
                raise ValueError(f"the vocabulary has no {role} {token!r}")
            ids[role] = token_id
        if vocab_size < tokenizer.get_vocab_size():
            raise ValueError(
                f"the tokenizer has {tokenizer.get_vocab_size()} tokens, more than the model's {vocab_size}"
            )
        cls, sep = specials["cls_token"], specials["sep_token"]
        # [CLS] text [SEP] whatever the file said (a tokenizer.json may come without its post-processor)
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{cls} $A {sep}",
            pair=f"{cls} $A {sep} $B:1 {sep}:1",
            special_tokens=[(cls, ids["cls_token"]), (sep, ids["sep_token"])],
        )
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self.tokenizer, self.specials, self._vocab_size = tokenizer, dict(specials), vocab_size
        self.bos_id, self.eos_id = ids["cls_token"], ids["sep_token"]
        self.pad_id, self.unk_id = ids["pad_token"], ids["unk_token"]

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @classmethod
    def from_directory(cls, directory: str | Path, vocab_size: int | None = None) -> WordPieceTokenizer:
        """Read a BERT directory: tokenizer.json if present, else vocab.txt with tokenizer_config.json's
        settings; neither raises FileNotFoundError naming both. `vocab_size`: the model's (default: the
        tokenizer's own size)."""
        directory = Path(directory)
        settings_file = directory / "tokenizer_config.json"
        settings = json.loads(settings_file.read_text(encoding="utf-8")) if settings_file.is_file() else {}
        specials = {role: _token_name(settings.get(role), default) for role, default in _SPECIALS.items()}
        if (directory / "tokenizer.json").is_file():
            try:
                tokenizer = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
            except Exception as err:  # tokenizers raises a bare Exception for malformed JSON
                raise ValueError(f"{directory / 'tokenizer.json'} is not a tokenizers file ({err})") from None
        elif (directory / "vocab.txt").is_file():
            tokenizer = _from_vocab(directory / "vocab.txt", settings, specials)
        else:
            raise FileNotFoundError(f"{directory} has neither tokenizer.json nor vocab.txt (WordPiece)")
        if json.loads(tokenizer.to_str())["model"].get("type") != "WordPiece":
            raise ValueError(f"{directory}: its tokenizer is not WordPiece")
        return cls(tokenizer, specials, vocab_size or tokenizer.get_vocab_size())

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` as [CLS] pieces [SEP]."""
        return self.tokenizer.encode(text).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [encoding.ids for encoding in self.tokenizer.encode_batch(list(texts))]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids` up to the first [SEP], special tokens dropped, "##" pieces joined to their word."""
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        ids = ids[: ids.index(self.eos_id)] if self.eos_id in ids else ids
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def decode_batch(self, batch: Sequence[Sequence[int]]) -> list[str]:
        return [self.decode(ids) for ids in batch]

    def to_json(self) -> str:
        """The checkpoint's form (`from_json` reverses it)."""
        state = {
            "tokenizer": self.tokenizer.to_str(),
            "specials": self.specials,
            "vocab_size": self._vocab_size,
        }
        return json.dumps({"wordpiece": state}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> WordPieceTokenizer:
        state = json.loads(text)["wordpiece"]
        return cls(tokenizers.Tokenizer.from_str(state["tokenizer"]), state["specials"], state["vocab_size"])

    @staticmethod
    def is_json(text: str) -> bool:
        """Whether a checkpoint's tokenizer text is this tokenizer's (not `tokenizers` BPE JSON)."""
        return text.lstrip().startswith('{"wordpiece"')

    def __repr__(self) -> str:
        return f"WordPieceTokenizer(vocab_size={self.vocab_size})"


def _from_vocab(path: Path, settings: Mapping[str, Any], specials: Mapping[str, str]) -> tokenizers.Tokenizer:
    """BERT's pipeline over vocab.txt, with the normalization settings of tokenizer_config.json (their
    defaults are BertTokenizer's: lower-cased, accents stripped when lower-casing, CJK split)."""
    try:
        vocab = models.WordPiece.read_file(str(path))  # an id per line, as BertTokenizer reads it
    except Exception as err:  # tokenizers raises a bare Exception (not UTF-8, unreadable)
        raise ValueError(f"{path} is not a WordPiece vocabulary ({err})") from None
    tokenizer = tokenizers.Tokenizer(models.WordPiece(vocab, unk_token=specials["unk_token"]))
    tokenizer.normalizer = normalizers.BertNormalizer(
        clean_text=True,
        handle_chinese_chars=bool(settings.get("tokenize_chinese_chars", True)),
        strip_accents=settings.get("strip_accents"),
        lowercase=bool(settings.get("do_lower_case", True)),
    )
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    mask = _token_name(settings.get("mask_token"), "[MASK]")
    tokenizer.add_special_tokens([token for token in (*specials.values(), mask) if token in vocab])
    return tokenizer
