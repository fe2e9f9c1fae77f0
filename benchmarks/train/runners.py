"""The competitors of bench_train.py: our model (and its variants with one lever reverted, or as it was at
an earlier revision), torch.nn.Transformer and MarianMTModel, each with its optimizer and training loss."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarks.common.references import PAD, Batch, MarianReference, TorchReference, matmul_flops
from transformer import losses as our_losses
from transformer.config import TransformerConfig
from transformer.kernels import attention_backends
from transformer.layers import Dropout
from transformer.model import Seq2SeqTransformer
from transformer.norm import residual_in_autocast_dtype
from transformer.packing import BatchPacking
from transformer.stacks import compile_layers
from transformer.training.compiling import CompiledStep, pad_length

CASES = {
    "d256": {"d_model": 256, "n_heads": 4, "n_encoder_layers": 3, "n_decoder_layers": 3, "d_ff": 1024},
    "d512": {"d_model": 512, "n_heads": 8, "n_encoder_layers": 6, "n_decoder_layers": 6, "d_ff": 2048},
    "smoke": {"d_model": 32, "n_heads": 2, "n_encoder_layers": 1, "n_decoder_layers": 1, "d_ff": 64},
}
VOCAB = 10_000
LABEL_SMOOTHING = 0.1


def ours_token_loss(model: nn.Module, batch: Batch, loss_fn: Callable[..., Tensor], packs: bool) -> Tensor:
    """Our training loss, as TranslationTask computes it: packed (the CPU), only the non-pad target
    positions are projected; otherwise the padded layout, pads ignored by the loss (no host read)."""
    if not packs and hasattr(model, "packing_on"):
        return padded_token_loss(model, batch.src, batch.tgt_in, batch.tgt_out, loss_fn).loss
    keep = batch.tgt_out.ne(PAD)  # (B, T)
    if hasattr(model, "pack_tokens"):
        hidden = model(batch.src, batch.tgt_in, return_hidden=True, positions=keep)  # (N, D)
    else:  # revisions before `positions`
        hidden = model(batch.src, batch.tgt_in, return_hidden=True)[keep]  # (N, D)
    logits = model.output_projection(hidden)  # (N, V)
    return loss_fn(logits, batch.tgt_out[keep], ignore_index=PAD, label_smoothing=LABEL_SMOOTHING).loss


def fused_token_loss(model: nn.Module, batch: Batch, packs: bool) -> Tensor:
    """The variant ours:fusedloss: `ours_token_loss` with the output projection and the loss as one
    (`losses.linear_label_smoothed_cross_entropy`: no (N, V) logits or gradient held whole)."""
    projection = model.output_projection
    if packs:
        keep = batch.tgt_out.ne(PAD)  # (B, T)
        hidden = model(batch.src, batch.tgt_in, return_hidden=True, positions=keep)  # (N, D)
        target = batch.tgt_out[keep]
    else:  # the padded layout, pads ignored by the loss (no host read)
        hidden = model(batch.src, batch.tgt_in, return_hidden=True)  # (B, T, D)
        target = batch.tgt_out
    return our_losses.linear_label_smoothed_cross_entropy(
        hidden, projection.weight, projection.bias, target, ignore_index=PAD, label_smoothing=LABEL_SMOOTHING
    ).loss


def host_packed_token_loss(model: nn.Module, batch: Batch, fused: bool = False) -> Tensor:
    """The variant ours:hostpacked: TranslationTask's step with data.packing=true, the packed path on any
    device with the packing built on the host (`Batch.to`), so no host read; `fused`: with
    model.fused_loss=true too (ours:fusedloss+hostpacked)."""
    if batch.packing is None:
        raise ValueError("ours:hostpacked needs batches moved from the host with Batch.to (their packing)")
    packing = BatchPacking.from_collated(batch.packing, batch.src, batch.tgt_in)
    hidden = model(batch.src, batch.tgt_in, return_hidden=True, packing=packing)  # (N, D)
    target = packing.target.pack(batch.tgt_out)  # (N,)
    projection = model.output_projection
    smoothing = {"ignore_index": PAD, "label_smoothing": LABEL_SMOOTHING}
    if fused:
        return our_losses.linear_label_smoothed_cross_entropy(
            hidden, projection.weight, projection.bias, target, **smoothing
        ).loss
    return our_losses.label_smoothed_cross_entropy(projection(hidden), target, **smoothing).loss


def padded_token_loss(
    model: nn.Module, src: Tensor, tgt_in: Tensor, tgt_out: Tensor, loss_fn: Callable[..., Any]
) -> Any:
    """TranslationTask._padded_token_loss: logits over the padded (B, T) batch, pads ignored by the loss."""
    return loss_fn(model(src, tgt_in), tgt_out, ignore_index=PAD, label_smoothing=LABEL_SMOOTHING)


def autograd_token_loss(logits: Tensor, target: Tensor, *, ignore_index: int, label_smoothing: float) -> Any:
    """The label-smoothed loss and accuracy written with autograd ops (log-softmax, gather, mean, argmax):
    what transformer/losses.py computed before its fused version; for the `ours:autogradloss` variant."""
    lprobs = F.log_softmax(logits, dim=-1)  # (N, V)
    nll = -lprobs.gather(-1, target.unsqueeze(-1)).squeeze(-1)  # (N,)
    loss = ((1 - label_smoothing) * nll - label_smoothing * lprobs.mean(dim=-1)).mean()
    with torch.no_grad():
        n_correct = (logits.argmax(dim=-1) == target).sum()
    return our_losses.TokenLoss(loss, nll.mean(), n_correct, torch.tensor(target.numel()))


def reference_loss(model: nn.Module, batch: Batch) -> Tensor:
    """Logits at every position, then torch's label-smoothed cross entropy ignoring pads."""
    logits = model(batch.src, batch.tgt_in)  # (B, T, V)
    return F.cross_entropy(
        logits.reshape(-1, logits.size(-1)),
        batch.tgt_out.reshape(-1),
        ignore_index=PAD,
        label_smoothing=LABEL_SMOOTHING,
    )


