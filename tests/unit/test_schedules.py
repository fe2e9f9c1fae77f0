"""Learning-rate schedules: the paper's formula, the peak form, cosine, and resume through state_dict."""

import functools
import itertools
import math

import pytest
import torch

from transformer.training.schedules import (
    CosineWithWarmup,
    InverseSqrtWarmup,
    LinearWithWarmup,
    constant,
    cosine_with_warmup,
    inverse_sqrt,
    linear_with_warmup,
)


def _optimizer(lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=lr)


def _lrs(scheduler: torch.optim.lr_scheduler.LRScheduler, n: int) -> list[float]:
    lrs = []
    for _ in range(n):
        lrs.append(scheduler.get_last_lr()[0])  # the lr the next optimizer step uses
        scheduler.optimizer.step()
        scheduler.step()
    return lrs


def test_inverse_sqrt_matches_the_paper_formula() -> None:
    d_model, warmup = 512, 4000
    lrs = _lrs(inverse_sqrt(_optimizer(1.0), warmup_steps=warmup, d_model=d_model), 10_000)
    for step in (1, 2, 100, 3999, 4000, 4001, 10_000):
        expected = d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)
        assert lrs[step - 1] == pytest.approx(expected, rel=1e-12)
    assert max(lrs) == pytest.approx(d_model**-0.5 * warmup**-0.5)
    assert lrs.index(max(lrs)) == warmup - 1  # peak at step == warmup


def test_inverse_sqrt_peak_form_peaks_at_the_optimizer_lr() -> None:
    lrs = _lrs(inverse_sqrt(_optimizer(5e-4), warmup_steps=10), 40)
    assert lrs[9] == pytest.approx(5e-4)
    assert max(lrs) == pytest.approx(5e-4)
    assert lrs[0] == pytest.approx(5e-5)  # linear warmup from lr / warmup
    assert lrs[39] == pytest.approx(5e-4 * math.sqrt(10 / 40))  # inverse-sqrt decay
    assert all(a < b for a, b in itertools.pairwise(lrs[:10]))
    assert all(a > b for a, b in itertools.pairwise(lrs[9:]))


def test_cosine_with_warmup_shape() -> None:
    f = CosineWithWarmup(warmup_steps=10, total_steps=110, min_ratio=0.1)
    assert f(0) == pytest.approx(0.1)  # step 1 of 10 warmup steps
    assert f(9) == pytest.approx(1.0)
    assert f(59) == pytest.approx(0.1 + 0.9 * 0.5)  # half way through the decay
    assert f(109) == pytest.approx(0.1)
    assert f(500) == pytest.approx(0.1)  # flat after total_steps
    lrs = _lrs(cosine_with_warmup(_optimizer(2.0), warmup_steps=10, total_steps=110), 110)
    assert max(lrs) == pytest.approx(2.0)
    assert lrs[-1] == pytest.approx(0.0, abs=1e-12)


def test_linear_with_warmup_shape() -> None:
    """transformers' get_linear_schedule_with_warmup at min_ratio 0 (its step s is our index s)."""
    f = LinearWithWarmup(warmup_steps=10, total_steps=110, min_ratio=0.2)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(59) == pytest.approx(1.0 - 0.8 * 0.5)  # half way down the line
    assert f(109) == pytest.approx(0.2) and f(500) == pytest.approx(0.2)  # flat after total_steps
    assert all(a > b for a, b in itertools.pairwise([f(i) for i in range(9, 110)]))
    lrs = _lrs(linear_with_warmup(_optimizer(2.0), total_steps=200, warmup_ratio=0.06), 200)
    assert lrs.index(max(lrs)) == 11 and max(lrs) == pytest.approx(2.0)  # 6% of 200: 12 steps
    transformers = pytest.importorskip("transformers")
    theirs = transformers.get_linear_schedule_with_warmup(_optimizer(2.0), 12, 200)
    assert lrs == pytest.approx(_lrs(theirs, 201)[1:], abs=1e-12)


