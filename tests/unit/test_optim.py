"""AdamW parameter groups: matrices decay; norms, biases and (tied) embeddings do not."""

import pytest
import torch
from torch import nn

from transformer.training.optim import adamw, param_groups


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.linear = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.out = nn.Linear(4, 10, bias=False)
        self.out.weight = self.embed.weight  # tied, as in the paper (section 3.4)
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)


def test_groups_split_decay_and_no_decay() -> None:
    model = _Tiny()
    decay, no_decay = param_groups(model, weight_decay=0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert [id(p) for p in decay["params"]] == [id(model.linear.weight)]
    expected = {id(p) for p in (model.embed.weight, model.linear.bias, model.norm.weight, model.norm.bias)}
    assert {id(p) for p in no_decay["params"]} == expected
    assert len(no_decay["params"]) == 4  # the tied weight appears once; frozen params are left out


def test_adamw_defaults_are_the_papers() -> None:
    optimizer = adamw(_Tiny(), lr=2e-4, weight_decay=0.01)
    assert isinstance(optimizer, torch.optim.AdamW)
    defaults = optimizer.defaults
    assert defaults["betas"] == (0.9, 0.98) and defaults["eps"] == 1e-9 and defaults["lr"] == 2e-4
    assert defaults["fused"] is True  # CPU and CUDA float parameters support the fused kernel
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.01, 0.0]


def test_adamw_steps_and_leaves_no_decay_params_alone_without_gradient() -> None:
    model = _Tiny()
    optimizer = adamw(model, lr=0.1, weight_decay=0.5)
    before = model.norm.weight.detach().clone(), model.linear.weight.detach().clone()
    for p in model.parameters():
        p.grad = torch.zeros_like(p) if p.requires_grad else None
    optimizer.step()  # zero gradients: only weight decay moves parameters
    torch.testing.assert_close(model.norm.weight, before[0])
    torch.testing.assert_close(model.linear.weight, before[1] * (1 - 0.1 * 0.5))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"lr": 0.0}, "lr"),
        ({"betas": (0.9, 1.0)}, "betas"),
        ({"eps": 0}, "eps"),
        ({"weight_decay": -1}, "weight_decay"),
    ],
)
def test_bad_values_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        adamw(_Tiny(), **kwargs)
