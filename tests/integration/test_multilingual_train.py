"""Issue 65 items 1, 2, 5, 6 end to end: a tiny many-to-many run of `experiment=quickstart_multilingual`
validates and tests every direction (val/bleu_en-de, ...; val/bleu their mean), writes the labels into
its checkpoint, and evaluate.py scores it per direction (one printed row each, hypotheses.en-de.txt, ...,
the report's section and chart). Bad pairs or a pair whose files are missing: one `error:` line, nothing
written. The Multi30k recipes start, validate per direction and test (with the real data only)."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest
import sacrebleu
import torch

from tests.helpers.cli import run_script
from tests.helpers.repo import REPO_ROOT
from tests.helpers.trained import train_run

DIRECTIONS = ["de-en", "en-de", "en-fr", "fr-de"]
TINY = [
    "experiment=quickstart_multilingual",
    "data.pairs=[en-de,en-fr,de-en,fr-de]",
    "data.synthetic_sizes.train=150",
    "data.synthetic_sizes.val=10",
    "data.synthetic_sizes.test=12",
    "data.vocab_size=300",
    "model.config.d_model=32",
    "model.config.n_heads=2",
    "model.config.n_encoder_layers=1",
    "model.config.n_decoder_layers=1",
    "model.config.d_ff=64",
    "model.scheduler.warmup_steps=8",
    "model.decoding.max_len_b=4",
    "trainer.max_epochs=1",
    "trainer.num_sanity_val_steps=0",
    "callbacks.rich_progress_bar=null",
    "callbacks.model_summary=null",
]


def _env() -> dict[str, str]:
    return {**os.environ, "PROJECT_ROOT": str(REPO_ROOT), "WANDB_MODE": "offline"}


@pytest.fixture(scope="module")
def multilingual_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("multilingual")
    return train_run(root / "run", root / "cache", TINY)


def test_training_validates_and_tests_every_direction(multilingual_run: Path) -> None:
    metrics = json.loads((multilingual_run / "metrics.json").read_text())
    values = metrics.get("metrics", metrics)
    for stage in ("val", "test"):
        per = [values[f"{stage}/bleu_{d}"] for d in DIRECTIONS]
        assert values[f"{stage}/bleu"] == pytest.approx(sum(per) / len(per))
        chrf = [values[f"{stage}/chrf_{d}"] for d in DIRECTIONS]
        assert values[f"{stage}/chrf"] == pytest.approx(sum(chrf) / len(chrf))
    assert {values[f"test/n_sentences_{d}"] for d in DIRECTIONS} == {12.0}
    checkpoint = torch.load(multilingual_run / "checkpoints" / "last.ckpt", weights_only=True)
    labels = {"labels": {"de": ">>de<<", "en": ">>en<<", "fr": ">>fr<<"}, "position": "start"}
    assert checkpoint["language_labels"] == labels
    state = checkpoint["TranslationDataModule"]
    assert state["pairs"] == ["en-de", "en-fr", "de-en", "fr-de"] and state["language_labels"] == labels


def test_evaluate_scores_and_writes_each_direction(multilingual_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "eval"
    result = run_script(
        "evaluate.py",
        [
            f"ckpt_path={multilingual_run / 'checkpoints' / 'last.ckpt'}",
            f"hydra.run.dir={out}",
            "progress=false",
        ],
        env=_env(),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [
        line.split() for line in result.stdout.splitlines() if line.split()[:1] in ([d] for d in DIRECTIONS)
    ]
    assert [row[0] for row in rows] == DIRECTIONS and all(row[1] == "12" for row in rows)
    metrics = json.loads((out / "metrics.json").read_text())
    predictions = (out / "predictions.tsv").read_text().splitlines()
    assert predictions[0].split("\t")[:2] == ["id", "direction"]
    by_direction: dict[str, list[tuple[str, str]]] = {}
    for line in predictions[1:]:
        _, direction, source, reference, hypothesis, _ = line.split("\t")
        assert source.startswith(f">>{direction[-2:]}<< ")  # the target's label before the source
        by_direction.setdefault(direction, []).append((hypothesis, reference))
    for direction in DIRECTIONS:
        lines = (out / f"hypotheses.{direction}.txt").read_text().splitlines()
        assert lines == [h for h, _ in by_direction[direction]]
        hyps, refs = zip(*by_direction[direction])
        expected = sacrebleu.BLEU(force=True).corpus_score(list(hyps), [list(refs)]).score
        assert metrics[f"test/bleu_{direction}"] == pytest.approx(expected)
        row = next(r for r in rows if r[0] == direction)
        assert float(row[2]) == pytest.approx(expected, abs=0.006)
    assert metrics["test/bleu"] == pytest.approx(sum(metrics[f"test/bleu_{d}"] for d in DIRECTIONS) / 4)
    report = (out / "report.md").read_text()
    assert "## Per direction" in report and (out / "bleu_by_direction.png").is_file()
    assert "## BLEU by source length and direction" in report
    assert (out / "bleu_by_length_by_direction.png").is_file()
    by_length = metrics["bleu_by_source_length_by_direction"]
    assert sorted(by_length) == sorted(DIRECTIONS)
    for direction in DIRECTIONS:  # every sentence in one bucket of its direction
        assert sum(b["count"] for b in by_length[direction]) == len(by_direction[direction])


@pytest.mark.parametrize(
    ("overrides", "error"),
    [
        (["data.pairs=[en-fr]"], None),  # one direction of the model: its label kept
        (
            ["data.pairs=[en-de,en-fr]", "data.labels.position=end"],
            "error: data.labels: the run spells or places its labels as '>>de<<' at the end, the model as "
            "'>>de<<' at the start: set data.labels.format and data.labels.position to the model's",
        ),
    ],
)
def test_fine_tuning_the_multilingual_model(
    multilingual_run: Path, tmp_path: Path, overrides: list[str], error: str | None
) -> None:
    """`model.init_from` a multilingual checkpoint: the run's sources keep the model's labels (one pair
    too), and the fine-tuned checkpoint lists them all; pairs or labels it cannot follow: one error line."""
    start = multilingual_run / "checkpoints" / "last.ckpt"
    run_dir = tmp_path / "run"
    tiny = [item for item in TINY if not item.startswith("data.pairs=")]
    result = run_script(
        "train.py",
        [
            *tiny,
            *overrides,
            f"model.init_from={start}",
            "test=false",
            f"hydra.run.dir={run_dir}",
            f"paths.cache_dir={tmp_path / 'cache'}",
            "logger=csv",
        ],
        env=_env(),
    )
    if error is not None:
        assert result.returncode == 1 and "Traceback" not in result.stderr
        assert result.stderr.rstrip().splitlines()[-1] == error, result.stderr[-2000:]
        assert not (run_dir / "checkpoints").exists()
        return
    assert result.returncode == 0, result.stderr[-3000:]
    saved = torch.load(start, weights_only=True)["language_labels"]
    tuned = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert tuned["language_labels"] == saved and tuned["TranslationDataModule"]["pairs"] == ["en-fr"]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "data.pairs=[en-xx]",
            "data.pairs[0] (en-xx): the numbers task has languages en, de, fr, not 'xx'",
        ),
        ("data.pairs=[en-en]", "data.pairs[0]: source and target language are both 'en'"),
        ("data.sampling_temperature=0", "data.sampling_temperature must be a number > 0"),
    ],
)
def test_bad_pairs_are_one_error_line(override: str, message: str, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = run_script(
        "train.py",
        [*TINY, override, f"hydra.run.dir={run_dir}", f"paths.cache_dir={tmp_path / 'cache'}", "logger=csv"],
        env=_env(),
    )
    assert result.returncode == 1
    lines = result.stderr.rstrip().splitlines()
    assert lines[-1].startswith("error: ") and message in lines[-1], result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())


def test_a_pair_whose_files_are_missing(tmp_path: Path) -> None:
    data_dir = tmp_path / "corpus"
    data_dir.mkdir()
    for split in ("train", "val", "test_2016_flickr"):
        for lang in ("en", "de"):
            (data_dir / f"{split}.{lang}").write_text("a small dog .\ntwo cats .\n")
    cache = tmp_path / "cache"
    result = run_script(
        "train.py",
        [
            "experiment=multi30k_en_defr",
            "data.source=parallel",
            f"data.data_dir={data_dir}",
            f"hydra.run.dir={tmp_path / 'run'}",
            f"paths.cache_dir={cache}",
            "logger=csv",
        ],
        env=_env(),
    )
    assert result.returncode == 1
    last = result.stderr.rstrip().splitlines()[-1]
    assert last.startswith(f"error: data.pairs[1] (en-fr): missing {data_dir / 'train.fr'}"), result.stderr[
        -2000:
    ]
    assert not list(cache.rglob("*.arrow")) and not list(cache.rglob("tokenizer.json"))


@pytest.fixture
def small_multi30k(multi30k_dir: Path, tmp_path: Path) -> Path:
    """The first 200 lines of every Multi30k file (en, de, fr; train, val, test_2016_flickr)."""
    target = tmp_path / "multi30k"
    target.mkdir()
    for path in multi30k_dir.glob("*.gz"):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            lines = [line for _, line in zip(range(200), f)]
        with gzip.open(target / path.name, "wt", encoding="utf-8") as f:
            f.writelines(lines)
    return target


@pytest.mark.parametrize(
    ("experiment", "directions"),
    [("multi30k_en_defr", ["en-de", "en-fr"]), ("multi30k_defr_en", ["de-en", "fr-en"])],
)
def test_multi30k_recipes_start_validate_and_test(
    experiment: str, directions: list[str], small_multi30k: Path, tmp_path: Path
) -> None:
    run = train_run(
        tmp_path / "run",
        tmp_path / "cache",
        [
            f"experiment={experiment}",
            f"data.data_dir={small_multi30k}",
            "data.vocab_size=500",
            "model.config.d_model=32",
            "model.config.n_heads=2",
            "model.config.d_ff=64",
            "model.decoding.max_len_b=2",
            "model.test_decoding.beam_size=1",
            "trainer.max_epochs=1",
            "trainer.limit_train_batches=3",
            "trainer.num_sanity_val_steps=0",
        ],
    )
    values = json.loads((run / "metrics.json").read_text())
    values = values.get("metrics", values)
    for stage in ("val", "test"):
        assert all(f"{stage}/bleu_{d}" in values for d in directions), sorted(values)
    checkpoint = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert ("language_labels" in checkpoint) == (experiment == "multi30k_en_defr")
