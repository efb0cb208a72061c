"""Method configs: frozen dataclasses with validated fields, buildable from spec strings."""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from typing import Any, Literal, get_args, get_origin


def param(default: Any, help: str, **kwargs: Any) -> Any:
    """A config field with a one-line description, shown by ``kvsieve methods``."""
    return dataclasses.field(default=default, metadata={"help": help}, **kwargs)


@dataclass(frozen=True)
class MethodConfig:
    """Base of every method's config. Subclasses validate their fields in ``__post_init__``."""

    @classmethod
    def parameters(cls) -> list[tuple[str, str, Any, str]]:
        """(name, type as text, default, help) of each field."""
        hints = typing.get_type_hints(cls)
        rows = []
        for f in dataclasses.fields(cls):
            rows.append((f.name, _type_text(hints[f.name]), f.default, f.metadata.get("help", "")))
        return rows

    @classmethod
    def from_strings(cls, method_name: str, values: dict[str, str]) -> MethodConfig:
        """Build from ``key=value`` text, converting each value to its field's type."""
        hints = typing.get_type_hints(cls)
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {}
        for key, text in values.items():
            if key not in known:
                raise ValueError(_unknown_param_message(method_name, key, sorted(known)))
            kwargs[key] = _convert(method_name, key, text, hints[key])
        return cls(**kwargs)

    def describe(self) -> str:
        """The spec-string form of this config's non-default fields."""
        parts = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value != f.default:
                parts.append(f"{f.name}={_value_text(value)}")
        return ",".join(parts)


def check_config_kwargs(method_name: str, config_cls: type[MethodConfig], kwargs: dict[str, Any]) -> None:
    known = {f.name for f in dataclasses.fields(config_cls)}
    for key in kwargs:
        if key not in known:
            raise ValueError(_unknown_param_message(method_name, key, sorted(known)))


def check_field_types(config: MethodConfig) -> None:
    """Reject a keyword value of the wrong type for a bool, int, float or str field.

    Spec strings are converted by type already; keywords are not, and a truthy string such as
    ``exact_when_covered="no"`` would otherwise be read silently as True.
    """
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        tp, value = hints[f.name], getattr(config, f.name)
        if tp is bool and not isinstance(value, bool):
            raise ValueError(f"{f.name}: expected true or false, got {value!r}")
        if tp is int:
            require_int(f.name, value)
        if tp is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError(f"{f.name}: expected a number, got {value!r}")
        if tp is str and not isinstance(value, str):
            raise ValueError(f"{f.name}: expected a string, got {value!r}")


def _unknown_param_message(method_name: str, key: str, known: list[str]) -> str:
    import difflib

    close = difflib.get_close_matches(key, known, n=3)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    listed = ", ".join(known) if known else "(none)"
    return f"method {method_name!r} has no parameter {key!r}; its parameters are: {listed}.{hint}"


def _type_text(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return "|".join(str(a) for a in get_args(tp))
    if get_origin(tp) is typing.Union or type(tp).__name__ == "UnionType":
        return " or ".join(_type_text(a) for a in get_args(tp))
    if get_origin(tp) is tuple:
        return "tuple"
    return getattr(tp, "__name__", str(tp))


def _value_text(value: Any) -> str:
    if isinstance(value, tuple):
        return "/".join(str(v) for v in value)
    return str(value)


def _convert(method_name: str, key: str, text: str, tp: Any) -> Any:
    where = f"{method_name}: parameter {key!r}"
    origin = get_origin(tp)
    if origin is typing.Union or type(tp).__name__ == "UnionType":
        args = [a for a in get_args(tp) if a is not type(None)]
        if text.lower() == "none" and type(None) in get_args(tp):
            return None
        errors = []
        for a in args:
            try:
                return _convert(method_name, key, text, a)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(f"{where}: cannot read {text!r} as {_type_text(tp)}")
    if origin is Literal:
        choices = get_args(tp)
        for c in choices:
            if str(c) == text:
                return c
        raise ValueError(f"{where}: expected one of {', '.join(map(str, choices))}, got {text!r}")
    if origin is tuple:
        (item,) = get_args(tp)[:1]
        if text.strip() == "":
            return ()
        return tuple(_convert(method_name, key, t, item) for t in text.split("/"))
    if tp is bool:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{where}: expected true or false, got {text!r}")
    if tp is int:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{where}: expected an integer, got {text!r}") from None
    if tp is float:
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"{where}: expected a number, got {text!r}") from None
    if tp is str:
        return text
    raise ValueError(f"{where}: unsupported field type {tp!r}")


# Validation helpers for __post_init__ methods.


def require_int(name: str, value: Any, *, minimum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: expected an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {value}")


def require_fraction(name: str, value: Any, *, low_open: bool = True, high_open: bool = True) -> None:
    """``value`` in (0, 1), with either end made closed on request."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name}: expected a number, got {value!r}")
    lo_ok = value > 0 if low_open else value >= 0
    hi_ok = value < 1 if high_open else value <= 1
    if not (lo_ok and hi_ok):
        interval = ("(" if low_open else "[") + "0, 1" + (")" if high_open else "]")
        raise ValueError(f"{name}: expected a value in {interval}, got {value}")


def require_choice(name: str, value: Any, choices: tuple[Any, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}: expected one of {', '.join(map(str, choices))}, got {value!r}")
