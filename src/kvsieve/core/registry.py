"""The method registry: names, spec strings and construction."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from .config import check_config_kwargs, check_field_types

if TYPE_CHECKING:
    from .method import Method

_REGISTRY: dict[str, type[Method]] = {}
# Declared names -> the loader whose call registers them (the built-in methods, declared by the methods
# package): a name can be checked, and one method built, without importing every method and torch.
_DECLARED: dict[str, Callable[[], Any]] = {}


def declare_methods(names: Iterable[str], loader: Callable[[], Any]) -> None:
    """Make ``names`` known before their classes are registered: ``loader()`` registers them."""
    for name in names:
        if not name or name in _DECLARED:
            raise ValueError(f"method name {name!r} is empty or declared twice")
        _DECLARED[name] = loader


def register_method(cls: type[Method]) -> type[Method]:
    """Class decorator: makes ``cls`` available as ``kvsieve.method(cls.name)``."""
    name = cls.name
    if not name or name in _REGISTRY:
        raise ValueError(f"method name {name!r} is empty or registered twice")
    _REGISTRY[name] = cls
    return cls


def methods() -> list[str]:
    """Names of all registered methods, sorted.

    The built-in methods are declared when ``kvsieve`` is imported (its ``__init__`` imports
    ``kvsieve.methods``, which declares each name with the loader of its module, so core never imports the
    layer above it) and registered when first asked for by name.
    """
    return sorted(set(_REGISTRY) | set(_DECLARED))


def method_class(name: str) -> type[Method]:
    if name not in _REGISTRY and name in _DECLARED:
        _DECLARED[name]()
        if name not in _REGISTRY:
            raise RuntimeError(f"method {name!r} is declared but its loader did not register it")
    check_method_name(name)
    return _REGISTRY[name]


def check_method_name(name: str) -> None:
    """A registered or declared method name, else a ValueError that suggests the near misses (imports nothing)."""
    if name not in _REGISTRY and name not in _DECLARED:
        known = methods()
        # Case-insensitive, so that "SANTA-SYS" still points at santa-sys.
        by_lower = {n.lower(): n for n in known}
        matches = difflib.get_close_matches(name.lower(), list(by_lower), n=3, cutoff=0.5)
        close = [by_lower[c] for c in matches]
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise ValueError(
            f"method: unknown method {name!r}.{hint} Registered methods: {', '.join(known)}"
        )


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """``"santa-sys:budget=128,rounding=largest"`` -> ``("santa-sys", {"budget": "128", ...})``."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"method: expected a method name or spec string, got {spec!r}")
    name, sep, rest = spec.strip().partition(":")
    name = name.strip()
    values: dict[str, str] = {}
    if sep and not rest.strip():
        raise ValueError(f"method spec {spec!r}: nothing after ':'; expected key=value pairs like budget=64")
    if rest.strip():
        for item in rest.split(","):
            key, eq, value = item.partition("=")
            key, value = key.strip(), value.strip()
            if not eq or not key or not value:
                raise ValueError(
                    f"method spec {spec!r}: malformed item {item.strip()!r}; "
                    "expected 'name:key=value,key=value'"
                )
            if key in values:
                raise ValueError(f"method spec {spec!r}: parameter {key!r} given twice")
            values[key] = value
    return name, values


def method(spec: str | Method, **kwargs: Any) -> Method:
    """Build a method from its name (or a spec string) and config keyword arguments."""
    if not isinstance(spec, str):
        from .method import Method

        if isinstance(spec, Method):
            if kwargs:
                raise ValueError("method: keyword arguments cannot be combined with a method instance")
            return spec
    name, values = parse_spec(spec)
    cls = method_class(name)
    check_config_kwargs(name, cls.config_class, kwargs)
    overlap = set(values) & set(kwargs)
    if overlap:
        raise ValueError(f"method {name!r}: {sorted(overlap)} given both in the spec string and as keywords")
    import dataclasses

    try:
        base = cls.config_class.from_strings(name, values)
        config = dataclasses.replace(base, **kwargs) if kwargs else base
        check_field_types(config)
    except ValueError as e:
        # A config validates its fields without knowing the method's name ("budget: expected ...");
        # say which method, unless the message already does.
        message = str(e)
        if not message.startswith(f"{name}:"):
            message = f"{name}: {message}"
        raise ValueError(message) from None
    return cls(config)
