"""`data.clean` as filters: a mapping of filter name -> its settings (null or {} for the defaults, false
for off), applied in the mapping's order; every bad name, key or value is one ValueError naming it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from data.clean.alignment import AlignmentFilter
from data.clean.filters import (
    DuplicatesFilter,
    IdenticalFilter,
    LangidFilter,
    LengthFilter,
    MarkupFilter,
    NumbersFilter,
    PairFilter,
    RatioFilter,
    RepetitionFilter,
    ScriptFilter,
)

# every filter by its name under data.clean, in the order of configs/data/clean/default.yaml
FILTERS: dict[str, type[PairFilter]] = {
    f.name: f
    for f in (
        LengthFilter,
        RatioFilter,
        IdenticalFilter,
        DuplicatesFilter,
        ScriptFilter,
        NumbersFilter,
        MarkupFilter,
        RepetitionFilter,
        LangidFilter,
        AlignmentFilter,
    )
}


class CleanSettings:
    """The checked filter settings of `data.clean`; `filters()` builds a fresh set (duplicates keep state)."""

    def __init__(self, config: Mapping[str, Any], src_lang: str, tgt_lang: str) -> None:
        if not isinstance(config, Mapping):
            raise ValueError(
                f"clean must be null or a mapping of filter name -> settings "
                f"(filters: {', '.join(FILTERS)}), got {config!r}"
            )
        self.src_lang, self.tgt_lang = src_lang, tgt_lang
        self._config: dict[str, dict[str, Any]] = {}
        for name, settings in config.items():
            if settings is False:
                continue
            if name not in FILTERS:
                raise ValueError(f"clean.{name} is not a filter; the filters are {', '.join(FILTERS)}")
            if settings is None or settings is True:
                settings = {}
            if not isinstance(settings, Mapping):
                raise ValueError(
                    f"clean.{name} must be a mapping of settings, {{}} / null for the defaults or false "
                    f"for off, got {settings!r}"
                )
            known = [f.name for f in fields(FILTERS[name]) if not f.name.startswith("_")]
            unknown = sorted(set(settings) - set(known))
            if unknown:
                raise ValueError(
                    f"clean.{name}.{unknown[0]} is not a setting of the {name} filter; "
                    f"its settings are {', '.join(known) or 'none'}"
                )
            self._config[name] = dict(settings)
        if not self._config:
            raise ValueError(
                "clean names no filter (all are false): set clean to null to switch cleaning off"
            )
        self.filters()  # every value checked now, at construction

    def filters(self) -> list[PairFilter]:
        """The filters, in order, new (the duplicates filter starts with nothing seen)."""
        built = []
        for name, settings in self._config.items():
            made = FILTERS[name](**settings)
            if isinstance(made, (LangidFilter, ScriptFilter)):
                made = made.for_languages(self.src_lang, self.tgt_lang)
            built.append(made)
        return built

    def key(self) -> dict[str, Any]:
        """Everything that changes which pairs are kept: part of the prepared-data cache keys."""
        return {
            "filters": [[f.name, f.settings()] for f in self.filters()],
            "languages": [self.src_lang, self.tgt_lang],
            "version": VERSION,
        }


VERSION = 1  # bump when a filter's behaviour changes: cleaned data prepared before then is not reused
