"""Fine-tuning an imported OPUS-MT model (`tests.helpers.pretrained`, imported by aiayn-import): the run's
tokenizer is the import's (MarianTokenizer's ids), its first-step loss is the imported model's (transformers'
loss on the same batch); then `train.py ... model.init_from=... finetune=lora` and `evaluate.py` on its
checkpoint."""

from __future__ import annotations

import gzip
import json
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

import train  # noqa: E402
from tests.helpers.cli import run_script  # noqa: E402
from tests.helpers.configs import compose_train_cfg  # noqa: E402
from tests.helpers.datasets import data_dir  # noqa: E402
from tests.helpers.pretrained import opus_mt_directory  # noqa: E402
from transformer.cli import build, init_from  # noqa: E402
from transformer.cli.errors import ConfigError  # noqa: E402
from transformer.interop.export_cli import main as export_main  # noqa: E402
from transformer.interop.import_cli import main as import_main  # noqa: E402

pytestmark = pytest.mark.slow


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


@pytest.fixture(scope="module")
def opus(tmp_path_factory) -> tuple[Path, Path]:
    """(the tiny OPUS-MT directory, its imported checkpoint)."""
    directory = opus_mt_directory(tmp_path_factory.mktemp("opus-mt-de-en"), data_dir("MULTI30K_DIR"))
    output = tmp_path_factory.mktemp("imported") / "opus"
    assert import_main([str(directory), "--output", str(output)]) == 0
    return directory, output / "model.ckpt"


def _cfg(overrides: list[str], tmp_path: Path):
    cfg = compose_train_cfg(overrides, tmp_path / "run")
    explicit = init_from.explicit_keys(overrides)
    return cfg, explicit


def test_the_run_starts_from_the_imported_model_with_its_tokenizer(opus, tiny_multi30k, tmp_path) -> None:
    directory, imported = opus
    overrides = [
        "experiment=multi30k_de_en", f"data.data_dir={tiny_multi30k}", f"model.init_from={imported}",
        "model.label_smoothing=0.0", f"paths.cache_dir={tmp_path / 'cache'}", "test=false",
    ]  # fmt: skip
    cfg, explicit = _cfg(overrides, tmp_path)
    tokenizers = init_from.take_init_from(cfg, None, explicit)
    datamodule = train.prepare_data(cfg, None, tokenizers)
    task = build.build_task(cfg, datamodule, None)  # loads init_from
    assert (
        datamodule.state_dict()["tokenizers"]
        == torch.load(imported, weights_only=True)["TranslationDataModule"]["tokenizers"]
    )
    assert task.model.config.d_model == 32  # the import's, not the experiment's 256

    batch = next(iter(datamodule.train_dataloader()))
    raw = datamodule.raw_split("train")
    ids = batch["id"].tolist()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Recommended: pip install sacremoses"
        marian_tokenizer = transformers.MarianTokenizer.from_pretrained(directory)
    pad = datamodule.pad_id
    for row, i in enumerate(ids):  # the run's ids are MarianTokenizer's, source and target
        src = [t for t in batch["src"][row].tolist() if t != pad]
        assert src == marian_tokenizer(raw["src"][i]).input_ids
        tgt = [t for t in batch["tgt_out"][row].tolist() if t != pad]
        assert tgt == marian_tokenizer(text_target=raw["tgt"][i]).input_ids

    task.eval()  # dropout off: the loss of the first step's weights on its batch
    with torch.no_grad():
        ours = task._token_loss(batch).nll
        marian = transformers.MarianMTModel.from_pretrained(directory).eval()
        labels = batch["tgt_out"].masked_fill(batch["tgt_out"] == pad, -100)
        theirs = marian(
            input_ids=batch["src"], attention_mask=batch["src"] != pad, decoder_input_ids=batch["tgt_in"],
            labels=labels,
        ).loss  # fmt: skip
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("data.tgt_lang=fr", "data.tgt_lang=fr but model.init_from="),
        ("model.config.d_model=64", "model.config.d_model=64 contradicts"),
    ],
)
def test_what_contradicts_the_import_is_refused(opus, tiny_multi30k, tmp_path, override, key) -> None:
    overrides = [
        "experiment=multi30k_de_en",
        f"data.data_dir={tiny_multi30k}",
        f"model.init_from={opus[1]}",
        override,
    ]
    cfg, explicit = _cfg(overrides, tmp_path)
    with pytest.raises(ConfigError, match=key):
        init_from.take_init_from(cfg, None, explicit)


def test_lora_fine_tuning_of_the_import_then_evaluate(opus, tiny_multi30k, tmp_path) -> None:
    run = tmp_path / "lora"
    result = run_script(
        "train.py",
        ["experiment=multi30k_de_en", f"data.data_dir={tiny_multi30k}", f"model.init_from={opus[1]}",
         "finetune=lora", "finetune.lora.rank=2", "logger=csv", "++callbacks.rich_progress_bar=null",
         "trainer.max_epochs=1", "++trainer.limit_train_batches=2", "++trainer.limit_val_batches=1",
         "++trainer.limit_test_batches=1", "model.decoding.max_len_b=5", "model.test_decoding.beam_size=1",
         f"paths.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={run}"],
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    log_text = (run / "train.log").read_text()
    # d_model 32, 2 + 2 layers: 6 attentions, each q, k, v, o with A (2 x 32) and B (32 x 2)
    assert "LoRA: 3072 trainable of " in log_text
    metrics = json.loads((run / "metrics.json").read_text())
    evaluated = run_script(
        "evaluate.py",
        [f"ckpt_path={metrics['last_ckpt_path']}", f"data.data_dir={tiny_multi30k}",
         "data.test_split=test_2016_flickr", "decode.max_len_b=5", f"hydra.run.dir={tmp_path / 'eval'}"],
    )  # fmt: skip
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert (tmp_path / "eval" / "hypotheses.txt").is_file()
    # exported merged: the export compares the files loaded back with the restored (merged) model
    assert export_main([metrics["last_ckpt_path"], "--to", "hf", "--output", str(tmp_path / "hf")]) == 0
