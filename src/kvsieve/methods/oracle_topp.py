"""``oracle-topp``: sink + window + the fewest highest-probability keys reaching attention mass p (an oracle).

``backend``: "auto" (default) runs the kernel path on CUDA tensors it can serve: the selection on the
device (:func:`kvsieve.kernels.oracle_topp.topp_triton.topp_select`: one scores launch over K, then a radix
select of the probability threshold by mass, split over programs per row — about 11 launches, no host
read) handed to the Triton weighted sparse kernel (:mod:`kvsieve.methods.shared.staged`) with sink and
window as key ranges and the chosen keys as an index list at weight 1 (the renormalised estimate);
elsewhere the torch reference. ``select="torch"`` keeps the reference's torch selection on the kernel
path (to compare). "reference" and "triton" force a path; ``stats.backend`` names the path that ran,
``stats["select"]`` the kernel path's selection, ``stats.extra["backend_reason"]`` why the kernel did
not run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ..core.config import param, require_choice, require_fraction
from ..core.registry import register_method
from .shared.backend import BACKENDS, kernel_operands
from .shared.base import SinkWindowConfig, fixed_part
from .shared.exact import compute_dtype
from .shared.selection import IndexSet, top_p
from .shared.staged import StagedSelection, Stages


@dataclass(frozen=True)
class OracleTopPConfig(SinkWindowConfig):
    top_p: float = param(0.9, "attention mass to cover, in (0, 1]")
    mass: Literal["total", "residual"] = param(
        "total", "'total': sink+window mass counts toward top_p (smallest set of the whole "
                      "softmax); 'residual': top_p of the mass left after sink+window (sparse-attention-hub)")
    share_kv_group: bool = param(False, "one selection per KV head shared by its query heads (summed mass)")
    backend: Literal["auto", "reference", "triton"] = param(
        "auto", "auto: the same selection through the Triton sparse kernel on CUDA, else the torch reference; "
                "reference; triton (error if it cannot)")

    select: Literal["triton", "torch"] = param(
        "triton", "the kernel path's selection: triton (device launches) or torch (the reference's ops)")

    def __post_init__(self) -> None:
        super().__post_init__()
        require_fraction("top_p", self.top_p, high_open=False)
        require_choice("select", self.select, ("triton", "torch"))
        if self.mass not in ("total", "residual"):
            raise ValueError(f"mass: expected one of total, residual, got {self.mass!r}")
        require_choice("backend", self.backend, BACKENDS)


@register_method
class OracleTopP(StagedSelection):
    name = "oracle-topp"
    config_class = OracleTopPConfig
    summary = "sink + window + the fewest highest-probability keys reaching attention mass p"
    small_config = {"sink": 4, "window": 8, "top_p": 0.5}
    exact_config = {"top_p": 1.0}
    multi_row = True
    graph_capturable = True

    def stages(self, inputs, gen, state):
        fixed, available = fixed_part(self, inputs)
        heads = fixed.heads
        # float64 probabilities from a product in the compute dtype (no float64 copy of K)
        probs = torch.softmax(inputs.scores(compute_dtype(inputs)).to(torch.float64), dim=-1)
        probs, target = _probs_and_target(probs, available, heads, self.config.top_p, self.config.mass)
        return Stages(fixed, top_p(probs, available, target), scored=None)

    def kernel_stages(self, inputs, gen, state):
        cfg = self.config
        if cfg.select == "torch":
            st = self.stages(inputs, gen, state)
            st.extra = {"select": "torch"}
            return st
        from ..kernels.oracle_topp.topp_triton import topp_select

        q, k, _, lens = kernel_operands(inputs)
        idx, counts = topp_select(q, k, lens, sink=cfg.sink, window=cfg.window, top_p=cfg.top_p, mass=cfg.mass,
                                  share_kv_group=self.selection_heads(inputs) != inputs.heads, scale=inputs.scale)
        rest = IndexSet(idx, counts)
        # the list is N wide (no smaller bound of a top-p set is known on the host); split it for the
        # kernel as if it were an eighth of that, so a typical set spreads over several programs
        return Stages(lambda: fixed_part(self, inputs)[0], rest, scored=None, extra={"select": "triton"},
                      plan_entries=max(1, inputs.n_keys // 8),
                      stats_rest=lambda: IndexSet(torch.where(rest.used(), idx.long(), 0), counts.long()))


def topp_reference(q, k, lengths, *, sink: int, window: int, top_p: float, mass: str, share_kv_group: bool,
                   scale: float | None = None) -> torch.Tensor:
    """``[B, Hs, N]`` bool: the keys :func:`topp_select` lists — the torch reference's set
    (:func:`kvsieve.methods.shared.selection.top_p` on float64 probabilities, as ``OracleTopP.stages``;
    here, not beside the kernel, because kernels import no method code), without sink and window."""
    from ..kernels.shared.scores import candidate_mask, scores_reference
    from .shared.selection import top_p as top_p_set  # the argument top_p shadows the module's name

    hkv, n = k.shape[1], k.shape[2]
    heads = hkv if share_kv_group else q.shape[1]
    probs = torch.softmax(scores_reference(q, k, lengths, 0, 0, scale).to(torch.float64), dim=-1)
    available = candidate_mask(lengths, n, 1, sink, window)[:, None, :].expand(q.shape[0], heads, n)
    probs, target = _probs_and_target(probs, available, heads, top_p, mass)
    return top_p_set(probs, available, target).mark(n)


def _probs_and_target(probs: torch.Tensor, available: torch.Tensor, heads: int, p: float, mass: str):
    """Per-query-head float64 ``probs [B, Hq, N]`` averaged over each group when the selection has fewer
    ``heads`` (``share_kv_group``), and the mass ``target [B, heads]`` the top-p set must reach among the
    ``available`` keys: ``mass="total"`` counts sink + window toward ``p``, ``"residual"`` takes ``p`` of
    the rest."""
    b, hq, n = probs.shape
    if heads != hq:
        probs = probs.view(b, heads, hq // heads, n).sum(2) / (hq // heads)
    rest = (probs * available).sum(-1)
    if mass == "total":
        return probs, torch.clamp(p - (1.0 - rest), min=0.0)  # mass still missing after sink + window
    return probs, p * rest
