"""Per-call statistics that every method returns beside its estimate."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any


@dataclass
class StepStats(Mapping):
    """What one decode step of one layer read and which code path ran.

    Row counts are means over the batch rows and the heads named in each field, so that they read
    the same for any batch size. Readable as attributes (``stats.density``) or as a mapping
    (``stats["density"]``); method-specific values live in ``extra`` and are reachable the same way.

    - ``n_keys``: mean number of valid keys N per batch row.
    - ``k_rows_scored``: mean number of K rows whose score q·k was computed, per query head.
    - ``v_rows_read``: mean number of distinct V rows read, per query head.
    - ``kv_rows_read``: mean number of distinct V rows read per KV head, i.e. the union over the
      query heads of a GQA group: this is what memory traffic is made of.
    - ``density``: ``v_rows_read / N`` averaged over rows (per query head).
    - ``kv_density``: ``kv_rows_read / N`` (per KV head, the union over the group).
    - ``bytes_read``: K and V bytes the method must touch for the whole batch (scored K rows of each
      KV head once, plus the union of V rows), at the input dtype.
    - ``backend``: ``"reference"`` or the kernel that ran.
    - ``exact_rows``: batch rows that ran exact attention because the method's budget covered their
      whole context (a documented fallback, never a silent one).
    """

    n_keys: float
    k_rows_scored: float
    v_rows_read: float
    kv_rows_read: float
    density: float
    kv_density: float
    bytes_read: int
    backend: str = "reference"
    exact_rows: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        if key in self._field_names():
            return getattr(self, key)
        if key in self.extra:
            return self.extra[key]
        raise KeyError(key)

    def __getattr__(self, key: str) -> Any:
        # Only reached for names that are not dataclass fields.
        extra = self.__dict__.get("extra", {})
        if key in extra:
            return extra[key]
        raise AttributeError(key)

    def __iter__(self) -> Iterator[str]:
        yield from (n for n in self._field_names() if n != "extra")
        yield from self.extra

    def __len__(self) -> int:
        return len(self._field_names()) - 1 + len(self.extra)

    @classmethod
    def _field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def as_dict(self) -> dict[str, Any]:
        """A flat dict, method-specific values included (tensors become lists)."""
        out: dict[str, Any] = {}
        for key in self:
            value = self[key]
            out[key] = value.tolist() if hasattr(value, "tolist") else value
        return out


_ROW_MEANS = ("n_keys", "k_rows_scored", "v_rows_read", "kv_rows_read", "density", "kv_density")


def merge_row_stats(rows: list[StepStats]) -> StepStats:
    """The stats of a batch from the stats of its rows run one at a time.

    Row counts and densities are means over rows (every row has the same heads), ``bytes_read`` and
    ``exact_rows`` add up; a method-specific value that is a tensor is concatenated over rows, a
    number that differs between rows is averaged, and anything else is kept when all rows agree.
    """
    first = rows[0]
    merged = {name: sum(getattr(r, name) for r in rows) / len(rows) for name in _ROW_MEANS}
    backends = sorted({r.backend for r in rows})
    extra: dict[str, Any] = {}
    for key, value in first.extra.items():
        values = [r.extra.get(key) for r in rows]
        if hasattr(value, "dim") and value.dim() > 0:
            extra[key] = _cat(values)
        elif all(v == value for v in values):
            extra[key] = value
        elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            extra[key] = sum(values) / len(values)
        else:
            extra[key] = values
    return StepStats(**merged, bytes_read=sum(r.bytes_read for r in rows), backend="+".join(backends),
                     exact_rows=sum(r.exact_rows for r in rows), extra=extra)


def _cat(values: list[Any]) -> Any:
    import torch

    return torch.cat(values, dim=0)
