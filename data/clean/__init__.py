"""Parallel-data cleaning (docs/data.md#cleaning): filters configured under `data.clean`, applied once to
the training split when it is prepared, a report of what each removed; `python -m data.clean` (or
`aiayn-clean`) runs the same filters on plain parallel files."""

from data.clean.filters import PairFilter
from data.clean.run import REPORT_FILE, Report, fit, judge, new_report, summary_line
from data.clean.settings import FILTERS, CleanSettings
from data.clean.split import clean_split

__all__ = [
    "FILTERS",
    "REPORT_FILE",
    "CleanSettings",
    "PairFilter",
    "Report",
    "clean_split",
    "fit",
    "judge",
    "new_report",
    "summary_line",
]
