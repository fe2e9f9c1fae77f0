"""The inference API (`transformer.inference`) on real checkpoints: its translations are `evaluate.py`'s
hypotheses byte for byte (evaluate.py scores the split through the datamodule's loader, another batch path),
greedy and beam search with n-best, for one checkpoint, an average, an ensemble and a LoRA run; input order
and batching change nothing; a classifier labels as evaluate.py's predictions.tsv; imported OPUS-MT and
BERT models give what transformers gives; segment requests work; bad input is one `InferenceError`."""

from __future__ import annotations

import csv
import random
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from data.synthetic import make_synthetic_splits
from tests.helpers import trained
from tests.helpers.repo import REPO_ROOT
from transformer.checkpoint import load_checkpoint
from transformer.evaluation.n_best import n_best_lines
from transformer.evaluation.restore import restore_model
from transformer.inference import Classifier, InferenceError, Segment, Translator, load
from transformer.lora import LoraSettings, LowRankUpdate, add_lora

pytestmark = pytest.mark.slow  # training runs (shared, once per session) and evaluate.py in-process
translation_run = trained.translation_run
classification_run = trained.classification_run
# The session's tiny model is barely trained: its search mostly ends at once (an empty line). At least 3
# tokens are asked for (as evaluate.py's decode.* and as translate's options), and the best checkpoint (the
# first epoch's, by val/loss) is decoded where the outputs must differ from sentence to sentence.
BEST = "epoch_000.ckpt"
FORCED = ["decode.min_len=3", "decode.max_len_b=6"]
OPTIONS = {"min_len": 3, "max_len_b": 6}


@pytest.fixture(scope="module")
def checkpoints(translation_run: Path) -> Path:
    return translation_run / "checkpoints"


@pytest.fixture
def scored(monkeypatch: pytest.MonkeyPatch) -> Iterator:
    """`scored(out_dir, *overrides)`: evaluate.py on the checkpoint's test split (in this process);
    returns the rows of its predictions.tsv and its output directory."""
    monkeypatch.setenv("PROJECT_ROOT", str(REPO_ROOT))

    def run(out_dir: Path, *overrides: str, forced: bool = True) -> tuple[list[dict[str, str]], Path]:
        from evaluate import evaluate

        with initialize_config_dir(config_dir=str(REPO_ROOT / "configs"), version_base="1.3"):
            cfg: DictConfig = compose(
                "eval",
                overrides=[
                    f"paths.output_dir={out_dir}",
                    "progress=false",
                    "report.enabled=false",
                    *(FORCED if forced else []),
                    *overrides,
                ],
            )
        evaluate(cfg)
        with open(out_dir / "predictions.tsv", encoding="utf-8", newline="") as handle:
            rows = sorted(csv.DictReader(handle, delimiter="\t"), key=lambda row: int(row["id"]))
        return rows, out_dir

    yield run


def _hypotheses_text(translations: list) -> str:
    """hypotheses.txt as evaluate.py writes it: one line per sentence."""
    return "".join(" ".join(t.text.splitlines()) + "\n" for t in translations)


@pytest.mark.parametrize("beam", [1, 4], ids=["greedy", "beam4"])
def test_translations_are_evaluate_hypotheses_byte_for_byte(
    checkpoints: Path, tmp_path: Path, scored, beam: int
) -> None:
    ckpt = checkpoints / BEST
    n_best = min(beam, 2)
    rows, out = scored(
        tmp_path / "eval", f"ckpt_path={ckpt}", f"decode.beam_size={beam}", f"decode.n_best={n_best}"
    )
    sources = [row["source"] for row in rows]
    translator = Translator.from_checkpoint(ckpt)
    assert translator.task == "translation" and translator.paths == [ckpt] and translator.num_parameters > 0
    translations = translator.translate(sources, beam_size=beam, n_best=n_best, **OPTIONS)
    assert _hypotheses_text(translations) == (out / "hypotheses.txt").read_text(encoding="utf-8")
    assert len({t.text for t in translations}) > 3  # a trained model: not one string repeated
    if n_best > 1:
        lines = [
            line
            for i, t in enumerate(translations)
            for line in n_best_lines(i, [(h.text, h.score) for h in t.hypotheses])
        ]
        assert "".join(lines) == (out / "nbest.txt").read_text(encoding="utf-8")
        assert all(len(t.hypotheses) == 2 and t.score >= t.hypotheses[1].score for t in translations)


