"""What the benchmarks compare against, defined once: reference models, batches, FLOP counts, a profile split.

- `TorchReference`: torch.nn.Transformer between the same kind of embeddings as ours (scaled, sinusoidal
  positions, dropout) with a tied output projection, given the masks ours uses.
- `MarianReference`: transformers.MarianMTModel built from the `MarianConfig` our export writes for the
  same config (`transformer.interop.marian.marian_config`; random init, no download): post-LN, sinusoidal
  positions, scaled embeddings, tied vocabulary as the config says, SDPA.
- `marian_generate`: its `generate` at a fixed length, the decoding reference; `mean_length` of outputs.
- `make_batches`: random padded batches; `Batch` carries the non-pad token count (and, once moved to its
  device, the packing data.packing=true builds on the host).
- `matmul_flops`: the FLOPs of the matmuls of one training step, padded or packed.
- `op_category` / `profile_split`: a torch.profiler trace folded into matmul / attention / dropout /
  softmax+loss / elementwise / optimizer.
- `load_revision`: our model package as it was at a git revision, importable next to the current one,
  so that "before" and "after" run side by side in one process.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import re
import subprocess
import sys
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from data.batching import batch_packing
from transformer.config import TransformerConfig
from transformer.positional import sinusoidal_table

PAD, BOS, EOS = 0, 1, 2
# both searches' alpha: with every hypothesis of one fixed length, GNMT's penalty and len ** alpha rank alike
LENGTH_PENALTY = 0.6
REPO = Path(__file__).resolve().parents[2]


class TorchReference(nn.Module):
    """torch.nn.Transformer between the same kind of embeddings as ours, with a tied output projection."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        self.embedding = nn.Embedding(config.src_vocab_size, config.d_model)
        self.output_projection = nn.Linear(config.d_model, config.tgt_vocab_size, bias=False)
        self.output_projection.weight = self.embedding.weight  # tie_embeddings="all", as ours
        self.register_buffer("positions", sinusoidal_table(config.max_len, config.d_model), persistent=False)
        self.dropout = nn.Dropout(config.dropout)
        self.transformer = nn.Transformer(
            config.d_model,
            config.n_heads,
            config.n_encoder_layers,
            config.n_decoder_layers,
            config.d_ff,
            dropout=config.dropout,
            batch_first=True,
            norm_first=config.norm_first,
        )
        self._causal_masks: dict[int, Tensor] = {}  # built once per target length, not per step

    def _embed(self, tokens: Tensor) -> Tensor:
        x = self.embedding(tokens) * math.sqrt(self.config.d_model)  # (B, L, D)
        return self.dropout(x + self.positions[: tokens.size(1)])

    def _causal(self, length: int, device: torch.device) -> Tensor:
        if torch.compiler.is_compiling():  # a dict keyed by the length would specialize every length
            return nn.Transformer.generate_square_subsequent_mask(length, device=device)
        if length not in self._causal_masks:
            self._causal_masks[length] = nn.Transformer.generate_square_subsequent_mask(length, device=device)
        return self._causal_masks[length]

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        src_mask = src.eq(PAD)  # (B, S)
        src_mask = torch.zeros(src_mask.shape, device=src.device).masked_fill_(src_mask, -math.inf)
        hidden = self.transformer(
            self._embed(src),
            self._embed(tgt_in),
            tgt_mask=self._causal(tgt_in.size(1), tgt_in.device),
            src_key_padding_mask=src_mask,  # float like tgt_mask: torch warns about mixed mask types
            memory_key_padding_mask=src_mask,
            tgt_is_causal=True,
        )  # (B, T, D)
        return self.output_projection(hidden)  # (B, T, V)


