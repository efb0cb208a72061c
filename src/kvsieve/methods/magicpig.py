"""``magicpig``: SimHash LSH sampling with importance weights (Chen et al., ICLR 2025).

``L`` hash tables of ``K`` random hyperplanes each. A key is retrieved when its K-bit code equals
the query's in at least one table; its retrieval probability over the random hyperplanes is
``p_i = 1 − (1 − (1 − θ_i/π)^K)^L`` with ``θ_i`` the angle between the transformed query and key,
and the estimate weighs each retrieved key by ``1/p_i`` (the ratio estimator of the contract).
If more than ``budget`` keys are retrieved, a uniform subset of ``budget`` is kept and the weights
scale by ``R/budget``. Sink and window are added at weight 1, as in the vAttention paper's setup.

Transforms: ``mips`` (default; the vAttention paper's MagicPig-B): the SimpleLSH transform
``k → [k/M, sqrt(1 − ‖k‖²/M²)]``, ``q → [q/‖q‖, 0]`` so that angles order keys by inner product;
``center`` (MagicPIG's code and sparse-attention-hub): angular LSH on keys centered by their mean.

Key codes are kept in ``state`` and extended incrementally; a new key longer than the stored norm
bound ``M`` makes every code be recomputed (``M`` changed). The centering mean is fixed at the
first call of a request (the prefill keys). Hyperplanes come from ``hash_seed`` and stay fixed for
the request, as LSH tables do.

``backend``: "auto" (default) runs the kernel path on CUDA tensors it can serve: the same retrieval
(codes, collisions, probabilities and the budget's uniform cap: torch ops on the same counter-based
draws, no host read) handed to the Triton weighted sparse kernel (:mod:`kvsieve.methods.shared.staged`)
with sink and window as key ranges and the kept keys as an index list weighted ``1/p`` (``p`` scaled
by ``cap / R`` when capped), which is the importance-weighted ratio estimator above; elsewhere the
torch reference. The list is as wide as the cap when there is one, else N (retrieval has no bound
known on the host). "reference" and "triton" force a path; ``stats.backend`` names the path that ran,
``stats.extra["backend_reason"]`` why the kernel did not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ..core.config import param, require_choice, require_int
from ..core.inputs import DecodeInputs
from ..core.registry import register_method
from ..core.rng import STREAM_CAP, RowStreams, derive_seed
from ..core.sync import any_or_true
from .shared.backend import BACKENDS
from .shared.base import SinkWindowConfig, fixed_part
from .shared.selection import IndexSet, compact, require_size, resolve_size, size_bound, uniforms
from .shared.staged import StagedSelection, Stages


@dataclass(frozen=True)
class MagicPigConfig(SinkWindowConfig):
    bits: int = param(8, "K: hyperplanes (bits) per hash table")
    tables: int = param(75, "L: hash tables")
    budget: int | float = param(
        0, "cap on retrieved keys beyond sink+window (count or fraction of the context); 0 = no cap")
    transform: Literal["mips", "center"] = param(
        "mips", "'mips' (SimpleLSH, the vAttention paper's MagicPig-B) or 'center' (MagicPIG code)")
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
        require_size("budget", self.budget)
        require_choice("transform", self.transform, ("mips", "center"))
        require_int("hash_seed", self.hash_seed, minimum=0)
        require_choice("backend", self.backend, BACKENDS)


def _codes(x: torch.Tensor, proj: torch.Tensor, bits: int, tables: int) -> torch.Tensor:
    """``[..., d'] -> [..., L]`` int64 K-bit codes of the signs of ``x @ proj``."""
    signs = (x @ proj > 0).view(*x.shape[:-1], tables, bits).long()
    return (signs << torch.arange(bits, device=x.device)).sum(-1)


class _KeyHashes:
    """Codes of the keys and the transform's constants, cached in ``state``."""

    def __init__(self, cfg: MagicPigConfig, inputs: DecodeInputs, state: dict[str, Any]) -> None:
        b, hkv, n, d = inputs.k.shape
        key = f"magicpig/{cfg.bits}x{cfg.tables}/{cfg.transform}/{cfg.hash_seed}"
        k = inputs.k.float()
        valid = inputs.key_mask[:, None, :, None]
        cached = state.get(key)
        if cached is not None and not (cached["n"] <= n and cached["codes"].shape[:2] == (b, hkv)
                                       and cached["proj"].shape[0] == d + (cfg.transform == "mips")):
            cached = None
        if cached is None:
            gen = torch.Generator(device="cpu").manual_seed(derive_seed(cfg.hash_seed, d))
            dims = d + 1 if cfg.transform == "mips" else d
            proj = torch.randn(dims, cfg.bits * cfg.tables, generator=gen).to(inputs.k.device)
            cached = {"n": 0, "proj": proj, "codes": torch.zeros(b, hkv, 0, cfg.tables, dtype=torch.long,
                                                                   device=k.device)}
            if cfg.transform == "mips":
                cached["norm_max"] = torch.zeros(b, hkv, device=k.device)
            else:
                nv = inputs.n_valid.float()[:, None, None]
                cached["mean"] = (k * valid).sum(2) / nv
        start = cached["n"]
        if cfg.transform == "mips":
            norms = k.norm(dim=-1).masked_fill(~inputs.key_mask[:, None, :], 0.0)
            new_max = torch.maximum(cached["norm_max"], norms.amax(-1))
            if start > 0 and any_or_true(new_max > cached["norm_max"]):
                start = 0  # M grew: every transformed key changed
            cached["norm_max"] = new_max
        kt = self.transform(cfg, cached, k[:, :, start:])
        new_codes = _codes(kt, cached["proj"], cfg.bits, cfg.tables)
        cached["codes"] = torch.cat([cached["codes"][:, :, :start], new_codes], dim=2)
        cached["n"] = n
        state[key] = cached
        self.cfg, self.cached = cfg, cached

    @staticmethod
    def transform(cfg: MagicPigConfig, cached: dict[str, Any], k: torch.Tensor) -> torch.Tensor:
        if cfg.transform == "mips":
            m = torch.clamp(cached["norm_max"], min=1e-30)[..., None, None]
            kn = k / m
            extra = torch.sqrt(torch.clamp(1 - (kn * kn).sum(-1, keepdim=True), min=0.0))
            return torch.cat([kn, extra], dim=-1)
        return k - cached["mean"][:, :, None, :]

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
            m = inputs.expand_kv(self.cached["norm_max"][..., None])
            return qk / (qn * m.clamp(min=1e-30))
        mu = self.cached["mean"]  # [B, Hkv, d]
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
    exact_note = ("no LSH setting is exact: a key is retrieved with probability p < 1 and weighted 1/p, so "
                  "even retrieving every key gives weights ≠ 1 (an importance-weighted estimate); only a "
                  "sink + window that covers the context is exact")

    def stages(self, inputs, gen, state):
        cfg = self.config
        b, hq, n = inputs.batch, inputs.heads, inputs.n_keys
        fixed, available = fixed_part(self, inputs)
        hashes = _KeyHashes(cfg, inputs, state)
        qcodes = _codes(hashes.query(inputs.q), hashes.cached["proj"], cfg.bits, cfg.tables)  # [B, Hq, L]
        kcodes = hashes.cached["codes"]  # [B, Hkv, N, L]
        hit = (kcodes[:, :, None] == qcodes.view(b, inputs.kv_heads, inputs.group, 1, cfg.tables)).any(-1)
        retrieved = hit.view(b, hq, n) & available
        theta = torch.arccos(torch.clamp(hashes.cosines(inputs).double(), -1.0, 1.0))
        p_table = (1 - theta / math.pi) ** cfg.bits
        p = 1 - (1 - p_table) ** cfg.tables
        r = retrieved.sum(-1)
        keep = retrieved
        if cfg.budget != 0:
            cap = resolve_size(cfg.budget, inputs.n_valid)[:, None].expand(b, hq)
            over = r > cap
            if any_or_true(over):
                u = uniforms(gen, STREAM_CAP, (b, hq, n), inputs.q.device, torch.float32).masked_fill(~retrieved, 2.0)
                rank = torch.argsort(torch.argsort(u, dim=-1), dim=-1)
                keep = retrieved & (~over[..., None] | (rank < cap[..., None]))
                p = p * torch.where(over, cap.double() / r.clamp(min=1).double(), 1.0)[..., None]
        weights = 1.0 / p.clamp(min=1e-300)
        idx = torch.arange(n, device=inputs.q.device).expand(b, hq, n)
        # A cap bounds the kept keys: the list is that wide on the device, not N.
        sampled = compact(idx, keep, weights, bound=None if cfg.budget == 0 else size_bound(cfg.budget, n))
        return Stages(fixed, sampled, extra=lambda: {"retrieved": r.double().mean(),
                                                     "kept": sampled.counts.double().mean()})

    def kernel_stages(self, inputs, gen, state):
        """The kernel path's retrieval: codes kept in ``state`` and hashed only for new keys (all of a row's
        keys where the MIPS bound grew), the collision test in one launch, the budget's uniform cap from
        the one-launch sampler (the same counter-based draws as :meth:`stages`), the cosines of the kept
        keys only (:mod:`~kvsieve.kernels.magicpig.lsh_triton`). The same keys as :meth:`stages` up to
        hyperplane projections within float32 rounding of 0 and ties of the 24-bit draws at the cap."""
        from ..kernels.magicpig import lsh_triton
        from ..kernels.shared import sample_triton

        cfg = self.config
        if (not isinstance(gen, RowStreams) or inputs.lengths is None or inputs.q_len != 1
                or not lsh_triton.usable(inputs.q)):
            return self.stages(inputs, gen, state)
        b, hq, n, d = inputs.batch, inputs.heads, inputs.n_keys, inputs.q.shape[-1]
        mips = cfg.transform == "mips"
        key = f"magicpig-kernel/{cfg.bits}x{cfg.tables}/{cfg.transform}/{cfg.hash_seed}"
        codes = state.get(key)
        if codes is None or codes.proj.shape[0] != d + mips or codes.proj.device != inputs.q.device:
            gen_p = torch.Generator(device="cpu").manual_seed(derive_seed(cfg.hash_seed, d))
            proj = torch.randn(d + mips, cfg.bits * cfg.tables, generator=gen_p).to(inputs.q.device)
            codes = state[key] = lsh_triton.LshCodes(proj, cfg.bits, cfg.tables, cfg.transform)
        lens = inputs.kernel_lengths
        codes.update(inputs.k, lens)
        excluded, r = lsh_triton.retrieve_triton(inputs.q, codes, lens, cfg.sink, cfg.window, n)
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
        p = lsh_triton.retrieval_probability(cos, cfg.bits, cfg.tables)
        if cfg.budget != 0:
            p = p * torch.where(r > cap, cap.double() / r.clamp(min=1).double(), 1.0)[..., None]
        used = torch.arange(width, device=idx.device) < kept[..., None]
        weights = torch.where(used, 1.0 / p.clamp(min=1e-300), 1.0)
        sampled = IndexSet(idx, kept, weights)
        return Stages(lambda: fixed_part(self, inputs)[0], sampled,
                      extra=lambda: {"retrieved": r.double().mean(), "kept": kept.double().mean()})