def test_input_order_and_batching_change_nothing(checkpoints: Path) -> None:
    translator = Translator.from_checkpoint(checkpoints / BEST)
    english, _ = make_synthetic_splits(7, {"test": 30})["test"]  # the quickstart task's sentences
    sources = [*english, " and ".join(english[:3]), "Hi."]  # lengths from 2 tokens to the longest
    together = [t.text for t in translator.translate(sources, beam_size=4, **OPTIONS)]
    alone = [translator.translate([source], beam_size=4, **OPTIONS)[0].text for source in sources]
    assert together == alone
    order = list(range(len(sources)))
    random.Random(0).shuffle(order)
    shuffled = translator.translate([sources[i] for i in order], beam_size=4, **OPTIONS)
    assert [t.text for t in shuffled] == [together[i] for i in order]
    assert len(set(together)) > 2
    tight = Translator.from_checkpoint(checkpoints / BEST, max_tokens=translator.max_len)
    assert [t.text for t in tight.translate(sources, beam_size=4, **OPTIONS)] == together
    assert translator.translate([]) == []


def test_averaged_and_ensembled_checkpoints_translate_as_evaluate_does(
    checkpoints: Path, tmp_path: Path, scored
) -> None:
    rows, out = scored(tmp_path / "avg", f"ckpt_path={checkpoints / 'last.ckpt'}", "average_last=2")
    averaged = Translator.from_checkpoint(checkpoints / "last.ckpt", average_last=2)
    assert len(averaged.paths) == 2
    sources = [row["source"] for row in rows]
    assert _hypotheses_text(averaged.translate(sources, **OPTIONS)) == (out / "hypotheses.txt").read_text(
        encoding="utf-8"
    )

    members = [checkpoints / "epoch_000.ckpt", checkpoints / "epoch_002.ckpt"]
    rows, out = scored(
        tmp_path / "ensemble",
        f"ckpt_path=[{members[0]},{members[1]}]",
        "ensemble_weights=[3,1]",
        "decode.beam_size=2",
    )
    ensemble = Translator.from_checkpoint(members, weights=[3, 1])
    translations = ensemble.translate([row["source"] for row in rows], beam_size=2, **OPTIONS)
    assert _hypotheses_text(translations) == (out / "hypotheses.txt").read_text(encoding="utf-8")


def _lora_checkpoint(source: Path, target: Path) -> Path:
    """`source` as a LoRA fine-tuning run saves one: base weights plus rank-2 adapters (random, so that the
    merged network differs from the base) and the run's `finetune.lora` settings."""
    checkpoint = load_checkpoint(source)
    model = restore_model(checkpoint, source).model
    settings = LoraSettings(rank=2, alpha=4.0)
    add_lora(model, settings)
    torch.manual_seed(0)
    for module in model.modules():
        if isinstance(module, LowRankUpdate):
            for parameter in module.lora_B.values():
                torch.nn.init.normal_(parameter, std=0.5)
    checkpoint["state_dict"] = {f"model.{k}": v for k, v in model.state_dict().items()}
    checkpoint["hyper_parameters"] = {
        **checkpoint["hyper_parameters"],
        "finetune": {"lora": settings.to_dict(), "freeze": "none"},
    }
    torch.save(checkpoint, target)
    return target


def test_a_lora_checkpoint_translates_as_evaluate_does(checkpoints: Path, tmp_path: Path, scored) -> None:
    lora = _lora_checkpoint(checkpoints / BEST, tmp_path / "lora.ckpt")
    rows, out = scored(tmp_path / "eval", f"ckpt_path={lora}")
    translator = Translator.from_checkpoint(lora)
    translations = translator.translate([row["source"] for row in rows], **OPTIONS)
    assert _hypotheses_text(translations) == (out / "hypotheses.txt").read_text(encoding="utf-8")
    plain = Translator.from_checkpoint(checkpoints / BEST).translate(
        [row["source"] for row in rows], **OPTIONS
    )
    assert [t.text for t in plain] != [t.text for t in translations]  # the adapters count
    with pytest.raises(InferenceError, match="LoRA fine-tuning checkpoint"):
        Translator.from_checkpoint(tmp_path, average_last=1)


def test_a_classifier_labels_as_evaluate_does(classification_run: Path, tmp_path: Path, scored) -> None:
    ckpt = classification_run / "checkpoints" / "last.ckpt"
    rows, _ = scored(tmp_path / "eval", f"ckpt_path={ckpt}", forced=False)  # no decoding options
    classifier = Classifier.from_checkpoint(ckpt)
    assert classifier.labels == ["negative", "positive"]
    predictions = classifier.predict([row["text"] for row in rows])
    assert [p.label for p in predictions] == [row["prediction"] for row in rows]
    for prediction, row in zip(predictions, rows):
        assert sum(prediction.probabilities.values()) == pytest.approx(1.0, abs=1e-6)
        for name, p in prediction.probabilities.items():
            assert f"{p:.4f}" == row[f"p({name})"]


def test_load_picks_the_class_by_the_checkpoint_task(checkpoints: Path, classification_run: Path) -> None:
    assert isinstance(load(classification_run / "checkpoints" / "last.ckpt"), Classifier)
    assert isinstance(load([checkpoints / "epoch_001.ckpt", checkpoints / "last.ckpt"]), Translator)


