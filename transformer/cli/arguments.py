"""Check the values a config gives a class or function against the types its signature declares.

A mistyped value (`data.num_workers=1.5`, `trainer.log_every_n_steps=oops`) then stops the run before
anything is built, naming its key, instead of failing deep inside a library minutes later. Ranges and
relations between values stay with their owners (`TransformerConfig.__post_init__`, the datamodules,
the tasks): this module only knows types. Types it cannot judge (classes, callables) pass.
"""

from __future__ import annotations

import collections.abc
import inspect
import math
import os
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, Union

__all__ = ["ArgumentError", "check_arguments"]


class ArgumentError(ValueError):
    """A value of the wrong type for the argument it is given to."""


def check_arguments(target: Callable[..., Any], arguments: Mapping[str, Any], key: str) -> None:
    """Raise ArgumentError naming `key.<argument>` for the first value in `arguments` that does not
    match `target`'s annotation (a class: its `__init__`). Nested configs with a `_target_` are the
    business of their own check; names the signature does not have are left to the call to refuse."""
    hints = _hints(target)
    for name, value in arguments.items():
        hint = hints.get(name)
        if name.startswith("_") or hint is None or _is_config_of_object(value):
            continue
        if not _matches(value, hint):
            raise ArgumentError(f"`{key}.{name}` must be {_describe(hint)}, got {value!r}")


def _hints(target: Callable[..., Any]) -> dict[str, Any]:
    function = target.__init__ if inspect.isclass(target) else target
    try:
        hints = typing.get_type_hints(function)
    except Exception:  # annotations that do not resolve here (optional imports): nothing to check
        return {}
    # a class that shows more keywords than its __init__ names (the datamodules' shared settings, taken
    # as **settings): the types its signature declares
    signature = getattr(target, "__signature__", None) if inspect.isclass(target) else None
    shown = signature.parameters.values() if isinstance(signature, inspect.Signature) else ()
    hints.update(
        (p.name, p.annotation) for p in shown if p.name not in hints and not isinstance(p.annotation, str)
    )
    hints.pop("settings", None)  # the **settings catch-all itself
    return {name: hint for name, hint in hints.items() if hint is not inspect.Parameter.empty}


def _is_config_of_object(value: Any) -> bool:
    return isinstance(value, Mapping) and "_target_" in value


def _matches(value: Any, hint: Any) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any or isinstance(hint, typing.TypeVar):
        return True
    if hint is None or hint is type(None):
        return value is None
    if origin in (Union, types.UnionType):
        return any(_matches(value, arg) for arg in args)
    if origin is Literal:
        return any(value == arg and type(value) is type(arg) for arg in args)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if hint is str:
        return isinstance(value, str)
    if hint in (Path, os.PathLike):
        return isinstance(value, (str, os.PathLike))
    if origin in (list, tuple, collections.abc.Sequence):
        if not isinstance(value, (list, tuple)):
            return False
        if origin is tuple and args and args[-1] is not Ellipsis:
            return len(value) == len(args) and all(_matches(v, a) for v, a in zip(value, args))
        return not args or all(_matches(v, args[0]) for v in value)
    if origin in (dict, collections.abc.Mapping):
        if not isinstance(value, Mapping):
            return False
        key_hint, value_hint = args or (Any, Any)
        return all(_matches(k, key_hint) and _matches(v, value_hint) for k, v in value.items())
    return True  # a class, a callable, a protocol: judged by the call itself


def _describe(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is None or hint is type(None):
        return "null"
    if origin in (Union, types.UnionType):
        kinds = [_describe(arg) for arg in args if arg is not type(None)]
        described = " or ".join(dict.fromkeys(kinds))
        return f"{described} or null" if type(None) in args else described
    if origin is Literal:
        return "one of " + ", ".join(repr(arg) for arg in args)
    names = {
        bool: "true or false",
        int: "an integer",
        float: "a finite number",
        str: "a string",
        Path: "a path",
    }
    if hint in names:
        return names[hint]
    if origin in (list, tuple, collections.abc.Sequence):
        return f"a list of {_describe(args[0])} values" if args else "a list"
    if origin in (dict, collections.abc.Mapping):
        return "a mapping"
    return getattr(hint, "__name__", str(hint))
