"""The inference API's parts on their own: it imports neither Hydra, OmegaConf nor Lightning; the batching
defaults it assumes for a checkpoint's data section are the datamodules' own; a checkpoint's tokenizers and
class names are read from its own keys or from the datamodule state (older checkpoints have only that);
target phrases are encoded and refused as evaluate.py's JSONL input refuses them; token-budget batches keep
every text once, shortest first, within the budget."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
import torch

from data.batching import TranslationCollator
from data.datamodules import ClassificationDataModule, TranslationDataModule
from tests.helpers.repo import REPO_ROOT
from transformer.evaluation.restore import saved_class_names, saved_tokenizers, with_stable_keys
from transformer.inference import InferenceError, Segment
from transformer.inference.batches import token_budget_batches
from transformer.inference.loading import DATA_DEFAULTS, as_paths, device_of
from transformer.inference.requests import PhraseEncoder


def test_the_api_imports_neither_hydra_omegaconf_nor_lightning() -> None:
    """Nor the scorers (sacrebleu, torchmetrics) nor `datasets`: a program that only translates loads what
    translating needs (the CTranslate2 backend and the export it converts with included)."""
    edge = (
        "hydra",
        "omegaconf",
        "lightning",
        "pytorch_lightning",
        "fastapi",
        "sacrebleu",
        "torchmetrics",
        "datasets",
    )
    code = f"import sys, transformer.inference; print(sorted(set({edge}) & set(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("task", "cls"), [("translation", TranslationDataModule), ("classification", ClassificationDataModule)]
)
def test_the_assumed_data_defaults_are_the_datamodules_own(task: str, cls: type) -> None:
    parameters = inspect.signature(cls).parameters
    assert {key: parameters[key].default for key in DATA_DEFAULTS[task]} == DATA_DEFAULTS[task]
    assert parameters["eval_max_tokens"].default is None  # then max_tokens, as loading assumes


def test_tokenizers_and_class_names_from_the_checkpoint_key_or_the_datamodule_state() -> None:
    old = {"ClassificationDataModule": {"tokenizers": {"joint": "{...}"}, "class_names": ["neg", "pos"]}}
    assert saved_tokenizers(old, "classification") == {"joint": "{...}"}
    assert saved_class_names(old) == ["neg", "pos"]
    new = with_stable_keys(dict(old))
    assert new["tokenizers"] is old["ClassificationDataModule"]["tokenizers"]  # shared: pickled once
    assert new["class_names"] == ["neg", "pos"]
    alone = {"tokenizers": {"joint": "mine"}, "class_names": ["a", "b"]}  # no datamodule state
    assert saved_tokenizers(alone, "classification") == {"joint": "mine"}
    assert saved_class_names(alone) == ["a", "b"]
    edited = {**new, "tokenizers": {"joint": "mine"}}  # a hand-edited checkpoint: the state wins
    assert saved_tokenizers(edited, "classification") == {"joint": "{...}"}
    imported = {"ClassificationDataModule": {"tokenizers": {}}, "imported_from": {"labels": ["L0", "L1"]}}
    assert saved_class_names(imported) == ["L0", "L1"]  # a BERT imported before the class_names key
    assert saved_tokenizers({}, "translation") == {} and saved_class_names({}) is None


_VOCAB = {"sie": 4, "kauften": 5, "ein": 6, "auto": 7}


class _Words:
    """A word-level target tokenizer: BOS 1, EOS 2, UNK 3, known words from 4."""

    bos_id, eos_id, unk_id = 1, 2, 3

    def encode(self, text: str) -> list[int]:
        return [1, *(_VOCAB.get(word, 3) for word in text.split()), 2]


def test_phrases_are_encoded_and_refused_as_the_jsonl_input_refuses_them() -> None:
    encoder = PhraseEncoder.of(_Words())
    request = encoder.request(
        "segment 0", Segment("x", prefix=" sie  kauften", constraints=("auto",), avoid=("ein",))
    )
    assert (request.prefix, request.include, request.avoid) == ((4, 5), ((7,),), ((6,),))
    cases = {
        "has characters the target tokenizer cannot encode": Segment("x", constraints=("zebra",)),
        r"constraints\[0\] is empty": Segment("x", constraints=("  ",)),
        "constraints must be a list of strings": Segment("x", constraints="auto"),  # type: ignore[arg-type]
        r"avoid\[0\] must be a string": Segment("x", avoid=(1,)),  # type: ignore[arg-type]
        r"avoid\[0\] 'kauften' occurs in prefix": Segment("x", prefix="sie kauften", avoid=("kauften",)),
        "prefix must be a string": Segment("x", prefix=5),  # type: ignore[arg-type]
    }
    for message, segment in cases.items():
        with pytest.raises(InferenceError, match=f"segment 3: .*(?:{message})"):
            encoder.request("segment 3", segment)


def test_batches_keep_every_text_once_shortest_first_within_the_budget() -> None:
    ids = [[1, *range(4, 4 + n), 2] for n in (5, 1, 9, 3, 1, 30)]
    batches = list(token_budget_batches(ids, max_len=12, max_tokens=24, collate=TranslationCollator(0)))
    order = [i for batch in batches for i in batch["id"].tolist()]
    assert sorted(order) == list(range(len(ids)))
    assert order == sorted(range(len(ids)), key=lambda i: (min(len(ids[i]), 12), i))  # ties in input order
    for batch in batches:
        assert batch["src"].numel() <= 24 and torch.equal(batch["src_padding_mask"], batch["src"] == 0)
    longest = next(b for b in batches if 5 in b["id"].tolist())["src"]
    assert longest.shape[1] == 12 and longest[0, -1].item() == 2  # cut to max_len, EOS kept
    assert list(token_budget_batches([], max_len=12, max_tokens=24, collate=TranslationCollator(0))) == []


def test_paths_and_devices_are_checked() -> None:
    assert as_paths("a.ckpt") == as_paths(["a.ckpt"])
    for bad in ([], 5, ["a.ckpt", 3]):
        with pytest.raises(InferenceError, match="checkpoint path"):
            as_paths(bad)  # type: ignore[arg-type]
    assert device_of("cpu") == torch.device("cpu")
    with pytest.raises(InferenceError, match="device='gpu0' is not a device"):
        device_of("gpu0")
