"""The shared datamodule settings (`TokenizedSettings`): one frozen record built from the flat `data.*` keys,
with each task's defaults, checked once; the task classes still show and take every key."""

import dataclasses
import inspect
import re
from pathlib import Path

import pytest

from data.datamodules import ClassificationDataModule, TokenizedSettings, TranslationDataModule


def test_each_task_takes_the_flat_keys_into_one_frozen_record_with_its_own_defaults(tmp_path: Path) -> None:
    translation = TranslationDataModule(max_tokens=512, max_len=64, cache_dir=str(tmp_path))
    assert translation.settings == TokenizedSettings(max_tokens=512, max_len=64, cache_dir=tmp_path)
    assert translation.settings.eval_max_tokens == 512 == translation.eval_max_tokens  # None: max_tokens
    assert translation.cache_dir == tmp_path and translation.splits["val"] == "val"
    with pytest.raises(dataclasses.FrozenInstanceError):
        translation.settings.max_len = 8  # type: ignore[misc]
    classification = ClassificationDataModule(data_dir="unused")
    assert (classification.max_len, classification.splits["val"]) == (128, "dev")
    assert TokenizedSettings().max_len == 256  # the task's defaults do not leak into the record's own


def test_the_signature_lists_every_shared_key_once_with_the_tasks_default() -> None:
    fields = [field.name for field in dataclasses.fields(TokenizedSettings)]
    for cls, max_len in ((TranslationDataModule, 256), (ClassificationDataModule, 128)):
        parameters = inspect.signature(cls).parameters
        assert [name for name in parameters if name in fields] == fields
        assert parameters["max_len"].default == max_len and parameters["cache_dir"].default is None


def test_an_unknown_key_or_a_value_out_of_range_names_the_key() -> None:
    with pytest.raises(
        TypeError,
        match=re.escape("TranslationDataModule.__init__() got an unexpected keyword argument 'max_token'"),
    ):
        TranslationDataModule(max_token=512)
    with pytest.raises(ValueError, match=r"eval_max_tokens \(32\) must be at least max_len \(64\)"):
        TranslationDataModule(max_len=64, eval_max_tokens=32)
    with pytest.raises(ValueError, match="num_workers must be >= 0, got -1"):
        TokenizedSettings(num_workers=-1)
