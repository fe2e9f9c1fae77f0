"""The fine-tuning user's first hour, end to end on the tiny imported models of `tests/helpers/pretrained.py`:
`aiayn-import` prints what it imported; `experiment=finetune_opus_mt` / `finetune_bert_sst2` run from the
imports with a quiet start (no wandb run, none of the warnings a fine-tuning start used to print) and say
what they initialized from where; `evaluate.py` names the original source; the model card of the exported
fine-tuned import names it too, with the vocabulary the SentencePiece models have."""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

from tests.helpers.cli import run_script  # noqa: E402
from tests.helpers.datasets import data_dir  # noqa: E402
from tests.helpers.pretrained import bert_directory, opus_mt_directory  # noqa: E402
from tests.helpers.repo import cli_env  # noqa: E402
from tests.helpers.sst import write_sst  # noqa: E402
from transformer.evaluation.restore import restore_model  # noqa: E402
from transformer.interop.import_cli import main as import_main  # noqa: E402

pytestmark = pytest.mark.slow

# what a fine-tuning start printed on stderr before (issue 63): each silenced at its source
NOISE = (
    "anonymous setting",  # wandb, from Lightning's WandbLogger passing anonymous=None
    "WeightAveraging callback",  # Lightning's sharding memory warning (our configure_model never shards)
    "could not find the monitored key",  # ModelCheckpoint
    "sacremoses",  # MarianTokenizer's Moses normalizer, unused
)
LIMITS = ["trainer.max_epochs=1", "++trainer.limit_train_batches=3", "++trainer.limit_val_batches=1",
          "++trainer.limit_test_batches=1"]  # fmt: skip


def _quiet(stderr: str, *, wandb: bool = False) -> None:
    found = [noise for noise in (*NOISE, *([] if wandb else ["wandb:"])) if noise in stderr]
    assert not found, (found, stderr[-3000:])


def _import(source: Path, output: Path, *args: str) -> str:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert import_main([str(source), "--output", str(output), *args]) == 0
    return printed.getvalue()


@pytest.fixture(scope="module")
def opus(tmp_path_factory) -> tuple[Path, Path, str]:
    """(the tiny OPUS-MT directory, its imported checkpoint, what aiayn-import printed)."""
    directory = opus_mt_directory(tmp_path_factory.mktemp("opus-mt-de-en"), data_dir("MULTI30K_DIR"))
    output = tmp_path_factory.mktemp("imported") / "opus"
    return directory, output / "model.ckpt", _import(directory, output)


@pytest.fixture(scope="module")
def bert(tmp_path_factory) -> tuple[Path, Path, str]:
    """(a tiny BertModel directory without a head, its import with a new 2-class head, what was printed)."""
    root = tmp_path_factory.mktemp("bert")
    directory = bert_directory(root / "bert", data_dir("SST2_DIR"), head=False)
    return (
        directory,
        root / "imported" / "model.ckpt",
        _import(directory, root / "imported", "--num-classes", "2"),
    )


@pytest.fixture(scope="module")
def tiny_multi30k(tmp_path_factory) -> Path:
    """The first 64 pairs of each Multi30k de-en split."""
    source, target = data_dir("MULTI30K_DIR"), tmp_path_factory.mktemp("multi30k")
    for path in source.glob("*.gz"):
        if path.name.split(".")[-2] in ("de", "en"):
            with gzip.open(path, "rt", encoding="utf-8") as f:
                lines = [line for _, line in zip(range(64), f)]
            with gzip.open(target / path.name, "wt", encoding="utf-8") as f:
                f.writelines(lines)
    return target


def test_aiayn_import_says_what_it_imported(opus, bert) -> None:
    directory, imported, printed = opus
    config = transformers.MarianConfig.from_pretrained(directory)
    vocab = len(json.loads((directory / "vocab.json").read_text(encoding="utf-8")))
    ours = restore_model(torch.load(imported, weights_only=True), imported).model
    lines = printed.splitlines()
    assert lines[1] == (
        f"  architecture: MarianMTModel -> ours, {config.encoder_layers} encoder + {config.decoder_layers} "
        f"decoder layers, d_model {config.d_model}, {config.encoder_attention_heads} heads, d_ff "
        f"{config.encoder_ffn_dim}, max_len {config.max_position_embeddings}"
    )
    parameters = sum(p.numel() for p in ours.parameters())  # tied embeddings counted once
    assert lines[2] == f"  vocabulary: SentencePiece, {vocab} tokens; {parameters:,} parameters"
    assert (
        lines[3] == f"  read with transformers {transformers.__version__}, revision none (a local directory)"
    )
    assert lines[4] == "  languages: de -> en"
    generation = transformers.GenerationConfig.from_pretrained(directory)
    alpha = (
        1.0 if generation.length_penalty is None else float(generation.length_penalty)
    )  # generate's default
    assert lines[5].startswith(
        f"  decoding defaults (the source's generation settings): beam {generation.num_beams}, length "
        f"penalty {alpha} (power normalization)"
    )
    bert_lines = bert[2].splitlines()
    assert bert_lines[1].startswith("  architecture: ") and "2 layers, d_model 32, 2 heads" in bert_lines[1]
    assert bert_lines[-1] == (
        "  classification head: new (initialized here, to be fine-tuned); 2 classes ['LABEL_0', 'LABEL_1']"
    )