def test_constant() -> None:
    assert _lrs(constant(_optimizer(0.3)), 5) == pytest.approx([0.3] * 5)


def test_state_dict_round_trip_resumes_the_same_lr() -> None:
    scheduler = inverse_sqrt(_optimizer(1e-3), warmup_steps=7)
    straight = _lrs(scheduler, 20)
    first = inverse_sqrt(_optimizer(1e-3), warmup_steps=7)
    head = _lrs(first, 12)
    resumed = inverse_sqrt(_optimizer(1e-3), warmup_steps=999)  # fields come back from the state
    resumed.load_state_dict(first.state_dict())
    resumed.optimizer.param_groups[0]["lr"] = first.optimizer.param_groups[0]["lr"]
    assert resumed.lr_lambdas[0].warmup_steps == 7
    assert head + _lrs(resumed, 8) == pytest.approx(straight)


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: InverseSqrtWarmup(warmup_steps=0), "warmup_steps"),
        (lambda: InverseSqrtWarmup(warmup_steps=10, d_model=-1), "d_model"),
        (lambda: CosineWithWarmup(warmup_steps=10, total_steps=10), "total_steps"),
        (lambda: CosineWithWarmup(warmup_steps=1, total_steps=10, min_ratio=2.0), "min_ratio"),
        (lambda: CosineWithWarmup(warmup_steps=1.5, total_steps=10), "warmup_steps"),
        (lambda: LinearWithWarmup(warmup_steps=10, total_steps=10), "total_steps"),
        (lambda: LinearWithWarmup(warmup_steps=1, total_steps=10, min_ratio=-0.1), "min_ratio"),
        (lambda: linear_with_warmup(_optimizer(1.0), total_steps=10, warmup_ratio=1.0), "warmup_ratio"),
        (lambda: linear_with_warmup(_optimizer(1.0), total_steps=10), "warmup_ratio"),
    ],
)
def test_bad_arguments_name_the_field(make, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        make()


class _Trainer:
    """What configure_optimizers reads of the trainer: its step estimate, no gradient scaler or clipping."""

    precision_plugin = None
    gradient_clip_val = None

    def __init__(self, steps: int) -> None:
        self.estimated_stepping_batches = steps


@pytest.mark.parametrize(
    ("scheduler", "warned"),
    [
        ({"_target_": "transformer.training.schedules.inverse_sqrt", "warmup_steps": 800}, True),
        ({"_target_": "transformer.training.schedules.inverse_sqrt", "warmup_steps": 99}, False),
        ({"_target_": "transformer.training.schedules.cosine_with_warmup", "warmup_steps": 100}, True),
        ({"_target_": "transformer.training.schedules.linear_with_warmup", "warmup_steps": 500}, True),
        ({"_target_": "transformer.training.schedules.linear_with_warmup", "warmup_ratio": 0.06}, False),
        ({"_target_": "transformer.training.schedules.constant"}, False),
    ],
)
def test_a_warmup_longer_than_the_run_is_one_warning_for_every_schedule(
    scheduler: dict, warned: bool, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """100 optimizer steps (the trainer's estimate) under a warmup of 800: one line naming both numbers."""
    import hydra

    from tests.helpers.tasks import TINY
    from transformer.training import TranslationTask
    from transformer.training.optim import adamw

    factory = hydra.utils.instantiate({**scheduler, "_partial_": True})
    task = TranslationTask(TINY, optimizer=functools.partial(adamw, lr=1e-3), scheduler=factory)
    monkeypatch.setattr(type(task), "trainer", property(lambda self: _Trainer(100)))
    with caplog.at_level("WARNING"):
        task.configure_optimizers()
    lines = [r.getMessage() for r in caplog.records if "warmup_steps" in r.getMessage()]
    assert len(lines) == int(warned)
    if warned:
        warmup = scheduler["warmup_steps"]
        assert f"warmup_steps={warmup} is not shorter than the run (100 optimizer steps)" in lines[0]
