"""Forward+backward time of transformer.MultiHeadAttention vs torch.nn.MultiheadAttention (same weights).

Both modules run batch_first self-attention on the same inputs; repeats are interleaved (alternating
which goes first) and medians reported. Prints a table, then one JSON line with the speedups
(torch time / ours time; > 1 means ours is faster).

    python -m benchmarks.train.bench_attention [--repeats 7] [--threads N] [--quick] [--only 'L=256']
    python -m benchmarks.train.bench_attention --smoke   # the L=32 cases at batch 4, width 32, one round
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn

from transformer.attention import MultiHeadAttention, make_causal_mask


def _make_case(batch: int, length: int, embed_dim: int, heads: int, padding: bool, causal: bool) -> dict:
    x = torch.randn(batch, length, embed_dim)
    grad = torch.randn(batch, length, embed_dim)
    kwargs: dict = {}
    if padding:  # lengths uniform in [length/2, length], like a bucketed batch
        lengths = torch.randint(length // 2, length + 1, (batch,))
        kwargs["key_padding_mask"] = torch.arange(length)[None, :] >= lengths[:, None]  # (B, S)
    if causal:
        kwargs["attn_mask"] = make_causal_mask(length)  # torch's module needs the mask with is_causal
        kwargs["is_causal"] = True
    return {"x": x, "grad": grad, "kwargs": kwargs}


def _step(module: nn.Module, case: dict, need_weights: bool) -> float:
    x = case["x"].detach().requires_grad_(True)
    start = time.perf_counter()
    out, _ = module(x, x, x, need_weights=need_weights, **case["kwargs"])
    out.backward(case["grad"])
    elapsed = time.perf_counter() - start
    module.zero_grad(set_to_none=True)
    return elapsed


# (name, length, key padding, causal, need_weights)
CASES = [
    ("L=32", 32, False, False, False),
    ("L=32 pad", 32, True, False, False),
    ("L=32 causal", 32, False, True, False),
    ("L=32 weights", 32, False, False, True),
    ("L=256", 256, False, False, False),
    ("L=256 pad", 256, True, False, False),
    ("L=256 causal", 256, False, True, False),
    ("L=256 weights", 256, False, False, True),
]


def _time_case(
    ours: nn.Module, theirs: nn.Module, case: dict, need_weights: bool, warmup: int, repeats: int
) -> tuple[float, float]:
    """Median forward+backward milliseconds of ours and torch's, interleaved (alternating which goes first),
    after checking that both give the same output."""
    with torch.no_grad():  # same numbers first, so the timing compares like with like
        a = ours(case["x"], case["x"], case["x"], need_weights=need_weights, **case["kwargs"])[0]
        b = theirs(case["x"], case["x"], case["x"], need_weights=need_weights, **case["kwargs"])[0]
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    times: dict[str, list[float]] = {"ours": [], "torch": []}
    for rep in range(warmup + repeats):
        order = [("ours", ours), ("torch", theirs)]
        if rep % 2:
            order.reverse()
        for label, module in order:
            elapsed = _step(module, case, need_weights)
            if rep >= warmup:
                times[label].append(elapsed)
    return 1e3 * statistics.median(times["ours"]), 1e3 * statistics.median(times["torch"])


def _report(rows: list[dict], batch: int, embed_dim: int, heads: int, repeats: int) -> None:
    """The table, then one JSON line."""
    print(
        f"N={batch} E={embed_dim} H={heads}, forward+backward, median of {repeats}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    print(f"{'case':<16}{'ours ms':>10}{'torch ms':>10}{'speedup':>9}")
    for row in rows:
        print(f"{row['case']:<16}{row['ours_ms']:>10.2f}{row['torch_ms']:>10.2f}{row['speedup']:>9.3f}")
    print(
        json.dumps(
            {
                "speedup_torch_over_ours": {r["case"]: round(r["speedup"], 3) for r in rows},
                "ours_ms": {r["case"]: round(r["ours_ms"], 2) for r in rows},
                "torch_ms": {r["case"]: round(r["torch_ms"], 2) for r in rows},
            }
        )
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="only the L=32 cases")
    parser.add_argument("--only", default="", help="only cases whose name contains this")
    parser.add_argument("--smoke", action="store_true", help="--quick at a tiny width, one round")
    args = parser.parse_args(argv)
    if args.smoke:
        args.quick, args.repeats, args.warmup = True, 1, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    batch, embed_dim, heads = (4, 32, 2) if args.smoke else (64, 512, 8)
    ours = MultiHeadAttention(embed_dim, heads, batch_first=True)
    theirs = nn.MultiheadAttention(embed_dim, heads, batch_first=True)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    ours.train()
    theirs.train()  # dropout 0: train mode only keeps torch's inference fast path out of the comparison

    cases = [c for c in CASES if c[1] == 32] if args.quick else CASES
    rows = []
    for name, length, padding, causal, need_weights in [c for c in cases if args.only in c[0]]:
        case = _make_case(batch, length, embed_dim, heads, padding, causal)
        ours_ms, torch_ms = _time_case(ours, theirs, case, need_weights, args.warmup, args.repeats)
        rows.append({"case": name, "ours_ms": ours_ms, "torch_ms": torch_ms, "speedup": torch_ms / ours_ms})
    _report(rows, batch, embed_dim, heads, args.repeats)


if __name__ == "__main__":
    main()
