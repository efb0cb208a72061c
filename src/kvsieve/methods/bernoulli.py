"""Bernoulli qKᵀ (the SANTA paper's Sec. 5, App. C): scores from sparse ternary queries.

``bernoulli-qk`` estimates the scores ``qKᵀ`` from B ternary draws of the query
(``kernels/bernoulli/reference.py`` has the math) and reads only the K features some draw kept.

- ``query=head`` (Eq. 5/9): one feature set per query head; a GQA group reads the union of its
  heads' sets (the paper's "group" access in Table 5).
- ``query=mean-group`` (Eq. 6/13, the paper's configuration from Table 5 on): one feature set per
  group, drawn from ``m = mean_g |q_g|``; head g is scored with ``m̂ ⊙ q_g / m``.

Value stage (``values``): ``exact`` takes the exact softmax of the estimated scores and all V rows
(the paper's Tables 5–6). ``santa``, ``santa-strat``, ``santa-sys``, ``santa-prop`` and
``santa-flash`` sample ``budget`` V rows from the softmax of the *estimated* scores, as Table 7
composes Bernoulli qKᵀ with SANTA. The scores enter the sampler exactly where the exact scores
would: ``p̃ = softmax(ŝ)``. Given ŝ each sampler is unbiased for ``p̃V`` (prop with
largest-remainder rounding keeps its own small bias), so the composition's expectation is
``E_ŝ[softmax(ŝ)] V``, the same as ``values=exact``: V sampling adds variance and no bias. Neither
is unbiased for ``softmax(s) V``: ŝ is unbiased for s but the softmax is not linear (Jensen), so
the score stage is biased, more so at small B and peaked attention.

On CUDA, ``query=mean-group,values=santa-prop`` (stratified, per-feature strata) runs the fused kernels of
``kernels/bernoulli/decode.py`` over a feature-major copy of K kept in the state; the draws are the
reference path's (counter-based, ``STREAM_BERNOULLI``), so both paths read the same features. A KV head
whose draws kept most features (more than ``k_row_layout_above`` of them, in the stats) is scored from the
cache's rows instead, in santa-prop's stats loop (the same sum, less time at the layouts' speeds);
``stats.extra["k_row_layout"]`` is the fraction of (row, KV head) units that did, and ``bytes_read`` counts
their whole K rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from ..core.config import MethodConfig, param, require_choice, require_int
from ..core.context import MethodState
from ..core.method import Method, read_stats
from ..core.registry import register_method
from ..core.rng import STREAM_BERNOULLI, STREAM_BUDGET, STREAM_SAMPLE, STREAM_TILE, RandomKey, seed_int
from ..core.stats import StepStats
from ..kernels.bernoulli.reference import (
    SAMPLINGS,
    STRATA,
    bernoulli_query,
    estimated_scores,
    mean_group_query,
)
from ..kernels.santa.reference import (
    auto_tile_size,
    grouped_weighted_values,
    n_tiles,
    santa_flash_reference,
    santa_prop_reference,
)
from ..kernels.santa.systematic import inverse_cdf
from .shared.backend import BACKENDS, choose_path, kernel_operands, triton_unsupported
from .shared.exact import compute_dtype, covered_rows, merge_exact_rows, row_draws, sampled_v_read
from .shared.selection import Draws, uniforms

VALUE_STAGES = ("exact", "santa", "santa-strat", "santa-sys", "santa-prop", "santa-flash")
QUERIES = ("head", "mean-group")


@dataclass(frozen=True)
class BernoulliConfig(MethodConfig):
    draws: int = param(4, "Bernoulli draws B averaged per query (the paper's B)")
    sampling: Literal["stratified", "iid"] = param(
        "stratified", "stratified: one draw per stratum [n/B, (n+1)/B) (Tables 5-7); iid: Eq. 8 as written"
    )
    strata: Literal["per-feature", "shared"] = param(
        "per-feature",
        "stratified only: stratum offsets drawn per feature (features independent) or shared by a query's features",
    )
    query: Literal["head", "mean-group"] = param(
        "head", "head: a feature set per query head (Eq. 5); mean-group: one per GQA group from mean|q_g| (Eq. 6)"
    )
    norm_factor: float = param(1.0, "norm = norm_factor * max|q| per query (>= 1: the paper needs norm >= max|q|)")
    values: Literal["exact", "santa", "santa-strat", "santa-sys", "santa-prop", "santa-flash"] = param(
        "exact", "value stage: exact softmax(ŝ)V, or an S²ANTA sampler over softmax(ŝ)"
    )
    budget: int = param(64, "V samples S per query head when values is a SANTA sampler")
    tile_size: int = param(0, "santa-prop/flash keys per tile; 0 = the kernels' rule")
    rounding: Literal["largest-remainder", "systematic"] = param(
        "largest-remainder", "santa-prop tile budgets: largest remainder (the paper) or systematic (unbiased)"
    )
    exact_when_covered: bool = param(
        True, "SANTA value stage: rows with at most `budget` valid keys get exact attention (as the santa family)"
    )
    backend: Literal["auto", "reference", "triton"] = param(
        "auto", "auto: the fused kernels (kernels/bernoulli/decode.py) on CUDA where they serve the "
        "configuration (query=mean-group, stratified per-feature draws, values=santa-prop), else the "
        "reference; reference; triton (error if it cannot)"
    )

    def __post_init__(self) -> None:
        require_int("draws", self.draws, minimum=1)
        require_choice("sampling", self.sampling, SAMPLINGS)
        require_choice("strata", self.strata, STRATA)
        if self.sampling == "iid" and self.strata != "per-feature":
            raise ValueError("strata: 'shared' couples stratified draws; sampling=iid takes strata=per-feature")
        require_choice("query", self.query, QUERIES)
        nf = self.norm_factor
        if isinstance(nf, bool) or not isinstance(nf, (int, float)) or not 1.0 <= nf < float("inf"):
            raise ValueError(f"norm_factor: expected a finite number >= 1 (norm >= max|q|), got {nf!r}")
        require_choice("values", self.values, VALUE_STAGES)
        require_int("budget", self.budget, minimum=1)
        require_int("tile_size", self.tile_size, minimum=0)
        require_choice("rounding", self.rounding, ("largest-remainder", "systematic"))
        require_choice("backend", self.backend, BACKENDS)


def _thresholds(kind: str, shape: tuple[int, int], budget: int, draws: Draws, device: torch.device) -> torch.Tensor:
    """SANTA's thresholds ``[B, Hq, S]`` (see methods/santa.py): iid, one per stratum, or systematic."""
    if kind == "santa":
        return uniforms(draws, STREAM_SAMPLE, (*shape, budget), device)
    m = torch.arange(budget, device=device, dtype=torch.float64)
    if kind == "santa-strat":
        return (m + uniforms(draws, STREAM_SAMPLE, (*shape, budget), device)) / budget
    return (m + uniforms(draws, STREAM_SAMPLE, (*shape, 1), device)) / budget


