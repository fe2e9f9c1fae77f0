"""The distillation cache key (`transformer.cli.distill.synthetic.cache_key` over `.teachers`): what
decides the teachers' translations changes it (their weights and tokenizers, `distill.ensemble_weights`,
every decoding setting that can change an output, the seed when sampling), and what does not is left out:
the teachers' file names and folders, and `kv_cache` (speed only). And the teachers' checks: the language
direction and the student's kind of data."""

from __future__ import annotations

import shutil
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.evaluation import tiny_config
from transformer.cli.distill import teachers
from transformer.cli.distill.synthetic import Plan, cache_key
from transformer.cli.distill.teachers import load_translator
from transformer.cli.errors import ConfigError
from transformer.training import TranslationTask

DIRECTION = ("de", "en")
DATA = {"source": "multi30k"}
TEXTS = ["ein hund", "zwei katzen", "drei vögel"]
CONFIG = tiny_config(src_vocab_size=16)


def _teacher(path: Path, seed: int, tokenizer: str = "{}") -> Path:
    """A tiny de -> en translation checkpoint as train.py saves one (its tokenizer a stand-in string)."""
    torch.manual_seed(seed)
    task = TranslationTask(CONFIG)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "state_dict": task.state_dict(),
            "hyper_parameters": dict(task.hparams),
            "global_step": 5,
            "epoch": 0,
            "config": {
                "model": {"_target_": "transformer.training.TranslationTask"},
                "data": {"src_lang": "de", "tgt_lang": "en", **DATA},
            },
            "TranslationDataModule": {"tokenizers": {"joint": tokenizer}},
        },
        path,
    )
    return path


@pytest.fixture
def key(monkeypatch: pytest.MonkeyPatch) -> Any:
    """`key(paths, weights=None, **decode)`: the cache key of distilling TEXTS with those teachers. The
    datamodule (the saved tokenizer; only its `max_len` enters the key) is a stand-in."""
    monkeypatch.setattr(
        teachers, "build_datamodule", lambda *args, **kwargs: types.SimpleNamespace(max_len=64)
    )

    def make(paths: list[Path], weights: list[float] | None = None, seed: int = 0, **decode: Any) -> str:
        translator = load_translator(
            "distill.teachers", paths, direction=DIRECTION, data=DATA, decode_values=decode, weights=weights
        )
        return cache_key(Plan("distill", translator, TEXTS, {"chunk_sentences": 2}), seed=seed)

    return make


def test_renamed_or_moved_teachers_keep_the_key(tmp_path: Path, key: Any) -> None:
    a, b = _teacher(tmp_path / "a.ckpt", 0), _teacher(tmp_path / "b.ckpt", 1)
    moved = tmp_path / "elsewhere" / "deeper"
    moved.mkdir(parents=True)
    a2, b2 = Path(shutil.copy(a, moved / "teacher-one.ckpt")), Path(shutil.copy(b, moved / "last.ckpt"))
    assert key([a, b]) == key([a2, b2]) == key([a2, b2])
    assert key([a]) == key([a2])
    a.rename(tmp_path / "renamed.ckpt")
    assert key([tmp_path / "renamed.ckpt"]) == key([a2])
    # other weights are other teachers
    assert key([a2]) != key([b2]) and key([a2, b2]) != key([a2])


def test_ensemble_weights_and_every_decoding_setting_change_the_key(tmp_path: Path, key: Any) -> None:
    a, b = _teacher(tmp_path / "a.ckpt", 0), _teacher(tmp_path / "b.ckpt", 1)
    base = key([a, b])
    weighted = {key([a, b], weights=w) for w in ([1.0, 2.0], [2.0, 1.0], [1.0, 3.0])}
    assert len(weighted) == 3 and base not in weighted
    changes: dict[str, dict[str, Any]] = {
        "search": {"search": "sample"},
        "beam_size": {"beam_size": 3},
        "n_best": {"beam_size": 3, "n_best": 2},
        "length_penalty": {"length_penalty": 1.0},
        "length_normalization": {"length_normalization": "power"},
        "max_len_a": {"max_len_a": 2.0},
        "max_len_b": {"max_len_b": 3.0},
        "top_k": {"top_k": 5},
        "top_p": {"top_p": 0.5},
        "temperature": {"temperature": 0.7},
        "min_len": {"min_len": 2},
        "no_repeat_ngram_size": {"no_repeat_ngram_size": 2},
        "alignments": {"alignments": True},
        "alignment_layer": {"alignment_layer": -1},
    }
    keys = {name: key([a, b], **decode) for name, decode in changes.items()}
    assert set(changes) | {"kv_cache"} == set(teachers.DecodingSettings.__dataclass_fields__)
    assert base not in keys.values() and len(set(keys.values())) == len(keys)
    assert key([a, b], beam_size=3, n_best=2) != key([a, b], beam_size=3)
    assert key([a, b], kv_cache="static") == base  # how fast, not what is decoded


def test_the_tokenizer_and_for_sampling_only_the_seed_change_the_key(tmp_path: Path, key: Any) -> None:
    a = _teacher(tmp_path / "a.ckpt", 0)
    other_tokenizer = _teacher(tmp_path / "b.ckpt", 0, tokenizer='{"another": 1}')  # the same weights
    assert key([a]) != key([other_tokenizer])
    assert key([a], seed=1) == key([a])  # beam search: the seed decides nothing
    assert key([a], seed=1, search="sample") != key([a], search="sample")


def test_a_teacher_trained_on_other_data_is_refused(tmp_path: Path) -> None:
    a = _teacher(tmp_path / "a.ckpt", 0)
    with pytest.raises(ConfigError, match=r"data\.source=multi30k, this run has data\.source=wmt14"):
        load_translator(
            "distill.teachers", [a], direction=DIRECTION, data={"source": "wmt14"}, decode_values={}
        )
    with pytest.raises(ConfigError, match=r"translates de -> en, but this needs en -> de"):
        load_translator("distill.teachers", [a], direction=("en", "de"), data=DATA, decode_values={})