class TorchDropout(nn.Module):
    """torch's dropout behind our `Dropout`'s interface, for the `ours:torchdropout` variant."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        dropped = F.dropout(x, self.p, self.training)
        return dropped if residual is None else residual + dropped


@dataclass
class Runner:
    """One competitor: a model, its optimizer and its loss; where its matmuls skip padding (for HFU)."""

    name: str
    model: nn.Module
    loss_fn: Callable[[Batch], Tensor]
    packed: bool  # linear layers on non-pad tokens only
    packed_logits: bool  # vocabulary projection on non-pad target positions only
    optimizer: torch.optim.Optimizer = field(init=False)
    autocast: torch.dtype | None = None
    fused_adamw: bool = True

    def __post_init__(self) -> None:
        params = list(self.model.parameters())
        self.optimizer = torch.optim.AdamW(
            params, lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=self.fused_adamw, foreach=not self.fused_adamw
        )

    def step(self, batch: Batch) -> float:
        device = batch.src.device
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=self.autocast or torch.bfloat16, enabled=bool(self.autocast)):
            loss = self.loss_fn(batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if not math.isfinite(loss.item()):
            raise RuntimeError(f"{self.name}: non-finite loss")
        return elapsed

    def matmul_flops(self, config: TransformerConfig, batch: Batch) -> float:
        return matmul_flops(config, batch, packed=self.packed, packed_logits=self.packed_logits)


# ours with one lever reverted, or (compiled) forward and loss compiled as model.compile=true compiles them,
# or (compiled-layers) the same padded step around layers compiled as model.compile=layers compiles them
VARIANTS = (
    "pack", "nopack", "torchdropout", "autogradloss", "foreachadamw", "compiled", "compiled-layers",
    "lowprecisionresidual", "fusedloss", "hostpacked",
)  # fmt: skip
# the variants that are settings of the task, not reverted levers: they combine, as ours:A+B
COMBINABLE = frozenset({"lowprecisionresidual", "fusedloss", "hostpacked"})


def build_runner(
    name: str,
    config: TransformerConfig,
    revisions: dict[str, dict[str, ModuleType]],
    device: torch.device = torch.device("cpu"),  # noqa: B008
    compile_backend: str = "inductor",
) -> Runner:
    """ours, ours:VARIANT (one optimization reverted or forced; the task's settings lowprecisionresidual,
    fusedloss and hostpacked also together, as ours:fusedloss+hostpacked), ours@REV (an earlier revision),
    torch, torch:no-cudnn (its SDPA with the backends ours uses: no cuDNN on CUDA) or marian, for training
    on `device` (ours packs tokens by default on the CPU only). `ours:compiled` is
    TranslationTask's `model.compile=true`: forward and loss through one `CompiledStep`;
    `ours:compiled-layers` its `model.compile=layers`: the same padded step around compiled layers."""
    torch.manual_seed(0)
    if name == "ours" or name.startswith("ours:"):
        return _ours_runner(name, config, device, compile_backend)
    if name.startswith("ours@"):
        modules = revisions[name.split("@", 1)[1]]
        old_config = modules["config"].TransformerConfig(**vars(config))
        model = modules["model"].Seq2SeqTransformer(old_config)
        on = getattr(model, "packing_on", None) or getattr(model, "_packing_on", None)  # renamed
        packs = on(device) if on is not None else bool(getattr(model, "pack_tokens", False))
        loss_fn = modules["losses"].label_smoothed_cross_entropy
        return Runner(name, model, lambda b: ours_token_loss(model, b, loss_fn, packs), packs, True)
    if name in ("torch", "torch:no-cudnn"):
        model = TorchReference(config)
        if name == "torch":  # torch's own choice of SDPA kernels (cuDNN's first on Hopper, torch 2.11)
            return Runner(name, model, lambda b: reference_loss(model, b), False, False)

        def no_cudnn_loss(b: Batch) -> Tensor:  # the backends ours runs with (kernels.attention_backends)
            with attention_backends(device):
                return reference_loss(model, b)

        return Runner(name, model, no_cudnn_loss, False, False)
    if name == "marian":
        model = MarianReference(config)
        return Runner(name, model, lambda b: reference_loss(model, b), False, False)
    raise ValueError(
        f"unknown model {name!r}; expected ours, ours:VARIANT, ours@REV, torch, torch:no-cudnn or marian"
    )


def _ours_runner(name: str, config: TransformerConfig, device: torch.device, compile_backend: str) -> Runner:
    """`build_runner`'s ours and ours:VARIANT: the model with the variant's setting, its step and loss."""
    variant = name.partition(":")[2]
    settings = set(variant.split("+")) if variant else set()
    if variant and (not settings <= COMBINABLE if "+" in variant else variant not in VARIANTS):
        raise ValueError(
            f"unknown variant {variant!r}; expected one of {VARIANTS}, or several of "
            f"{sorted(COMBINABLE)} joined by '+'"
        )
    model = Seq2SeqTransformer(config)
    if "lowprecisionresidual" in settings:  # model.low_precision_residual=true
        residual_in_autocast_dtype(model)
    compiled = variant in ("compiled", "compiled-layers")
    if variant in ("pack", "nopack") or compiled:  # packing's shapes depend on the data: not compiled
        model.pack_tokens = variant == "pack"
    if variant == "torchdropout":
        for module in list(model.modules()):
            for child_name, child in module.named_children():
                if isinstance(child, Dropout):
                    setattr(module, child_name, TorchDropout(child.p))
    loss_fn = autograd_token_loss if variant == "autogradloss" else our_losses.label_smoothed_cross_entropy
    packs = model.packing_on(device)
    if compiled:
        layers = variant == "compiled-layers"
        if layers:
            compile_layers(model, compile_backend)
        step = CompiledStep(
            lambda src, tgt_in, tgt_out: padded_token_loss(model, src, tgt_in, tgt_out, loss_fn),
            "the training step's layers" if layers else "the training step",
            backend=compile_backend,
            whole=not layers,
        )

        def padded_step(b: Batch) -> Tensor:  # the task's lengths: multiples of LENGTH_MULTIPLE
            return step(*(pad_length(t, PAD) for t in (b.src, b.tgt_in, b.tgt_out))).loss

        return Runner(name, model, padded_step, False, False)
    if "hostpacked" in settings:  # data.packing=true: packed on any device, no host read
        fused = "fusedloss" in settings
        return Runner(name, model, lambda b: host_packed_token_loss(model, b, fused), True, True)
    if "fusedloss" in settings:
        return Runner(name, model, lambda b: fused_token_loss(model, b, packs), packs, packs)
    return Runner(
        name,
        model,
        lambda b: ours_token_loss(model, b, loss_fn, packs),
        packs,
        packs,
        fused_adamw=variant != "foreachadamw",
    )
