"""Exact top-k selection on the device (``oracle-topk``): every score in one Triton pass over K, then the
exact top keys in one more launch (:mod:`kvsieve.kernels.shared.select_triton`), as a token list for
:func:`kvsieve.kernels.shared.weighted_triton.sparse_decode_triton`.

The scores pass reads all of K once (a GQA group's query rows share each K tile) and writes float32
scaled logits ``[B, Hq, N]``, −inf outside each row's candidates ``[sink_end, window_start)`` (the keys
the dense part does not cover, below the length), and each row's count of keys to take (and what the
select launch needs: the maxima of every 8 scores, or per-block softmax partials). No host sync; shapes
are static.
"""

from __future__ import annotations

import torch

from ..shared.scores import (
    candidate_mask,
    group_summed,
    score_block,
    scores_reference,
    scores_triton,
    selection_counts_reference,
)

# Per-query-head rows above this many keys take the radix select spread over many programs per row
# (select_radix.topk_rows_radix); shorter rows, and per-KV-head rows at any length, the Triton select. On the H200
# at 128k keys, batch 1, 32 rows: the scores pass and select 188.0 µs against torch.topk's 210.0 and the Triton
# select's 244.8 (docs/results/gpu-bench/2026-11-29-h200-vattention-stages-radix-128k.md); per KV head (a quarter
# of the rows) and at 32k the Triton select wins (2026-11-25-h100-sparse-decode-select.md).
RADIX_SELECT_ABOVE = 65536


def select_path(share_kv_group: bool, n_keys: int) -> str:
    """The top-k step of an oracle top-k on the device (oracle-topk, vattention's oracle predictor):
    ``"radix"`` for per-query-head rows over ``RADIX_SELECT_ABOVE`` keys, else ``"triton"``. Reads the limit at
    call time (the benchmarks and tests change it)."""
    return "radix" if not share_kv_group and n_keys > RADIX_SELECT_ABOVE else "triton"


def topk_select(q, k, lengths, *, sink: int, window: int, size: int | float, max_k: int, share_kv_group: bool,
                scale: float | None = None, scores: str = "triton", select: str = "triton",
                keep_scores: bool = False, launch_opts: dict[str, dict] | None = None) -> tuple[torch.Tensor, ...]:
    """``oracle-topk``'s token list for :func:`sparse_decode_triton` (with the same ``sink``/``window``):
    ``(indices [B, Hs, K], counts [B, Hs])`` with ``K = max(1, max_k)``; ``Hs = Hkv`` when
    ``share_kv_group`` (ranked by the group-summed softmax, each head's softmax over every valid key as in
    the reference) else ``Hq``. ``size``: keys per row (a count or a fraction of its length, as
    ``resolve_size``). The first ``counts`` entries of a row are its keys.

    ``select="triton"`` (default): the scores pass over K (writing the maxima of every 8 scores, or for
    group-summed rows per-block softmax partials and then one parallel group-sum launch) and
    :func:`~kvsieve.kernels.shared.select_triton.topk_rows_triton` (prefilter, exact radix select), keys
    in ascending order: 2 launches, 3 with ``share_kv_group``. ``select="radix"``: the scores pass (no maxima)
    and :func:`~kvsieve.kernels.shared.select_radix.topk_rows_radix` (a radix select spread over many programs
    per row, ``ceil(32 / RADIX_BITS) + 2`` launches; ascending order). ``select="torch"``: the same up to
    ``torch.topk`` in place of the select launch (a multi-block radix select of its own for
    rows over ~20k keys). ``scores="reference"`` runs every step
    in torch (highest first). ``keep_scores=True`` (per-query-head rows only) also returns the scores pass's
    ``[B, Hq, N]`` float32 logits (−inf outside the candidates), valid until the next selection on the
    device (a cached buffer). ``launch_opts``: the select launches' overrides
    (:func:`~kvsieve.kernels.shared.select_triton.select_rows`)."""
    b, hq, _ = q.shape
    hkv, n = k.shape[1], k.shape[2]
    if keep_scores and share_kv_group and hq > hkv:
        raise ValueError("keep_scores: the per-head logits are kept for per-query-head rows only")
    kk = max(1, min(max_k, n))
    from ..shared.select_triton import SELECTS

    if select not in SELECTS:
        raise ValueError(f"select: expected one of {', '.join(SELECTS)}, got {select!r}")
    if scores == "reference":
        if share_kv_group:
            s = group_summed(scores_reference(q, k, lengths, 0, 0, scale), hq // hkv)
            s = s.masked_fill(~candidate_mask(lengths, n, 1, sink, window)[:, None, :], float("-inf"))
        else:
            s = scores_reference(q, k, lengths, sink, window, scale)
        counts = selection_counts_reference(lengths, size, 1, sink, window, kk)
    elif scores != "triton":
        raise ValueError(f"scores: expected 'triton' or 'reference', got {scores!r}")
    else:
        from ..shared.select_triton import select_rows

        def score(**kw):
            return scores_triton(q, k, lengths, sink, window, scale, size=size, max_k=kk, **kw)

        return select_rows(score, batch=b, heads=hq, kv_heads=hkv, n_units=n, k=kk, block=score_block(q.shape[-1]),
                           share_kv_group=share_kv_group, lengths=lengths, unit=1, sink=sink, window=window,
                           select=select, device=q.device, keep_scores=keep_scores, launch_opts=launch_opts)
    idx = torch.topk(s, kk, dim=-1, sorted=True).indices
    counts = counts[:, None].expand(b, s.shape[1])
    return (idx, counts, s) if keep_scores else (idx, counts)


__all__ = ["RADIX_SELECT_ABOVE", "select_path", "topk_select"]