def test_training_saves_the_tokenizers_under_the_checkpoint_own_key(
    checkpoints: Path, classification_run: Path
) -> None:
    """The stable keys hold the datamodule state's own objects: pickle stores them once."""
    checkpoint = load_checkpoint(checkpoints / "last.ckpt")
    assert checkpoint["tokenizers"] is checkpoint["TranslationDataModule"]["tokenizers"]
    classification = load_checkpoint(classification_run / "checkpoints" / "last.ckpt")
    assert classification["class_names"] == ["negative", "positive"]
    assert classification["tokenizers"] is classification["ClassificationDataModule"]["tokenizers"]


def test_segments_honour_prefix_constraints_and_avoid(checkpoints: Path) -> None:
    translator = Translator.from_checkpoint(checkpoints / BEST)
    segments = [
        Segment("They bought one car.", prefix="Sie kauften", constraints=("Autos",)),
        Segment("She saw eighty-one eggs.", constraints=("Bälle",), avoid=("Eier", "sah")),
        Segment("We needed five cars.", avoid=("Wir",)),
        "They bought one car.",
        Segment("They bought one car.", constraints=(" ".join(["Äpfel und Autos"] * 12),)),
    ]
    results = translator.translate(segments, beam_size=4, n_best=2, max_len_b=20)
    assert results[0].text.startswith("Sie kauften") and "Autos" in results[0].text.split()
    assert "Bälle" in results[1].text.replace(".", " ").split()
    for result, avoided in ((results[1], ("Eier", "sah")), (results[2], ("Wir",))):
        for hypothesis in result.hypotheses:
            assert not set(avoided) & set(hypothesis.text.split()), hypothesis
    assert results[4].unsatisfiable and not any(r.unsatisfiable for r in results[:4])
    with pytest.raises(InferenceError, match=r"required phrases \(constraints\) need beam or greedy"):
        translator.translate(segments[:1], search="sample")


def test_bad_input_is_one_inference_error_naming_it(
    checkpoints: Path, classification_run: Path, tmp_path: Path
) -> None:
    missing = tmp_path / "missing.ckpt"
    with pytest.raises(InferenceError, match=f"checkpoint {missing} does not exist"):
        Translator.from_checkpoint(missing)
    classifier = classification_run / "checkpoints" / "last.ckpt"
    with pytest.raises(InferenceError, match=f"checkpoint {classifier} is a classification checkpoint"):
        Translator.from_checkpoint(classifier)
    with pytest.raises(InferenceError, match="is a translation checkpoint, not a classification one"):
        Classifier.from_checkpoint(checkpoints / "last.ckpt")
    translator = Translator.from_checkpoint(checkpoints / "last.ckpt")
    with pytest.raises(InferenceError, match="unknown decoding option beam_width"):
        translator.translate(["Hi."], beam_width=2)
    with pytest.raises(InferenceError, match="beam_size must be an integer >= 1, got -1"):
        translator.translate(["Hi."], beam_size=-1)
    with pytest.raises(InferenceError, match="n_best must be <= beam_size"):
        translator.settings(beam_size=2, n_best=3)
    with pytest.raises(InferenceError, match="segment 1: the text must be a string, got 5"):
        translator.translate(["Hi.", 5])  # type: ignore[list-item]
    with pytest.raises(InferenceError, match="segment 0: avoid\\[0\\] 'Sie' occurs in prefix"):
        translator.translate([Segment("They bought one car.", prefix="Sie kauften", avoid=("Sie",))])
    with pytest.raises(InferenceError, match="max_tokens must be an integer >= the checkpoint's max_len"):
        Translator.from_checkpoint(checkpoints / "last.ckpt", max_tokens=3)
    with pytest.raises(InferenceError, match="not both"):
        translator.translate(["Hi."], translator.settings(), beam_size=2)
    with pytest.raises(InferenceError, match="segment 0: the text must be a string"):
        Classifier.from_checkpoint(classifier).predict([None])  # type: ignore[list-item]


def test_the_examples_of_docs_inference_run(checkpoints: Path, classification_run: Path, capsys) -> None:
    """docs/inference.md's Python blocks, with the session's checkpoints for the placeholder path."""
    text = (REPO_ROOT / "docs" / "inference.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)
    assert len(blocks) == 2
    placeholder = "logs/train/runs/<time>/checkpoints/last.ckpt"
    for block, ckpt in zip(blocks, (checkpoints / BEST, classification_run / "checkpoints" / "last.ckpt")):
        assert placeholder in block
        exec(compile(block.replace(placeholder, str(ckpt)), "docs/inference.md", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 2 * 2 + 1 + 2  # two translations (best, n-best), a segment, two predictions
