"""Distillation with an imported model as the teacher (`aiayn-import` of the tiny OPUS-MT directory of
`tests.helpers.pretrained`): the teacher's own SentencePiece pair encodes the training sources and decodes its
translations, so the distilled corpus is text, the student's own BPE tokenizer is trained on it, and it
equals what transformers (MarianTokenizer in, `generate`, MarianTokenizer out) and `evaluate.py
translate.input=` make of the same sentences with the same settings. The import ensembles with a model
fine-tuned from it (one vocabulary); with a teacher of another tokenizer, and of the wrong direction, it is
refused in one line before any work.
"""

from __future__ import annotations

import gzip
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

from tests.helpers.cli import IN_PROCESS, TINY, run_script  # noqa: E402
from tests.helpers.configs import compose_train_cfg  # noqa: E402
from tests.helpers.datasets import data_dir  # noqa: E402
from tests.helpers.opus_mt import train_to_copy  # noqa: E402
from tests.helpers.pretrained import opus_mt_directory  # noqa: E402
from train import train  # noqa: E402
from transformer.cli.distill import corpus, synthetic  # noqa: E402
from transformer.cli.errors import ConfigError  # noqa: E402
from transformer.interop.import_cli import main as import_main  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

PAIRS = 48  # Multi30k pairs per split: 48 training sources for the teacher to translate
MAX_NEW = 20  # tokens a translation may have
# distillation's beam search, with length penalty 0: it then ranks as transformers' beam search does
DECODE = ["search=beam", "beam_size=4", "length_penalty=0.0", "max_len_a=0", f"max_len_b={MAX_NEW}"]
STUDENT = [
    "experiment=multi30k_de_en_distill",
    *[override for override in TINY if not override.startswith("data.synthetic_sizes")],
    *IN_PROCESS,
    "logger=csv",
    "trainer.max_epochs=1",
    "test=false",
    *[f"distill.decode.{setting}" for setting in DECODE],
]


