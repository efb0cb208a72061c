"""``kvsieve bench decode``: one decode step's attention, our kernels against FlashInfer and SDPA.

For each shape (query heads, KV heads, head dim), context n and batch size it times every variant
with the cold-L2 protocol (``bench.timing``) on i.i.d. Gaussian bf16 inputs, and reports µs, the
speedup over FlashInfer, the bytes each method must touch (dense: all of K and V; S²ANTA: all of K
plus the union over each GQA group of the V rows sampled, measured on the same inputs), achieved
GB/s, the fraction of the bandwidth floor (bytes / measured copy rate) and kernel launches per call.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .timing import ColdL2Timer, copy_bandwidth, count_launches, host_us

SHAPES = {"llama-3.1-8b": (32, 8, 128), "smollm2-135m": (9, 3, 64)}
DEFAULT_CONTEXTS = (4096, 8192, 16384, 32768, 65536, 131072, 262144)
DEFAULT_VARIANTS = ("flashinfer", "sdpa", "dense", "santa-prop:128", "santa-flash:2048", "santa-flash:256")
# santa-prop / santa-flash = the default paths (docs/methods/santa-kernels.md); named paths: santa-prop-v8 =
# stats, budgets, compacted sampling with the merge folded in (3 launches); santa-prop-v7 = stats, budgets,
# v7 sampling with the merge folded in (3 launches); santa-prop-4launch = stats, budgets, v7 sampling, merge;
# santa-flash-v8 = stats + compacted sampling with the merge folded in (2 launches); santa-flash-fused = the
# fused kernel + merge (2 launches); santa-flash-split = stats + v7 sampling pass + merge (3 launches);
# santa-prop-v10 / santa-flash-v10 = stats in (row, KV head) order + the sampling kernel launched early (PDL);
# a "-pdl" / "-nopdl" suffix = the same path with programmatic dependent launch on / off (default: on, Hopper+)


@dataclass
class Case:
    shape: str
    heads: int
    kv_heads: int
    head_dim: int
    n: int
    batch: int


VARIANT_NAMES = ("flashinfer", "flashinfer-hnd", "sdpa", "dense", "santa-prop", "santa-prop-sys", "santa-prop-v7",
                 "santa-prop-v8", "santa-prop-v8-pdl", "santa-prop-v8-nopdl", "santa-prop-v10",
                 "santa-prop-4launch", "santa-flash", "santa-flash-v8", "santa-flash-v8-pdl", "santa-flash-v8-nopdl",
                 "santa-flash-v10", "santa-flash-fused", "santa-flash-split")


def parse_variant(spec: str) -> tuple[str, int | None]:
    name, _, budget = spec.partition(":")
    if name not in VARIANT_NAMES:
        raise ValueError(f"variant: expected one of {', '.join(VARIANT_NAMES)} (santa ones as name:S), got {spec!r}")
    if name.startswith("santa"):
        if not budget.isdigit() or int(budget) < 1:
            raise ValueError(f"variant {spec!r}: expected a budget, e.g. {name}:128")
        return name, int(budget)
    return name, None


def _load_flashinfer():
    try:
        import flashinfer

        return flashinfer
    except Exception as exc:  # noqa: BLE001 - FlashInfer is optional; its absence is reported
        return exc


class Inputs:
    """Random bf16 decode inputs of one case, in our layout (and FlashInfer's NHD copy on demand)."""

    def __init__(self, case: Case, dtype: torch.dtype, seed: int, q_scale: float = 1.0):
        g = torch.Generator(device="cuda").manual_seed(seed)
        b, h, hkv, d, n = case.batch, case.heads, case.kv_heads, case.head_dim, case.n
        # q_scale > 1 sharpens attention (Gaussian q, K: scores have standard deviation q_scale)
        self.q = (torch.randn(b, h, d, device="cuda", generator=g) * q_scale).to(dtype)
        self.k = torch.randn(b, hkv, n, d, device="cuda", dtype=dtype, generator=g)
        self.v = torch.randn(b, hkv, n, d, device="cuda", dtype=dtype, generator=g)
        self.lens = torch.full((b,), n, device="cuda", dtype=torch.int32)
        self.scale = d ** -0.5
        self._nhd = None

    def nhd(self):
        if self._nhd is None:
            self._nhd = (self.k[0].transpose(0, 1).contiguous(), self.v[0].transpose(0, 1).contiguous())
        return self._nhd


def make_call(name: str, budget: int | None, case: Case, x: Inputs, flashinfer, seed: int,
              workspace: dict) -> Callable[[], torch.Tensor]:
    from ..kernels.dense import dense_decode_triton
    from ..kernels.santa.kernels import santa_flash_triton, santa_prop_triton
    from ..kernels.santa.reference import auto_tile_size

    if name in ("flashinfer", "flashinfer-hnd"):
        if isinstance(flashinfer, Exception):
            raise RuntimeError(f"FlashInfer is not importable: {flashinfer}")
        if case.batch == 1 and name == "flashinfer":
            kn, vn = x.nhd()
            q0 = x.q[0]
            return lambda: flashinfer.single_decode_with_kv_cache(q0, kn, vn, kv_layout="NHD")
        if case.batch == 1:
            q0, k0, v0 = x.q[0], x.k[0], x.v[0]
            return lambda: flashinfer.single_decode_with_kv_cache(q0, k0, v0, kv_layout="HND")
        # FlashInfer's batch decode reads a paged cache: pages of 16 keys in its HND page layout
        # [pages, Hkv, 16, d], copied from ours outside the timed region.
        ws = workspace.setdefault("fi", torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda"))
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, kv_layout="HND")
        b, page = case.batch, 16
        per_row = case.n // page
        def paged(t):
            return (t.view(b, case.kv_heads, per_row, page, case.head_dim).permute(0, 2, 1, 3, 4)
                    .reshape(b * per_row, case.kv_heads, page, case.head_dim).contiguous())
        kp, vp = paged(x.k), paged(x.v)
        wrapper.plan(torch.arange(b + 1, dtype=torch.int32, device="cuda") * per_row,
                     torch.arange(b * per_row, dtype=torch.int32, device="cuda"),
                     torch.full((b,), page, dtype=torch.int32, device="cuda"),
                     case.heads, case.kv_heads, case.head_dim, page,
                     q_data_type=x.q.dtype, kv_data_type=x.k.dtype)
        return lambda: wrapper.run(x.q, (kp, vp))
    if name == "sdpa":
        q4 = x.q[:, :, None, :]
        return lambda: F.scaled_dot_product_attention(q4, x.k, x.v, enable_gqa=True)
    if name == "dense":
        return lambda: dense_decode_triton(x.q, x.k, x.v, x.lens, x.scale)
    if name.endswith("pdl"):
        from ..kernels.santa.kernels import programmatic_dependent_launch

        base, _, suffix = name.rpartition("-")
        fn = make_call(base, budget, case, x, flashinfer, seed, workspace)

        def with_pdl_set():
            with programmatic_dependent_launch(suffix == "pdl"):
                return fn()
        return with_pdl_set
    tile = auto_tile_size(case.n)
    if name.startswith("santa-flash"):
        fopts = flash_options(name)
        return lambda: santa_flash_triton(x.q, x.k, x.v, x.lens, x.scale, budget, tile, seed, **fopts)[0]
    rounding = "systematic" if name == "santa-prop-sys" else "largest-remainder"
    opts = prop_options(name)
    return lambda: santa_prop_triton(x.q, x.k, x.v, x.lens, x.scale, budget, tile, seed, rounding=rounding,
                                     **opts)[0]


def prop_options(name: str) -> dict:
    """santa-prop-v7: the v7 sampling pass; santa-prop-v8: the compacted one; santa-prop-4launch: the merge
    in its own kernel."""
    return {"santa-prop-v7": {"compact": False, "overlap": False},
            "santa-prop-v8": {"compact": True, "overlap": False},
            "santa-prop-v10": {"overlap": True},
            "santa-prop-4launch": {"compact": False, "fold_merge": False, "overlap": False}
            }.get(name, {})


def flash_options(name: str) -> dict:
    """santa-flash-v8: stats + compacted sampling pass (merge folded); santa-flash-fused: the fused kernel +
    merge (v6/v7); santa-flash-split: stats, v7 sampling pass, merge."""
    return {"santa-flash-v8": {"fused": False, "fold_merge": True, "overlap": False},
            "santa-flash-v10": {"overlap": True},
            "santa-flash-fused": {"fused": True, "overlap": False},
            "santa-flash-split": {"fused": False, "fold_merge": False, "overlap": False}
            }.get(name, {})


def bytes_touched(name: str, budget: int | None, case: Case, x: Inputs, seed: int) -> dict[str, float]:
    """Bytes the method must read (K, V) and, for S²ANTA, the V-row fraction measured on these inputs."""
    from ..kernels.santa.kernels import santa_flash_triton, santa_prop_triton
    from ..kernels.santa.reference import auto_tile_size

    elt = x.k.element_size()
    row = case.head_dim * elt
    k_bytes = case.batch * case.kv_heads * case.n * row
    if not name.startswith("santa"):
        return {"bytes": 2.0 * k_bytes, "v_row_fraction": 1.0}
    tile = auto_tile_size(case.n)
    name = name.removesuffix("-nopdl").removesuffix("-pdl")  # same samples with or without PDL
    if name.startswith("santa-flash"):
        _, counts = santa_flash_triton(x.q, x.k, x.v, x.lens, x.scale, budget, tile, seed, write_counts=True,
                                       **flash_options(name))
    else:
        rounding = "systematic" if name == "santa-prop-sys" else "largest-remainder"
        _, counts, _ = santa_prop_triton(x.q, x.k, x.v, x.lens, x.scale, budget, tile, seed, rounding=rounding,
                                         write_counts=True, **prop_options(name))
    g = case.heads // case.kv_heads
    used = (counts > 0).view(case.batch, case.kv_heads, g, case.n).any(2)
    v_rows = float(used.sum())
    return {"bytes": k_bytes + v_rows * row, "v_row_fraction": v_rows / (case.batch * case.kv_heads * case.n)}


def run_decode_bench(*, shapes=("llama-3.1-8b", "smollm2-135m"), contexts=DEFAULT_CONTEXTS, batches=(1, 8),
                     variants=DEFAULT_VARIANTS, warmup: int = 10, iters: int = 40, seed: int = 0,
                     dtype: torch.dtype = torch.bfloat16, max_kv_bytes: float = 24e9, q_scale: float = 1.0,
                     log: Callable[[str], None] = print) -> dict:
    if not torch.cuda.is_available():
        raise RuntimeError("kvsieve bench decode needs a CUDA GPU")
    parsed = [(spec, *parse_variant(spec)) for spec in variants]
    flashinfer = _load_flashinfer() if any(p[1].startswith("flashinfer") for p in parsed) else None
    if isinstance(flashinfer, Exception):
        log(f"FlashInfer unavailable ({flashinfer}); its rows are skipped")
    peak = copy_bandwidth()
    log(f"device-to-device copy: {peak / 1e12:.2f} TB/s (bytes read + written)")
    timer = ColdL2Timer()
    workspace: dict = {}
    rows = []
    cases = [Case(s, *SHAPES[s], n, b) for s in shapes for b in batches for n in contexts]
    try:
        from tqdm import tqdm

        cases_iter = tqdm(cases, desc="bench decode", mininterval=5)
    except ImportError:  # pragma: no cover
        cases_iter = cases
    for case in cases_iter:
        kv_bytes = 2 * case.batch * case.kv_heads * case.n * case.head_dim * torch.finfo(dtype).bits // 8
        if kv_bytes > max_kv_bytes:
            log(f"skip {case}: K+V {kv_bytes / 1e9:.1f} GB > {max_kv_bytes / 1e9:.0f} GB")
            continue
        try:
            x = Inputs(case, dtype, seed, q_scale)
            # float32 reference one batch row at a time (the GQA expansion of a whole batch can exceed memory)
            reference = torch.cat([
                F.scaled_dot_product_attention(x.q[i:i + 1, :, None, :].float(), x.k[i:i + 1].float(),
                                               x.v[i:i + 1].float(), enable_gqa=True)[:, :, 0]
                for i in range(case.batch)])
        except torch.OutOfMemoryError as exc:
            log(f"skip {case}: out of memory ({str(exc)[:80]})")
            torch.cuda.empty_cache()
            continue
        case_rows = []
        for spec, name, budget in parsed:
            row = {"shape": case.shape, "heads": case.heads, "kv_heads": case.kv_heads, "head_dim": case.head_dim,
                   "n": case.n, "batch": case.batch, "variant": spec}
            try:
                call = make_call(name, budget, case, x, flashinfer, seed, workspace)
                out = call()
                torch.cuda.synchronize()
                out = out.reshape(case.batch, case.heads, case.head_dim).float()
                row["rel_error_vs_sdpa"] = float((out - reference).norm() / reference.norm())
                row.update(timer.time_us(call, warmup=warmup, iters=iters))
                try:
                    row["graph_us"] = timer.time_graph_us(call, warmup=warmup, iters=iters)["median_us"]
                except Exception as exc:  # noqa: BLE001 - not every library call can be captured
                    row["graph_error"] = f"{type(exc).__name__}: {exc}"[:200]
                row["launches"] = count_launches(call)
                row["host_us"] = host_us(call)
                row["kernels_us"] = timer.kernel_breakdown(call)
                row.update(bytes_touched(name, budget, case, x, seed))
                row["gb_per_s"] = row["bytes"] / (row["median_us"] * 1e-6) / 1e9
                row["floor_us"] = row["bytes"] / peak * 1e6
                row["fraction_of_floor"] = row["floor_us"] / row["median_us"]
                kernels = ", ".join(f"{k[:28]} {v:.1f}" for k, v in (row["kernels_us"] or {}).items())
                log(f"{case.shape} n={case.n} b={case.batch} {spec}: {row['median_us']:.1f} us, graph "
                    f"{row.get('graph_us', float('nan')):.1f} us, host {row['host_us']:.0f} us; kernels: {kernels}")
            except Exception as exc:  # noqa: BLE001 - one failing variant must not lose the others' rows
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                log(f"{case.shape} n={case.n} b={case.batch} {spec}: {row['error']}")
            case_rows.append(row)
        base = next((r for r in case_rows if r["variant"] == "flashinfer" and "median_us" in r), None)
        for r in case_rows:
            if base is not None and "median_us" in r:
                r["speedup_vs_flashinfer"] = base["median_us"] / r["median_us"]
                if "graph_us" in r and "graph_us" in base:
                    r["graph_speedup_vs_flashinfer"] = base["graph_us"] / r["graph_us"]
        rows.extend(case_rows)
        del x, reference
        workspace.pop("fi", None)
        torch.cuda.empty_cache()
    return {
        "kind": "decode",
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "flashinfer": None if isinstance(flashinfer, Exception) or flashinfer is None else _version("flashinfer"),
        "dtype": str(dtype).replace("torch.", ""),
        "inputs": f"i.i.d. Gaussian q (times {q_scale}), K, V; all keys valid",
        "protocol": f"512 MB L2 flush before every call, CUDA events, {warmup} warm-up + {iters} timed, median; "
                    "'graph' = the same with the call captured in a CUDA graph and replayed",
        "copy_bandwidth_bytes_per_s": peak,
        "rows": rows,
    }


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001
        return None


def geometric_mean(values) -> float:
    values = [v for v in values if v > 0]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")
