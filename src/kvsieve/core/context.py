"""What a caller tells a method about one call, and the typed state a method keeps between calls.

A method's ``decode``/``prefill`` takes the tensors of one layer and, beside them,

- a :class:`CallContext`: frozen facts about the call that only the caller knows (which layer, which
  request, whether anyone reads the step's stats, a host-known lower bound on the rows' lengths, the
  cache capacity, the state shared by the layers of the forward pass). Passed explicitly, never
  looked up in a dict;
- its own :class:`MethodState` for this request and layer (``Method.new_state()`` makes one; the
  driver keeps one per layer and drops it when the request ends), and, for methods whose state crosses
  layers, a :class:`ForwardState` shared by the layers of one forward pass
  (``Method.new_forward_state()``; the driver makes a fresh one per forward and puts it in
  ``context.forward``).

Typed state keeps its fields visible to readers and tools: a method's state class lists what it
keeps (page summaries, sketches, an index), with no string keys.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch


class MethodState:
    """Base of a method's per-(request, layer) state: a dataclass of tensors and small host values.

    Subclasses are dataclasses. :meth:`stack_rows` builds the state of a batch from the states of its
    rows (the driver prefills a batch one row at a time for methods that see each prompt alone).
    """

    @classmethod
    def stack_rows(cls, rows: list[MethodState]) -> MethodState:
        """One state whose batch row ``b`` is ``rows[b]``: tensor fields (batch first) are padded with
        zeros to the largest shape and concatenated; other fields must agree across rows."""
        if not rows:
            raise ValueError("rows: expected at least one row state")
        if any(type(r) is not type(rows[0]) for r in rows):
            raise ValueError(f"rows: expected states of one type, got {sorted({type(r).__name__ for r in rows})}")
        values = {}
        for f in fields(rows[0]):
            got = [getattr(r, f.name) for r in rows]
            values[f.name] = _stack_field(f.name, got)
        return type(rows[0])(**values)


class ForwardState:
    """Base of the state shared by the layers of one forward pass (e.g. Sketch&Walk's walk)."""


def _stack_field(name: str, values: list[Any]) -> Any:
    if all(v is None for v in values):
        return None
    if isinstance(values[0], MethodState):
        return type(values[0]).stack_rows(values)
    if all(isinstance(v, torch.Tensor) for v in values):
        shape = [max(v.shape[i] for v in values) for i in range(values[0].dim())]
        padded = []
        for v in values:
            if v.shape[0] != 1:
                raise ValueError(f"rows: field {name!r} holds {v.shape[0]} batch rows; expected one per row state")
            pad = [p for i in reversed(range(1, v.dim())) for p in (0, shape[i] - v.shape[i])]
            padded.append(torch.nn.functional.pad(v, pad) if any(pad) else v)
        return torch.cat(padded)
    if all(v == values[0] for v in values):
        return values[0]
    raise ValueError(f"rows: field {name!r} differs across row states ({values!r}); they cannot be stacked")


@dataclass(frozen=True)
class CallContext:
    """Facts about one call that only the caller knows.

    - ``layer``: the model layer served (methods with per-layer artifacts, such as SAAP's
      classifiers, need it; None for a call outside a model).
    - ``request``: the request counter of the caller (seeds are derived from it).
    - ``count_reads``: whether the step's stats will be read. A captured decode step reads none, so
      a kernel path may skip the work that only the stats need.
    - ``min_length``: a lower bound on every row's valid length for the rest of the request, known on
      the host (lengths only grow): a method may skip work for short rows without reading the device.
    - ``capacity``: the cache's capacity per row when the caller owns a static cache (None otherwise),
      for state sized once per request.
    - ``forward``: the state shared by the layers of the current forward pass
      (``Method.new_forward_state()``), or None.
    """

    layer: int | None = None
    request: int = 0
    count_reads: bool = True
    min_length: int = 0
    capacity: int | None = None
    forward: ForwardState | None = None

    def __post_init__(self) -> None:
        if self.layer is not None and (isinstance(self.layer, bool) or not isinstance(self.layer, int)
                                       or self.layer < 0):
            raise ValueError(f"context.layer: expected a layer index >= 0 or None, got {self.layer!r}")
        if isinstance(self.min_length, bool) or not isinstance(self.min_length, int) or self.min_length < 0:
            raise ValueError(f"context.min_length: expected an integer >= 0, got {self.min_length!r}")
        if self.capacity is not None and (isinstance(self.capacity, bool) or not isinstance(self.capacity, int)
                                          or self.capacity < 1):
            raise ValueError(f"context.capacity: expected an integer >= 1 or None, got {self.capacity!r}")
        if self.forward is not None and not isinstance(self.forward, ForwardState):
            raise ValueError(f"context.forward: expected a ForwardState (Method.new_forward_state()) or None, "
                             f"got {type(self.forward).__name__}")


#: The context of a call made outside any driver: no layer, stats read, nothing known on the host.
NO_CONTEXT = CallContext()
