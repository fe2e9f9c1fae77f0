"""Distillation settings that only make sense with teachers are refused without them, before any work
(`transformer.cli.distill.synthetic.wanted`): the distillation recipes, `distill.mix=both` and
`distill.ensemble_weights` would otherwise train a plain model and say nothing."""

from __future__ import annotations

import pytest

from tests.helpers.configs import compose_train_cfg
from transformer.cli.distill import synthetic
from transformer.cli.errors import ConfigError


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["experiment=multi30k_de_en_distill"], r"this experiment distils \(distill.required=true\)"),
        (["experiment=multi30k_de_en_distill_small"], r"this experiment distils"),
        (["distill.mix=both"], r"distill.mix=both mixes in the teachers' translations"),
        (["distill.teachers=[]", "distill.mix=both"], r"distill.mix=both"),
        (["distill.ensemble_weights=[1,2]"], r"distill.ensemble_weights weighs teachers"),
    ],
)
def test_teacher_settings_without_teachers_are_refused(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as raised:
        synthetic.wanted(compose_train_cfg(overrides))
    assert "distill.teachers=[a.ckpt,b.ckpt]" in str(raised.value) and "\n" not in str(raised.value)


def test_plain_runs_and_distillation_with_teachers_are_not_refused() -> None:
    assert synthetic.wanted(compose_train_cfg([])) is False
    assert synthetic.wanted(compose_train_cfg(["experiment=multi30k_de_en"])) is False
    with_teachers = ["experiment=multi30k_de_en_distill", "distill.teachers=[a.ckpt]", "distill.mix=both"]
    assert synthetic.wanted(compose_train_cfg(with_teachers)) is True


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["distill.teachers=['']"], "distill.teachers[0] is an empty path"),
        (["distill.teachers=[a.ckpt,' ']"], "distill.teachers[1] is an empty path"),
        (["distill.teachers=''"], "distill.teachers is an empty path"),
    ],
)
def test_an_empty_teacher_path_is_refused_as_such(overrides: list[str], key: str) -> None:
    """Not "checkpoint . is a directory": `Path('')` is the current directory."""
    with pytest.raises(ConfigError, match=r"give the path of a \.ckpt file") as raised:
        synthetic.wanted(compose_train_cfg(overrides))
    assert str(raised.value).startswith(key) and "\n" not in str(raised.value)


def test_an_empty_reverse_model_path_is_refused_as_such() -> None:
    cfg = compose_train_cfg(["backtranslate.model=''", "backtranslate.monolingual=mono.txt"])
    assert synthetic.wanted(cfg) is True
    with pytest.raises(ConfigError, match=r"^backtranslate.model is an empty path"):
        synthetic.make_plan(cfg)
