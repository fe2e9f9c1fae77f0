"""LoRA (Hu et al., 2021): a trainable low-rank update W + (alpha / r) B A on chosen projections, added as a
weight parametrization (`torch.nn.utils.parametrize`) and merged back into plain weights for evaluation.

Parametrizations, not PEFT: our attention keeps q, k and v in one packed `in_proj_weight` (as
`torch.nn.MultiheadAttention`), a parameter rather than an `nn.Linear`, so each of q, k, v gets its own
A and B on its rows of that matrix. A weight parametrization sees the weight, not the input, so
`dropout` drops whole rank-one components B[:, i] A[i] in training (rank dropout) instead of PEFT's
dropout on the adapter's input.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from transformer.attention import MultiHeadAttention
from transformer.layers import FeedForward

__all__ = [
    "FROZEN_MODULES",
    "TARGETS",
    "FinetuneSettings",
    "LoraSettings",
    "LowRankUpdate",
    "add_lora",
    "is_under",
    "lora_targets",
    "lora_weights",
    "merge_lora",
]

# q, k, v: rows of the attention's input projection; o: its output projection; ff: the feed-forward's
# linears (and the gate of a gated one)
TARGETS = ("q", "k", "v", "o", "ff")

# `finetune.freeze`: the modules whose weights a fine-tuning run keeps as they are (LoRA adds no update
# there either); the encoder's token embedding is its own input, and with tied embeddings also the
# decoder's and the output projection's
FROZEN_MODULES: dict[str, tuple[str, ...]] = {
    "none": (),
    "embeddings": ("src_embed", "tgt_embed"),
    "encoder": ("src_embed", "encoder"),
}


def is_under(path: str, modules: Sequence[str]) -> bool:
    """Whether the module at `path` (e.g. "encoder.layers.0") is one of `modules` or inside one."""
    return any(path == m or path.startswith(f"{m}.") for m in modules)


@dataclass(frozen=True)
class LoraSettings:
    """Rank, scale (alpha / rank), rank dropout and the projections that get an update."""

    rank: int
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("q", "k", "v", "o")

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"lora.rank must be an integer >= 1, got {self.rank!r}")
        alpha = self.alpha
        number = isinstance(alpha, (int, float)) and not isinstance(alpha, bool)
        if not number or not math.isfinite(alpha) or alpha <= 0:
            raise ValueError(f"lora.alpha must be a number > 0, got {alpha!r}")
        dropout = self.dropout
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"lora.dropout must be in [0, 1), got {dropout!r}")
        targets = tuple(self.targets)
        unknown = [t for t in targets if t not in TARGETS]
        if not targets or unknown or len(set(targets)) != len(targets):
            raise ValueError(
                f"lora.targets must be distinct names among {list(TARGETS)}, got {list(targets)}"
            )
        object.__setattr__(self, "targets", targets)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "targets": list(self.targets)}

    @classmethod
    def from_dict(cls, values: Mapping[str, object]) -> LoraSettings:
        unknown = sorted(set(values) - {"rank", "alpha", "dropout", "targets"})
        if unknown:
            raise ValueError(f"lora has no setting {unknown[0]!r} (rank, alpha, dropout, targets)")
        targets = values.get("targets", cls.targets)
        if isinstance(targets, str) or not isinstance(targets, Sequence):
            raise ValueError(f"lora.targets must be a list of names among {list(TARGETS)}, got {targets!r}")
        return cls(**{**values, "targets": tuple(targets)})  # type: ignore[arg-type]


class LowRankUpdate(nn.Module):
    """W -> W + scale * B A on row blocks of W (`parts`: name -> (first row, end row)), each block with its
    own A (rank, in) and B (rows, rank). B starts at zero, so the parametrized model starts as the base;
    A as PEFT's (Kaiming-uniform)."""

    def __init__(
        self, weight: Tensor, parts: Mapping[str, tuple[int, int]], rank: int, scale: float, dropout: float
    ) -> None:
        super().__init__()
        self.parts = dict(sorted(parts.items(), key=lambda item: item[1]))
        self.scale, self.dropout = scale, dropout
        self.rows, self.columns = weight.shape
        factory = {"device": weight.device, "dtype": weight.dtype}
        self.lora_A, self.lora_B = nn.ParameterDict(), nn.ParameterDict()
        for name, (start, stop) in self.parts.items():
            A = torch.empty(rank, self.columns, **factory)
            nn.init.kaiming_uniform_(A, a=math.sqrt(5))
            self.lora_A[name] = nn.Parameter(A)
            self.lora_B[name] = nn.Parameter(torch.zeros(stop - start, rank, **factory))

    def delta(self) -> Tensor:
        """scale * B A in the rows of each part, zeros elsewhere: (rows, columns)."""
        blocks, row = [], 0
        for name, (start, stop) in self.parts.items():
            B, A = self.lora_B[name], self.lora_A[name]  # (rows of the part, r), (r, columns)
            if start > row:
                blocks.append(A.new_zeros(start - row, self.columns))
            if self.training and self.dropout > 0.0:  # rank dropout: whole components B[:, i] A[i]
                keep = torch.rand(B.size(1), device=B.device) >= self.dropout  # (r,)
                B = B * (keep.to(B.dtype) / (1.0 - self.dropout))
            blocks.append(B @ A)
            row = stop
        if row < self.rows:
            blocks.append(self.lora_A[next(iter(self.parts))].new_zeros(self.rows - row, self.columns))
        return self.scale * torch.cat(blocks)  # (rows, columns)

    def forward(self, weight: Tensor) -> Tensor:
        return weight + self.delta().to(weight.dtype)


