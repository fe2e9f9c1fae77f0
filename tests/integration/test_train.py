"""train.py end to end: the quickstart through `train(cfg)` and the real command line, checkpoint
contents, test-only runs, resuming, loggers, DDP on two CPU processes, fast_dev_run on real data."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import lightning as L
import pytest
import torch

from tests.helpers.cli import IN_PROCESS, TINY, run_script
from tests.helpers.configs import compose_train_cfg
from tests.helpers.repo import cli_env
from train import train
from transformer.cli.errors import ConfigError
from transformer.training import TranslationTask
from transformer.training.schedules import InverseSqrtWarmup

pytestmark = pytest.mark.slow


def _read_csv(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


def _lrs(run_dir: Path) -> dict[int, float]:
    rows = _read_csv(run_dir / "csv" / "metrics.csv")
    return {int(r["step"]): float(r["lr-AdamW/pg1"]) for r in rows if r.get("lr-AdamW/pg1")}


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """One tiny quickstart run through `train(cfg)`: its run directory and returned metrics."""
    run_dir = tmp_path_factory.mktemp("quickstart") / "run"
    metrics = train(compose_train_cfg([*TINY, *IN_PROCESS], output_dir=run_dir))
    return run_dir, metrics


def test_quickstart_run_directory(quickstart: tuple[Path, dict]) -> None:
    run_dir, metrics = quickstart
    written = json.loads((run_dir / "metrics.json").read_text())
    assert written == metrics
    for name in ("val/loss", "val/bleu", "val/bleu_best", "val/exact_match", "test/bleu", "test/chrf"):
        assert isinstance(metrics[name], float), name
    # the values metrics.json can be checked against: the CSV log's per-epoch validations, the split sizes
    rows = _read_csv(run_dir / "csv" / "metrics.csv")
    val_bleu = [float(r["val/bleu"]) for r in rows if r.get("val/bleu")]
    assert len(val_bleu) == 2 and metrics["val/bleu"] == pytest.approx(val_bleu[-1])
    assert metrics["val/bleu_best"] == pytest.approx(max(val_bleu))
    assert metrics["val/n_sentences"] == 30 and metrics["test/n_sentences"] == 30
    assert {"test/loss", "test/exact_match", "train/tokens_per_s", "train/pad_ratio"} <= set(metrics)
    assert Path(metrics["best_ckpt_path"]).parent == run_dir / "checkpoints"
    assert metrics["last_ckpt_path"] == str(run_dir / "checkpoints" / "last.ckpt")
    assert Path(metrics["best_ckpt_path"]).is_file() and Path(metrics["last_ckpt_path"]).is_file()
    assert metrics["run_dir"] == str(run_dir) and metrics["global_step"] > 0
    assert (run_dir / "csv" / "metrics.csv").is_file()
    resolved = (run_dir / "config.yaml").read_text()
    assert "src_vocab_size:" in resolved and "${" not in resolved  # data-derived and resolved
    # matmul_precision=high is for GPUs: on the CPU it made steps 2x slower and memory grow
    assert "matmul_precision: high" in resolved and torch.get_float32_matmul_precision() == "highest"


def test_checkpoint_is_self_sufficient(quickstart: tuple[Path, dict]) -> None:
    from data.sources import load_synthetic
    from data.tokenization import BPETokenizer
    from transformer.evaluation.scoring import corpus_scores
    from transformer.search.decoding import greedy_search

    run_dir, metrics = quickstart
    checkpoint = torch.load(
        metrics["last_ckpt_path"], map_location="cpu", weights_only=True
    )  # plain data only
    config = checkpoint["config"]
    assert (
        config["model"]["config"]["src_vocab_size"]
        == checkpoint["hyper_parameters"]["config"]["src_vocab_size"]
    )
    assert config["paths"]["output_dir"] == str(run_dir) and config["seed"] == 42
    assert not any("_orig_mod" in key for key in checkpoint["state_dict"])
    tokenizer = BPETokenizer.from_json(checkpoint["TranslationDataModule"]["tokenizers"]["joint"])
    assert tokenizer.vocab_size == config["model"]["config"]["tgt_vocab_size"]
    # weights + hyperparameters + tokenizer from the file alone translate the test split into the very
    # sentences the run scored: the same test BLEU and exact match (the run tested the best checkpoint)
    best = torch.load(metrics["best_ckpt_path"], map_location="cpu", weights_only=True)
    tokenizer = BPETokenizer.from_json(best["TranslationDataModule"]["tokenizers"]["joint"])
    task = TranslationTask.load_from_checkpoint(metrics["best_ckpt_path"], map_location="cpu").eval()
    data = config["data"]
    test = load_synthetic(["test"], seed=data["seed"], sizes=data["synthetic_sizes"])["test"]
    settings = task.hparams.decoding  # test_decoding is null: the validation settings
    with torch.no_grad():
        hypotheses = [
            tokenizer.decode(
                greedy_search(
                    task.model,
                    torch.tensor([tokenizer.encode(source)]),
                    max_len_a=settings["max_len_a"],
                    max_len_b=settings["max_len_b"],
                )[0].tolist()
            )
            for source in test["src"]
        ]
    assert sum(bool(h.strip()) for h in hypotheses) == len(test) == metrics["test/n_sentences"]
    scores = corpus_scores(hypotheses, test["tgt"])
    assert scores["bleu"] == pytest.approx(metrics["test/bleu"], abs=1e-6)
    assert scores["exact_match"] == pytest.approx(metrics["test/exact_match"], abs=1e-6)


def test_test_only_run_reproduces_the_test_metrics(quickstart: tuple[Path, dict], tmp_path: Path) -> None:
    _, trained = quickstart
    overrides = [*TINY, *IN_PROCESS, "train=false", f"ckpt_path={trained['best_ckpt_path']}"]
    metrics = train(compose_train_cfg(overrides, output_dir=tmp_path / "test_only"))
    for name in ("test/bleu", "test/chrf", "test/exact_match"):
        assert metrics[name] == trained[name], name
    assert metrics["test/loss"] == pytest.approx(trained["test/loss"], rel=1e-5)


def test_resume_from_last_continues_at_the_same_step_and_lr(
    quickstart: tuple[Path, dict], tmp_path: Path
) -> None:
    first_dir, first = quickstart
    steps_per_epoch = first["global_step"] // 2
    overrides = [*TINY, *IN_PROCESS, "trainer.max_epochs=3", f"ckpt_path={first['last_ckpt_path']}"]
    resumed = train(compose_train_cfg(overrides, output_dir=tmp_path / "resumed"))
    assert resumed["global_step"] == 3 * steps_per_epoch
    before, after = _lrs(first_dir), _lrs(tmp_path / "resumed")
    assert min(after) == first["global_step"]  # the first step after the checkpoint, none repeated
    schedule = InverseSqrtWarmup(warmup_steps=8)
    for step, lr in {**before, **after}.items():
        assert lr == pytest.approx(3e-3 * schedule(step), rel=1e-6), step


def test_malformed_values_fail_early_with_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"model.*n_heads"):
        train(compose_train_cfg([*TINY, *IN_PROCESS, "model.config.n_heads=3"], output_dir=tmp_path / "a"))
    with pytest.raises(ConfigError, match=r"data\.max_len"):
        train(compose_train_cfg([*TINY, *IN_PROCESS, "data.max_len=128"], output_dir=tmp_path / "b"))
    with pytest.raises(ConfigError, match="ckpt_path"):
        train(
            compose_train_cfg([*TINY, *IN_PROCESS, "ckpt_path=/nonexistent.ckpt"], output_dir=tmp_path / "c")
        )


def test_cli_quickstart_with_every_logger_then_resume(tmp_path: Path) -> None:
    """The real command, from another working directory; wandb offline needs no account or network."""
    no_network = {"WANDB_BASE_URL": "http://127.0.0.1:9", "WANDB_SILENT": "true"}
    args = [*TINY, f"paths.log_dir={tmp_path / 'logs'}", "logger=many_loggers"]
    done = run_script("train.py", args, cwd=tmp_path, env=cli_env(**no_network))
    assert done.returncode == 0, done.stderr[-3000:]
    last_line = done.stdout.strip().splitlines()[-1]
    assert last_line.startswith("run directory: "), done.stdout[-2000:]
    run_dir = Path(last_line.removeprefix("run directory: "))
    assert run_dir.parent == tmp_path / "logs" / "train" / "runs"
    assert "test/exact_match" in done.stdout
    for path in (".hydra/config.yaml", "config.yaml", "metrics.json", "checkpoints/last.ckpt", "train.log"):
        assert (run_dir / path).is_file(), path
    assert list((run_dir / "tensorboard").rglob("events.out.tfevents.*"))
    (wandb_run,) = (run_dir / "wandb").glob("offline-run-*")
    run_id = wandb_run.name.rsplit("-", 1)[1]
    assert (wandb_run / f"run-{run_id}.wandb").is_file()
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True, mmap=True)
    assert checkpoint["wandb_run_id"] == run_id

    resumed = run_script(
        "train.py",
        [*args, "trainer.max_epochs=3", f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}"],
        cwd=tmp_path,
        env=cli_env(**no_network),
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    resumed_dir = Path(resumed.stdout.strip().splitlines()[-1].removeprefix("run directory: "))
    assert resumed_dir != run_dir
    metrics = json.loads((resumed_dir / "metrics.json").read_text())
    assert metrics["global_step"] == checkpoint["global_step"] * 3 // 2
    assert [p.name.rsplit("-", 1)[1] for p in (resumed_dir / "wandb").glob("offline-run-*")] == [run_id]

    tested = run_script(
        "train.py",
        [
            *TINY,
            f"paths.log_dir={tmp_path / 'logs'}",
            "train=false",
            f"ckpt_path={metrics['best_ckpt_path']}",
        ],
        cwd=tmp_path,
    )
    assert tested.returncode == 0, tested.stderr[-3000:]
    assert f"Testing checkpoint {metrics['best_ckpt_path']}" in tested.stderr + tested.stdout
    printed = {line.split()[0] for line in tested.stdout.splitlines() if line.strip()}
    assert "test/bleu" in printed and "val/bleu" not in printed  # tested, not trained


def test_cli_start_is_quiet(tmp_path: Path) -> None:
    """The start names the saved config and the overrides instead of printing it whole; no Lightning tip,
    no deprecation warning of Lightning's own code, no FLOPs (always 0); no colour codes in train.log."""
    args = [*(a for a in TINY if a != "callbacks.model_summary=null"), "trainer.max_epochs=1"]
    done = run_script("train.py", [*args, f"paths.log_dir={tmp_path}"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    output = done.stdout + done.stderr
    run_dir = Path(done.stdout.strip().splitlines()[-1].removeprefix("run directory: "))
    assert f"Config: {run_dir / 'config.yaml'} (overrides: {' '.join(args)} paths.log_dir=" in output
    assert "task_name:" not in output and "Resolved config" not in output  # the ~200-line dump
    assert "Total params" in output and "FLOPs" not in output
    assert "Tip:" not in output and "LeafSpec" not in output and "deprecated" not in output, output
    assert "\x1b" not in (run_dir / "train.log").read_text()


def test_prepare_only(tmp_path: Path) -> None:
    metrics = train(compose_train_cfg([*TINY, *IN_PROCESS, "train=false", "test=false"], output_dir=tmp_path))
    assert metrics == {"run_dir": str(tmp_path)} and not (tmp_path / "checkpoints").exists()


def test_cli_bad_value_is_one_line_and_exit_1(tmp_path: Path) -> None:
    done = run_script(
        "train.py", [*TINY, f"paths.log_dir={tmp_path}", "model.config.dropout=1.5"], cwd=tmp_path
    )
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].startswith("error: cannot build `model`")
    assert "dropout" in done.stderr and "Traceback" not in done.stderr


class RecordTraining(L.Callback):
    """Write `directory`/rank{R}.pt when training ends or stops (a signal's exit): the example ids of every
    training batch this process took (with its epoch), its global_step and its weights."""

    def __init__(self, directory: str) -> None:
        self.directory, self.batches = Path(directory), []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, *args) -> None:
        self.batches.append((trainer.current_epoch, batch["id"].tolist()))

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        self.on_train_end(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        weights = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        (guard,) = (c for c in trainer.callbacks if type(c).__name__ == "NonFiniteLossGuard")
        record = {"global_step": trainer.global_step, "batches": self.batches, "weights": weights}
        torch.save({**record, "skipped": guard.skipped}, self.directory / f"rank{trainer.global_rank}.pt")


class PoisonOneRank(L.Callback):
    """On rank `rank` only, make optimizer step `step` (1-based) see a NaN loss: one weight is NaN during
    that step's forward pass and restored afterwards, so anything that let the step through would show."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step, self.saved = rank, step, None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        if trainer.global_rank == self.rank and trainer.global_step + 1 == self.step:
            weight = next(pl_module.parameters())
            self.saved = weight.detach().clone()
            with torch.no_grad():
                weight.fill_(float("nan"))

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        if self.saved is not None:
            with torch.no_grad():
                next(pl_module.parameters()).copy_(self.saved)
            self.saved = None


def _check_ranks_split_the_epochs(ranks: list[dict], epochs: int, n_train: int) -> None:
    """Each epoch's distinct batches are dealt out between the 2 ranks: together they cover every
    training example, each rank takes ceil(n/2) of the n batches (one batch repeated when n is odd, so
    that the ranks step together), and global_step counts a rank's share, not the whole epoch."""
    total = 0
    for epoch in range(epochs):
        per_rank = [[frozenset(ids) for e, ids in rank["batches"] if e == epoch] for rank in ranks]
        distinct = set(per_rank[0]) | set(per_rank[1])
        share = -(-len(distinct) // 2)
        assert [len(b) for b in per_rank] == [share, share], (epoch, len(distinct))
        assert len(set(per_rank[0]) & set(per_rank[1])) == 2 * share - len(distinct)  # 0, or 1 if n is odd
        assert set().union(*distinct) == set(range(n_train))  # the whole epoch, between the two ranks
        assert sum(len(b) for b in distinct) == n_train  # each example in one batch
        total += share
    assert ranks[0]["global_step"] == ranks[1]["global_step"] == total


class SignalTheLauncher(L.Callback):
    """Send SIGTERM to rank 0 only, the process the command started (Lightning started rank 1 from it), at
    the end of optimizer step `step`, as `kill PID` does: rank 1 gets no signal of its own. Rank 0 then
    winds down slower than rank 1: `linger` seconds after rank 1 has exited (a logger uploading files)."""

    def __init__(self, step: int, linger: float) -> None:
        self.step, self.linger, self.others = step, linger, []

    def on_train_start(self, trainer: L.Trainer, *args) -> None:
        self.others = list(getattr(trainer.strategy.launcher, "procs", []))  # on rank 0: rank 1's process

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        if trainer.global_rank == 0 and trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_exception(self, trainer: L.Trainer, *args) -> None:
        if trainer.global_rank == 0:
            for process in self.others:
                process.wait()
            time.sleep(self.linger)


def _ddp_args(directory: Path, *extra: str) -> list[str]:
    """The tiny quickstart on 2 CPU processes, exact (trainer.deterministic=true, the README's condition for
    an exact resume), logging into `directory`/logs; each rank records its batches and weights in
    `directory`, and rank 1 alone sees a NaN loss at step 3: the guard's decision is shared, so both
    ranks skip that step."""
    return [
        *TINY,
        "+data.eval_max_tokens=128",  # the 30 test sentences in several batches, not one
        "trainer=ddp_cpu",
        "trainer.deterministic=true",
        f"+callbacks.record._target_={__name__}.RecordTraining",
        f"+callbacks.record.directory={directory}",
        f"+callbacks.poison._target_={__name__}.PoisonOneRank",
        "+callbacks.poison.rank=1",
        "+callbacks.poison.step=3",
        "callbacks.non_finite_loss.action=skip",
        f"paths.log_dir={directory / 'logs'}",
        *extra,
    ]


def _curves(run_dir: Path) -> dict[tuple[str, int], float]:
    """(metric, step) -> value of the training loss, learning rate and validation scores (rank 0's CSV)."""
    curves = {}
    for row in _read_csv(run_dir / "csv" / "metrics.csv"):
        for name in ("train/loss", "lr-AdamW/pg1", "train/skipped_steps", "val/loss", "val/bleu"):
            if row.get(name):
                curves[(name, int(row["step"]))] = float(row[name])
    return curves


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """Two DDP runs of 2 epochs (10 steps per rank), started together: `straight` runs to the end;
    `killed` is the same run sent SIGTERM at the end of step 6 (mid-epoch 2), without the final test."""
    runs = {
        "straight": (tmp_path_factory.mktemp("ddp_straight"), []),
        "killed": (
            tmp_path_factory.mktemp("ddp_killed"),
            [
                "test=false",
                f"+callbacks.sigterm._target_={__name__}.SignalTheLauncher",
                "+callbacks.sigterm.step=6",
                # longer than the 5 s in which Lightning's launcher looks at the other ranks' exit status
                "+callbacks.sigterm.linger=6",
            ],
        ),
    }
    with ThreadPoolExecutor(max_workers=2) as pool:  # much of each run is interpreter start-up
        futures = {
            name: pool.submit(run_script, "train.py", _ddp_args(d, *extra), cwd=d)
            for name, (d, extra) in runs.items()
        }
        return {name: (runs[name][0], future.result()) for name, future in futures.items()}


def test_ddp_cpu_two_processes_one_run_directory(
    ddp_runs: dict[str, tuple[Path, subprocess.CompletedProcess]], tmp_path: Path
) -> None:
    record_dir, done = ddp_runs["straight"]
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [torch.load(record_dir / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    _check_ranks_split_the_epochs(ranks, epochs=2, n_train=600)
    # the same weights on both ranks after training (gradients all-reduced every step), none NaN: rank 0,
    # whose own loss was finite, skipped step 3 with rank 1 (stepping would have applied NaN gradients)
    assert [rank["skipped"] for rank in ranks] == [1, 1]
    assert all(torch.isfinite(w).all() for rank in ranks for w in rank["weights"].values())
    assert ranks[0]["weights"].keys() == ranks[1]["weights"].keys()
    assert all(torch.equal(ranks[0]["weights"][k], ranks[1]["weights"][k]) for k in ranks[0]["weights"])
    (run_dir,) = (record_dir / "logs" / "train" / "runs").iterdir()
    assert done.stdout.strip().splitlines()[-1] == f"run directory: {run_dir}"
    assert done.stdout.count("run directory:") == 1  # printed by rank 0 only
    assert (run_dir / "train_ddp_process_1.log").is_file()  # the second process ran in the same directory
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert Path(metrics["last_ckpt_path"]).is_file() and metrics["global_step"] == ranks[0]["global_step"]
    # The test step scored the hypotheses of all 30 test sentences, gathered from both processes: the
    # same scores as one process testing the same checkpoint (a lost rank would score a part of them).
    assert metrics["test/n_sentences"] == 30 and metrics["val/n_sentences"] == 30
    overrides = [
        *TINY,
        *IN_PROCESS,
        "+data.eval_max_tokens=128",
        "train=false",
        f"ckpt_path={metrics['best_ckpt_path']}",
    ]
    single = train(compose_train_cfg(overrides, output_dir=tmp_path / "single"))
    assert single["test/n_sentences"] == 30 and single["test/chrf"] > 0  # not 0 == 0
    for name in ("test/bleu", "test/chrf", "test/exact_match"):
        assert metrics[name] == single[name], name
    assert metrics["test/loss"] == pytest.approx(single["test/loss"], rel=1e-5)


def test_ddp_sigterm_to_the_launcher_then_resume_equals_the_straight_run(
    ddp_runs: dict[str, tuple[Path, subprocess.CompletedProcess]], tmp_path: Path
) -> None:
    """docs/reliability.md: under DDP a SIGTERM acts at the next log write (here every step), the run writes
    last.ckpt and exits 143; resuming from it continues as if never stopped. SIGTERM to the launching
    process only, at the end of step 6: both ranks finish step 7 and stop there, one last.ckpt holds
    step 7, and the command exits 143 although rank 0 ends 6 s after rank 1 (not 137: Lightning's
    launcher SIGKILLs itself when another rank exits non-zero first, unless told otherwise). Resumed to
    the end on 2 processes: each rank takes the rest of the straight run's batches (none repeated or
    missed) and ends with bitwise its weights, losses, learning rates, validation scores and
    skipped-step count (every rank restores its own random state: dropout)."""
    (straight_dir, straight), (killed_dir, killed) = ddp_runs["straight"], ddp_runs["killed"]
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert killed.returncode == 128 + signal.SIGTERM, killed.stderr[-3000:]
    (run_dir,) = (killed_dir / "logs" / "train" / "runs").iterdir()
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    saved = f"saved {ckpt} at step 7; resume with ckpt_path={ckpt}"
    assert f"SIGTERM: {saved}" in (run_dir / "train.log").read_text()
    assert f"a signal (on another rank): {saved}" in (run_dir / "train_ddp_process_1.log").read_text()
    stopped = [torch.load(killed_dir / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert [rank["global_step"] for rank in stopped] == [7, 7]  # no rank went on to step 8
    # one whole checkpoint (no temporary file left): the state both ranks stopped with
    assert not [p.name for p in ckpt.parent.iterdir() if p.suffix == ".tmp"]
    checkpoint = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert checkpoint["global_step"] == 7
    for key, value in checkpoint["state_dict"].items():
        assert torch.equal(value, stopped[0]["weights"][key]) and torch.equal(
            value, stopped[1]["weights"][key]
        )

    done = run_script("train.py", _ddp_args(tmp_path, "test=false", f"ckpt_path={ckpt}"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    (resumed_dir,) = (tmp_path / "logs" / "train" / "runs").iterdir()
    (straight_run,) = (straight_dir / "logs" / "train" / "runs").iterdir()
    resumed = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    reference = [torch.load(straight_dir / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    for rank, (before, after, ref) in enumerate(zip(stopped, resumed, reference)):
        assert before["batches"] + after["batches"] == ref["batches"], rank
        assert after["global_step"] == ref["global_step"] == 10 and after["skipped"] == ref["skipped"] == 1
        assert after["weights"].keys() == ref["weights"].keys()
        for key, value in ref["weights"].items():
            assert torch.equal(after["weights"][key], value), (rank, key)
    before, after = _curves(run_dir), _curves(resumed_dir)
    assert min(step for name, step in after if name == "train/loss") == 7  # the first step not taken
    assert {**before, **after} == _curves(straight_run)


@pytest.mark.parametrize(
    ("experiment", "fixture", "overrides"),
    [
        ("quickstart", None, []),
        ("multi30k_de_en", "multi30k_dir", ["model.config.d_model=64", "model.config.d_ff=128"]),
        ("sst2", "sst2_dir", ["model.config.d_model=64", "model.config.d_ff=128"]),
    ],
)
def test_fast_dev_run(
    experiment: str, fixture: str | None, overrides: list[str], request, tmp_path: Path
) -> None:
    if fixture is not None:
        overrides = [*overrides, f"data.data_dir={request.getfixturevalue(fixture)}"]
    cfg = compose_train_cfg(
        [f"experiment={experiment}", "debug=fdr", *IN_PROCESS, *overrides], output_dir=tmp_path
    )
    metrics = train(cfg)
    assert metrics["global_step"] == 1
    if experiment == "sst2":
        assert 0.0 <= metrics["test/acc"] <= 1.0
    else:  # one test batch (fast_dev_run saves no checkpoint, so its scores cannot be recomputed)
        split_size = 500 if experiment == "quickstart" else 1000  # synthetic test, test_2016_flickr
        assert 0 < metrics["test/n_sentences"] < split_size and metrics["test/bleu"] >= 0.0
