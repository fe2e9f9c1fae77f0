"""The tables of bench_train.py: padded batches, the profile split, the end-to-end epoch and the summary."""

from __future__ import annotations


def print_padded(
    case: str, rows: dict[str, dict[str, float]], ratios: dict[str, float], steps: int, batch_size: int
) -> None:
    print(f"\n[{case}] padded batches of {batch_size} pairs, median of {steps} interleaved steps")
    print(f"{'model':18} {'tok/s':>8} {'step s':>7} {'MFU %':>6} {'HFU %':>6} {'pad %':>6} {'ours/it':>8}")
    print("  (ours/it: median over steps of its step time / ours, on the same batch)")
    for name, row in rows.items():
        rel = ratios.get(f"{case}_padded_ours_vs_{name}", 1.0 if name == "ours" else float("nan"))
        print(
            f"{name:18} {row['tok_s']:8.0f} {row['step_s']:7.2f} {row['mfu_pct']:6.1f} "
            f"{row['hfu_pct']:6.1f} {row['pad_pct']:6.1f} {rel:8.2f}"
        )


def print_profile(case: str, splits: dict[str, dict[str, float]], steps: int) -> None:
    print(f"[{case}] where the time goes: % of self CPU time by op category ({steps} step(s) each)")
    categories = list(next(iter(splits.values())))
    print(f"{'model':18} " + " ".join(f"{c:>12}" for c in categories))
    for name, split in splits.items():
        print(f"{name:18} " + " ".join(f"{split[c]:12.1f}" for c in categories))


def print_e2e(case: str, rows: dict[str, dict[str, float]], source: str, max_tokens: int, size: int) -> None:
    print(f"\n[{case}] end to end, one epoch over the same sentences ({source})")
    print(f"  bucketed: TokenBudgetBatchSampler(max_tokens={max_tokens}); random: {size} sentences per batch")
    print(f"{'model, batches':24} {'tok/s':>8} {'epoch s':>8} {'batches':>8} {'pad %':>6} {'ours/it':>8}")
    best = rows.get("ours bucketed", {}).get("tok_s", float("nan"))
    for name, row in rows.items():
        print(
            f"{name:24} {row['tok_s']:8.0f} {row['seconds']:8.1f} {row['batches']:8d} "
            f"{row['pad_pct']:6.1f} {best / row['tok_s']:8.2f}"
        )


def print_summary(result: dict[str, object], ratios: dict[str, float], rescale: float) -> None:
    """One table of the padded-batch results with MFU/HFU against the best measured peak (updated in
    `result` too), and the end-to-end ratios."""
    print(f"\n{'case':5} {'model':18} {'tok/s':>8} {'MFU %':>6} {'HFU %':>6} {'ours/it':>8}")
    for key, rows in result.items():
        if not key.endswith("_padded") or not isinstance(rows, dict):
            continue
        case = key.removesuffix("_padded")
        for name, row in rows.items():
            row["mfu_pct"], row["hfu_pct"] = (
                round(row["mfu_pct"] * rescale, 1),
                round(row["hfu_pct"] * rescale, 1),
            )
            rel = ratios.get(f"{case}_padded_ours_vs_{name}", 1.0 if name == "ours" else float("nan"))
            mfu, hfu = row["mfu_pct"], row["hfu_pct"]
            print(f"{case:5} {name:18} {row['tok_s']:8.0f} {mfu:6.1f} {hfu:6.1f} {rel:8.2f}")
    for key, value in ratios.items():
        if "_e2e_" in key or key.startswith("rss_"):
            print(f"{key:60} {value:6.2f}")


def rounded(table: dict[str, dict[str, float]], digits: int = 2) -> dict[str, dict[str, float]]:
    return {name: {k: round(v, digits) for k, v in row.items()} for name, row in table.items()}