def test_finetune_opus_mt_preset_evaluate_and_export_name_the_source(opus, tiny_multi30k, tmp_path) -> None:
    directory, imported, _ = opus
    run = tmp_path / "run"
    result = run_script(
        "train.py",
        ["experiment=finetune_opus_mt", f"model.init_from={imported}", f"data.data_dir={tiny_multi30k}",
         f"paths.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={run}", *LIMITS,
         "model.decoding.max_len_b=5", "model.test_decoding.beam_size=1"],
        env=cli_env(WANDB_MODE="offline"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    _quiet(result.stderr)
    assert not (run / "wandb").exists() and (run / "csv" / "metrics.csv").is_file()
    log_text = (run / "train.log").read_text()
    assert f"tensors from {imported} (imported from {directory})" in log_text
    checkpoint = json.loads((run / "metrics.json").read_text())["last_ckpt_path"]

    evaluated = run_script(
        "evaluate.py",
        [f"ckpt_path={checkpoint}", f"data.data_dir={tiny_multi30k}", "data.test_sentences=4",
         "decode.max_len_b=5", f"hydra.run.dir={tmp_path / 'eval'}"],
    )  # fmt: skip
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert f"imported from {directory} (transformers {transformers.__version__})" in evaluated.stderr
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert metrics["imported_from"]["source"] == str(directory)
    assert metrics["imported_from"]["transformers"] == transformers.__version__
    assert metrics["init_from"] == str(imported.resolve())
    report = (tmp_path / "eval" / "report.md").read_text()
    assert f"| imported_from | source: {directory}, architecture: MarianMTModel, transformers: " in report

    export = Path(sys.executable).parent / "aiayn-export"  # the installed command, as users run it
    exported = run_script(export, [checkpoint, "--to", "hf", "--output", str(tmp_path / "hf")])
    assert exported.returncode == 0, exported.stderr[-3000:]
    _quiet(exported.stderr)
    card = (tmp_path / "hf" / "README.md").read_text(encoding="utf-8")
    vocab = len(json.loads((directory / "vocab.json").read_text(encoding="utf-8")))
    assert f"- vocabulary: SentencePiece, {vocab} tokens, the tokenizers of the start" in card
    assert "data.vocab_size" not in card and "8000" not in card
    assert f"- `model.init_from`: `{directory}` (imported with aiayn-import" in card
    assert str(imported.parent) not in card.replace(str(directory), "")  # the local file's folder: not named


def test_finetune_bert_sst2_preset_from_a_new_head(bert, tmp_path) -> None:
    """The import's new head has the data's 2 classes: kept (and said so); EMA and wandb on, still quiet."""
    directory, imported, _ = bert
    data, run = write_sst(tmp_path / "sst"), tmp_path / "run"
    result = run_script(
        "train.py",
        ["experiment=finetune_bert_sst2", f"model.init_from={imported}", f"data.data_dir={data}",
         f"paths.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={run}", *LIMITS, "callbacks=[default,ema]",
         "logger=[csv,wandb]"],
        env=cli_env(WANDB_MODE="offline"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    _quiet(result.stderr, wandb=True)
    log_text = (run / "train.log").read_text()
    assert (
        f"tensors, the classification head kept (2 classes) from {imported} (imported from {directory})"
        in log_text
    )
    assert "warmup_steps" not in log_text  # 6% of the run: never longer than it
    checkpoint = json.loads((run / "metrics.json").read_text())["last_ckpt_path"]
    evaluated = run_script(
        "evaluate.py", [f"ckpt_path={checkpoint}", f"data.data_dir={data}", f"hydra.run.dir={tmp_path / 'e'}"]
    )
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    metrics = json.loads((tmp_path / "e" / "metrics.json").read_text())
    assert metrics["imported_from"]["source"] == str(directory) and metrics["init_from"] == str(imported)


@pytest.mark.parametrize("stop", ["trainer.max_steps=1", "++trainer.limit_val_batches=0"])
def test_a_run_that_validates_nothing_is_said_once(opus, tiny_multi30k, tmp_path, stop: str) -> None:
    """A short fine-tuning (max_steps before the first validation) or none at all: ModelCheckpoint's
    "could not find the monitored key" is not added to what the run says (our line for max_steps)."""
    _, imported, _ = opus
    run = tmp_path / "run"
    result = run_script(
        "train.py",
        ["experiment=finetune_opus_mt", f"model.init_from={imported}", f"data.data_dir={tiny_multi30k}",
         f"paths.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={run}", "trainer.max_epochs=1", stop,
         "model.decoding.max_len_b=5", "model.test_decoding.beam_size=1", "test=false"],
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    _quiet(result.stderr)
    said = "before the first validation" in (run / "train.log").read_text()
    assert said == stop.startswith("trainer.max_steps")


def test_classify_input_on_a_translation_model_names_translate_input(opus, tmp_path) -> None:
    _, imported, _ = opus
    result = run_script(
        "evaluate.py",
        [f"ckpt_path={imported}", "classify.input=-", f"hydra.run.dir={tmp_path / 'e'}"],
        stdin="",
    )
    assert result.returncode == 1 and result.stdout == "" and "Traceback" not in result.stderr
    assert result.stderr.rstrip().splitlines()[-1] == (
        f"error: classify.input needs a classification checkpoint; {imported} is a translation one "
        "(translate.input=FILE or - translates text lines with it)"
    )
