"""`aiayn-lora` on real LoRA fine-tuning runs of the tiny imported models (`tests/helpers/pretrained.py`): the
merged plain checkpoint translates (and scores) exactly as the LoRA checkpoint; the adapter file is a small
part of the checkpoint and, applied on its base, gives back the LoRA checkpoint's weights and translations; on
another base it is refused in one line, nothing written. A classifier's adapter carries its new head."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

from tests.helpers.cli import run_script
from tests.helpers.datasets import data_dir
from tests.helpers.pretrained import bert_directory, opus_mt_directory
from tests.helpers.repo import REPO_ROOT, cli_env
from tests.helpers.sst import write_sst
from transformer.inference import Classifier, Translator
from transformer.interop.import_cli import main as import_main
from transformer.interop.lora_cli import main as lora_main

pytestmark = pytest.mark.slow

LIMITS = ["trainer.max_epochs=1", "++trainer.limit_train_batches=4", "++trainer.limit_val_batches=1",
          "++trainer.limit_test_batches=1"]  # fmt: skip
TEXTS = ["Ein Mann fährt Fahrrad.", "Zwei Hunde spielen im Schnee.", "Eine Frau liest ein Buch am Fenster."]


def _train(args: list[str], run: Path) -> Path:
    result = run_script("train.py", [*args, f"hydra.run.dir={run}", *LIMITS], env=cli_env())
    assert result.returncode == 0, result.stderr[-3000:]
    return Path(json.loads((run / "metrics.json").read_text())["last_ckpt_path"])


@pytest.fixture(scope="module")
def opus_lora(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(the import, a second import of other weights, the LoRA run's last checkpoint)."""
    root = tmp_path_factory.mktemp("lora")
    multi30k = data_dir("MULTI30K_DIR")
    data = root / "multi30k"
    data.mkdir()
    for path in multi30k.glob("*.gz"):
        if path.name.split(".")[-2] in ("de", "en"):
            with gzip.open(path, "rt", encoding="utf-8") as f:
                lines = [line for _, line in zip(range(64), f)]
            with gzip.open(data / path.name, "wt", encoding="utf-8") as f:
                f.writelines(lines)
    imports = []
    for seed in (0, 1):
        directory = opus_mt_directory(root / f"opus{seed}", multi30k, seed=seed)
        assert import_main([str(directory), "--output", str(root / f"imported{seed}")]) == 0
        imports.append(root / f"imported{seed}" / "model.ckpt")
    lora = _train(
        [
            "experiment=finetune_opus_mt",
            f"model.init_from={imports[0]}",
            f"data.data_dir={data}",
            "finetune=lora",
            "finetune.lora.rank=4",
            "model.optimizer.lr=1e-2",
            f"paths.cache_dir={root / 'cache'}",
            "model.decoding.max_len_b=5",
            "model.test_decoding.beam_size=1",
        ],
        root / "run",
    )
    return imports[0], imports[1], lora


def _translations(path: Path) -> list[tuple[str, float]]:
    translator = Translator.from_checkpoint(path)
    return [(t.text, t.score) for t in translator.translate(TEXTS, beam_size=2)]


def test_merged_checkpoint_translates_as_the_lora_checkpoint(opus_lora, tmp_path) -> None:
    base, _, lora = opus_lora
    merged = tmp_path / "merged.ckpt"
    assert lora_main(["merge", str(lora), "--output", str(merged)]) == 0
    plain = torch.load(merged, weights_only=True)
    assert not any(".parametrizations." in key for key in plain["state_dict"])
    assert plain["hyper_parameters"]["finetune"]["lora"]["rank"] == 0
    assert not any(key in plain for key in ("optimizer_states", "lr_schedulers", "loops", "callbacks"))
    expected = _translations(lora)
    assert _translations(merged) == expected  # the same text and the same score, sentence by sentence
    assert expected != _translations(base)  # the adapters changed the model: the comparison has teeth


def test_adapter_is_small_and_loads_back_on_its_base_only(opus_lora, tmp_path, capsys) -> None:
    base, other, lora = opus_lora
    adapter = tmp_path / "adapter.pt"
    assert lora_main(["save-adapter", str(lora), "--output", str(adapter)]) == 0
    saved = torch.load(adapter, weights_only=True)
    assert all(".parametrizations." in key and ".lora_" in key for key in saved["adapters"])
    assert saved["trained"] == {} and saved["lora"]["rank"] == 4
    assert adapter.stat().st_size * 10 < lora.stat().st_size
    applied = tmp_path / "applied.ckpt"
    assert lora_main(["apply", str(adapter), "--base", str(base), "--output", str(applied)]) == 0
    original, rebuilt = (torch.load(p, weights_only=True)["state_dict"] for p in (lora, applied))
    assert original.keys() == rebuilt.keys() and all(torch.equal(original[k], rebuilt[k]) for k in original)
    assert _translations(applied) == _translations(lora)
    capsys.readouterr()
    # another base (other weights of the same shapes): one line, nothing written; as the installed command
    wrong = tmp_path / "wrong.ckpt"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "transformer.interop.lora_cli",
            "apply",
            str(adapter),
            "--base",
            str(other),
            "--output",
            str(wrong),
        ],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=cli_env(),
        timeout=300,
    )
    assert result.returncode == 1 and result.stdout == "" and not wrong.exists()
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: adapter {adapter} was not trained on {other}: its base weights have")
    assert str(base) in lines[0]  # names the base it was trained on
    # a plain checkpoint has no adapters to merge or save
    assert lora_main(["merge", str(base), "--output", str(tmp_path / "x.ckpt")]) == 1
    assert "has no LoRA adapters" in capsys.readouterr().err


def test_a_classifiers_adapter_carries_its_new_head(tmp_path) -> None:
    directory = bert_directory(tmp_path / "bert", data_dir("SST2_DIR"), head=False)
    assert import_main([str(directory), "--output", str(tmp_path / "imported"), "--num-classes", "2"]) == 0
    base = tmp_path / "imported" / "model.ckpt"
    lora = _train(
        [
            "experiment=finetune_bert_sst2",
            f"model.init_from={base}",
            f"data.data_dir={write_sst(tmp_path / 's')}",
            "finetune=lora",
            "finetune.lora.rank=2",
            "model.optimizer.lr=1e-2",
            f"paths.cache_dir={tmp_path / 'c'}",
        ],
        tmp_path / "run",
    )
    adapter, applied = tmp_path / "adapter.pt", tmp_path / "applied.ckpt"
    assert lora_main(["save-adapter", str(lora), "--output", str(adapter)]) == 0
    assert set(torch.load(adapter, weights_only=True)["trained"]) == {"model.head.weight", "model.head.bias"}
    assert lora_main(["apply", str(adapter), "--base", str(base), "--output", str(applied)]) == 0
    texts = ["a great fun film", "boring and flat", "a moving story 3"]
    expected = [p.probabilities for p in Classifier.from_checkpoint(lora).predict(texts)]
    assert [p.probabilities for p in Classifier.from_checkpoint(applied).predict(texts)] == expected
    merged = tmp_path / "merged.ckpt"
    assert lora_main(["merge", str(lora), "--output", str(merged)]) == 0
    assert [p.probabilities for p in Classifier.from_checkpoint(merged).predict(texts)] == expected
