"""S²ANTA-prop and S²ANTA-flash on the GPU: each call takes the path measured fastest for its size.

Torch references: ``reference.santa_prop_reference`` / ``santa_flash_reference`` (float64). Given the
uniforms of ``triton_utils.tile_uniforms`` / ``budget_uniforms`` every path draws the reference's counts
and budgets, except for rare floor-boundary flips on the GPU (float32 scores here, float64 there): the
running sums of systematic sampling are exact fixed-point integers (``common.fixed_point``), so every
tile's counts add up to its budget exactly.

Layout: q ``[B, Hq, d]``, K/V ``[B, Hkv, N, d]`` (the transformers cache; last dim contiguous), ``lens [B]``
int32 valid prefix lengths. Every program serves the G query heads of a GQA group with one K load.

The paths (H100, bf16, graph-timed, docs/methods/santa-kernels.md):

- santa-flash: ``overlap.py`` (v10) from ``FLASH_OVERLAP_MIN_TILES`` tiles in all (rows × KV heads × tiles
  per head), where programmatic dependent launch is on (Hopper and newer): the sampling overlaps the K stream;
  ``fused.py`` up to ``FLASH_FUSED_MAX_TILES`` tiles per head; ``two_pass.py`` (v8) otherwise, and wherever
  programmatic dependent launch is off (older GPUs, the interpreter), since without it v10 only adds waits.
- santa-prop: from ``PROP_WIDE_MIN_TILES`` tiles in all ``split_merge.py`` (v8's stats pass at the wide
  launch ``PROP_WIDE_STATS``, budgets, sampling, and the merge in a launch of its own instead of a counter
  that thousands of programs hit), ``two_pass.py`` (v8) below. v10 is slower for prop on the H200: its
  ordered stats kernel (a release per tile and thread) streams K ~11 µs slower per layer at 128k than v8's,
  more than the overlap hides.
"""

from __future__ import annotations

import torch

from ..shared.triton_utils import pdl_available
from .common import all_tiles, check_rounding, check_tile, tile_count
from .fused import santa_flash_fused
from .overlap import santa_flash_overlap, santa_prop_overlap
from .split_merge import santa_prop_split
from .two_pass import santa_flash_two_pass, santa_prop_two_pass

# santa-flash: the fused kernel up to this many tiles per head (8k keys at tile 256), v8 above; v10 from this
# many tiles in all where programmatic dependent launch is on: its 528 stats programs finish the (row, KV head)
# units one after another only when there are several rounds of tiles, and with one or two rounds it only adds
# waits. Measured on the H100 (graph-timed; docs/methods/santa-kernels.md,
# docs/results/gpu-bench/2026-11-22-h100-decode-v10d.md).
FLASH_FUSED_MAX_TILES = 32
FLASH_OVERLAP_MIN_TILES = 1024
# santa-prop from this many tiles in all: v8's stats kernel with 528 programs (4 per SM), 128-key sub-blocks,
# 4 warps, 2 stages, and the merge launch (split_merge.py). H200, 128k batch 1, graph µs with a cold L2, peaked
# attention: v8 with that stats launch and the folded merge 102.3 against 108.2 for v10; the stats kernel alone
# 80.7, against 85.6 at v8's default launch and 91.8 for v10's ordered one
# (docs/results/gpu-bench/2026-11-28-h200-santa-prop-stream-sweep.md). The merge launch in place of the folded
# one follows the sparse gather kernel's measurement (split_merge.py); the santa-prop call itself is timed by
# benchmarks/santa_kernels/tune_prop_stream.py --quick. Launch parameters: no count changes.
PROP_WIDE_MIN_TILES = 2048
# ... and from this many tiles per head; below it, where programmatic dependent launch is on, v10: at 32k batch 8
# (128 tiles per head, 8 rows) v10 took 178.8 µs against 187.6 for the merge-launch path, which took 99.6 against
# 108.1 at 128k batch 1 (512 tiles per head; H200, peaked, same run, tune_prop_stream.py --quick).
PROP_SPLIT_MIN_HEAD_TILES = 512
PROP_WIDE_STATS = {"block_n": 128, "stats_programs": 528, "stats_warps": 4, "stats_stages": 2}


def flash_path(k: torch.Tensor, tile: int) -> str:
    """"overlap", "fused" or "two-pass": the path ``santa_flash_triton`` takes for this cache."""
    if all_tiles(k, tile) >= FLASH_OVERLAP_MIN_TILES and pdl_available():
        return "overlap"
    return "fused" if tile_count(k.shape[2], tile) <= FLASH_FUSED_MAX_TILES else "two-pass"


def prop_path(k: torch.Tensor, tile: int) -> str:
    """"split" (``split_merge.py`` with ``PROP_WIDE_STATS``), "overlap" (v10) or "two-pass" (v8 at its own
    launch defaults): the path ``santa_prop_triton`` takes for this cache."""
    if all_tiles(k, tile) < PROP_WIDE_MIN_TILES:
        return "two-pass"
    if tile_count(k.shape[2], tile) < PROP_SPLIT_MIN_HEAD_TILES and pdl_available():
        return "overlap"
    return "split"


def santa_flash_triton(q, k, v, lens, scale: float, budget: int, tile: int, seed: int, *,
                       write_counts: bool = False, out: torch.Tensor | None = None):
    """S²ANTA-flash: ``max(1, S // T_b)`` systematic samples in every tile, tiles merged by their softmax
    mass. Returns ``(out [B, Hq, d] in q's dtype, counts [B, Hq, N] int32 or None)``."""
    check_tile(tile)
    run = {"overlap": santa_flash_overlap, "fused": santa_flash_fused,
           "two-pass": santa_flash_two_pass}[flash_path(k, tile)]
    return run(q, k, v, lens, scale, budget, tile, seed, write_counts=write_counts, out=out)


def santa_prop_triton(q, k, v, lens, scale: float, budget: int, tile: int, seed: int, *,
                      rounding: str = "largest-remainder", write_counts: bool = False,
                      out: torch.Tensor | None = None):
    """S²ANTA-prop: the budget shared over the tiles by mass (largest remainder or systematic rounding),
    systematic samples in each tile. Returns ``(out, counts or None, tile budgets [B, Hq, T] int32)``."""
    check_tile(tile)
    check_rounding(rounding)
    path = prop_path(k, tile)
    if path == "split":
        return santa_prop_split(q, k, v, lens, scale, budget, tile, seed, rounding=rounding,
                                write_counts=write_counts, out=out, **PROP_WIDE_STATS)
    run = santa_prop_overlap if path == "overlap" else santa_prop_two_pass
    return run(q, k, v, lens, scale, budget, tile, seed, rounding=rounding, write_counts=write_counts, out=out)


__all__ = ["flash_path", "prop_path", "santa_flash_triton", "santa_prop_triton"]
