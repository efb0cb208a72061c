"""``magicpig``: SimHash LSH sampling with importance weights (Chen et al., ICLR 2025).

``L`` hash tables of ``K`` random hyperplanes each. A key is retrieved when its K-bit code equals the
query's in at least ``min_tables`` tables (default 2, the rule of MagicPIG's code; 1 is
sparse-attention-hub's). Over the random hyperplanes a key collides in one table with probability
``p_i = (1 − θ_i/π)^K`` (``θ_i`` the angle between the transformed query and key), so it is retrieved
with probability ``P_i = Pr[Binomial(L, p_i) ≥ min_tables]``, and the estimate weighs each retrieved key
by ``1/(P_i + weight_eps)`` (the ratio estimator of the contract; ``weight_eps`` = 1e-4 as in their code,
0 for the exact inverse). If more than ``budget`` keys are retrieved, a uniform subset of ``budget`` is
kept and the weights scale by ``R/budget``. Sink and window are attended at weight 1.

Transforms: ``center`` (default; MagicPIG's code): angular LSH on keys centred by the mean of the
"middle" keys of the first call (the valid keys neither in the sink nor in the window; all valid keys
where there are none), the query not centred; ``mips`` (the vAttention paper's MagicPig-B): the
SimpleLSH transform ``k → [k/M, sqrt(1 − ‖k‖²/M²)]``, ``q → [q/‖q‖, 0]`` so that angles order keys by
inner product.

Key codes are kept in ``state`` and extended incrementally; a new key longer than the stored norm
bound ``M`` makes every code be recomputed (``M`` changed). The centring mean is fixed at the first
call of a request (the prefill keys). Hyperplanes come from ``hash_seed`` and stay fixed for the
request, as LSH tables do.

``backend``: "auto" (default) runs the kernel path on CUDA tensors it can serve: the same retrieval
(codes, collision counts, probabilities and the budget's uniform cap: torch ops on the same
counter-based draws, no host read) handed to the Triton weighted sparse kernel
(:mod:`kvsieve.methods.shared.staged`) with sink and window as key ranges and the kept keys as an index
list weighted as above; elsewhere the torch reference. The list is as wide as the cap when there is one,
else N (retrieval has no bound known on the host). "reference" and "triton" force a path;
``stats.backend`` names the path that ran, ``stats.extra["backend_reason"]`` why the kernel did not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from ..core.config import param, require_choice, require_fraction, require_int
from ..core.context import MethodState
from ..core.inputs import DecodeInputs
from ..core.registry import register_method
from ..core.rng import STREAM_CAP, RowStreams, derive_seed
from ..core.sync import any_or_true
from ..kernels.magicpig.lsh_triton import middle_mean, retrieval_weights
from .shared.backend import BACKENDS
from .shared.base import SinkWindowConfig, fixed_part
from .shared.selection import IndexSet, compact, require_size, resolve_size, size_bound, uniforms
from .shared.staged import StagedSelection, Stages


@dataclass(frozen=True)
class MagicPigConfig(SinkWindowConfig):
    bits: int = param(8, "K: hyperplanes (bits) per hash table")
    tables: int = param(75, "L: hash tables")
    min_tables: int = param(
        2, "a key is retrieved when it collides with the query in at least this many of the L tables "
           "(2: MagicPIG's code; 1: sparse-attention-hub's); an integer in [1, tables]")
    weight_eps: float = param(
        1e-4, "a retrieved key weighs 1/(P + weight_eps), P its retrieval probability (MagicPIG's code: 1e-4; "
              "0: the exact inverse; sparse-attention-hub's masks divide by P + 1e-6); in [0, 1)")
    budget: int | float = param(
        0, "cap on retrieved keys beyond sink+window (count or fraction of the context); 0 = no cap")
    transform: Literal["center", "mips"] = param(
        "center", "'center' (MagicPIG's code: keys centred by the mean of the middle keys) or 'mips' "
                  "(SimpleLSH, the vAttention paper's MagicPig-B)")
    hash_seed: int = param(0, "seed of the hyperplanes (fixed for a request)")
    backend: Literal["auto", "reference", "triton"] = param(
        "auto", "auto: the same retrieval through the Triton sparse kernel on CUDA, else the torch reference; "
                "reference; triton (error if it cannot)")

    def __post_init__(self) -> None:
        super().__post_init__()
        require_int("bits", self.bits, minimum=1)
        if self.bits > 62:
            raise ValueError(f"bits: expected at most 62 bits per table, got {self.bits}")
        require_int("tables", self.tables, minimum=1)
        require_int("min_tables", self.min_tables)
        if not 1 <= self.min_tables <= self.tables:
            raise ValueError(f"min_tables: expected an integer in [1, tables] = [1, {self.tables}], "
                             f"got {self.min_tables}")
        require_fraction("weight_eps", self.weight_eps, low_open=False)
        require_size("budget", self.budget)
        require_choice("transform", self.transform, ("center", "mips"))
        require_int("hash_seed", self.hash_seed, minimum=0)
        require_choice("backend", self.backend, BACKENDS)


def _codes(x: torch.Tensor, proj: torch.Tensor, bits: int, tables: int) -> torch.Tensor:
    """``[..., d'] -> [..., L]`` int64 K-bit codes of the signs of ``x @ proj``."""
    signs = (x @ proj > 0).view(*x.shape[:-1], tables, bits).long()
    return (signs << torch.arange(bits, device=x.device)).sum(-1)


@dataclass
class KeyCodes:
    """The reference path's key codes ``[B, Hkv, n, L]`` for the first ``n`` keys, the hyperplanes, and the
    transform's constant: the largest key norm so far (``mips``) or the middle keys' mean (``center``)."""

    n: int
    proj: torch.Tensor
    codes: torch.Tensor
    norm_max: torch.Tensor | None = None
    mean: torch.Tensor | None = None


@dataclass
class MagicPigState(MethodState):
    """Key codes of one request and layer: the reference path's (``reference``) or the kernel path's
    (``codes``, a ``kernels.magicpig.lsh_triton.LshCodes``), each with the hashing setup (``*_key``) it was
    made under."""

    reference: KeyCodes | None = None
    reference_key: str = ""
    codes: Any = None
    codes_key: str = ""


class _KeyHashes:
    """Codes of the keys and the transform's constants, cached in ``state``."""

    def __init__(self, cfg: MagicPigConfig, inputs: DecodeInputs, state: MagicPigState) -> None:
        b, hkv, n, d = inputs.k.shape
        key = f"magicpig/{cfg.bits}x{cfg.tables}/{cfg.transform}/{cfg.hash_seed}/{cfg.sink},{cfg.window}"
        k = inputs.k.float()
        cached = state.reference if state.reference_key == key else None
        if cached is not None and not (cached.n <= n and cached.codes.shape[:2] == (b, hkv)
                                       and cached.proj.shape[0] == d + (cfg.transform == "mips")):
            cached = None
        if cached is None:
            gen = torch.Generator(device="cpu").manual_seed(derive_seed(cfg.hash_seed, d))
            dims = d + 1 if cfg.transform == "mips" else d
            proj = torch.randn(dims, cfg.bits * cfg.tables, generator=gen).to(inputs.k.device)
            cached = KeyCodes(n=0, proj=proj, codes=torch.zeros(b, hkv, 0, cfg.tables, dtype=torch.long,
                                                                 device=k.device))
            if cfg.transform == "mips":
                cached.norm_max = torch.zeros(b, hkv, device=k.device)
            else:
                # valid keys by rank, so that a mask with holes takes the same middle as sink_and_window
                rank = torch.cumsum(inputs.key_mask.long(), -1) - 1
                cached.mean = middle_mean(inputs.k, inputs.key_mask, rank, inputs.n_valid, cfg.sink, cfg.window)
        start = cached.n
        if cfg.transform == "mips":
            norms = k.norm(dim=-1).masked_fill(~inputs.key_mask[:, None, :], 0.0)
            new_max = torch.maximum(cached.norm_max, norms.amax(-1))
            if start > 0 and any_or_true(new_max > cached.norm_max):
                start = 0  # M grew: every transformed key changed
            cached.norm_max = new_max
        kt = self.transform(cfg, cached, k[:, :, start:])
        new_codes = _codes(kt, cached.proj, cfg.bits, cfg.tables)
        cached.codes = torch.cat([cached.codes[:, :, :start], new_codes], dim=2)
        cached.n = n
        state.reference, state.reference_key = cached, key
        self.cfg, self.cached = cfg, cached

    @staticmethod
    def transform(cfg: MagicPigConfig, cached: KeyCodes, k: torch.Tensor) -> torch.Tensor:
        if cfg.transform == "mips":
            m = torch.clamp(cached.norm_max, min=1e-30)[..., None, None]
            kn = k / m
            extra = torch.sqrt(torch.clamp(1 - (kn * kn).sum(-1, keepdim=True), min=0.0))
            return torch.cat([kn, extra], dim=-1)
        return k - cached.mean[:, :, None, :]

    def query(self, q: torch.Tensor) -> torch.Tensor:
        """``[B, Hq, d] -> [B, Hq, d']`` transformed queries."""
        qf = q.float()
        if self.cfg.transform == "mips":
            qn = qf / torch.clamp(qf.norm(dim=-1, keepdim=True), min=1e-30)
            return torch.cat([qn, torch.zeros_like(qn[..., :1])], dim=-1)
        return qf

    def cosines(self, inputs: DecodeInputs) -> torch.Tensor:
        """``[B, Hq, N]`` cosine between transformed query and keys (reference: all keys)."""
        b, hq, d = inputs.q.shape
        qk = inputs.scores(torch.float32).masked_fill(~inputs.key_mask[:, None, :], 0.0) / inputs.scale
        qn = inputs.q.float().norm(dim=-1)[..., None].clamp(min=1e-30)
        if self.cfg.transform == "mips":
            m = inputs.expand_kv(self.cached.norm_max[..., None])
            return qk / (qn * m.clamp(min=1e-30))
        mu = self.cached.mean  # [B, Hkv, d]
        q_mu = (inputs.q.float().view(b, inputs.kv_heads, inputs.group, d) @ mu[..., None]).view(b, hq, 1)
        kc = (inputs.k.float() - mu[:, :, None, :]).norm(dim=-1)
        return (qk - q_mu) / (qn * inputs.expand_kv(kc).clamp(min=1e-30))


@register_method
class MagicPig(StagedSelection):
    name = "magicpig"
    config_class = MagicPigConfig
    summary = "MagicPIG: sink + window + SimHash-LSH retrieval weighted by 1/P(retrieved)"
    # Key codes are state per request and layer: the rows of a chunk update them one by one.
    multi_row = False
    random_keys = True
    graph_capturable = True
    stochastic = True
    small_config = {"sink": 4, "window": 8, "bits": 4, "tables": 8, "budget": 8}
    exact_config = None
    exact_note = ("no LSH setting is exact: a key is retrieved with probability P < 1 and weighted "
                  "1/(P + weight_eps), so even retrieving every key gives weights ≠ 1 (an importance-weighted "
                  "estimate); only a sink + window that covers the context is exact")

    def new_state(self) -> MagicPigState:
        return MagicPigState()

    def stages(self, inputs, gen, state):
        cfg = self.config
        b, hq, n = inputs.batch, inputs.heads, inputs.n_keys
        fixed, available = fixed_part(self, inputs)
        hashes = _KeyHashes(cfg, inputs, state)
        qcodes = _codes(hashes.query(inputs.q), hashes.cached.proj, cfg.bits, cfg.tables)  # [B, Hq, L]
        kcodes = hashes.cached.codes  # [B, Hkv, N, L]
        collisions = (kcodes[:, :, None] == qcodes.view(b, inputs.kv_heads, inputs.group, 1, cfg.tables)).sum(-1)
        retrieved = (collisions >= cfg.min_tables).view(b, hq, n) & available
        weights = retrieval_weights(hashes.cosines(inputs), cfg.bits, cfg.tables, cfg.min_tables, cfg.weight_eps)
        r = retrieved.sum(-1)
        keep = retrieved
        if cfg.budget != 0:
            cap = resolve_size(cfg.budget, inputs.n_valid)[:, None].expand(b, hq)
            over = r > cap
            if any_or_true(over):
                u = uniforms(gen, STREAM_CAP, (b, hq, n), inputs.q.device, torch.float32).masked_fill(~retrieved, 2.0)
                rank = torch.argsort(torch.argsort(u, dim=-1), dim=-1)
                keep = retrieved & (~over[..., None] | (rank < cap[..., None]))
                weights = weights * torch.where(over, r.double() / cap.clamp(min=1).double(), 1.0)[..., None]
        idx = torch.arange(n, device=inputs.q.device).expand(b, hq, n)
        # A cap bounds the kept keys: the list is that wide on the device, not N.
        sampled = compact(idx, keep, weights, bound=None if cfg.budget == 0 else size_bound(cfg.budget, n))
        return Stages(fixed, sampled, extra=lambda: {"retrieved": r.double().mean(),
                                                     "kept": sampled.counts.double().mean()})

    def kernel_stages(self, inputs, gen, state):
        """The kernel path's retrieval: codes kept in ``state`` and hashed only for new keys (all of a row's
        keys where the MIPS bound grew), the collision test in one launch, the budget's uniform cap from
        the one-launch sampler (the same counter-based draws as :meth:`stages`), the cosines of the kept
        keys only (:mod:`~kvsieve.kernels.magicpig.lsh_triton`), the same probabilities and weights. The
        same keys as :meth:`stages` up to hyperplane projections within float32 rounding of 0 and ties
        of the 24-bit draws at the cap."""
        from ..kernels.magicpig import lsh_triton
        from ..kernels.shared import sample_triton

        cfg = self.config
        if (not isinstance(gen, RowStreams) or inputs.lengths is None or inputs.q_len != 1
                or not lsh_triton.usable(inputs.q)):
            return self.stages(inputs, gen, state)
        b, hq, n, d = inputs.batch, inputs.heads, inputs.n_keys, inputs.q.shape[-1]
        mips = cfg.transform == "mips"
        key = f"magicpig-kernel/{cfg.bits}x{cfg.tables}/{cfg.transform}/{cfg.hash_seed}/{cfg.sink},{cfg.window}"
        codes = state.codes if state.codes_key == key else None
        if codes is None or codes.proj.shape[0] != d + mips or codes.proj.device != inputs.q.device:
            gen_p = torch.Generator(device="cpu").manual_seed(derive_seed(cfg.hash_seed, d))
            proj = torch.randn(d + mips, cfg.bits * cfg.tables, generator=gen_p).to(inputs.q.device)
            codes = state.codes = lsh_triton.LshCodes(proj, cfg.bits, cfg.tables, cfg.transform, cfg.sink, cfg.window)
            state.codes_key = key
        lens = inputs.kernel_lengths
        codes.update(inputs.k, lens)
        excluded, r = lsh_triton.retrieve_triton(inputs.q, codes, lens, cfg.sink, cfg.window, n, cfg.min_tables)
        nv = inputs.n_valid
        start = torch.clamp(nv, max=cfg.sink)
        end = torch.maximum(nv - cfg.window, start)
        if cfg.budget != 0:
            cap = resolve_size(cfg.budget, nv)[:, None].expand(b, hq)
            width = min(size_bound(cfg.budget, n), n)
        else:
            cap, width = r, n  # no cap: every retrieved key
        idx, _ = sample_triton.sample_rows_triton(gen.lo, gen.hi, STREAM_CAP, start, end, cap, r, width, n,
                                                  excluded=excluded, page=1, with_weights=False)
        kept = torch.minimum(cap, r.long())
        dots, knorm = lsh_triton.key_dots_triton(inputs.q, inputs.k, codes, idx, kept)
        qn = inputs.q.float().norm(dim=-1).clamp(min=1e-30)[..., None]
        if mips:
            cos = dots / (qn * inputs.expand_kv(codes.norm_max[..., None]).clamp(min=1e-30))
        else:
            q_mu = (inputs.q.float().view(b, inputs.kv_heads, inputs.group, d) @ codes.mean[..., None]).view(b, hq, 1)
            cos = (dots - q_mu) / (qn * knorm.clamp(min=1e-30))
        w = retrieval_weights(cos, cfg.bits, cfg.tables, cfg.min_tables, cfg.weight_eps)
        if cfg.budget != 0:
            w = w * torch.where(r > cap, r.double() / cap.clamp(min=1).double(), 1.0)[..., None]
        used = torch.arange(width, device=idx.device) < kept[..., None]
        weights = torch.where(used, w, 1.0)
        sampled = IndexSet(idx, kept, weights)
        return Stages(lambda: fixed_part(self, inputs)[0], sampled,
                      extra=lambda: {"retrieved": r.double().mean(), "kept": kept.double().mean()})
