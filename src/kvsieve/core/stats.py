"""Per-call statistics that every method returns beside its estimate.

Values may be device tensors: a method never turns them into numbers itself (that would make the
host wait for the device on every call). They become Python numbers when read — ``stats.density``,
``stats["density"]``, ``as_dict()`` — and :meth:`StepStats.raw` gives the tensor as stored, so that a
session can sum stats per layer on the device and read them once at the end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

FIELDS = ("n_keys", "k_rows_scored", "v_rows_read", "kv_rows_read", "density", "kv_density", "bytes_read",
          "backend", "exact_rows")
_INT_FIELDS = ("bytes_read", "exact_rows")


def to_number(value: Any) -> Any:
    """A 0-dim tensor as a Python number (int for integer dtypes, bool for bool); anything else as is."""
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return value.item()
    return value


class StepStats(Mapping):
    """What one decode step of one layer read and which code path ran.

    Row counts are means over the query rows (batch rows × rows of the call) and the heads named in
    each field, so that they read the same for any batch size. Readable as attributes
    (``stats.density``) or as a mapping (``stats["density"]``); method-specific values live in
    ``extra`` and are reachable the same way.

    - ``n_keys``: mean number of valid keys N per query row.
    - ``k_rows_scored``: mean number of K rows whose score q·k was computed, per query head.
    - ``v_rows_read``: mean number of distinct V rows read, per query head.
    - ``kv_rows_read``: mean number of distinct V rows read per KV head, i.e. the union over the
      query heads of a GQA group: this is what memory traffic is made of.
    - ``density``: ``v_rows_read / N`` averaged over rows (per query head).
    - ``kv_density``: ``kv_rows_read / N`` (per KV head, the union over the group).
    - ``bytes_read``: K and V bytes the method must touch for the whole call (scored K rows of each
      KV head once, plus the union of V rows), at the input dtype.
    - ``backend``: ``"reference"`` or the kernel that ran.
    - ``exact_rows``: query rows that ran exact attention because the method's budget covered their
      whole context (a documented fallback, never a silent one).
    """

    __slots__ = ("_values", "extra", "_pending")

    def __init__(self, n_keys, k_rows_scored, v_rows_read, kv_rows_read, density, kv_density, bytes_read,
                 backend: str = "reference", exact_rows: Any = 0, extra: dict[str, Any] | None = None) -> None:
        object.__setattr__(self, "_values", {
            "n_keys": n_keys, "k_rows_scored": k_rows_scored, "v_rows_read": v_rows_read,
            "kv_rows_read": kv_rows_read, "density": density, "kv_density": kv_density,
            "bytes_read": bytes_read, "backend": backend, "exact_rows": exact_rows})
        object.__setattr__(self, "extra", dict(extra or {}))
        object.__setattr__(self, "_pending", None)

    @classmethod
    def deferred(cls, compute: Callable[[], StepStats], backend: str, extra: dict[str, Any] | None = None
                 ) -> StepStats:
        """Stats whose values ``compute()`` builds on first read (it returns a StepStats; its fields and
        extra values join these). A kernel path returns this so that a call whose stats nobody reads
        launches nothing for them: the device ops of the stats run only when asked, after the call."""
        stats = cls(None, None, None, None, None, None, None, backend=backend, extra=extra)
        object.__setattr__(stats, "_pending", compute)
        return stats

    def _resolve(self) -> None:
        compute = self._pending
        if compute is not None:
            object.__setattr__(self, "_pending", None)
            done = compute()
            backend = self._values["backend"]
            self._values.update(done._values)
            self._values["backend"] = backend
            for key, value in done.extra.items():
                self.extra.setdefault(key, value)

    def raw(self, key: str) -> Any:
        """The value as stored (a device tensor where the method left one)."""
        if self._pending is not None and key not in self.extra and key != "backend":
            self._resolve()
        if key in self._values:
            return self._values[key]
        if key in self.extra:
            return self.extra[key]
        raise KeyError(key)

    def __getitem__(self, key: str) -> Any:
        value = to_number(self.raw(key))
        if key in _INT_FIELDS and isinstance(value, float):
            value = int(round(value))
        return value

    def __getattr__(self, key: str) -> Any:
        # Only reached for names that are not slots or methods.
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None

    def __setattr__(self, key: str, value: Any) -> None:
        if key in FIELDS:
            self._resolve()
            self._values[key] = value
        else:
            raise AttributeError(f"StepStats has no field {key!r}; method-specific values go in extra")

    def __iter__(self) -> Iterator[str]:
        self._resolve()
        yield from FIELDS
        yield from self.extra

    def __len__(self) -> int:
        self._resolve()
        return len(FIELDS) + len(self.extra)

    def __repr__(self) -> str:
        return "StepStats(" + ", ".join(f"{k}={self[k]!r}" for k in self) + ")"

    @classmethod
    def _field_names(cls) -> tuple[str, ...]:
        return (*FIELDS, "extra")

    def as_dict(self) -> dict[str, Any]:
        """A flat dict, method-specific values included (tensors become numbers or lists)."""
        out: dict[str, Any] = {}
        for key in self:
            value = self[key]
            out[key] = value.tolist() if hasattr(value, "tolist") else value
        return out
