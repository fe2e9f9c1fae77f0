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


def test_fused_is_picked_exactly_where_torch_has_the_kernel() -> None:
    """`fused=None` asks torch's own list of devices with a fused AdamW; elsewhere (meta here) the
    foreach/for-loop kernel, which every device has."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    assert {"cpu", "cuda"} <= set(_get_fused_kernels_supported_devices())
    assert adamw(_Tiny()).defaults["fused"] is True  # CPU float32
    assert adamw(_Tiny().to(torch.bfloat16)).defaults["fused"] is True
    assert adamw(_Tiny().to("meta")).defaults["fused"] is False
    assert adamw(_Tiny(), fused=False).defaults["fused"] is False  # an explicit choice is kept


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_on_cuda_steps_like_the_foreach_kernel() -> None:
    """On CUDA parameters the fused kernel is chosen and gives the foreach kernel's update."""
    torch.manual_seed(0)
    fused_model = _Tiny().cuda()
    foreach_model = _Tiny().cuda()
    foreach_model.load_state_dict(fused_model.state_dict())
    fused, foreach = adamw(fused_model, lr=0.1, weight_decay=0.1), adamw(foreach_model, lr=0.1, fused=False)
    assert fused.defaults["fused"] is True and foreach.defaults["fused"] is False
    foreach.param_groups[0]["weight_decay"] = 0.1
    for _ in range(3):
        for model, optimizer in ((fused_model, fused), (foreach_model, foreach)):
            for p in model.parameters():
                if p.requires_grad:
                    p.grad = torch.full_like(p, 0.5)
            optimizer.step()
    for a, b in zip(fused_model.parameters(), foreach_model.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_full_precision_clipping_keeps_the_fused_kernel(tmp_path) -> None:
    """Only mixed precision stops Lightning from clipping a fused optimizer's gradients (the task then
    picks foreach, tests/unit/test_tasks.py); at 32-true it clips, and the fused kernel stays."""
    import lightning as L

    from tests.helpers.tasks import CopyData, cpu_trainer, translation_task

    norms: list[float] = []

    # Lightning runs backward and clipping inside step(closure): after the step, .grad is what was clipped
    class GradNorms(L.Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            def record(optimizer: torch.optim.Optimizer, *_: object) -> None:
                grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
                norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))

            trainer.optimizers[0].register_step_post_hook(record)

    trainer = cpu_trainer(
        tmp_path, max_steps=2, limit_val_batches=0, gradient_clip_val=1e-3, callbacks=[GradNorms()]
    )
    trainer.fit(translation_task(), datamodule=CopyData())
    assert trainer.global_step == 2 and trainer.optimizers[0].defaults["fused"] is True
    assert len(norms) == 2 and max(norms) <= 1e-3 * (1 + 1e-4)  # clipped
