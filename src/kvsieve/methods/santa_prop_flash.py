"""S²ANTA-prop and S²ANTA-flash: the tile-budget semantics of the paper's two GPU kernels.

See ``kvsieve.kernels.santa.reference`` for the math. ``santa-prop`` shares the budget over tiles
by mass (largest remainder by default, as the paper; ``rounding=systematic`` is the unbiased
option). ``santa-flash`` gives each tile the same budget ``max(1, S // T)`` and merges tiles with
deferred normalisation; it is unbiased but spends samples on tiles of little mass.

``backend``: "auto" (default) runs the Triton kernels (``kernels/santa/decode.py``) on CUDA tensors
they can serve and the float64 reference otherwise; "triton" insists (a ValueError says why it
cannot; CPU tensors only under ``TRITON_INTERPRET=1``); "reference" always runs the reference.
``stats.backend`` names the path that ran. The kernels draw their uniforms from a counter-based hash
of the seed (``kernels/shared/triton_utils.py``), the reference from a torch generator: the two paths give
different samples for one seed, with the same distribution.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ..core.config import MethodConfig, param, require_choice, require_int
from ..core.method import Method, read_stats
from ..core.registry import register_method
from ..core.rng import STREAM_BUDGET, STREAM_TILE, seed_int
from ..core.stats import StepStats
from ..kernels.santa.reference import (
    auto_tile_size,
    n_tiles,
    santa_flash_reference,
    santa_prop_reference,
)
from .shared.backend import BACKENDS, choose_backend, kernel_operands
from .shared.exact import compute_dtype, covered_rows, merge_exact_rows, row_draws, sampled_v_read
from .shared.selection import uniforms


@dataclass(frozen=True)
class SantaTileConfig(MethodConfig):
    budget: int = param(128, "samples S per query head (nominal, see each method)")
    tile_size: int = param(0, "keys per tile; 0 = the public kernels' rule (32 to 1536 keys, 64 to 3072, else 256)")
    exact_when_covered: bool = param(
        True, "rows with at most `budget` valid keys run exact attention (no more reads than S samples)"
    )
    backend: Literal["auto", "reference", "triton"] = param(
        "auto", "auto: Triton kernel on CUDA tensors, reference otherwise; reference; triton (error if it cannot)"
    )

    def __post_init__(self) -> None:
        require_int("budget", self.budget, minimum=1)
        require_int("tile_size", self.tile_size, minimum=0)
        require_choice("backend", self.backend, BACKENDS)


@dataclass(frozen=True)
class SantaPropConfig(SantaTileConfig):
    rounding: Literal["largest-remainder", "systematic"] = param(
        "largest-remainder",
        "tile budgets: largest remainder (the paper; slightly biased) or systematic rounding (unbiased)",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        require_choice("rounding", self.rounding, ("largest-remainder", "systematic"))


class _SantaTiled(Method):
    stochastic = True
    small_config = {"budget": 16}
    exact_config = {"budget": lambda n: n}
    exact_note = "rows whose valid keys fit in `budget` run exact attention (exact_when_covered=true, the default)"
    random_keys = True
    multi_row = True
    # The Triton kernels take the seed by value and mix each row's length (read from device memory)
    # into it, so a replayed graph draws fresh numbers at every step.
    graph_capturable = True

    def exact_below(self) -> int:
        return self.config.budget if self.config.exact_when_covered else 0

    def tile_for(self, n_keys: int) -> int:
        return self.config.tile_size or auto_tile_size(n_keys)

    def _decode(self, inputs, seed, state):
        tile = self.tile_for(inputs.n_keys)
        path, reason = choose_backend(self.config.backend, inputs, tile=tile, budget=self.config.budget)
        extra = {"tile_size": tile}
        if path == "triton":
            return self._decode_triton(inputs, tile, seed, state, extra)
        gen = row_draws(inputs, seed)
        t = n_tiles(inputs.n_keys, tile)
        sample = self.sample(inputs, tile, gen, t, (inputs.batch, inputs.heads))
        out, counts, samples = sample.out.to(compute_dtype(inputs)), sample.counts, sample.samples
        if reason is not None:
            extra["backend_reason"] = reason
        v_read = counts > 0
        exact_rows = 0
        if self.config.exact_when_covered:
            out, v_read, exact_rows = merge_exact_rows(inputs, out, v_read, covered_rows(inputs, self.config.budget),
                                                           self.config.budget)
        extra["samples"] = samples.to(torch.float64).mean()
        return out, read_stats(inputs, v_read, backend=path, exact_rows=exact_rows, extra=extra)

    def _decode_triton(self, inputs, tile, seed, state, extra):
        # The kernels, then (exact_when_covered) one launch that gives the rows the budget covers exact
        # attention, and nothing else: the stats are built from the kernels' outputs when read.
        from ..kernels.shared.dense import dense_short_rows_triton

        q, k, v, lens = kernel_operands(inputs)
        # context.count_reads = False (the decode runtime's captured steps, which read no per-step stats)
        # skips the per-key counts, a [B, Hq, N] int32 buffer zeroed every call; the stats then report
        # the samples drawn as V rows read, an upper bound on the distinct rows.
        count_reads = inputs.context.count_reads
        out, counts, samples = self.run_triton(inputs, (q, k, v, lens), tile, seed_int(seed, inputs.q.device),
                                               count_reads)
        budget = self.config.budget
        # context.min_length: a bound on every row's length the caller knows on the host (the runtime)
        if self.config.exact_when_covered and inputs.context.min_length <= budget:
            dense_short_rows_triton(q, k, v, lens, inputs.scale, out, budget)

        def stats():
            drawn = samples().to(torch.float64)  # [B, Hq]
            v_read, exact_rows, more = sampled_v_read(inputs, counts, drawn, budget, self.config.exact_when_covered)
            more["samples"] = drawn.mean()
            return read_stats(inputs, v_read, backend="triton", exact_rows=exact_rows, extra=more)

        return out, StepStats.deferred(stats, "triton", extra)


def _scores(inputs) -> torch.Tensor:
    """float64 logits for the sampling arithmetic, from the product in the compute dtype (float32
    products of float32 inputs: converting K to float64 would cost more than the scores)."""
    return inputs.scores(compute_dtype(inputs)).to(torch.float64)


def _uniform(shape, gen, device, stream=STREAM_TILE):
    return uniforms(gen, stream, shape, device)


@register_method
class SantaProp(_SantaTiled):
    name = "santa-prop"
    config_class = SantaPropConfig
    summary = "S²ANTA-prop: budget shared over key tiles by mass, systematic sampling in each tile"

    def sample(self, inputs, tile, gen, t, shape):
        budget_offset = _uniform(shape, gen, inputs.q.device, STREAM_BUDGET)
        tile_offsets = _uniform((*shape, t), gen, inputs.q.device)
        return santa_prop_reference(_scores(inputs), inputs.v, self.config.budget, tile,
                                    rounding=self.config.rounding, budget_offset=budget_offset,
                                    tile_offsets=tile_offsets, out_dtype=compute_dtype(inputs))

    def run_triton(self, inputs, operands, tile, seed, write_counts=True):
        from ..kernels.santa.decode import santa_prop_triton

        q, k, v, lens = operands
        out, counts, budgets = santa_prop_triton(q, k, v, lens, inputs.scale, self.config.budget, tile, seed,
                                                 rounding=self.config.rounding, write_counts=write_counts)
        return out, counts, lambda: budgets.sum(-1)


@register_method
class SantaFlash(_SantaTiled):
    name = "santa-flash"
    config_class = SantaTileConfig
    summary = "S²ANTA-flash: max(1, S//T) samples in every tile, tiles merged by their softmax mass"

    def sample(self, inputs, tile, gen, t, shape):
        tile_offsets = _uniform((*shape, t), gen, inputs.q.device)
        return santa_flash_reference(_scores(inputs), inputs.v, self.config.budget, tile,
                                     tile_offsets=tile_offsets, out_dtype=compute_dtype(inputs))

    def run_triton(self, inputs, operands, tile, seed, write_counts=True):
        from ..kernels.santa.decode import santa_flash_triton

        q, k, v, lens = operands
        out, counts = santa_flash_triton(q, k, v, lens, inputs.scale, self.config.budget, tile, seed,
                                         write_counts=write_counts)

        def samples():
            tiles = -(-inputs.n_valid // tile)
            per_tile = torch.clamp(self.config.budget // tiles, min=1)
            return (per_tile * tiles)[:, None].expand(inputs.batch, inputs.heads)

        return out, counts, samples
