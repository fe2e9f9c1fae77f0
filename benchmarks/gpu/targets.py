"""bench_gpu.py's targets (issue 29's, on one H100) and the figures checked against them: the ratios of
ours to the references, each target met or not by the best measured for it, and their table."""

from __future__ import annotations

from typing import Any

# issue 29's targets on one H100
TARGETS = {"mfu_pct": 25.0, "train_vs_torch_eager": 1.5, "compile_s": 90.0, "beam4": 1.5, "greedy": 2.0}


def ratios(result: dict[str, Any]) -> dict[str, float]:
    """The figures issue 29 sets targets for, where measured."""
    train, out = result.get("train", {}), {}
    for reference, label in (("torch", "torch_eager"), ("torch:no-cudnn", "torch_eager_no_cudnn")):
        reference_tok_s = train.get(reference, {}).get("tok_s")
        for name in ("ours", "ours:compiled", "ours:compiled-layers"):
            row = train.get(name, {})
            if "tok_s" in row and reference_tok_s:
                out[f"train_{name.replace(':', '_').replace('-', '_')}_vs_{label}"] = (
                    row["tok_s"] / reference_tok_s
                )
    for case, methods in result.get("decode", {}).items():
        if isinstance(methods, dict):
            for name, row in methods.items():
                if "ours_speedup" in row:
                    out[f"decode_{case}_ours_vs_{name.replace(' ', '_')}"] = row["ours_speedup"]
    return out


def target_checks(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target of TARGETS against the best figure measured for it: MFU and training speed by the
    fastest of ours (against torch as shipped and without cuDNN's attention), compile seconds by each
    compiled variant, decoding by each of ours' methods at its worst batch size (eager: the paired ratio
    of the table; compiled steps: the ratio of medians)."""
    train, decode = result.get("train", {}), result.get("decode", {})
    ours = {name: row for name, row in train.items() if name.startswith("ours") and "tok_s" in row}
    checks: list[dict[str, Any]] = []

    def check(what: str, value: float, target: float, by: str, at_most: bool = False) -> None:
        met = value <= target if at_most else value >= target
        checks.append(
            {"target": what, "value": value, "goal": target, "at_most": at_most, "by": by, "met": met}
        )

    if ours:
        fastest, row = max(ours.items(), key=lambda item: item[1]["tok_s"])
        if row.get("mfu_pct") is not None:
            check("MFU %", row["mfu_pct"], TARGETS["mfu_pct"], fastest)
        for reference in ("torch", "torch:no-cudnn"):
            if "tok_s" in train.get(reference, {}):
                ratio = row["tok_s"] / train[reference]["tok_s"]
                check(f"training x {reference}", ratio, TARGETS["train_vs_torch_eager"], fastest)
    for name, row in ours.items():
        if "compile_s" in row:
            check("compile s", row["compile_s"], TARGETS["compile_s"], name, at_most=True)
    for mode in ("beam4", "greedy"):
        cases = [  # this search's batch sizes where generate ran
            rows
            for case, rows in decode.items()
            if case.endswith(mode)
            and isinstance(rows, dict)
            and "sent_s" in rows.get("transformers generate", {})
        ]
        for method in ("ours", "ours compiled step", "ours cudagraphs step", "ours graphed step"):
            speedups = [_speedup(rows, method) for rows in cases if "sent_s" in rows.get(method, {})]
            if speedups:
                check(f"{mode} x generate", min(speedups), TARGETS[mode], method)
    return checks


def _speedup(rows: dict[str, Any], method: str) -> float:
    """`method` against generate in one decoding case: the table's paired ratio for eager ours, else the
    ratio of medians."""
    generate = rows["transformers generate"]
    if method == "ours" and "ours_speedup" in generate:
        return generate["ours_speedup"]
    return rows[method]["sent_s"] / generate["sent_s"]


def print_targets(checks: list[dict[str, Any]]) -> None:
    print("\nTargets (the best measured for each; decoding at its worst batch size)")
    for c in checks:
        goal = f"{'<=' if c['at_most'] else '>='} {c['goal']:g}"
        print(f"{c['target']:26} {c['value']:9.2f} {goal:>8}  {'met' if c['met'] else 'not met':8} {c['by']}")
