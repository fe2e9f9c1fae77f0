"""Running the filters over a stream of pairs, and what they did: the report.

`judge` streams: a pair in, its verdict out, nothing kept but the report's counts and a few examples
(and the duplicates filter's digests). A pair counts against the first filter that rejects it
(`removed`) and against every filter that would (`would_remove`): every filter sees every pair.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from data.clean.filters import PairFilter
from data.sources import DataError

REPORT_FILE = "clean_report.json"
EXAMPLES = 5  # rejected pairs kept per filter as examples in the report


@dataclass
class FilterCount:
    name: str
    settings: dict[str, Any]
    removed: int = 0  # pairs this filter was the first to reject
    would_remove: int = 0  # pairs this filter rejects, whichever came first
    examples: list[dict[str, Any]] = field(default_factory=list)  # of `removed`


@dataclass
class Report:
    """What cleaning did to one corpus: pairs read, kept, and per filter its counts and examples."""

    origin: str
    languages: tuple[str, str]
    counts: list[FilterCount]
    pairs: int = 0
    kept: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "origin": self.origin,
            "languages": list(self.languages),
            "pairs": self.pairs,
            "kept": self.kept,
            "removed": self.pairs - self.kept,
            "filters": [vars(count) for count in self.counts],
        }

    def summary(self) -> str:
        """One line for the training log."""
        return summary_line(self.as_dict())

    def write(self, path: Path) -> None:
        """The report as JSON at `path` (whole or absent: written beside, then renamed)."""
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.as_dict(), indent=1, ensure_ascii=False) + "\n")
        os.replace(tmp, path)

    def check_kept(self) -> None:
        """DataError when the filters removed every pair, naming the filter that removed the most."""
        if self.kept or not self.pairs:
            return
        worst = max(self.counts, key=lambda c: c.removed)
        raise DataError(
            f"{self.origin}: the cleaning filters removed all {self.pairs} pairs; {worst.name} removed "
            f"the most ({worst.removed}): loosen or drop data.clean.{worst.name}"
        )


def summary_line(report: Mapping[str, Any]) -> str:
    """A report (`Report.as_dict()`, or its JSON read back) in one line: kept, and removed per filter."""
    pairs, kept = report["pairs"], report["kept"]
    share = 100 * kept / pairs if pairs else 0.0
    removed = ", ".join(f"{f['name']} {f['removed']}" for f in report["filters"])
    return f"kept {kept} of {pairs} pairs ({share:.1f}%); removed first by {removed}"


def fit(filters: list[PairFilter], pairs: Callable[[], Iterable[tuple[str, str]]]) -> None:
    """The first pass of the filters that learn from the corpus (`alignment`), if any: `pairs()` is
    called once more for it (a second read of the files or the split, never a list of the corpus)."""
    learning = [f for f in filters if type(f).fit is not PairFilter.fit]
    if learning:
        for f in learning:  # one pass each: few filters learn, and each keeps its own tables
            f.fit(pairs())


def judge(
    pairs: Iterable[tuple[str, str]], filters: list[PairFilter], report: Report
) -> Iterator[tuple[str, str, list[str]]]:
    """(src, tgt, names of the filters that reject it) for each pair, in order; `report` counts them."""
    by_name = {count.name: count for count in report.counts}
    for line, (src, tgt) in enumerate(pairs, start=1):
        rejected = [f.name for f in filters if not f.keep(src, tgt)]
        report.pairs += 1
        if rejected:
            first = by_name[rejected[0]]
            first.removed += 1
            if len(first.examples) < EXAMPLES:
                first.examples.append({"line": line, "src": src, "tgt": tgt, "rejected_by": rejected})
            for name in rejected:
                by_name[name].would_remove += 1
        else:
            report.kept += 1
        yield src, tgt, rejected


def new_report(origin: str, filters: list[PairFilter], languages: tuple[str, str]) -> Report:
    return Report(origin, languages, [FilterCount(f.name, f.settings()) for f in filters])