def _targets(model: nn.Module, targets: Sequence[str]) -> Iterator[tuple[str, nn.Module, str, dict]]:
    """(module path, module, weight name, parts) of every projection `targets` names in `model`."""
    for path, module in model.named_modules():
        if isinstance(module, MultiHeadAttention):
            d = module.embed_dim
            rows = {"q": (0, d), "k": (d, 2 * d), "v": (2 * d, 3 * d)}
            wanted = [t for t in ("q", "k", "v") if t in targets]
            if wanted and module.in_proj_weight is not None:  # packed: one matrix, a block each
                yield path, module, "in_proj_weight", {t: rows[t] for t in wanted}
            elif wanted:
                for t in wanted:
                    weight = getattr(module, f"{t}_proj_weight")
                    yield path, module, f"{t}_proj_weight", {t: (0, weight.size(0))}
            if "o" in targets:
                yield f"{path}.out_proj", module.out_proj, "weight", {"o": (0, d)}
        elif isinstance(module, FeedForward) and "ff" in targets:
            for name in ("linear1", "gate", "linear2"):
                linear = getattr(module, name, None)
                if linear is not None:
                    yield f"{path}.{name}", linear, "weight", {"ff": (0, linear.weight.size(0))}


def lora_targets(
    model: nn.Module, settings: LoraSettings, skip: Sequence[str] = ()
) -> list[tuple[str, nn.Module, str, dict[str, tuple[int, int]]]]:
    """(module path, module, weight name, parts) of every projection of `model` that `settings.targets`
    names, none under the modules `skip`. A rank larger than a projection allows (the smaller of its
    rows and columns) raises ValueError."""
    found = [item for item in _targets(model, settings.targets) if not is_under(item[0], skip)]
    for path, module, name, parts in found:
        columns = getattr(module, name).size(1)
        for part, (start, stop) in parts.items():
            if settings.rank > min(stop - start, columns):
                raise ValueError(
                    f"lora.rank={settings.rank} is larger than the {part} projection of "
                    f"{path or 'the model'} ({stop - start} x {columns}) allows: at most "
                    f"{min(stop - start, columns)}"
                )
    return found


def add_lora(model: nn.Module, settings: LoraSettings, skip: Sequence[str] = ()) -> list[str]:
    """Parametrize the projections of `lora_targets` with a `LowRankUpdate` each; returns their names."""
    names = []
    for path, module, name, parts in lora_targets(model, settings, skip):
        update = LowRankUpdate(getattr(module, name), parts, settings.rank, settings.scale, settings.dropout)
        parametrize.register_parametrization(module, name, update)
        names.append(f"{path}.{name}".lstrip("."))
    return names


def lora_weights(model: nn.Module) -> list[nn.Parameter]:
    """The adapters' A and B matrices in `model`."""
    return [
        parameter
        for module in model.modules()
        if isinstance(module, LowRankUpdate)
        for parameter in module.parameters()
    ]


@torch.no_grad()
def merge_lora(model: nn.Module) -> int:
    """Fold every LoRA update into its weight (W + scale B A, without dropout) and remove the
    parametrizations: plain weights and state_dict names again. Returns how many weights were merged."""
    merged = 0
    for module in list(model.modules()):
        if not parametrize.is_parametrized(module):
            continue
        for name in list(module.parametrizations.keys()):
            chain = module.parametrizations[name]
            if len(chain) == 1 and isinstance(chain[0], LowRankUpdate):
                chain[0].eval()
                parametrize.remove_parametrizations(module, name, leave_parametrized=True)
                merged += 1
    return merged


@dataclass(frozen=True)
class FinetuneSettings:
    """The `finetune` section (configs/finetune/, a checkpoint's hyperparameters), read here only: `freeze`:
    none, embeddings or encoder; `lora`: the adapters' settings, None without LoRA."""

    freeze: str = "none"
    lora: LoraSettings | None = None

    @classmethod
    def from_values(cls, values: Mapping[str, Any] | None) -> FinetuneSettings:
        """From the `finetune` config node (plain data); a bad value raises ValueError naming its key."""
        values = dict(values or {})
        unknown = sorted(set(values) - {"freeze", "lora"})
        if unknown:
            raise ValueError(f"finetune has no setting {unknown[0]!r} (freeze, lora)")
        freeze = values.get("freeze") or "none"
        if freeze not in FROZEN_MODULES:
            raise ValueError(f"finetune.freeze must be one of {', '.join(FROZEN_MODULES)}, got {freeze!r}")
        lora = values.get("lora") or {}
        if not isinstance(lora, Mapping):
            raise ValueError(f"finetune.lora must be a mapping (rank, alpha, dropout, targets), got {lora!r}")
        if not lora.get("rank"):  # rank 0 / null: no adapters
            return cls(freeze, None)
        try:
            return cls(freeze, LoraSettings.from_dict(lora))
        except (TypeError, ValueError) as err:
            raise ValueError(f"finetune.{err}") from None

    @property
    def frozen_modules(self) -> tuple[str, ...]:
        return FROZEN_MODULES[self.freeze]

    @property
    def active(self) -> bool:
        return self.freeze != "none" or self.lora is not None

    def check_fits(self, model: nn.Module) -> None:
        """Raise ValueError (naming finetune.lora.rank) if a rank is larger than a projection allows, or
        (naming finetune.freeze) if the frozen modules hold every projection LoRA targets."""
        if self.lora is not None:
            try:
                found = lora_targets(model, self.lora, self.frozen_modules)
            except ValueError as err:
                raise ValueError(f"finetune.{err}") from None
            if not found:  # LoRA would freeze every weight and adapt none: only a new head would train
                raise ValueError(
                    f"finetune.lora.targets={list(self.lora.targets)} are all in what "
                    f"finetune.freeze={self.freeze} freezes: LoRA would adapt no weight (to train the head "
                    f"alone, use finetune.freeze={self.freeze} without LoRA)"
                )
