"""Distillation and back-translation end to end, with tiny teachers trained here on the synthetic task: the
cached distilled corpus is evaluate.py's translation of the training sources with the same ensemble and
settings; a resumed translation equals an uninterrupted one; the DDP corpus (2 CPU processes) equals the
single-process one; a second run translates nothing; back-translated sources carry the tag and real ones
do not; each bad input stops before any work with one `error:` line naming the key and the file."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from tests.helpers.cli import IN_PROCESS, TINY, run_script
from tests.helpers.configs import compose_train_cfg
from tests.helpers.sst import TINY_SST, write_sst
from train import prepare_data, train
from transformer.cli.distill import corpus, synthetic
from transformer.cli.distill.teachers import Translator, load_translator
from transformer.cli.errors import ConfigError

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

DATA = ["data.seed=0", "logger=csv"]  # every teacher and student: the same synthetic corpus (600 pairs)
# beam search as distill.decode's default, cut short for tiny teachers (min_len: no empty translation)
DECODE = ["max_len_b=4", "min_len=2"]
DISTILL = [f"distill.decode.{d}" for d in DECODE] + ["distill.chunk_sentences=128"]
STUDENT = [*TINY, *IN_PROCESS, *DATA, "trainer.max_epochs=1", *DISTILL]


# a teacher that translates the synthetic task a little (distinct sentences, not one repeated token)
TEACHER = [
    "model.config.d_model=64",
    "model.config.d_ff=128",
    "model.config.n_heads=4",
    "model.optimizer.lr=5e-3",
    "data.max_tokens=512",
    "trainer.max_epochs=4",
    "callbacks.model_checkpoint.save_top_k=-1",
]


@pytest.fixture(scope="module")
def teachers(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Two teachers with the same tokenizer and different weights: one run's last checkpoint and its
    checkpoint of an epoch before (one training run, not two, on this busy CPU)."""
    root = tmp_path_factory.mktemp("teachers")
    cfg = compose_train_cfg(
        [*TINY, *IN_PROCESS, *DATA, *TEACHER, f"paths.cache_dir={root / 'cache'}"], output_dir=root / "run"
    )
    last = Path(train(cfg)["last_ckpt_path"])
    return [last, last.parent / "epoch_002.ckpt"]


