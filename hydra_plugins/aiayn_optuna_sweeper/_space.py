"""The search space: `key=value` overrides in hydra-optuna-sweeper's grammar -> Optuna distributions.

    choice(a, b, ...), a,b,...          CategoricalDistribution([a, b, ...])
    range(start, stop[, step])          IntDistribution(start, stop, step) for integers (stop included,
                                        as in hydra-optuna-sweeper), FloatDistribution with step for floats;
                                        shuffle(range(...)) a CategoricalDistribution of its values (sorted)
    interval(low, high)                 FloatDistribution(low, high)
    int(interval(low, high))            IntDistribution(low, high)
    tag(log, interval(...))             the same with log=True (also around int(interval(...)))

Any other value is fixed: given to every trial as it is written.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, Override, RangeSweep, Transformer
from hydra.errors import HydraException
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)

__all__ = ["SearchSpace", "SweepConfigError", "distribution_of", "parse_space"]


class SweepConfigError(ValueError):
    """A `hydra.sweeper` value that cannot work; its message names the key (one line for the user)."""


@dataclass
class SearchSpace:
    """What the trials sample (`distributions`, by parameter name) and the overrides every trial gets as
    they are (`fixed`, as written); `override_keys` spells each parameter as its override does (`+key`)."""

    distributions: dict[str, BaseDistribution] = field(default_factory=dict)
    fixed: dict[str, str] = field(default_factory=dict)
    override_keys: dict[str, str] = field(default_factory=dict)

    def overrides(self, params: dict[str, Any]) -> list[str]:
        """The command-line overrides of one trial: the fixed ones, then its sampled values."""
        sampled = [f"{self.override_keys[name]}={_as_override_value(v)}" for name, v in params.items()]
        return [*self.fixed.values(), *sampled]


def parse_space(params: dict[str, Any] | None, arguments: list[str]) -> SearchSpace:
    """`hydra.sweeper.params` then the command line's overrides; a key given again (the command line
    after the config) replaces the earlier value, so `model.config.d_model=256` takes it out of the search."""
    lines = [f"{key}={value}" for key, value in (params or {}).items()]  # the grammar, as written
    space = SearchSpace()
    parser = OverridesParser.create()
    for line, origin in [*((ln, "hydra.sweeper.params") for ln in lines), *((a, None) for a in arguments)]:
        try:
            (override,) = parser.parse_overrides([line])
        except HydraException as err:
            key = line.split("=", 1)[0]
            where = f"{origin}.{key}" if origin else key
            message = " ".join(str(err).split()).split(" See https://hydra.cc")[0]
            raise SweepConfigError(f"{where}: {message}") from None
        name = override.key_or_group
        where = f"{origin}.{name}" if origin else name
        space.distributions.pop(name, None)
        space.fixed.pop(name, None)
        if override.is_sweep_override():
            space.distributions[name] = distribution_of(override, where)
            space.override_keys[name] = override.get_key_element()
        else:
            space.fixed[name] = override.input_line
    return space


def distribution_of(override: Override, where: str) -> BaseDistribution:
    """The Optuna distribution of one sweep override; `where` names it in errors."""
    value = override.value()
    if isinstance(value, ChoiceSweep):
        choices = list(override.sweep_iterator(transformer=Transformer.encode))
        if not choices:
            raise SweepConfigError(f"{where}: choice() needs at least one value")
        _no_log(value, where, "choice")
        for choice in choices:
            if not isinstance(choice, (str, int, float, bool, type(None))):
                raise SweepConfigError(
                    f"{where}: a choice must be a number, string, bool or null, not {choice!r}"
                )
        return CategoricalDistribution(choices)
    if isinstance(value, RangeSweep):
        return _range(override, value, where)
    if isinstance(value, IntervalSweep):
        return _interval(value, where)
    raise SweepConfigError(f"{where}: {override.input_line!r} is no choice(), range() or interval()")


def _range(override: Override, value: RangeSweep, where: str) -> BaseDistribution:
    start, stop, step = value.start, value.stop, value.step
    _no_log(value, where, "range")
    if step is None or step <= 0:
        raise SweepConfigError(f"{where}: range() needs a positive step, got {step}")
    if start is None or stop is None or stop <= start:
        raise SweepConfigError(f"{where}: range({start}, {stop}) is empty or inverted; it needs start < stop")
    if value.shuffle:  # the order is Optuna's concern: sorted, so that a resumed study compares equal
        return CategoricalDistribution(sorted(override.sweep_iterator(transformer=Transformer.encode)))
    if all(isinstance(x, int) for x in (start, stop, step)):
        return IntDistribution(int(start), int(stop), step=int(step))
    return FloatDistribution(float(start), float(stop), step=float(step))


def _interval(value: IntervalSweep, where: str) -> BaseDistribution:
    low, high = value.start, value.end
    log = "log" in value.tags
    if low is None or high is None or not low < high:
        raise SweepConfigError(f"{where}: interval({low}, {high}) is empty or inverted; it needs low < high")
    if log and low <= 0:
        raise SweepConfigError(f"{where}: tag(log, interval({low}, {high})) needs low > 0")
    if isinstance(low, int) and isinstance(high, int):
        return IntDistribution(low, high, log=log)
    return FloatDistribution(float(low), float(high), log=log)


def _no_log(value: Any, where: str, kind: str) -> None:
    if "log" in getattr(value, "tags", set()):
        raise SweepConfigError(f"{where}: tag(log, ...) applies to interval(...) only, not to {kind}(...)")


def _as_override_value(value: Any) -> str:
    """A sampled value as Hydra's override grammar reads it back: strings quoted unless plain words."""
    if isinstance(value, str):
        plain = value[:1].isalpha() and all(c.isalnum() or c in "._-/" for c in value)
        if plain and value.lower() not in ("true", "false", "null", "nan", "inf"):
            return value
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)
