"""Language identification for the `langid` filter: py3langid, whose model ships inside the package (no
download at run time), chosen by `benchmarks/data/langid_choice.py` (docs/data.md#language-identification).

The identifier is loaded once per process, on first use; py3langid is an optional dependency (the
`clean` extra), so its absence is one `DataError` naming the install command.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from data.sources import DataError

INSTALL = "pip install 'aiayn[clean]' (py3langid)"


@cache
def identifier() -> Any:
    """py3langid's identifier over its whole model (every language it knows)."""
    try:
        from py3langid.langid import MODEL_FILE, LanguageIdentifier
    except ImportError as err:
        raise DataError(f"the langid filter needs py3langid: {INSTALL}") from err
    return LanguageIdentifier.from_model_file(MODEL_FILE)


def languages() -> list[str]:
    """The ISO 639-1 codes the identifier knows."""
    return sorted(set(identifier().nb_classes))


def check_language(lang: str) -> str:
    """`lang` as the identifier names it (e.g. "de" for "de" or "de_DE"); ValueError when it is unknown."""
    code = lang.split("_")[0].split("-")[0].lower()
    known = languages()
    if code not in known:
        raise ValueError(
            f"clean.langid cannot check {lang!r}: the language identifier does not know it; "
            f"it knows {' '.join(known)}"
        )
    return code


def classify(text: str) -> str:
    """The most likely language of `text` (an ISO 639-1 code)."""
    return identifier().classify(text)[0]
