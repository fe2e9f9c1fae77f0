"""An imported OPUS-MT model decodes as the system it came from: `aiayn-import` takes its generation settings
(num_beams, length_penalty with transformers' len ** alpha normalization, early_stopping) as the
checkpoint's decoding defaults (`transformer.interop.marian.decoding_from_marian`), and our beam search at
those defaults gives `MarianMTModel.generate`'s tokens.

The model is the tiny OPUS-MT-shaped directory of `tests.helpers.pretrained`, trained here for 100 steps to
copy German sentences (`tests.helpers.opus_mt.train_to_copy`), so that its translations end at many lengths.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from torch import Tensor

transformers = pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

from data.sentencepiece_pair import SentencePieceSide  # noqa: E402
from tests.helpers.datasets import data_dir  # noqa: E402
from tests.helpers.opus_mt import quiet_marian_tokenizer, train_to_copy  # noqa: E402
from tests.helpers.pretrained import multi30k_lines, opus_mt_directory  # noqa: E402
from transformer.interop.import_hf import import_hf  # noqa: E402
from transformer.interop.marian import decoding_from_marian  # noqa: E402
from transformer.interop.source import ExportError, ExportSource, load_source  # noqa: E402
from transformer.search.decoding import DecodingSettings, search  # noqa: E402
from transformer.search.step import LengthLimits  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

N_SENTENCES = 100
EOS = 0  # OPUS-MT's </s>


# --- the mapping -------------------------------------------------------------------------------------------


def _directory(tmp_path: Path, config: dict | None = None, generation: dict | None = None) -> Path:
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "marian", **(config or {})}))
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    return tmp_path


def test_generation_settings_become_the_decoding_defaults(tmp_path: Path, caplog) -> None:
    """generation_config.json over an older config.json's generation keys, as transformers reads them;
    transformers' defaults (alpha 1.0, early_stopping false) where neither says, and beam 4 (OPUS-MT's)."""
    limits = {"length_normalization": "power", "max_len_a": 1.2, "max_len_b": 10}
    assert decoding_from_marian(_directory(tmp_path / "none")) == {
        "beam_size": 4, "length_penalty": 1.0, **limits
    }  # fmt: skip
    old = _directory(tmp_path / "old", {"num_beams": 6, "length_penalty": 0.8, "max_length": 512})
    assert decoding_from_marian(old) == {"beam_size": 6, "length_penalty": 0.8, **limits}
    both = _directory(tmp_path / "both", {"num_beams": 6, "length_penalty": 0.8}, {"num_beams": 5})
    assert decoding_from_marian(both) == {"beam_size": 5, "length_penalty": 0.8, **limits}
    with caplog.at_level(logging.WARNING):
        assert decoding_from_marian(
            _directory(tmp_path / "never0", None, {"early_stopping": "never", "length_penalty": 0.0})
        )
        assert not caplog.records  # "never" with alpha <= 0 is transformers' false rule, ours
        assert decoding_from_marian(_directory(tmp_path / "true", None, {"early_stopping": True}))
    assert "early_stopping=True has no counterpart" in caplog.text
    settings = DecodingSettings.from_values(None, decoding_from_marian(old))  # a valid settings base
    assert settings.length_normalizer(4) == 4**0.8


@pytest.mark.parametrize(
    ("generation", "named"),
    [
        ({"num_beams": 0}, "num_beams must be an integer >= 1, got 0"),
        ({"num_beams": "4"}, "num_beams must be an integer >= 1, got '4'"),
        ({"length_penalty": "long"}, "length_penalty must be a finite number, got 'long'"),
        ({"early_stopping": "sometimes"}, "early_stopping must be true, false or \"never\", got 'sometimes'"),
    ],
)
def test_bad_generation_settings_are_refused_by_file_and_key(
    tmp_path: Path, generation: dict, named: str
) -> None:
    with pytest.raises(ValueError, match=r"generation_config\.json: ") as refused:
        decoding_from_marian(_directory(tmp_path, None, generation))
    assert named in str(refused.value)
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"generation_config\.json cannot be read as JSON"):
        decoding_from_marian(tmp_path)


# --- against generate --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ExportSource]:
    root = tmp_path_factory.mktemp("import-decoding")
    opus = opus_mt_directory(root / "opus-mt-de-en", data_dir("MULTI30K_DIR"))
    train_to_copy(opus)
    return opus, load_source(import_hf(opus, root / "imported"))


@pytest.fixture(scope="module")
def sentences() -> list[str]:
    return multi30k_lines(data_dir("MULTI30K_DIR"), "test_2016_flickr.de.gz", N_SENTENCES)


def _until_eos(rows: Tensor) -> list[list[int]]:
    return [row[: row.index(EOS) + 1] if EOS in row else row for row in rows.tolist()]


def test_the_import_decodes_as_generate_at_its_own_settings(
    imported: tuple[Path, ExportSource], sentences: list[str], tmp_path: Path
) -> None:
    """Beam 4, length penalty 1.0 (the import's own, from its generation_config.json: len ** alpha) and
    alpha 0, ours against `generate` with the directory's own generation config: the same tokens on every
    sentence whose translation ends before its length limit, here nearly all of them.

    At the limit the two differ by design: ours cuts a hypothesis at floor(1.2 * source length + 10)
    tokens per sentence and forces EOS there with EOS's own log-probability, while `generate` has one
    `max_length` per call (the generation config's, 128 here, 512 in OPUS-MT's) and, with OPUS-MT's
    `forced_eos_token_id`, forces EOS at it with log-probability 0. So a sentence that reaches our limit
    is cut where `generate` decodes on; and even with the same limit, hypotheses cut there score higher in
    `generate` than in ours, which can change the winner. With GNMT's normalization at the same alpha
    (ours before this option) some sentences differ: the formula, not chance, makes them agree."""
    opus, source = imported
    defaults = DecodingSettings.from_values(None, source.decoding)
    assert (defaults.beam_size, defaults.length_penalty, defaults.length_normalization) == (4, 1.0, "power")
    side = SentencePieceSide(source.sentencepiece, "src")
    rows = [torch.tensor(ids) for ids in side.encode_batch(sentences)]
    src = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=source.config.pad_id)
    limits = LengthLimits.of(source.config, src, defaults.max_len_a, defaults.max_len_b).per_sentence.tolist()
    tokenizer = quiet_marian_tokenizer(opus)
    marian = transformers.MarianMTModel.from_pretrained(opus).eval()
    batch = tokenizer(sentences, return_tensors="pt", padding=True)
    assert batch.input_ids.tolist() == src.tolist()  # the same ids in (MarianTokenizer pads with <pad>)
    decoded = {}
    for alpha in (1.0, 0.0):
        settings = DecodingSettings.from_values({"length_penalty": alpha}, defaults)
        ours = decoded[alpha] = _until_eos(search(source.model, src, settings)[0][:, 0])
        with torch.no_grad():
            theirs = _until_eos(marian.generate(**batch, length_penalty=alpha)[:, 1:])  # after the start
        before_limit = [i for i, limit in enumerate(limits) if max(len(ours[i]), len(theirs[i])) < limit]
        assert len(before_limit) >= 0.9 * N_SENTENCES, alpha
        assert [ours[i] for i in before_limit] == [theirs[i] for i in before_limit], alpha
        assert len({tuple(row) for row in ours}) >= N_SENTENCES // 2  # real, varied sentences
    gnmt = DecodingSettings.from_values({"length_normalization": "gnmt"}, defaults)
    assert _until_eos(search(source.model, src, gnmt)[0][:, 0]) != decoded[1.0]


def test_at_a_length_limit_only_the_sentences_cut_there_may_differ(
    imported: tuple[Path, ExportSource], sentences: list[str]
) -> None:
    """The same limit on both sides (16 tokens with EOS: `max_new_tokens=16`, EOS forced as the 16th token in
    both), tight enough that most translations reach it: every sentence that ended before it in both is
    still the same, and every difference is a sentence that one of the two cut at the limit (there ours
    ranks the cut hypotheses with EOS's own log-probability, `generate` with 0)."""
    opus, source = imported
    limit = 16
    settings = DecodingSettings.from_values({"max_len_a": 0, "max_len_b": limit}, source.decoding)
    side = SentencePieceSide(source.sentencepiece, "src")
    rows = [torch.tensor(ids) for ids in side.encode_batch(sentences)]
    src = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=source.config.pad_id)
    ours = _until_eos(search(source.model, src, settings)[0][:, 0])
    batch = quiet_marian_tokenizer(opus)(sentences, return_tensors="pt", padding=True)
    with torch.no_grad():
        marian = transformers.MarianMTModel.from_pretrained(opus).eval()
        theirs = _until_eos(marian.generate(**batch, max_new_tokens=limit)[:, 1:])
    cut = {i for i in range(N_SENTENCES) if max(len(ours[i]), len(theirs[i])) >= limit}
    assert 10 <= len(cut) <= N_SENTENCES - 10  # both kinds, many of each (78 cut here)
    assert all(ours[i] == theirs[i] for i in range(N_SENTENCES) if i not in cut)
    assert all(len(row) <= limit for row in ours + theirs)


def test_a_bad_generation_config_stops_the_import_with_one_line(
    imported: tuple[Path, ExportSource], tmp_path: Path
) -> None:
    opus, _ = imported
    broken = tmp_path / "broken"
    broken.mkdir()
    for path in opus.iterdir():
        (broken / path.name).write_bytes(path.read_bytes())
    (broken / "generation_config.json").write_text(json.dumps({"num_beams": -2}))
    with pytest.raises(ExportError, match=r"cannot import .*generation_config.json: num_beams must be"):
        import_hf(broken, tmp_path / "out")
    assert not (tmp_path / "out").exists()
