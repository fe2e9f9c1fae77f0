"""Sharded evaluation under DDP: `train.py train=false ckpt_path=X trainer=ddp_cpu` decodes about half of the
test split in each of its 2 processes and scores exactly what one process scores on the same checkpoint."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.helpers.cli import IN_PROCESS, TINY, run_script
from tests.helpers.configs import compose_train_cfg
from train import train

pytestmark = pytest.mark.slow

SMALL_BATCHES = "+data.eval_max_tokens=128"  # the 30 test sentences in several batches, not one


def test_ddp_test_only_run_shards_decoding_and_scores_like_one_process(tmp_path: Path) -> None:
    single = train(compose_train_cfg([*TINY, *IN_PROCESS, SMALL_BATCHES], output_dir=tmp_path / "single"))
    assert single["test/n_sentences"] == 30 and single["test/chrf"] > 0  # not 0 == 0
    ckpt = single["best_ckpt_path"]
    run_dir = tmp_path / "ddp"
    args = [*TINY, SMALL_BATCHES, "train=false", f"ckpt_path={ckpt}", "trainer=ddp_cpu"]
    done = run_script("train.py", [*args, f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    ddp = json.loads((run_dir / "metrics.json").read_text())
    for name in ("test/bleu", "test/bleu_lc", "test/chrf", "test/exact_match", "test/n_sentences"):
        assert ddp[name] == single[name], name
    assert ddp["test/loss"] == pytest.approx(single["test/loss"], rel=1e-5)
    # each process decoded its own part of the split (the logs say how many), together all 30 sentences
    decoded = []
    for log in sorted(run_dir.glob("*.log")):
        found = re.findall(r"test: this process decoded (\d+) of the (\d+) sentences", log.read_text())
        assert [total for _, total in found] == ["30"], log.name
        decoded.append(int(found[0][0]))
    assert len(decoded) == 2 and sum(decoded) == 30 and min(decoded) >= 10, decoded