def sample_values(
    kind: str,
    scores: torch.Tensor,
    v: torch.Tensor,
    budget: int,
    draws: Draws,
    *,
    tile_size: int = 0,
    rounding: str = "largest-remainder",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """S²ANTA sampler ``kind`` over ``softmax(scores)``: ``(out [B, Hq, dv] float64, v_read [B, Hq, N]
    bool, samples [B, Hq])`` for ``scores [B, Hq, N]`` (float64, -inf on invalid keys) and
    ``v [B, Hkv, N, dv]``. The samplers are the ones of methods/santa.py and santa_prop_flash.py,
    fed with whatever scores the caller has (here the Bernoulli estimates); ``draws`` are row streams
    (``core.rng``) or a generator."""
    require_choice("values", kind, VALUE_STAGES[1:])
    b, hq, n = scores.shape
    shape = (b, hq)
    device = scores.device
    if kind in ("santa", "santa-strat", "santa-sys"):
        t = _thresholds(kind, shape, budget, draws, device)
        idx = inverse_cdf(torch.softmax(scores, -1), t)  # [B, Hq, S]
        hkv, dv = v.shape[1], v.shape[-1]
        v_heads = v.unsqueeze(2).expand(b, hkv, hq // hkv, n, dv).reshape(b, hq, n, dv)
        rows = torch.gather(v_heads, 2, idx.unsqueeze(-1).expand(b, hq, budget, dv))
        v_read = torch.zeros(b, hq, n, dtype=torch.bool, device=device)
        v_read.scatter_(2, idx, True)
        return rows.to(torch.float64).mean(2), v_read, torch.full(shape, budget, device=device)
    tile = tile_size or auto_tile_size(n)
    t = n_tiles(n, tile)
    tile_offsets = uniforms(draws, STREAM_TILE, (*shape, t), device)
    if kind == "santa-prop":
        budget_offset = uniforms(draws, STREAM_BUDGET, shape, device)
        sample = santa_prop_reference(scores, v, budget, tile, rounding=rounding,
                                      budget_offset=budget_offset, tile_offsets=tile_offsets)
    else:
        sample = santa_flash_reference(scores, v, budget, tile, tile_offsets=tile_offsets)
    return sample.out, sample.counts > 0, sample.samples


@dataclass
class BernoulliState(MethodState):
    """The kernel path's feature-major copy of K (a ``kernels.bernoulli.feature_major.FeatureMajorKeys``),
    brought up to date by each call."""

    keys: Any = None


@register_method
class BernoulliQK(Method):
    name = "bernoulli-qk"
    config_class = BernoulliConfig
    summary = ("Bernoulli qKᵀ: scores from B sparse ternary queries (K features read sparsely), "
               "optional S²ANTA V sampling")
    stochastic = True
    random_keys = True
    multi_row = True
    graph_capturable = True
    # values=exact reads every V row (the sparsity is in K features); a SANTA value stage makes the
    # V side sparse too, which is what the contract test's density check needs.
    small_config = {"values": "santa-sys", "budget": 16}
    exact_config = None
    exact_note = ("the scores come from B random ternary query draws: no setting makes them exact, and "
                  "softmax of the estimated scores is biased for softmax(s) at any finite B (Jensen)")
    gqa_note = ("per query head under the default query=head; query=mean-group draws one feature set per "
                "GQA group from mean|q_g|, so GQA then differs from repeated KV heads")

    def new_state(self) -> BernoulliState:
        return BernoulliState()

    def estimate_scores(self, inputs, draws: Draws):
        """Estimated scaled scores ``[B, Hq, N]`` (float64, -inf on invalid keys) and the features
        read per query head ``[B, Hq, d]`` and per KV head ``[B, Hkv, d]``. ``draws``: the row streams
        of the call (or a generator); feature i of draw n of head (or group) h is uniform number
        ``(h·B + n)·2^22 + i`` of the row's ``STREAM_BERNOULLI`` stream, the numbers the kernel draws."""
        c = self.config
        b, hq, d = inputs.q.shape
        hkv, g = inputs.kv_heads, inputs.group
        sets = hq if c.query == "head" else hkv
        u = uniforms(draws, STREAM_BERNOULLI, (b, sets, c.draws, d if c.strata == "per-feature" else 1),
                     inputs.q.device)
        kwargs = dict(norm_factor=c.norm_factor, sampling=c.sampling, strata=c.strata, uniforms=u,
                      check_values=False)  # check_decode_inputs read the values already when asked
        if c.query == "head":
            q_est, read_head = bernoulli_query(inputs.q, c.draws, **kwargs)
            read_group = read_head.view(b, hkv, g, d).any(2)
        else:
            q_est, read_group = mean_group_query(inputs.q.view(b, hkv, g, d), c.draws, **kwargs)
            q_est = q_est.view(b, hq, d)
            read_head = read_group[:, :, None, :].expand(b, hkv, g, d).reshape(b, hq, d)
        scores = estimated_scores(q_est, inputs.k, inputs.scale, inputs.key_mask)
        return scores, read_head, read_group

    def kernel_unsupported(self, inputs) -> str | None:
        """Why the fused kernels cannot serve this call (None when they can)."""
        c = self.config
        if (c.query, c.sampling, c.strata, c.values) != ("mean-group", "stratified", "per-feature", "santa-prop"):
            return ("the fused kernels serve query=mean-group, sampling=stratified, strata=per-feature, "
                    "values=santa-prop")
        if inputs.q.shape[-1] not in (64, 128, 256):
            return f"head dim {inputs.q.shape[-1]} (the feature-major kernels take 64, 128, 256)"
        return triton_unsupported(inputs, tile=self.tile_for(inputs.n_keys), budget=c.budget)

    def tile_for(self, n_keys: int) -> int:
        return self.config.tile_size or auto_tile_size(n_keys)

    def _decode(self, inputs, seed, state):
        c = self.config
        path, reason = choose_path(c.backend, inputs, lambda: self.kernel_unsupported(inputs))
        if path == "triton":
            return self._decode_triton(inputs, seed, state)
        draws = row_draws(inputs, seed)
        scores, read_head, read_group = self.estimate_scores(inputs, draws)
        dtype = compute_dtype(inputs)
        extra = {"draws": c.draws}
        if reason is not None:
            extra["backend_reason"] = reason
        if c.values == "exact":
            out = grouped_weighted_values(torch.softmax(scores, -1), inputs.v).to(dtype)
            v_read = inputs.key_mask[:, None, :].expand(inputs.batch, inputs.heads, inputs.n_keys)
        else:
            out, v_read, samples = sample_values(c.values, scores, inputs.v, c.budget, draws,
                                                 tile_size=c.tile_size, rounding=c.rounding)
            extra["samples"] = samples.to(torch.float64).mean()
            out = out.to(dtype)
        exact_rows = 0
        if c.values != "exact" and c.exact_when_covered:
            out, v_read, exact_rows = merge_exact_rows(inputs, out, v_read, covered_rows(inputs, c.budget), c.budget)
        return out, self._stats(inputs, v_read, read_head, read_group, exact_rows, extra, "reference")

    def _decode_triton(self, inputs, seed, state):
        # The feature-major copy of K lives in the state (per request and layer) and takes one launch per
        # call to bring up to date; then the draw, stats, budget and sampling launches (and, for rows the
        # budget covers, the exact short-rows launch); the stats are built from the outputs when read.
        from ..kernels.bernoulli.decode import ROW_LAYOUT_ABOVE, bernoulli_prop_triton, row_layout_features
        from ..kernels.bernoulli.feature_major import FeatureMajorKeys
        from ..kernels.shared.dense import dense_short_rows_triton

        c = self.config
        q, k, v, lens = kernel_operands(inputs)
        if state.keys is None:
            state.keys = FeatureMajorKeys()
        keys = state.keys
        # kT follows the cache [B, ...]; without one (a hand-built DecodeInputs) the per-row keys stand in
        cache_k, rows = (inputs.cache_k, inputs.q_len) if inputs.cache_k is not None else (inputs.k, 1)
        cache_k = cache_k if cache_k.stride(-1) == 1 else cache_k.contiguous()
        kt = keys.reserve(cache_k)  # the draw launch copies the new keys in
        v_seed = seed_int(seed, inputs.q.device)
        key = seed if isinstance(seed, RandomKey) else RandomKey(v_seed)
        tile = self.tile_for(inputs.n_keys)
        count_reads = inputs.context.count_reads
        out, counts, budgets, n_feat = bernoulli_prop_triton(
            q, kt, v, lens, inputs.scale, c.draws, c.budget, tile, key, v_seed, norm_factor=c.norm_factor,
            rounding=c.rounding, rows_per_batch=rows, write_counts=count_reads, k=k,
            append=(cache_k, keys.done))
        if c.exact_when_covered and inputs.context.min_length <= c.budget:
            dense_short_rows_triton(q, k, v, lens, inputs.scale, out, c.budget)

        def stats():
            drawn = budgets.sum(-1).to(torch.float64)  # [R, Hq]
            v_read, exact_rows, more = sampled_v_read(inputs, counts, drawn, c.budget, c.exact_when_covered)
            rows_layout = n_feat > row_layout_features(q.shape[-1])  # [R, Hkv]: these read whole K rows
            more.update(draws=c.draws, samples=drawn.mean(), tile_size=tile,
                        k_row_layout=rows_layout.to(torch.float64).mean(), k_row_layout_above=ROW_LAYOUT_ABOVE)
            read_group = torch.arange(q.shape[-1], device=q.device) < n_feat[..., None]  # counts matter, not which
            read_head = read_group.repeat_interleave(inputs.group, 1)
            return self._stats(inputs, v_read, read_head, read_group, exact_rows, more, "triton",
                               k_read_group=torch.where(rows_layout[..., None], True, read_group))

        return out, StepStats.deferred(stats, "triton", {"draws": c.draws, "tile_size": tile})

    @staticmethod
    def _stats(inputs, v_read, read_head, read_group, exact_rows, extra, backend, k_read_group=None):
        """``read_*``: the features the draws kept (the estimator's access); ``k_read_group``: the features
        the K read touched per KV head where a unit read whole rows (default: the kept ones)."""
        d = inputs.q.shape[-1]
        feats_head = read_head.sum(-1).to(torch.float64)  # [B, Hq]
        feats_group = read_group.sum(-1).to(torch.float64)  # [B, Hkv]
        extra.update(
            k_features_head=feats_head.mean(),
            k_features_group=feats_group.mean(),
            k_access_head=feats_head.mean() / d,
            k_access_group=feats_group.mean() / d,
        )
        stats = read_stats(inputs, v_read, backend=backend, exact_rows=exact_rows, extra=extra)
        # Every valid key of a KV head is scored, but only on the group's read features.
        touched = feats_group if k_read_group is None else k_read_group.sum(-1).to(torch.float64)
        k_bytes = (inputs.n_valid[:, None].to(torch.float64) * touched).sum() * inputs.k.element_size()
        v_rows = v_read.view(inputs.batch, inputs.kv_heads, inputs.group, -1).any(2).sum()
        stats.bytes_read = k_bytes + v_rows * (inputs.v.element_size() * inputs.v.shape[-1])
        return stats
