"""The prepared-data cache through the real command line: `train=false test=false` prepares, later runs and
DDP ranks only memory-map; real Multi30k and SST-2 give the same tokenizers, ids and batches as before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.cli import TINY, run_script
from tests.helpers.data_digest import digest, real_datamodules, write_fixture

pytestmark = pytest.mark.slow

# A small Multi30k-layout corpus through experiment=multi30k_de_en with TINY's tiny model.
FIXTURE_RUN = [
    "experiment=multi30k_de_en",
    *[o for o in TINY if not o.startswith("data.synthetic_sizes")],
    "data.test_split=test",
    "data.max_tokens=600",
    "data.max_len=40",
    "model.config.max_len=40",
    "trainer.max_steps=4",
    "optimized_metric=null",
    "logger=csv",
]


def _logs(run_dir: Path) -> dict[str, str]:
    return {path.name: path.read_text() for path in run_dir.glob("*.log")}


def test_ddp_ranks_tokenize_once_then_later_runs_only_read(tmp_path: Path) -> None:
    data = write_fixture(tmp_path / "corpus")
    common = [*FIXTURE_RUN, f"data.data_dir={data}", f"paths.cache_dir={tmp_path / 'cache'}"]
    ddp = run_script(
        "train.py", [*common, "trainer=ddp_cpu", f"hydra.run.dir={tmp_path / 'ddp'}"], cwd=tmp_path
    )
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    logs = _logs(tmp_path / "ddp")
    rank1 = logs.pop("train_ddp_process_1.log")
    (rank0,) = logs.values()
    # rank 0 tokenized train, val and test before it started rank 1, which only memory-mapped them
    assert rank0.count("Prepared cache entry") == 3 and "Training BPE tokenizer" in rank0
    assert "Prepared" not in rank1 and "Training BPE" not in rank1
    assert rank1.count("Using cache entry") == 3 and "Reusing tokenizer" in rank1
    # the preprocess step and a later run read everything from the cache
    prepare = run_script(
        "train.py", [*common, "train=false", "test=false", f"hydra.run.dir={tmp_path / 'prep'}"], cwd=tmp_path
    )
    assert prepare.returncode == 0, prepare.stderr[-3000:]
    (prep_log,) = _logs(tmp_path / "prep").values()
    assert "Prepared" not in prep_log and prep_log.count("Using cache entry") == 3
    again = run_script("train.py", [*common, f"hydra.run.dir={tmp_path / 'again'}"], cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    (log,) = _logs(tmp_path / "again").values()
    assert "Prepared" not in log and "Training BPE" not in log and log.count("Using cache entry") == 3
    metrics = json.loads((tmp_path / "again" / "metrics.json").read_text())
    assert metrics["global_step"] == 4 and metrics["test/n_sentences"] == 48


# tests/helpers/data_digest.py on 859cf18, with MULTI30K_DIR and SST2_DIR set (real_datamodules: the
# experiments' data settings)
GOLDEN_REAL = {
    "multi30k": {
        "test": "44b7190e8e475b54",
        "tokenizer": "3866cae1db8e0f9e",
        "train": "229a7f5f92b89024",
        "train_epoch0": "377b804c2d70edd2",
        "train_epoch1": "bcd2ade13a26db98",
        "val": "e3d5a8807752e663",
        "val_batches": "68da12af59cb7d65",
    },
    "sst2": {
        "test": "83630ed11f81a239",
        "tokenizer": "a0c212daec565f89",
        "train": "998d2030fca26b49",
        "train_epoch0": "19b789867fcd6a93",
        "train_epoch1": "30670049e05713e6",
        "val": "83630ed11f81a239",
        "val_batches": "569c04169ad30702",
    },
}


@pytest.mark.parametrize("cache", ["none", "cold", "warm"])
def test_real_data_same_as_before(multi30k_dir: Path, sst2_dir: Path, tmp_path: Path, cache: str) -> None:
    cache_dir = None if cache == "none" else tmp_path / "cache"
    if cache == "warm":
        for dm in real_datamodules(cache_dir).values():
            dm.setup(None)
    assert {name: digest(dm) for name, dm in real_datamodules(cache_dir).items()} == GOLDEN_REAL