def _evaluate_translations(ckpt_path: str, sources: list[str], tmp_path: Path) -> list[str]:
    """evaluate.py's translations of `sources` (a file in, a file out) with the distillation's settings."""
    first, out = tmp_path / "first.de", tmp_path / "translated.en"
    first.write_text("".join(f"{line}\n" for line in sources), encoding="utf-8")
    done = run_script(
        "evaluate.py",
        [f"ckpt_path={ckpt_path}", f"translate.input={first}", f"translate.output={out}",
         *[f"decode.{setting}" for setting in DECODE], f"hydra.run.dir={tmp_path / 'eval'}"],
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return _lines(out)


@pytest.fixture(scope="module")
def multi30k(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The first PAIRS pairs of each Multi30k de-en split."""
    source, target = data_dir("MULTI30K_DIR"), tmp_path_factory.mktemp("multi30k")
    for path in source.glob("*.gz"):
        if path.name.split(".")[-2] in ("de", "en"):
            with gzip.open(path, "rt", encoding="utf-8") as f:
                lines = [line for _, line in zip(range(PAIRS), f)]
            with gzip.open(target / path.name, "wt", encoding="utf-8") as f:
                f.writelines(lines)
    return target


@pytest.fixture(scope="module")
def opus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the tiny OPUS-MT de -> en directory, its imported checkpoint). Trained with transformers for 100
    steps (seconds) to copy German: random weights repeat one token, a teacher that says little."""
    directory = opus_mt_directory(tmp_path_factory.mktemp("opus-mt-de-en"), data_dir("MULTI30K_DIR"))
    train_to_copy(directory)
    output = tmp_path_factory.mktemp("imported") / "opus"
    assert import_main([str(directory), "--output", str(output)]) == 0
    return directory, output / "model.ckpt"


@pytest.fixture(scope="module")
def student(opus: tuple[Path, Path], multi30k: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A de -> en student distilled from the imported teacher: train()'s result and its directories."""
    root = tmp_path_factory.mktemp("student")
    overrides = [
        *STUDENT,
        f"data.data_dir={multi30k}",
        f"distill.teachers=[{opus[1]}]",
        f"paths.cache_dir={root / 'cache'}",
    ]
    result = train(compose_train_cfg(overrides, output_dir=root / "run"))
    return {**result, "run": root / "run", "cache": root / "cache"}


def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").split("\n")[:-1]


def test_the_distilled_corpus_is_the_imported_models_text(opus, student, multi30k, tmp_path) -> None:
    directory, imported = opus
    run = student["run"]
    sources, distilled = _lines(run / "distill" / "train.de"), _lines(run / "distill" / "train.en")
    with gzip.open(multi30k / "train.de.gz", "rt", encoding="utf-8") as f:
        assert sources == f.read().splitlines()  # the student's training sources, in order
    entries = list((student["cache"] / "synthetic").glob("distill-*"))
    assert len(entries) == 1 and _lines(entries[0] / corpus.TRANSLATIONS) == distilled

    # transformers' own pipeline on the same sentences: MarianTokenizer in, generate, MarianTokenizer out
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Recommended: pip install sacremoses"
        tokenizer = transformers.MarianTokenizer.from_pretrained(directory)
    marian = transformers.MarianMTModel.from_pretrained(directory).eval()
    batch = tokenizer(sources, return_tensors="pt", padding=True)
    pad = tokenizer.pad_token_id
    with torch.no_grad():
        generated = marian.generate(
            **batch, num_beams=4, length_penalty=0.0, max_new_tokens=MAX_NEW, do_sample=False,
            bad_words_ids=[[pad]],
        )  # fmt: skip
    assert distilled == tokenizer.batch_decode(generated, skip_special_tokens=True)
    assert len(set(distilled)) >= PAIRS // 2 and all(distilled)  # distinct sentences, not one repeated
    assert not any("▁" in line or "</s>" in line for line in distilled)  # decoded text, not pieces

    # evaluate.py on the imported checkpoint, translating a file, with the same decoding settings
    assert _evaluate_translations(str(imported), sources[:6], tmp_path) == distilled[:6]

    # the student trained a BPE tokenizer of its own on that text (the teacher's SentencePiece stays there)
    checkpoint = torch.load(student["last_ckpt_path"], map_location="cpu", weights_only=True)
    tokenizers = checkpoint["TranslationDataModule"]["tokenizers"]
    teacher = torch.load(imported, map_location="cpu", weights_only=True)["TranslationDataModule"]
    assert list(tokenizers) == ["joint"] and '"type":"BPE"' in tokenizers["joint"].replace(" ", "")
    assert tokenizers != teacher["tokenizers"]
    assert checkpoint["config"]["data"]["extra_train"][0]["tgt"] == str(entries[0] / corpus.TRANSLATIONS)


def _relabelled(imported: Path, tmp_path: Path, src: str, tgt: str) -> Path:
    """The imported checkpoint as aiayn-import writes an OPUS-MT model of `src` -> `tgt` (its
    tokenizer_config.json's languages are all that the data section takes from it)."""
    checkpoint = torch.load(imported, map_location="cpu", weights_only=True)
    checkpoint["config"]["data"].update(src_lang=src, tgt_lang=tgt)
    path = tmp_path / f"opus-mt-{src}-{tgt}.ckpt"
    torch.save(checkpoint, path)
    return path


def test_what_cannot_teach_this_student_is_refused_in_one_line(opus, student, multi30k, tmp_path) -> None:
    """An ensemble averages the members' distributions over one vocabulary: an imported teacher with one
    trained here (its own BPE, e.g. this student) is refused; so is an en -> de import for a de -> en
    student. Before any work: no cache entry, an empty run directory."""
    imported = opus[1]
    ours = Path(student["last_ckpt_path"])
    cases = {
        "ensemble": ([imported, ours], f"distill.teachers: {ours} has another tokenizer than {imported}"),
        "direction": (
            [_relabelled(imported, tmp_path, "en", "de")],
            "translates en -> de, but this needs de -> en (wrong language direction)",
        ),
        "no languages": ([_relabelled(imported, tmp_path, "src", "tgt")], "names no source_lang"),
    }
    for name, (teachers, expected) in cases.items():
        cache, run = tmp_path / name / "cache", tmp_path / name / "run"
        overrides = [*STUDENT, f"data.data_dir={multi30k}", f"paths.cache_dir={cache}"]
        overrides.append(f"distill.teachers=[{','.join(map(str, teachers))}]")
        with pytest.raises(ConfigError) as info:
            train(compose_train_cfg(overrides, output_dir=run))
        message = str(info.value)
        assert expected in message and "\n" not in message, (name, message)
        assert not (cache / "synthetic").exists() and not (cache / "data").exists(), name
        assert not run.exists() or not any(run.iterdir()), name


def test_an_import_ensembles_with_a_model_fine_tuned_from_it(opus, multi30k, tmp_path) -> None:
    """Fine-tuning keeps the import's tokenizer (model.init_from), so the two share one vocabulary: their
    ensemble teaches, and translates as `evaluate.py` decodes the same ensemble."""
    imported = opus[1]
    tuned = [
        "experiment=multi30k_de_en", f"data.data_dir={multi30k}", f"model.init_from={imported}", *IN_PROCESS,
        "logger=csv", "trainer.max_epochs=3", "test=false", "model.optimizer.lr=1e-2",
        "model.scheduler.warmup_steps=1", "callbacks.rich_progress_bar=null",
        "++trainer.enable_progress_bar=false", f"paths.cache_dir={tmp_path / 'cache'}",
    ]  # fmt: skip
    fine_tuned = Path(train(compose_train_cfg(tuned, output_dir=tmp_path / "tuned"))["last_ckpt_path"])
    base = [*STUDENT, f"data.data_dir={multi30k}", f"paths.cache_dir={tmp_path / 'cache'}"]
    overrides = [*base, f"distill.teachers=[{imported},{fine_tuned}]"]
    plan = synthetic.make_plan(compose_train_cfg(overrides, output_dir=tmp_path / "student"))
    sources = plan.texts[:6]
    ensemble = plan.translator.chunk_function(0)(0, sources)

    assert all(ensemble)
    assert _evaluate_translations(f"[{imported},{fine_tuned}]", sources, tmp_path) == ensemble
    alone = synthetic.make_plan(
        compose_train_cfg([*base, f"distill.teachers=[{imported}]"], output_dir=tmp_path / "one")
    )
    assert alone.translator.chunk_function(0)(0, sources) != ensemble  # the fine-tuned member counts