class MarianReference(nn.Module):
    """transformers.MarianMTModel (SDPA attention, random init) behind our forward(src, tgt_in) -> logits."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        from transformers import MarianMTModel

        from transformer.interop.marian import marian_config  # the export's own mapping

        self.config = config
        self.marian = MarianMTModel._from_config(marian_config(config), attn_implementation="sdpa")

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        out = self.marian(
            input_ids=src, attention_mask=src.ne(PAD), decoder_input_ids=tgt_in, use_cache=False
        )  # causal decoder self-attention; right-padded targets need no mask of their own, as ours
        return out.logits  # (B, T, V)


def marian_generate(marian: MarianReference, src: Tensor, length: int, beams: int) -> Tensor:
    """MarianMTModel.generate with exactly `length` new tokens per sentence -> (B, length) without BOS."""
    with torch.no_grad():
        out = marian.marian.generate(
            input_ids=src,
            attention_mask=src.ne(PAD),
            num_beams=beams,
            num_return_sequences=1,
            do_sample=False,
            max_new_tokens=length,
            min_new_tokens=length,
            use_cache=True,
            **({"length_penalty": LENGTH_PENALTY, "early_stopping": False} if beams > 1 else {}),
        )
    return out[:, 1:]  # drop the decoder start token


def mean_length(tokens: Tensor) -> float:
    """Mean tokens per hypothesis up to and including the first EOS (pads after it not counted)."""
    ended = tokens.eq(EOS).int().cumsum(1)  # (B, L): 1 from the first EOS on
    return float((ended.eq(0) | (ended.eq(1) & tokens.eq(EOS))).sum(1).float().mean())


@dataclass
class Batch:
    src: Tensor
    tgt_in: Tensor
    tgt_out: Tensor
    n_tokens: int  # non-pad source + target tokens
    # the packing the collator builds on the host with data.packing=true (`ours:hostpacked`), made here
    # when a host batch moves to its device: outside the timed steps, as in a loader worker
    packing: dict[str, Any] | None = None

    def to(self, device: torch.device | str) -> Batch:
        packing = self.packing
        if packing is None and self.src.device.type == "cpu":
            packing = batch_packing(self.src.eq(PAD), self.tgt_in, PAD)
        if packing is not None:
            packing = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in packing.items()}
        tensors = (self.src.to(device), self.tgt_in.to(device), self.tgt_out.to(device))
        return Batch(*tensors, self.n_tokens, packing)

    @property
    def pad_fraction(self) -> float:
        return 1.0 - self.n_tokens / (self.src.numel() + self.tgt_out.numel())


def batch_from_lengths(src_len: Tensor, tgt_len: Tensor, vocab: int, generator: torch.Generator) -> Batch:
    """Random token ids with the given lengths: src (B, S), tgt_in = [BOS y1..yn], tgt_out = [y1..yn EOS]."""
    batch_size = src_len.numel()
    src = torch.randint(4, vocab, (batch_size, int(src_len.max())), generator=generator)
    src = src.masked_fill(torch.arange(src.size(1)) >= src_len[:, None], PAD)
    body = torch.randint(4, vocab, (batch_size, int(tgt_len.max())), generator=generator)
    body = body.masked_fill(torch.arange(body.size(1)) >= tgt_len[:, None], PAD)
    tgt_in = F.pad(body, (1, 0), value=BOS)  # [BOS y1 .. yn] + pads
    tgt_out = F.pad(body, (0, 1), value=PAD)
    tgt_out[torch.arange(batch_size), tgt_len] = EOS  # [y1 .. yn EOS] + pads
    return Batch(src, tgt_in, tgt_out, int(src_len.sum() + tgt_len.sum() + batch_size))


def batch_from_ids(pairs: list[tuple[list[int], list[int]]]) -> Batch:
    """Real token ids [BOS .. EOS] per side -> the training layout (src, tgt_in, tgt_out)."""
    src_width = max(len(s) for s, _ in pairs)
    tgt_width = max(len(t) for _, t in pairs) - 1
    src = torch.full((len(pairs), src_width), PAD)
    tgt_in = torch.full((len(pairs), tgt_width), PAD)
    tgt_out = torch.full((len(pairs), tgt_width), PAD)
    for row, (s, t) in enumerate(pairs):
        src[row, : len(s)] = torch.tensor(s)
        tgt_in[row, : len(t) - 1] = torch.tensor(t[:-1])
        tgt_out[row, : len(t) - 1] = torch.tensor(t[1:])
    n_tokens = int(src.ne(PAD).sum() + tgt_out.ne(PAD).sum())
    return Batch(src, tgt_in, tgt_out, n_tokens)


def make_batches(n: int, batch_size: int, vocab: int, generator: torch.Generator) -> list[Batch]:
    """Random pairs with lengths uniform in [10, 32] (about 35% padding), src/tgt lengths independent."""
    batches = []
    for _ in range(n):
        src_len = torch.randint(10, 33, (batch_size,), generator=generator)
        tgt_len = torch.randint(10, 33, (batch_size,), generator=generator)
        batches.append(batch_from_lengths(src_len, tgt_len, vocab, generator))
    return batches


def matmul_flops(
    config: TransformerConfig, batch: Batch, *, packed: bool, packed_logits: bool, backward: bool = True
) -> float:
    """FLOPs of the matmuls of one step (2 per multiply-add; backward = 2x forward; attention scores and
    weighted sums at the padded lengths, as SDPA computes them).

    packed=False: every linear layer runs over the padded tensors; packed=True: over the non-pad tokens
    only (the decoder over each target's prefix). packed_logits: the vocabulary projection likewise.
    """
    D, F_, V = config.d_model, config.d_ff, config.tgt_vocab_size
    B, S = batch.src.shape
    T = batch.tgt_in.size(1)
    src_tokens = int(batch.src.ne(PAD).sum()) if packed else B * S
    tgt_tokens = int(batch.tgt_out.ne(PAD).sum()) if packed else B * T
    logit_tokens = int(batch.tgt_out.ne(PAD).sum()) if packed_logits else B * T
    per_enc_token = 2 * (4 * D * D + 2 * D * F_)  # QKV + out projections, FFN
    per_dec_token = 2 * (4 * D * D + 2 * D * D + 2 * D * F_)  # self QKV + out, cross Q + out, FFN
    per_memory_token = 2 * (2 * D * D)  # cross-attention K, V of the memory, per decoder layer
    attention = 2 * 2 * B * D * (S * S * config.n_encoder_layers + (T * T + T * S) * config.n_decoder_layers)
    forward = (
        src_tokens * per_enc_token * config.n_encoder_layers
        + tgt_tokens * per_dec_token * config.n_decoder_layers
        + src_tokens * per_memory_token * config.n_decoder_layers
        + attention
        + logit_tokens * 2 * D * V  # output projection
    )
    return 3.0 * forward if backward else float(forward)


def model_flops(config: TransformerConfig, batch: Batch) -> float:
    """The useful matmul FLOPs of a step: packed layout (no padding work), for MFU."""
    return matmul_flops(config, batch, packed=True, packed_logits=True)


def measure_matmul_peak(device: torch.device, dtype: torch.dtype, repeats: int = 20) -> dict[str, float]:
    """Best GFLOP/s over `repeats` of square and FFN-shaped matmuls (the best, not the median: on a
    shared machine the ceiling is what an undisturbed run reaches); 'peak' is the best of them."""
    import time

    sizes = {"1024^3": (1024, 1024, 1024), "4096x512x2048": (4096, 512, 2048)}
    if device.type == "cuda":
        sizes = {"8192^3": (8192, 8192, 8192), "16384x1024x4096": (16384, 1024, 4096)}
    result = {}
    for name, (m, k, n) in sizes.items():
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        times = []
        for _ in range(repeats + 1):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            a @ b
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        result[name] = 2 * m * k * n / min(times[1:]) / 1e9
    result["peak"] = max(result.values())
    return result


# --- profile split -------------------------------------------------------------------------------------

CATEGORIES = ("matmul", "attention", "dropout", "softmax+loss", "elementwise", "optimizer")
_MATMUL = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear")
_DROPOUT = ("dropout", "bernoulli", "aten::rand")  # also our mask generators and fused dropout-add
_LOSS = ("log_softmax", "cross_entropy", "nll_loss", "label_smoothed", "LabelSmoothed", "logsumexp")


def op_category(name: str, ancestors: list[str]) -> str:
    """The category of a profiler event from its name and its ancestors' names (outermost first).

    The optimizer step and attention kernels claim everything under them; otherwise the innermost
    matmul / dropout / loss op above (or at) the event decides, and the rest is elementwise work.
    """
    chain = [*ancestors, name]
    if any("Optimizer." in n or "_fused_adam" in n or "_foreach_" in n for n in chain):
        return "optimizer"
    if any("scaled_dot_product" in n or "ScaledDotProduct" in n or "flash_attention" in n for n in chain):
        return "attention"
    for n in reversed(chain):
        if n.startswith(_MATMUL) or n in ("MmBackward0", "AddmmBackward0", "BmmBackward0"):
            return "matmul"
        if any(key in n for key in _DROPOUT) or "Dropout" in n:
            return "dropout"
        if any(key in n for key in _LOSS) or "softmax" in n.lower():
            return "softmax+loss"
    return "elementwise"


def profile_split(prof: torch.profiler.profile) -> dict[str, float]:
    """Self CPU time per category, in percent of the total, from a finished torch.profiler run."""
    totals: dict[str, float] = defaultdict(float)
    events = prof.events()
    for event in events:
        ancestors = []
        parent = event.cpu_parent
        while parent is not None:
            ancestors.append(parent.name)
            parent = parent.cpu_parent
        totals[op_category(event.name, ancestors[::-1])] += event.self_cpu_time_total
    total = sum(totals.values()) or 1.0
    return {category: 100.0 * totals[category] / total for category in CATEGORIES}


# --- our model at an earlier revision -------------------------------------------------------------------

# the torch-only core, in every layout it has had (one a revision lacks is skipped)
_REVISION_FILES = (
    *("config", "kernels", "packing", "cache", "attention_paths", "attention", "dropout", "positional"),
    *("layers", "embedding", "stacks", "model", "encoder_only", "losses", "decoding"),
    *("search_step", "beam_search", "ensemble"),
)
# the decoding family under its names in transformer/search/ (since 07d8fdb) and before (transformer/)
_SEARCH_NAMES = {"decoding": "decoding", "search_step": "step", "beam_search": "beam", "ensemble": "ensemble"}
_SEARCH_NAMES |= {"cache": "cache", "static_cache": "static_cache"}


def load_revision(revision: str) -> dict[str, ModuleType]:
    """Our torch-only model modules as they were at git `revision`, under a package of their own.

    The torch-only files (transformer/*.py and transformer/search/*.py) are exported with `git show` into
    a temporary package `transformer_at_<sha>` whose imports are rewritten to point at itself; returns
    {"model": ..., "losses": ..., "decoding": ...}, the decoding family under its old names whichever
    layout the revision has.
    """
    sha = subprocess.run(
        ["git", "rev-parse", "--short", revision], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.strip()
    package = f"transformer_at_{sha}"
    root = Path(tempfile.mkdtemp(prefix="bench_rev_"))
    listed = subprocess.run(
        ["git", "ls-tree", "-r", "--name-only", revision, "transformer/"],
        cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    for path in listed:
        parts = Path(path).parts[1:]
        if not path.endswith(".py") or len(parts) > 2 or (len(parts) == 2 and parts[0] != "search"):
            continue  # training/, evaluation/, ...: not torch-only
        source = subprocess.run(
            ["git", "show", f"{revision}:{path}"], cwd=REPO, capture_output=True, text=True
        )
        target = root / package / Path(*parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        text = source.stdout if parts[-1] != "__init__.py" else ""
        target.write_text(re.sub(r"\b(from|import) transformer\.", rf"\1 {package}.", text))
    (root / package / "__init__.py").write_text("")
    where = {}
    for name in _REVISION_FILES:
        moved = root / package / "search" / f"{_SEARCH_NAMES.get(name, name)}.py"
        if name in _SEARCH_NAMES and moved.exists():
            where[name] = f"{package}.search.{_SEARCH_NAMES[name]}"
        elif (root / package / f"{name}.py").exists():
            where[name] = f"{package}.{name}"
    # the package registered by its location (not through sys.path): its modules import each other by name
    init = root / package / "__init__.py"
    spec = importlib.util.spec_from_file_location(
        package, init, submodule_search_locations=[str(init.parent)]
    )
    sys.modules[package] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules[package])
    return {name: importlib.import_module(module) for name, module in where.items()}
