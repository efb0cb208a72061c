"""S²ANTA-prop and S²ANTA-flash on the GPU: each call takes the path measured fastest for its size.

Torch references: ``reference.santa_prop_reference`` / ``santa_flash_reference`` (float64). Given the
uniforms of ``triton_utils.tile_uniforms`` / ``budget_uniforms`` every path draws the reference's counts
and budgets, except for rare floor-boundary flips on the GPU (float32 scores here, float64 there): the
running sums of systematic sampling are exact fixed-point integers (``common.fixed_point``), so every
tile's counts add up to its budget exactly.

Layout: q ``[B, Hq, d]``, K/V ``[B, Hkv, N, d]`` (the transformers cache; last dim contiguous), ``lens [B]``
int32 valid prefix lengths. Every program serves the G query heads of a GQA group with one K load.

The paths (H100, bf16, graph-timed, docs/methods/santa-kernels.md):

- ``overlap.py`` (v10) from ``*_OVERLAP_MIN_TILES`` tiles in all (rows × KV heads × tiles per head), where
  programmatic dependent launch is on (Hopper and newer): the sampling overlaps the K stream;
- ``fused.py``, santa-flash up to ``FLASH_FUSED_MAX_TILES`` tiles per head;
- ``two_pass.py`` (v8) otherwise, and wherever programmatic dependent launch is off (older GPUs, the
  interpreter), since without it v10 only adds waits.
"""

from __future__ import annotations

import torch

from ..shared.triton_utils import pdl_available
from .common import all_tiles, check_rounding, check_tile, tile_count
from .fused import santa_flash_fused
from .overlap import santa_flash_overlap, santa_prop_overlap
from .two_pass import santa_flash_two_pass, santa_prop_two_pass

# santa-flash: the fused kernel up to this many tiles per head (8k keys at tile 256), v8 above; v10 from this
# many tiles in all where programmatic dependent launch is on: its 528 stats programs finish the (row, KV head)
# units one after another only when there are several rounds of tiles, and with one or two rounds it only adds
# waits. Measured on the H100 (graph-timed; docs/methods/santa-kernels.md,
# docs/results/gpu-bench/2026-11-22-h100-decode-v10d.md).
FLASH_FUSED_MAX_TILES = 32
FLASH_OVERLAP_MIN_TILES = 1024
PROP_OVERLAP_MIN_TILES = 2048


def flash_path(k: torch.Tensor, tile: int) -> str:
    """"overlap", "fused" or "two-pass": the path ``santa_flash_triton`` takes for this cache."""
    if all_tiles(k, tile) >= FLASH_OVERLAP_MIN_TILES and pdl_available():
        return "overlap"
    return "fused" if tile_count(k.shape[2], tile) <= FLASH_FUSED_MAX_TILES else "two-pass"


def prop_path(k: torch.Tensor, tile: int) -> str:
    """"overlap" or "two-pass": the path ``santa_prop_triton`` takes for this cache."""
    return "overlap" if all_tiles(k, tile) >= PROP_OVERLAP_MIN_TILES and pdl_available() else "two-pass"


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
    run = santa_prop_overlap if prop_path(k, tile) == "overlap" else santa_prop_two_pass
    return run(q, k, v, lens, scale, budget, tile, seed, rounding=rounding, write_counts=write_counts, out=out)


__all__ = ["flash_path", "prop_path", "santa_flash_triton", "santa_prop_triton"]
