"""``vattention``: verified sparse attention with a user (ε, δ) (Desai et al., 2025; Algorithms 1–2).

Per (query, head): a deterministic set ``I_f`` = sink ∪ window ∪ predicted top-k (``predictor``:
``oracle`` exact q·k, or ``quest`` page bounds), then a uniform sample ``I_dyn`` of ``b`` keys of
the residual ``R = [n] \\ I_f`` (``n_s = |R|``), weighted ``n_s / b``, and the ratio estimator

    vAttn = (N_f + N_dyn) / (D_f + D_dyn).

The budget ``b`` comes from a base sample of ``⌊f_b · n_s⌋`` residual keys (at least 2), whose
plug-in statistics (D̂, σ̂ of ``e^{s}``; for ``bound=full`` also ‖N̂‖ and Tr Σ̂ of ``e^{s} v``) enter

- ``bound=full`` (Theorem 4.3, default): ``b = min over (ε', δ') of max(b_D(ε'/2, δ'), b_N((ε−ε')/2, δ−δ'))``
  with ``b_N = (z · n_s √Tr Σ̂ / (ε ‖N̂‖))²``, minimised on a grid;
- ``bound=denominator`` (the paper's experiments): ``b = (z · n_s σ̂ / (ε D̂))²``, which bounds only the
  denominator's error and fails δ on real attention (docs/results/vattention-guarantee.md);
- ``concentration=hoeffding`` (Appendix E; denominator only): ``b = n_s² R̂² ln(2/δ) / (2 ε² D̂²)``
  with ``R̂`` the range of ``e^{s}`` in the base sample (our reconstruction: the paper gives no formula);

``z = Φ⁻¹(1 − δ/2)`` (the paper; ``quantile=one-sided`` gives the hub's ``Φ⁻¹(1 − δ)``). ``b`` is
rounded up (``rounding=down``: the hub's truncation) and clamped to ``[1, n_s]`` (``budget_floor=base``:
the hub's ``[|base|, n_s]``); a
budget of ``n_s`` takes the whole residual at weight 1 (exact). Flags reproduce the
sparse-attention-hub code where it differs from the paper: ``replacement``, ``residual``,
``quantile``, ``budget_floor``, ``rounding``, ``duplicates`` (all of them: the hub's selection and
budget; its 1e-6 in inverse weights and 1e-8 floors are not). See ``docs/methods/vattention.md``.

``backend``: "auto" (default) runs the kernel path on CUDA tensors it can serve: the same selection
(predictor, base sample, budget, residual sample: device launches on the same counter-based draws, no
host read; :meth:`VAttention.kernel_stages`) handed to the Triton weighted sparse kernel
(:mod:`kvsieve.methods.shared.staged`), which computes the ratio estimator above as
``Σ w e^s v / Σ w e^s`` — sink and window as key ranges at weight 1, the predicted top-k (weight 1) and
the residual sample (weight ``n_s / b``) as one index list; elsewhere the torch reference. The sample's
list is as wide as the residual can be (N): ``b`` is data-dependent and has no smaller bound known on the
host. "reference" and "triton" force a path; ``stats.backend`` names the path that ran,
``stats.extra["backend_reason"]`` why the kernel did not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from ..core.config import param, require_choice, require_fraction, require_int
from ..core.inputs import DecodeInputs
from ..core.registry import register_method
from ..core.rng import STREAM_SUBSET, STREAM_SUBSET2, RowStreams
from ..kernels.shared.weighted import gather_rows
from .shared.backend import BACKENDS
from .shared.base import SinkWindowConfig, ranking_scores
from .shared.pages import PageState, quest_top_tokens
from .shared.selection import (
    IndexSet,
    available_after,
    compact,
    empty_set,
    require_size,
    resolve_size,
    sink_and_window,
    size_bound,
    top_k,
    uniform_sample,
    union,
)
from .shared.staged import StagedSelection, Stages


@dataclass(frozen=True)
class VAttentionConfig(SinkWindowConfig):
    top_k: int | float = param(0.025, "f_t: predicted heavy hitters, a count or a fraction of the context (0 = none)")
    predictor: Literal["oracle", "quest"] = param(
        "oracle", "top-k predictor: 'oracle' (exact q·k) or 'quest' (page min/max bounds)")
    page_size: int = param(16, "page size of the quest predictor")
    base_rate: float = param(0.025, "f_b: base sample as a fraction of the residual (at least 2 keys)")
    epsilon: float = param(0.05, "ε: relative error tolerance, in (0, 1)")
    delta: float = param(0.05, "δ: failure probability, in (0, 1)")
    bound: Literal["denominator", "full"] = param(
        "full", "'full' (Theorem 4.3: numerator and denominator; keeps the (ε, δ) promise) or 'denominator' "
                "(the paper's experiments: sparser, fails δ in our measurement)")
    concentration: Literal["clt", "hoeffding"] = param(
        "clt", "'clt' (Lemma 4.1) or 'hoeffding' (Appendix E; bound=denominator only)")
    quantile: Literal["two-sided", "one-sided"] = param(
        "two-sided", "'two-sided' Φ⁻¹(1−δ/2) (paper) or 'one-sided' Φ⁻¹(1−δ) (sparse-attention-hub)")
    replacement: bool = param(False, "sample with replacement (sparse-attention-hub); the paper samples without")
    residual: Literal["excludes-topk", "includes-topk"] = param(
        "excludes-topk", "sampling range: 'excludes-topk' (paper: [n] minus I_f) or "
                          "'includes-topk' (hub: everything but sink and window; sampled top-k keys keep weight 1)")
    budget_floor: Literal["one", "base"] = param(
        "one", "smallest budget: 'one' (paper: no clamp given) or 'base' (hub: the base-sample size)")
    rounding: Literal["up", "down"] = param(
        "up", "budget rounding: 'up' (ceil; the paper gives none) or 'down' (hub: truncation)")
    duplicates: Literal["keep", "collapse"] = param(
        "keep", "keys drawn twice (replacement=true): 'keep' (every draw counts: unbiased) or 'collapse' (hub: "
                "counted once in D̂, N̂ and the sample, at the draws' weight; σ̂ still over every draw)")
    grid: int = param(19, "grid points per axis for the (ε', δ') split of bound=full")
    share_kv_group: bool = param(False, "one selection per KV head for its query heads (budget = max over the group)")
    backend: Literal["auto", "reference", "triton"] = param(
        "auto", "auto: the same selection through the Triton sparse kernel on CUDA, else the torch reference; "
                "reference; triton (error if it cannot)")

    def __post_init__(self) -> None:
        super().__post_init__()
        require_size("top_k", self.top_k)
        require_choice("predictor", self.predictor, ("oracle", "quest"))
        require_int("page_size", self.page_size, minimum=1)
        require_fraction("base_rate", self.base_rate)
        require_fraction("epsilon", self.epsilon)
        require_fraction("delta", self.delta)
        require_choice("bound", self.bound, ("denominator", "full"))
        require_choice("concentration", self.concentration, ("clt", "hoeffding"))
        if self.concentration == "hoeffding" and self.bound != "denominator":
            raise ValueError("concentration: 'hoeffding' is implemented for bound='denominator' only "
                             "(the paper gives no vector Hoeffding bound)")
        require_choice("quantile", self.quantile, ("two-sided", "one-sided"))
        require_choice("residual", self.residual, ("excludes-topk", "includes-topk"))
        require_choice("budget_floor", self.budget_floor, ("one", "base"))
        require_choice("rounding", self.rounding, ("up", "down"))
        require_choice("duplicates", self.duplicates, ("keep", "collapse"))
        if self.duplicates == "collapse" and not self.replacement:
            raise ValueError("duplicates: 'collapse' needs replacement=true (a sample without replacement "
                             "draws no key twice)")
        require_int("grid", self.grid, minimum=1)
        require_choice("backend", self.backend, BACKENDS)


def normal_quantile(delta: torch.Tensor | float, two_sided: bool) -> torch.Tensor:
    """``Φ⁻¹(1 − δ/2)`` (two-sided) or ``Φ⁻¹(1 − δ)``, float64."""
    d = torch.as_tensor(delta, dtype=torch.float64)
    return torch.special.ndtri(1 - d / 2 if two_sided else 1 - d)


def clt_budget(z: torch.Tensor, n_s: torch.Tensor, spread: torch.Tensor, eps: torch.Tensor | float,
               total: torch.Tensor) -> torch.Tensor:
    """Lemma 4.1 with ``τ = ε · total``: ``(z · n_s · spread / (ε · total))²`` (spread = σ or √Tr Σ)."""
    return (z * n_s * spread / (eps * total)) ** 2


def hoeffding_budget(delta: float, n_s: torch.Tensor, value_range: torch.Tensor, eps: float,
                     total: torch.Tensor) -> torch.Tensor:
    """Hoeffding for the residual sum: ``n_s² R² ln(2/δ) / (2 ε² D²)``."""
    return n_s.double() ** 2 * value_range**2 * torch.log(torch.tensor(2.0 / delta, dtype=torch.float64)) / (
        2 * eps**2 * total**2)


def full_budget_grid(cfg: VAttentionConfig, device) -> tuple[torch.Tensor, ...]:
    """Theorem 4.3's grid: ``(ε'/2, (ε − ε')/2, z(δ'), z(δ − δ'))``, each ``[grid]`` float64, with
    ``ε' = ε·t``, ``δ' = δ·t``, ``t = 1/(grid+1) … grid/(grid+1)``."""
    two = cfg.quantile == "two-sided"
    t = torch.arange(1, cfg.grid + 1, dtype=torch.float64, device=device) / (cfg.grid + 1)
    e1 = cfg.epsilon * t  # ε'
    d1 = cfg.delta * t  # δ'
    return e1 / 2, (cfg.epsilon - e1) / 2, normal_quantile(d1, two), normal_quantile(cfg.delta - d1, two)


def full_budget(cfg: VAttentionConfig, n_s: torch.Tensor, sigma: torch.Tensor, d_hat: torch.Tensor,
                tr_sigma: torch.Tensor, n_norm: torch.Tensor) -> torch.Tensor:
    """Theorem 4.3: min over a grid of (ε', δ') of max(b_D(ε'/2, δ'), b_N((ε − ε')/2, δ − δ'))."""
    e_d, e_n, z_d, z_n = full_budget_grid(cfg, n_s.device)
    shape = (*n_s.shape, 1, 1)
    # rows ε', columns δ'
    b_d = clt_budget(z_d[None, :], n_s.double().view(shape), sigma.view(shape), e_d[:, None], d_hat.view(shape))
    b_n = clt_budget(z_n[None, :], n_s.double().view(shape), tr_sigma.sqrt().view(shape), e_n[:, None],
                     n_norm.view(shape))
    return torch.maximum(b_d, b_n).flatten(-2).amin(-1)


_CONSTANTS: dict = {}

#: The oracle predictor's per-query-head path tests its keys in the attention pass
#: (:mod:`kvsieve.kernels.vattention.attend_triton`). False lists them for the weighted sparse kernel as the
#: other settings do: kept to time the two against each other (``benchmarks/breakdown/stages.py``); the
#: stats' ``kernel`` names the pass that ran.
TESTED_ATTENTION = True


def budget_constants(cfg: VAttentionConfig, device) -> torch.Tensor:
    """The float64 constants of the kernel path's budget (``budget_triton.BudgetRule``): ``[z, ln(2/δ),
    2ε², ε]`` as :meth:`VAttention.budget` computes them (on the host), then :func:`full_budget_grid`
    (on ``device``, as the reference). Cached per (config, device); built on first use, outside any graph
    capture."""
    key = (cfg, str(device))
    c = _CONSTANTS.get(key)
    if c is None:
        z = float(normal_quantile(cfg.delta, cfg.quantile == "two-sided"))
        log_term = float(torch.log(torch.tensor(2.0 / cfg.delta, dtype=torch.float64)))
        head = torch.tensor([z, log_term, 2 * cfg.epsilon**2, cfg.epsilon], dtype=torch.float64, device=device)
        c = _CONSTANTS[key] = torch.cat([head, *full_budget_grid(cfg, device)])
    return c


def _amax(t: torch.Tensor) -> torch.Tensor:
    """Max over the last axis; -inf where that axis is empty."""
    if t.shape[-1] == 0:
        return torch.full(t.shape[:-1], float("-inf"), dtype=t.dtype, device=t.device)
    return t.amax(-1)


def _rows(inputs: DecodeInputs, t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Rows of ``t [B, Hkv, N, x]`` at ``idx [B, Hq, M]`` for each query head -> ``[B, Hq, M, x]``."""
    return gather_rows(t, idx, torch.arange(idx.shape[1], device=idx.device) // inputs.group)


def _repeated(s: IndexSet) -> torch.Tensor:
    """``[B, Hs, M]`` bool: used entries whose position an earlier entry of the row already holds."""
    used = s.used()
    vals, perm = torch.sort(torch.where(used, s.indices, -1), dim=-1, stable=True)
    again = torch.zeros_like(used)
    again[..., 1:] = (vals[..., 1:] == vals[..., :-1]) & (vals[..., 1:] >= 0)
    return torch.zeros_like(used).scatter_(-1, perm, again)


def _logits(inputs: DecodeInputs, s: IndexSet) -> torch.Tensor:
    """Scaled float64 logits ``[B, Hq, M]`` of a query-head index set, -inf on padding."""
    kr = _rows(inputs, inputs.k, s.indices).double()
    logit = torch.einsum("bhd,bhmd->bhm", inputs.q.double(), kr) * inputs.scale
    return logit.masked_fill(~s.used(), float("-inf"))


@register_method
class VAttention(StagedSelection):
    name = "vattention"
    config_class = VAttentionConfig
    summary = "vAttention: sink + window + top-k + uniform sample of the rest, budget from (ε, δ)"
    multi_row = True
    random_keys = True
    graph_capturable = True
    stochastic = True
    small_config = {"sink": 4, "window": 8, "top_k": 8, "base_rate": 0.1, "epsilon": 0.5, "delta": 0.5}
    exact_config = {"top_k": 1.0}

    def new_state(self) -> PageState:
        """The quest predictor's page summaries (unused by the other predictors)."""
        return PageState()

    def predicted_top(self, inputs: DecodeInputs, available: torch.Tensor, state) -> IndexSet:
        cfg = self.config
        if cfg.top_k == 0:
            return empty_set(inputs.batch, available.shape[1], inputs.q.device)
        k = resolve_size(cfg.top_k, inputs.n_valid)
        if cfg.predictor == "oracle":
            return top_k(ranking_scores(inputs, available.shape[1]), available, k, size_bound(cfg.top_k, inputs.n_keys))
        return quest_top_tokens(inputs, available, k, cfg.page_size, state)

    def budget(self, inputs: DecodeInputs, fixed: IndexSet, base: IndexSet, n_s: torch.Tensor,
               n_base: torch.Tensor) -> torch.Tensor:
        """Sample size per query head ``[B, Hq]`` (float64, before rounding and clamps)."""
        cfg = self.config
        hq = inputs.heads
        fixed_q, base_q = fixed.to_heads(hq), base.to_heads(hq)
        n_s_q = n_s.repeat_interleave(hq // n_s.shape[1], dim=1).double()
        nb_q = n_base.repeat_interleave(hq // n_s.shape[1], dim=1).double()
        s_f, s_b = _logits(inputs, fixed_q), _logits(inputs, base_q)
        shift = torch.maximum(_amax(s_f), _amax(s_b))
        shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))[..., None]
        e_f = torch.exp(s_f - shift)  # 0 on padding
        e_b = torch.exp(s_b - shift)
        used_b = base_q.used()
        # the hub's dense base mask holds a key drawn twice once: D̂ and N̂ over distinct keys
        once_b = used_b & ~_repeated(base_q) if cfg.duplicates == "collapse" else used_b
        ratio = n_s_q / nb_q.clamp(min=1)
        d_hat = e_f.sum(-1) + ratio * (e_b * once_b).sum(-1)
        safe_nb = nb_q.clamp(min=2)
        mean_b = e_b.sum(-1) / nb_q.clamp(min=1)
        var_b = ((e_b - mean_b[..., None]) ** 2 * used_b).sum(-1) / (safe_nb - 1)
        sigma = var_b.sqrt()
        two = cfg.quantile == "two-sided"
        if cfg.concentration == "hoeffding":
            lo = -_amax(-e_b.masked_fill(~used_b, float("inf")))
            hi = _amax(e_b.masked_fill(~used_b, float("-inf")))
            rng = torch.where(nb_q > 0, hi - lo, torch.zeros_like(hi))
            b = hoeffding_budget(cfg.delta, n_s_q, rng, cfg.epsilon, d_hat)
        elif cfg.bound == "denominator":
            b = clt_budget(normal_quantile(cfg.delta, two), n_s_q, sigma, cfg.epsilon, d_hat)
        else:
            v_f = _rows(inputs, inputs.v, fixed_q.indices).double()
            v_b = _rows(inputs, inputs.v, base_q.indices).double()
            r_b = e_b[..., None] * v_b  # [B, Hq, Mb, dv]
            n_hat = (e_f[..., None] * v_f).sum(2) + ratio[..., None] * (r_b * once_b[..., None]).sum(2)
            mean_r = r_b.sum(2) / nb_q.clamp(min=1)[..., None]
            tr = (((r_b - mean_r[:, :, None]) ** 2) * used_b[..., None]).sum((2, 3)) / (safe_nb - 1)
            b = full_budget(cfg, n_s_q, sigma, d_hat, tr, n_hat.norm(dim=-1))
        return torch.nan_to_num(b, nan=0.0, posinf=float("inf"))

    def stages(self, inputs, gen, state):
        cfg = self.config
        heads = self.selection_heads(inputs)
        fixed = sink_and_window(inputs, cfg.sink, cfg.window, heads)
        available = available_after(inputs, fixed)
        top = self.predicted_top(inputs, available, state)
        static = union(fixed, top)
        residual = available_after(inputs, static) if cfg.residual == "excludes-topk" else available
        n_s = residual.sum(-1)
        n_base = torch.minimum(torch.clamp(torch.floor(cfg.base_rate * n_s.double()).long(), min=2), n_s)
        base_bound = max(2, math.floor(cfg.base_rate * inputs.n_keys))
        base = uniform_sample(residual, n_base, gen, replacement=cfg.replacement, size_bound=base_bound)

        b = self.budget(inputs, static, base, n_s, n_base)
        if heads != inputs.heads:
            b = b.view(inputs.batch, heads, inputs.group).amax(-1)
        floor = torch.ones_like(n_s) if cfg.budget_floor == "one" else n_base
        b_cap = torch.clamp(b, max=float(inputs.n_keys))
        b_int = (torch.ceil(b_cap) if cfg.rounding == "up" else torch.floor(b_cap)).long()
        b_int = torch.minimum(torch.maximum(b_int, floor), n_s)
        dyn = self.sample_residual(residual, b_int, n_s, gen)
        if cfg.residual == "includes-topk" and top.width:
            # The hub merges masks by adding probabilities and clamping to 1: a sampled top-k key
            # keeps weight 1, i.e. the sample entry is dropped.
            in_top = torch.gather(top.mark(inputs.n_keys), 2, dyn.indices)
            dyn = compact(dyn.indices, dyn.used() & ~in_top, dyn.weights)

        scored = [base]
        if cfg.predictor == "oracle":
            scored = None  # every key scored

        def extra():
            return self.extras(b_int, b, n_base, n_s, static.counts, inputs.n_keys)

        v_extra = [base] if cfg.bound == "full" else []  # V rows read for Tr Σ̂ and ‖N̂‖
        # fixed, then top-k, then the sample: the order (and so the sums) of union(static, dyn)
        return Stages(fixed, union(top, dyn), scored=scored, v_extra=v_extra, extra=extra)

    def kernel_stages(self, inputs, gen, state):
        """The kernel path's selection, the same keys as :meth:`stages` given the same draws (up to ties
        of the scores or page bounds, computed in another order, and of the 24-bit hash at a sample's
        cut), in about ten launches whatever the predictor:

        - the predicted top-k: ``oracle`` — oracle-topk's device top-k (:func:`~kvsieve.kernels.
          oracle_topk.topk.topk_select`: every score in one pass over K, then its select, chosen on the shapes
          by :func:`~kvsieve.kernels.oracle_topk.topk.select_path`: the radix select spread over the GPU
          (``"radix"``) for per-query-head rows over ``RADIX_SELECT_ABOVE`` keys, else the Triton select
          (``"triton"``), a long row's candidates merged by a second launch; ``stats.extra["topk_select"]``
          names it); ``quest`` — Quest's incremental page
          summaries (in ``state``) and device page selection;
        - one launch (:func:`~kvsieve.kernels.vattention.budget_triton.residual_setup_triton`) writes the
          top-k keys as the first entries of the kernel's list, marks them for the samples, and sizes the
          residual and the base sample;
        - the base sample (:mod:`~kvsieve.kernels.shared.sample_triton`: no sort over the row; one program per
          row, its sample a small share of the row);
        - the budget's statistics and the (ε, δ) budget itself, rounded and clamped, in two launches
          (:func:`~kvsieve.kernels.vattention.budget_triton.budget_triton`); with the oracle's kept scores
          the top-k and base keys' logits are read from them (float32) rather than from K rows again;
        - the residual sample (the windowed cut): with the oracle's kept scores as the cut alone, tested in
          the attention pass; else listed after the top-k.

        Other settings (``replacement``, ``residual=includes-topk``, ``rounding=down``, pages not a power of
        two) run
        :meth:`stages`."""
        from ..kernels.shared import sample_triton
        from ..kernels.vattention import attend_triton, budget_triton

        cfg = self.config
        oracle = cfg.predictor == "oracle"
        # Quest's page kernels take power-of-two pages
        if (cfg.replacement or cfg.residual != "excludes-topk" or cfg.rounding != "up"
                or (not oracle and cfg.page_size & (cfg.page_size - 1))
                or not isinstance(gen, RowStreams) or inputs.lengths is None or not sample_triton.usable(inputs.q)
                or not budget_triton.usable(inputs.q)):
            return self.stages(inputs, gen, state)

        heads = self.selection_heads(inputs)
        r, n, dev = inputs.batch, inputs.n_keys, inputs.q.device
        nv, lens = inputs.n_valid, inputs.kernel_lengths
        share = heads != inputs.heads
        pages = counts = scores = select = None
        page, p_total = 1, n  # the oracle's top-k as pages of one key
        if cfg.top_k != 0 and oracle:
            from ..kernels.oracle_topk.topk import select_path, topk_select

            q, k = (t if t.stride(-1) == 1 else t.contiguous() for t in (inputs.q, inputs.k))
            select = select_path(share, n)  # static: shapes only
            pages, counts, *kept = topk_select(q, k, lens, sink=cfg.sink, window=cfg.window, size=cfg.top_k,
                                               max_k=size_bound(cfg.top_k, n), share_kv_group=share,
                                               scale=inputs.scale, select=select,
                                               keep_scores=TESTED_ATTENTION and not share and attend_triton.usable(q),
                                               launch_opts={"rows": {"merge": "launch"}})
            scores = kept[0] if kept else None
        elif cfg.top_k != 0:
            from ..kernels.quest.quest_pages import PageSummaries, quest_select

            page, p_total = cfg.page_size, -(-n // cfg.page_size)
            if state.device is None:
                state.device = PageSummaries(page)
            summaries = state.device
            kmin, kmax = summaries.update(inputs.k, lens)
            max_pages = -(-min(size_bound(cfg.top_k, n), n) // page)
            pages, counts = quest_select(inputs.q, kmin, kmax, lens, page_size=page, sink=cfg.sink,
                                         window=cfg.window, size=cfg.top_k, max_pages=max_pages,
                                         share_kv_group=share, scale=inputs.scale)
        kt = 0 if pages is None else pages.shape[-1] * page
        # the oracle's per-query-head top-k: the attention pass tests its keys (no list as wide as the context)
        tested = scores is not None
        width = kt if tested else kt + n
        idx = torch.empty(r, heads, width, dtype=torch.long, device=dev)
        w = torch.empty(r, heads, width, dtype=torch.float64, device=dev)
        setup = budget_triton.residual_setup_triton(lens, cfg.sink, cfg.window, cfg.base_rate, heads, pages, counts,
                                                    page, p_total, idx, w)
        start, end, n_s, n_base = setup.start, setup.end, setup.n_s, setup.n_base
        top = IndexSet(idx[..., :kt], setup.top_counts) if kt else empty_set(r, heads, dev)
        base_bound = min(max(2, math.floor(cfg.base_rate * n)), n)
        # the base sample (~2.5 % of the residual): one program per row beats the windowed cut
        b_idx, b_w = sample_triton.sample_rows_triton(gen.lo, gen.hi, STREAM_SUBSET, start, end, n_base, n_s,
                                                      base_bound, n, excluded=setup.excluded, page=page, window=False)
        base = IndexSet(b_idx, n_base, b_w)
        rule = budget_triton.BudgetRule(3 if cfg.concentration == "hoeffding" else 1 if cfg.bound == "denominator"
                                        else 2, budget_constants(cfg, dev), cfg.grid, cfg.budget_floor == "base", n)
        budget = budget_triton.budget_triton(inputs.q, inputs.k, inputs.v, start, end, nv, top.indices,
                                             setup.top_counts, b_idx, n_base, n_s, inputs.scale,
                                             cfg.bound == "full" and cfg.concentration == "clt",
                                             min(cfg.sink + cfg.window, n), rule=rule, logits=scores)
        b_int = budget.size

        def residual_list(out_idx, out_w):
            # the list is N wide and the kernel reads its first counts entries only: its padding stays unwritten
            sample_triton.sample_rows_triton(gen.lo, gen.hi, STREAM_SUBSET2, start, end, b_int, n_s, kt + n, n,
                                             excluded=setup.excluded, page=page, offset=setup.top_counts,
                                             out=out_idx, weights=out_w, fill=False)
            return IndexSet(out_idx, budget.counts, out_w)

        def stats_rest():
            if tested:  # the same draws listed, for the stats only
                full_idx = torch.cat([idx, torch.empty(r, heads, n, dtype=torch.long, device=dev)], -1)
                full_w = torch.cat([w, torch.empty(r, heads, n, dtype=torch.float64, device=dev)], -1)
                listed = residual_list(full_idx, full_w)
            else:
                listed = rest
            used = listed.used()
            return IndexSet(torch.where(used, listed.indices, 0), listed.counts,
                            torch.where(used, listed.weights, 1.0))

        def fixed():  # the stats' index set of the kernel's ranges, built only when the stats are read
            return sink_and_window(inputs, cfg.sink, cfg.window, heads)

        def extra():
            return self.extras(b_int, budget.raw, n_base, n_s, (start + nv - end)[:, None] + top.counts, n)

        v_extra = [base] if cfg.bound == "full" else []
        labels = {} if select is None else {"topk_select": select}
        if tested:
            cut = sample_triton.sample_cut_triton(gen.lo, gen.hi, STREAM_SUBSET2, start, end, b_int, n_s, n,
                                                  excluded=setup.excluded)

            def attend(q, k, v, lengths):
                return attend_triton.attend_triton(q, k, v, lengths, cfg.sink, cfg.window, inputs.scale, scores,
                                                   setup.excluded, gen.lo, gen.hi, STREAM_SUBSET2, cut[0], cut[1],
                                                   n_s, b_int)

            return Stages(fixed, top, scored=None, v_extra=v_extra, extra=extra, stats_rest=stats_rest,
                          attend=attend, attend_counts=budget.counts, attend_kernel="vattention attend_triton",
                          labels=labels)
        rest = residual_list(idx, w)
        # the sample's list is N wide; its size is typically of the order of the base sample's
        return Stages(fixed, rest, scored=None if oracle else [base], v_extra=v_extra,
                      extra=extra, plan_entries=kt + max(base_bound, 256), stats_rest=stats_rest, labels=labels)

    def extras(self, b_int, b, n_base, n_s, fixed_keys, n_keys: int) -> dict:
        """The stats extras of both paths."""
        cfg = self.config
        return {
            "budget_per_head": b_int.double(),
            "budget": b_int.double().mean(),
            "budget_raw": torch.clamp(b, max=float(n_keys)).mean(),
            "base_sample": n_base.double().mean(),
            "residual_keys": n_s.double().mean(),
            "fixed_keys": fixed_keys.double().mean(),
            "sampled_fraction": (b_int.double() / n_s.clamp(min=1).double()).mean(),
            "epsilon": cfg.epsilon,
            "delta": cfg.delta,
            "bound": cfg.bound,
        }

    def sample_residual(self, residual: torch.Tensor, b: torch.Tensor, n_s: torch.Tensor,
                        gen: torch.Generator) -> IndexSet:
        """``b`` residual keys at weight ``n_s / b``; ``b = n_s`` takes the whole residual (exact), except
        with ``duplicates=collapse`` (the hub: ``b`` draws with replacement, a key drawn twice one entry)."""
        if not self.config.replacement:
            return uniform_sample(residual, b, gen, stream=STREAM_SUBSET2)
        if self.config.duplicates == "collapse":
            sample = uniform_sample(residual, b, gen, replacement=True, stream=STREAM_SUBSET2)
            return compact(sample.indices, sample.used() & ~_repeated(sample), sample.weights)
        full = b >= n_s
        sample = uniform_sample(residual, torch.where(full, 0, b), gen, replacement=True, stream=STREAM_SUBSET2)
        everything = uniform_sample(residual & full[..., None], torch.where(full, n_s, 0), gen,
                                    stream=STREAM_SUBSET2 + 10)
        return union(sample, everything)


__all__ = ["VAttention", "VAttentionConfig", "clt_budget", "full_budget", "hoeffding_budget", "normal_quantile"]
