"""Learning-rate schedules: the paper's formula, the peak form, cosine, and resume through state_dict."""

import itertools
import math

import pytest
import torch

from transformer.training.schedules import (
    CosineWithWarmup,
    InverseSqrtWarmup,
    constant,
    cosine_with_warmup,
    inverse_sqrt,
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
    ],
)
def test_bad_arguments_name_the_field(make, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        make()
