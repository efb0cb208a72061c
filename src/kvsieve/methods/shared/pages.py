"""Page summaries and Quest's page scoring, shared by ``quest`` and ``vattention:predictor=quest``.

Keys are cut into pages of ``page_size`` positions. Each page keeps the per-channel minimum and
maximum of its valid keys; a query bounds the page's best logit by
``Σ_j max(q_j · min_j, q_j · max_j)`` (Tang et al., "Quest: Query-Aware Sparsity for Efficient
Long-Context LLM Inference", ICML 2024). The summaries live in the per-(request, layer)
:class:`PageState` and are updated incrementally as the cache grows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...core.context import MethodState
from ...core.inputs import DecodeInputs
from ...core.sync import host_reads_allowed, max_or_bound
from ...kernels.shared.triton_utils import cdiv
from .selection import IndexSet, compact, empty_set, group_scores


@dataclass
class PageSummaryCache:
    """The reference path's page summaries: over the first ``n`` keys under ``mask`` in ``dtype``."""

    n: int
    kmin: torch.Tensor
    kmax: torch.Tensor
    dtype: torch.dtype
    mask: torch.Tensor


@dataclass
class PageState(MethodState):
    """Page summaries of one request and layer: the reference path's (``reference``) or the kernel
    path's incremental device summaries (``device``, a ``kernels.quest.quest_pages.PageSummaries``)."""

    reference: PageSummaryCache | None = None
    device: Any = None


def page_summaries(inputs: DecodeInputs, page_size: int, state: PageState) -> tuple[torch.Tensor, torch.Tensor]:
    """``(kmin, kmax)`` ``[B, Hkv, P, d]`` over each page's valid keys (±inf for pages without any).

    Cached in ``state.reference``; a cache that grew since the last call has only its new
    pages (and the last old one, which may have been partial) recomputed, and so do pages from the
    first key whose validity changed. A cache that shrank, or changed shape or dtype, is summarized
    again from scratch.
    """
    b, hkv, n, d = inputs.k.shape
    p_total = cdiv(n, page_size)
    cached = state.reference
    start_page = 0
    if cached is not None:
        ok = (cached.n <= n and cached.kmin.shape[:2] == (b, hkv) and cached.kmin.shape[-1] == d
              and cached.dtype == inputs.k.dtype and cached.mask.shape[0] == b)
        if ok:
            # Pages from the first key whose validity changed (e.g. the next row of a causal question
            # block sees one more key) are recomputed; pages before it are still right.
            changed = (cached.mask != inputs.key_mask[:, : cached.n]).any(0)
            if host_reads_allowed(changed):
                first = int(changed.to(torch.int8).argmax()) if bool(changed.any()) else cached.n
            else:
                # Finding the first changed key needs a host read: summarize every page again
                # (one pass over K; a kernel that updates pages in place is the GPU's way).
                first = 0
            start_page = first // page_size
        else:
            cached = None
    lo = start_page * page_size
    k_new = inputs.k[:, :, lo:].float()
    m_new = inputs.key_mask[:, None, lo:, None]
    pad = (p_total - start_page) * page_size - (n - lo)
    kmin_new = k_new.masked_fill(~m_new, float("inf"))
    kmax_new = k_new.masked_fill(~m_new, float("-inf"))
    if pad:
        kmin_new = torch.nn.functional.pad(kmin_new, (0, 0, 0, pad), value=float("inf"))
        kmax_new = torch.nn.functional.pad(kmax_new, (0, 0, 0, pad), value=float("-inf"))
    kmin_new = kmin_new.view(b, hkv, -1, page_size, d).amin(3)
    kmax_new = kmax_new.view(b, hkv, -1, page_size, d).amax(3)
    if cached is not None and start_page > 0:
        kmin = torch.cat([cached.kmin[:, :, :start_page], kmin_new], dim=2)
        kmax = torch.cat([cached.kmax[:, :, :start_page], kmax_new], dim=2)
    else:
        kmin, kmax = kmin_new, kmax_new
    state.reference = PageSummaryCache(n, kmin, kmax, inputs.k.dtype, inputs.key_mask.clone())
    return kmin, kmax


def page_bounds(inputs: DecodeInputs, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """``[B, Hq, P]`` upper bound of the scaled logit over each page (-inf for pages with no valid key)."""
    b, hq, d = inputs.q.shape
    qg = inputs.q.float().view(b, inputs.kv_heads, inputs.group, 1, d)
    empty = torch.isinf(kmin[..., 0])  # [B, Hkv, P]
    lo = torch.where(torch.isinf(kmin), 0.0, kmin)[:, :, None]
    hi = torch.where(torch.isinf(kmax), 0.0, kmax)[:, :, None]
    bound = torch.maximum(qg * lo, qg * hi).sum(-1) * inputs.scale  # [B, Hkv, G, P]
    bound = bound.masked_fill(empty[:, :, None], float("-inf"))
    return bound.view(b, hq, -1)


def select_pages(available: torch.Tensor, scores: torch.Tensor, pages: torch.Tensor, page_size: int) -> IndexSet:
    """Available keys of the ``pages [B, Hs]`` best-scoring pages (``scores [B, Hs, P]``) that hold any."""
    b, h, n = available.shape
    p_total = scores.shape[-1]
    pad = p_total * page_size - n
    av = torch.nn.functional.pad(available, (0, pad), value=False).view(b, h, p_total, page_size)
    has = av.any(-1)
    pages = torch.minimum(pages, has.sum(-1))
    kp = max_or_bound(pages, p_total)
    if kp == 0:
        return empty_set(b, h, available.device)
    s = scores.masked_fill(~has, float("-inf"))
    top = torch.topk(s, kp, dim=-1, sorted=True).indices  # [B, Hs, kp]
    page_used = torch.arange(kp, device=available.device) < pages[..., None]
    pos = (top[..., None] * page_size + torch.arange(page_size, device=available.device)).view(b, h, -1)
    pos_c = torch.clamp(pos, max=n - 1)
    keep = page_used.repeat_interleave(page_size, dim=-1) & (pos < n) & torch.gather(available, 2, pos_c)
    return compact(pos_c, keep, None)


def quest_top_tokens(inputs: DecodeInputs, available: torch.Tensor, tokens: torch.Tensor, page_size: int,
                     state: PageState) -> IndexSet:
    """The pages of highest Quest bound covering ``tokens [B]`` keys (rounded up to whole pages)."""
    kmin, kmax = page_summaries(inputs, page_size, state)
    bounds = page_bounds(inputs, kmin, kmax)
    heads = available.shape[1]
    if heads != inputs.heads:
        bounds = group_scores(bounds, inputs.group)
    pages = torch.div(tokens + page_size - 1, page_size, rounding_mode="floor")
    return select_pages(available, bounds, pages[:, None].expand(inputs.batch, heads), page_size)