@pytest.fixture(scope="module")
def student(teachers: list[Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A student distilled from both teachers: its run directory and cache directory."""
    root = tmp_path_factory.mktemp("student")
    cfg = compose_train_cfg(
        [*STUDENT, _teachers_arg(teachers), f"paths.cache_dir={root / 'cache'}"], output_dir=root / "run"
    )
    train(cfg)
    return root / "run", root / "cache"


def _teachers_arg(paths: Sequence[Path]) -> str:
    return f"distill.teachers=[{','.join(str(p) for p in paths)}]"


def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").split("\n")[:-1]


def _reverse_model(teacher: Path, tmp_path: Path) -> Path:
    """`teacher` relabelled as a de -> en model (the synthetic task has one direction): a reverse model
    for an en -> de student, as far as every check can tell."""
    checkpoint = torch.load(teacher, map_location="cpu", weights_only=True)
    checkpoint["config"]["data"].update(src_lang="de", tgt_lang="en")
    path = tmp_path / "reverse.ckpt"
    torch.save(checkpoint, path)
    return path


def test_distilled_corpus_is_evaluate_translation_of_the_training_sources(
    student: tuple[Path, Path], teachers: list[Path], tmp_path: Path
) -> None:
    run_dir, cache = student
    distilled = _lines(run_dir / "distill" / "train.de")
    sources = _lines(run_dir / "distill" / "train.en")
    assert len(distilled) == len(sources) == 600 and all(distilled)
    entries = list((cache / "synthetic").glob("distill-*"))
    assert len(entries) == 1 and _lines(entries[0] / corpus.TRANSLATIONS) == distilled
    out = tmp_path / "eval"
    args = [
        f"ckpt_path=[{','.join(map(str, teachers))}]",
        "decode=beam",
        *[f"decode.{d}" for d in DECODE],
        "data.test_split=train",
        "report.enabled=false",
        f"hydra.run.dir={out}",
    ]
    done = run_script("evaluate.py", args)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _lines(out / "hypotheses.txt") == distilled  # token for token, in corpus order
    assert len(set(distilled)) > 1  # not one repeated line
    config = (run_dir / "config.yaml").read_text()
    assert "train_copies: 0" in config and str(entries[0]) in config  # the teachers' targets only


def test_second_run_with_the_same_teachers_translates_nothing(
    student: tuple[Path, Path], teachers: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir, cache = student

    def refuse(*args: object) -> None:
        raise AssertionError("a second run translated again")

    monkeypatch.setattr(Translator, "chunk_function", lambda self, seed: refuse)
    monkeypatch.setattr(corpus, "_translate_chunks", refuse)
    second = run_dir.parent / "second"
    # another student shape, another seed: the same teachers, settings and corpus
    overrides = [*STUDENT, _teachers_arg(teachers), f"paths.cache_dir={cache}", "seed=7"]
    train(compose_train_cfg([*overrides, "model.config.d_model=16"], output_dir=second))
    assert _lines(second / "distill" / "train.de") == _lines(run_dir / "distill" / "train.de")


def test_resumed_translation_equals_an_uninterrupted_one(teachers: list[Path], tmp_path: Path) -> None:
    """Sampling, so that each chunk's draws must not depend on what was translated before."""
    translator = load_translator(
        "distill.teachers",
        teachers,
        direction=("en", "de"),
        data={},
        decode_values={"search": "sample", "top_k": 10, "max_len_b": 4, "min_len": 2},
        device="cpu",
    )
    texts = [f"Today I need {n} big eggs." for n in range(40)]
    whole = corpus.translate_corpus(
        texts,
        translator.chunk_function(3),
        directory=tmp_path / "a",
        name="t",
        key="a" * 64,
        chunk_sentences=8,
    )
    done: list[int] = []
    translate = translator.chunk_function(3)

    def interrupted(index: int, chunk: Sequence[str]) -> list[str]:
        if index == 2:
            raise KeyboardInterrupt
        done.append(index)
        return translate(index, chunk)

    kwargs = {"directory": tmp_path / "b", "name": "t", "key": "a" * 64, "chunk_sentences": 8}
    with pytest.raises(KeyboardInterrupt):
        corpus.translate_corpus(texts, interrupted, **kwargs)
    torch.manual_seed(12345)  # the global RNG moved on: the chunks must not care
    resumed = corpus.translate_corpus(texts, translator.chunk_function(3), **kwargs)
    assert done == [0, 1]
    assert _lines(resumed / corpus.TRANSLATIONS) == _lines(whole / corpus.TRANSLATIONS)


def test_ddp_corpus_equals_the_single_process_one(
    student: tuple[Path, Path], teachers: list[Path], tmp_path: Path
) -> None:
    run_dir = tmp_path / "ddp"
    args = [*STUDENT, _teachers_arg(teachers), f"paths.cache_dir={tmp_path / 'cache'}", "trainer=ddp_cpu"]
    done = run_script("train.py", [*args, f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _lines(run_dir / "distill" / "train.de") == _lines(student[0] / "distill" / "train.de")
    logs = "".join(path.read_text() for path in run_dir.glob("*.log"))
    for rank in (0, 1):  # 600 sentences in 5 chunks: ranks 0 and 1 take 3 and 2 of them
        assert f"in {3 - rank} chunks (rank {rank} of 2)" in logs, logs[-3000:]


def test_back_translated_pairs_carry_the_tag_and_real_ones_do_not(
    teachers: list[Path], tmp_path: Path
) -> None:
    mono = tmp_path / "mono.de"
    mono.write_text("".join(f"Heute male ich {n} rote Tassen.\n" for n in range(50)))
    overrides = [
        *TINY,
        *IN_PROCESS,
        *DATA,
        f"backtranslate.model={_reverse_model(teachers[0], tmp_path)}",
        f"backtranslate.monolingual={mono}",
        "backtranslate.decode.max_len_b=4",
        "backtranslate.decode.min_len=2",
        "backtranslate.real_copies=2",
        f"paths.cache_dir={tmp_path / 'cache'}",
        "train=false",
        "test=false",
    ]
    cfg = compose_train_cfg(overrides, output_dir=tmp_path / "run")
    synthetic.add_synthetic_pairs(cfg, synthetic.make_plan(cfg))
    datamodule = prepare_data(cfg, None)
    raw = datamodule.raw_split("train")
    assert len(raw) == 2 * 600 + 50
    assert not any(src.startswith("<bt>") for src in raw["src"][:1200])
    assert all(src.startswith("<bt> ") for src in raw["src"][1200:])
    assert raw["tgt"][1200:] == mono.read_text().splitlines()
    tag = datamodule.src_tokenizer.tokenizer.token_to_id("<bt>")
    rows = datamodule.tokenized("train")
    assert [ids[1] == tag for ids in rows["src_ids"]] == [row >= 1200 for row in rows["id"]]
    assert not any(tag in ids for ids, row in zip(rows["src_ids"], rows["id"]) if row < 1200)


@pytest.fixture(scope="module")
def classifier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sst")
    data = write_sst(root / "data")
    overrides = ["experiment=sst2", f"data.data_dir={data}", *TINY_SST, *IN_PROCESS, "logger=csv"]
    overrides += ["trainer.max_epochs=1", f"paths.cache_dir={root / 'cache'}"]
    return Path(train(compose_train_cfg(overrides, output_dir=root / "run"))["last_ckpt_path"])


def _other_tokenizer(teacher: Path, tmp_path: Path) -> Path:
    """`teacher` with two of its vocabulary's ids swapped: another tokenizer of the same size."""
    checkpoint = torch.load(teacher, map_location="cpu", weights_only=True)
    tokenizer = json.loads(checkpoint["TranslationDataModule"]["tokenizers"]["joint"])
    vocab = tokenizer["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[10:12]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    checkpoint["TranslationDataModule"]["tokenizers"]["joint"] = json.dumps(tokenizer)
    path = tmp_path / "other_tokenizer.ckpt"
    torch.save(checkpoint, path)
    return path


def _bad_inputs(teachers: list[Path], classifier: Path, tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (overrides, what the error line says)."""
    parallel = tmp_path / "parallel"
    parallel.mkdir()
    for name in ("train.en", "train.de", "val.en", "val.de", "test.en", "test.de"):
        (parallel / name).write_text("a b\n")
    empty, binary, text = tmp_path / "empty.de", tmp_path / "binary.de.gz", tmp_path / "mono.de"
    empty.write_text("\n\n")
    text.write_text("Heute male ich drei rote Tassen.\n")
    binary.write_bytes(b"\x1f\x8b\x08\x00\xff\xfe\x00\x00binary")
    reverse = _reverse_model(teachers[0], tmp_path)
    a, b = teachers
    return {
        "missing": (
            [_teachers_arg([a, tmp_path / "missing.ckpt"])],
            f"distill.teachers: checkpoint {tmp_path}",
        ),
        "other task": (
            [_teachers_arg([a, classifier])],
            f"distill.teachers: {classifier} is a classification",
        ),
        "direction": ([_teachers_arg([a, reverse])], f"distill.teachers: {reverse} translates de -> en"),
        "tokenizer": (
            [_teachers_arg([a, _other_tokenizer(b, tmp_path)])],
            f"has another tokenizer than {a}",
        ),
        "data": (
            [_teachers_arg([a]), "data.source=parallel", f"+data.data_dir={parallel}"],
            "data.source=synthetic, this run has data.source=parallel",
        ),
        "reverse direction": (
            [f"backtranslate.model={a}", f"backtranslate.monolingual={text}"],
            f"backtranslate.model: {a} translates en -> de, but this needs de -> en",
        ),
        "empty": (
            [f"backtranslate.model={reverse}", f"backtranslate.monolingual={empty}"],
            f"{empty} is empty",
        ),
        "binary": (
            [f"backtranslate.model={reverse}", f"backtranslate.monolingual={binary}"],
            f"backtranslate.monolingual: cannot read {binary}",
        ),
    }


def test_each_bad_input_stops_before_any_work(teachers: list[Path], classifier: Path, tmp_path: Path) -> None:
    for name, (overrides, expected) in _bad_inputs(teachers, classifier, tmp_path).items():
        cache = tmp_path / "cache" / name
        cfg = compose_train_cfg(
            [*TINY, *IN_PROCESS, *DATA, *overrides, f"paths.cache_dir={cache}"], output_dir=tmp_path / name
        )
        with pytest.raises(ConfigError) as info:
            train(cfg)
        assert expected in str(info.value), (name, str(info.value))
        assert not (cache / "synthetic").exists() and not (cache / "data").exists(), name
        assert not any((tmp_path / name).iterdir()), name  # the run directory stays empty


def test_bad_teacher_on_the_command_line_is_one_error_line(teachers: list[Path], tmp_path: Path) -> None:
    reverse = _reverse_model(teachers[0], tmp_path)
    args = [*TINY, *DATA, _teachers_arg([teachers[0], reverse]), f"hydra.run.dir={tmp_path / 'run'}"]
    done = run_script("train.py", [*args, f"paths.cache_dir={tmp_path / 'cache'}"])
    assert done.returncode == 1 and "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert lines == [
        f"error: distill.teachers: {reverse} translates de -> en, but this needs en -> de "
        "(wrong language direction)"
    ], done.stderr[-2000:]
