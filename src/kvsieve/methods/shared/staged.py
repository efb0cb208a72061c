"""Sampling and selection methods whose estimate the weighted sparse Triton kernel computes.

``random``, ``vattention``, ``magicpig`` and ``oracle-topp`` select keys with torch ops that read
nothing on the host (the decode contract), so their selection already runs on the device. What their
reference adds is the estimate: a gather of the chosen K/V rows and ``Σ w e^s v / Σ w e^s`` in torch.
Their kernel path keeps the selection — the same code on the same counter-based random numbers, so
both paths choose the same keys at the same weights — and hands it to
:func:`kvsieve.kernels.shared.weighted_triton.sparse_decode_triton`: sink and window as the kernel's
dense ranges (weight 1, read contiguously, no index list), the method's own keys (top-k, sample,
retrieved keys) as an index list per (batch row, selection head) with their weights ``1/p``.

That needs the selection before sink and window are merged into it, hence :class:`Stages`; a method's
``select`` (its reference) is the union of its stages, so the two paths cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...core.inputs import DecodeInputs
from ...core.rng import RandomKey, RowStreams
from ...core.stats import StepStats
from ...kernels.shared.triton_utils import cdiv
from .backend import choose_path, kernel_operands
from .base import Selected, SelectionMethod, selection_stats
from .selection import IndexSet, union
from .sparse_path import sparse_unsupported


@dataclass
class Stages:
    """A selection split where the kernel splits it.

    ``fixed``: sink + window at weight 1 (``sink_and_window`` of the method's config: exactly the
    kernel's dense ranges on a prefix of each row). ``rest``: the method's own weighted keys, disjoint
    from ``fixed``. ``scored``, ``v_extra`` as in :class:`~kvsieve.methods.shared.base.Selected`;
    ``extra``: the stats extras, or a function building them (kept lazy on the kernel path, where a
    call whose stats nobody reads should launch nothing for them); ``fixed`` may be such a function too
    (the kernel reads sink and window as ranges, only the stats need their index set).
    """

    fixed: IndexSet | Callable[[], IndexSet]
    rest: IndexSet
    scored: list[IndexSet] | None = field(default_factory=list)
    v_extra: list[IndexSet] = field(default_factory=list)
    extra: dict[str, Any] | Callable[[], dict[str, Any]] = field(default_factory=dict)
    #: A host guess of the entries ``rest`` typically uses when its width is only a bound (vAttention's
    #: sample is as wide as the context): the kernel then splits the list as if it were that long, so the
    #: used entries spread over several programs instead of one (more, mostly empty, programs).
    plan_entries: int | None = None
    #: ``rest`` with the padding convention of :class:`IndexSet` (position 0, weight 1), for the stats,
    #: where the kernel's list leaves its padding unwritten (it reads the first ``counts`` entries only).
    stats_rest: Callable[[], IndexSet] | None = None
    #: The method's own attention launch in place of the list kernel's, when it tests its keys instead of
    #: listing them (vAttention's oracle path): ``attend(q, k, v, lengths) -> out``; ``rest`` then holds
    #: only what the stats need besides ``stats_rest``, and ``attend_counts [B, Hs]`` the keys each
    #: selection head takes besides sink and window. ``attend_kernel`` names it in the stats.
    attend: Callable[..., Any] | None = None
    attend_counts: Any = None
    attend_kernel: str = ""
    #: Host-known names of the ways the kernel path took (static choices on the shapes), put in the stats'
    #: extras as they are, with no device read.
    labels: dict[str, str] = field(default_factory=dict)

    def selected(self) -> Selected:
        extra = self.extra() if callable(self.extra) else self.extra
        fixed = self.fixed() if callable(self.fixed) else self.fixed
        rest = self.rest if self.stats_rest is None else self.stats_rest()
        return Selected(union(fixed, rest), self.scored, self.v_extra, extra)


def kernel_plan(st: Stages) -> dict[str, int]:
    """Keyword arguments of ``sparse_decode_triton`` for ``st``'s list: more programs than the default
    when ``st.plan_entries`` says the list is mostly padding."""
    width = st.rest.width
    if not st.plan_entries or width <= st.plan_entries:
        return {}
    import inspect

    from ...kernels.shared.weighted_triton import sparse_decode_triton

    default = inspect.signature(sparse_decode_triton).parameters["target_programs"].default
    return {"target_programs": default * cdiv(width, st.plan_entries)}


class StagedSelection(SelectionMethod):
    """A selection method with a ``backend`` config field whose estimate the weighted sparse kernel
    computes; subclasses implement :meth:`stages`."""

    def stages(self, inputs: DecodeInputs, gen, state: dict[str, Any]) -> Stages:
        raise NotImplementedError

    def select(self, inputs, gen, state):
        return self.stages(inputs, gen, state).selected()

    def kernel_stages(self, inputs: DecodeInputs, gen, state: dict[str, Any]) -> Stages:
        """The selection the kernel path runs: :meth:`stages` unless a method overrides it with device
        launches that select the same keys (its ``rest`` is what the kernel reads)."""
        return self.stages(inputs, gen, state)

    def kernel_row_streams(self, inputs: DecodeInputs, seed):
        """:meth:`row_streams`, with the rows' words from one fused launch where it can (the torch
        words are ~40 elementwise launches on a key with a device step counter)."""
        if self.stochastic and self.random_keys and isinstance(seed, RandomKey):
            from ...kernels.shared.sample_triton import row_words_triton

            words = row_words_triton(seed, inputs.n_valid, inputs.q_len)
            if words is not None:
                return RowStreams.from_words(seed, *words)
        return self.row_streams(inputs, seed)

    def _decode(self, inputs, seed, state):
        cfg = self.config
        path, reason = choose_path(cfg.backend, inputs, lambda: sparse_unsupported(inputs))
        if path == "reference":
            out, stats = super()._decode(inputs, seed, state)
            if reason is not None:
                stats.extra["backend_reason"] = reason
            return out, stats
        from ...kernels.shared.weighted_triton import sparse_decode_triton

        st = self.kernel_stages(inputs, self.kernel_row_streams(inputs, seed), state)
        rest = st.rest
        counts = rest.counts if st.attend is None else st.attend_counts
        width = rest.width if st.attend is None else 1
        if cfg.sink + cfg.window == 0 and (width == 0 or (inputs.checked and int(counts.min()) < 1)):
            # The reference raises the same error (it reads the counts only when the call is checked;
            # unchecked, the kernel gives such a head out = 0 instead of NaN).
            raise ValueError(f"{self.name}: the configuration selected no key for some head; "
                             "give sink, window or a budget > 0")
        q, k, v, lens = kernel_operands(inputs)
        if st.attend is not None:
            out, kernel = st.attend(q, k, v, lens), st.attend_kernel
        else:
            idx = counts = weights = None
            if rest.width > 0:
                idx, counts, weights = rest.indices, rest.counts, rest.weights
            out, _ = sparse_decode_triton(q, k, v, idx, counts, weights, lengths=lens, sink=cfg.sink,
                                          window=cfg.window, scale=inputs.scale, **kernel_plan(st))
            kernel = "sparse_decode_triton"
        return out, StepStats.deferred(lambda: selection_stats(inputs, st.selected(), backend="triton"), "triton",
                                       {"kernel": kernel, **st.labels})


__all__ = ["Stages", "StagedSelection", "kernel_plan"]
