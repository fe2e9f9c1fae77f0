"""`translate.output` and `translate.alignments` (evaluate.py's translate mode): written aside and renamed
at the end, so a bad input line stops the run with the earlier files whole; a folder that does not exist
or a directory given as the file is refused before anything runs (one line naming the key). The decoding
itself is stubbed: these are the file rules of `transformer.cli.text_io.translate_stream`. Also: the
warning for a request that cannot fit names the limit that binds."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from transformer import disk
from transformer.cli import text_io, text_translation
from transformer.cli.errors import ConfigError
from transformer.cli.text_io import Translation, translate_stream
from transformer.cli.translate_input import Entry
from transformer.search.constraints import TargetRequest
from transformer.search.decoding import DecodingSettings


class _Tokenizer:
    bos_id, eos_id, unk_id = 1, 2, 3

    def encode(self, text: str) -> list[int]:
        return [1, *(4 + len(word) for word in text.split()), 2]


@pytest.fixture
def translated(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The decoding stubbed: each line's translation is its source reversed; returns the batch sizes."""
    batches: list[int] = []

    def translator(*args: object) -> object:
        def translate(items: list) -> list[Translation]:
            batches.append(len(items))
            texts = [getattr(item, "src", item) for item in items]
            return [Translation([(text[::-1], -1.0)], ["0-0"]) for text in texts]

        return translate

    monkeypatch.setattr(text_io, "line_translator", translator)
    return batches


def _translate(tmp_path: Path, lines: str, **options: object) -> None:
    source = tmp_path / "in.txt"
    source.write_text(lines, encoding="utf-8")
    config = OmegaConf.create({"input": str(source), "chunk_lines": 1, **options})
    datamodule = SimpleNamespace(tgt_tokenizer=_Tokenizer())
    translate_stream(config, torch.nn.Identity(), datamodule, DecodingSettings(), torch.device("cpu"))


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_the_output_appears_whole_at_the_end(tmp_path: Path, translated: list[int]) -> None:
    target, aligned = tmp_path / "out.txt", tmp_path / "align.txt"
    target.write_text("earlier\n")
    _translate(tmp_path, "abc\nxy\n", output=str(target), alignments=str(aligned))
    assert target.read_text() == "cba\nyx\n" and aligned.read_text() == "0-0\n0-0\n"
    assert translated == [1, 1] and _leftovers(tmp_path) == []


def test_a_bad_line_leaves_the_earlier_files_whole(tmp_path: Path, translated: list[int]) -> None:
    target, aligned = tmp_path / "out.jsonl", tmp_path / "align.txt"
    target.write_text("earlier translations\n")
    aligned.write_text("earlier alignments\n")
    with pytest.raises(ConfigError, match="line 2: not JSON"):
        _translate(
            tmp_path, '{"src": "abc"}\n{oops\n', output=str(target), alignments=str(aligned), format="jsonl"
        )
    assert translated == [1]  # the first line was translated and written (aside) before the bad one
    assert target.read_text() == "earlier translations\n" and aligned.read_text() == "earlier alignments\n"
    assert _leftovers(tmp_path) == []
    new = tmp_path / "new.jsonl"  # a file that did not exist is not left behind half-written either
    with pytest.raises(ConfigError):
        _translate(tmp_path, '{"src": "abc"}\n{oops\n', output=str(new), format="jsonl")
    assert not new.exists() and _leftovers(tmp_path) == []


@pytest.mark.parametrize("key", ["output", "alignments"])
def test_an_output_that_cannot_be_a_file_is_refused_first(
    tmp_path: Path, translated: list[int], key: str
) -> None:
    missing = rf"translate\.{key}=.*out\.txt: the folder .*missing does not exist"
    with pytest.raises(ConfigError, match=missing):
        _translate(tmp_path, "abc\n", **{key: str(tmp_path / "missing" / "out.txt")})
    with pytest.raises(ConfigError, match=rf"translate\.{key}=.* is a directory"):
        _translate(tmp_path, "abc\n", **{key: str(tmp_path)})
    assert translated == []  # refused before any decoding


def test_writing_aside_keeps_the_earlier_file_on_ctrl_c(tmp_path: Path) -> None:
    target = tmp_path / "out.txt"
    target.write_text("earlier\n")
    with pytest.raises(KeyboardInterrupt), disk.writing_aside(target, "translations") as handle:
        handle.write("half")
        raise KeyboardInterrupt
    assert target.read_text() == "earlier\n" and _leftovers(tmp_path) == []


@pytest.mark.parametrize(
    ("model_max_len", "binds"),
    [
        (64, "decode.max_len_a * source length + decode.max_len_b = 1.2 * source length + 10 caps it"),
        (8, "the model's max_len of 8 positions caps it"),
    ],
    ids=["decode_limit", "model_max_len"],
)
def test_the_unsatisfiable_warning_names_the_limit_that_binds(
    caplog: pytest.LogCaptureFixture, model_max_len: int, binds: str
) -> None:
    """A 5-token source allows 1.2 * 5 + 10 = 16 tokens unless the model's positions cap it lower: only
    then is raising decode.max_len_* no help (issue 51: it was always the advice)."""
    config = SimpleNamespace(pad_id=0, max_len=model_max_len)
    src = torch.tensor([[5, 6, 7, 8, 9]])  # (B, S)
    entries = [Entry(3, "a b c d e", TargetRequest(prefix=tuple(range(10, 30))))]  # 21 tokens with EOS
    with caplog.at_level(logging.WARNING):
        assert text_translation._unsatisfiable(config, src, DecodingSettings(), entries, "in.jsonl") == {0}
    (message,) = [record.getMessage() for record in caplog.records]
    assert (
        message.startswith("in.jsonl line 3: the prefix and constraints need 21 tokens") and binds in message
    )
    assert ("raise decode.max_len_b" in message) == (model_max_len == 64)
