"""``kvsieve bench decode``: one decode step's attention, our kernels against FlashInfer and SDPA.

For each shape (query heads, KV heads, head dim), context n and batch size it times every variant
with the cold-L2 protocol (``bench.timing``) on i.i.d. Gaussian bf16 inputs, and reports µs, the
speedup over FlashInfer, the bytes each method must touch (dense: all of K and V; S²ANTA: all of K
plus the union over each GQA group of the V rows sampled, measured on the same inputs), achieved
GB/s, the fraction of the bandwidth floor (bytes / measured copy rate) and kernel launches per call.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .report import library_version
from .timing import ColdL2Timer, copy_bandwidth, count_launches, host_us

SHAPES = {"llama-3.1-8b": (32, 8, 128), "smollm2-135m": (9, 3, 64)}
DEFAULT_CONTEXTS = (4096, 8192, 16384, 32768, 65536, 131072, 262144)
DEFAULT_VARIANTS = ("flashinfer", "sdpa", "dense", "santa-prop:128", "santa-flash:2048", "santa-flash:256")


@dataclass
class Case:
    shape: str
    heads: int
    kv_heads: int
    head_dim: int
    n: int
    batch: int


class Inputs:
    """Random bf16 decode inputs of one case, in our layout (and FlashInfer's NHD copy on demand)."""

    def __init__(self, case: Case, dtype: torch.dtype, seed: int, q_scale: float = 1.0, device: str = "cuda",
                 attention: str = "uniform", peaked=None):
        g = torch.Generator(device=device).manual_seed(seed)
        b, h, hkv, d, n = case.batch, case.heads, case.kv_heads, case.head_dim, case.n
        self.case = case
        if attention == "peaked":
            # q and K as one layer of the shape's peaked model makes them (bench.peaked), V Gaussian
            from .peaked import peaked_decode_qk

            if q_scale != 1.0:
                raise ValueError(f"q_scale: only with attention='uniform', got {q_scale}")
            self.q, self.k = peaked_decode_qk(case.shape, b, h, hkv, d, n, seed, dtype, device, peaked)
        else:
            from .peaked import check_attention

            check_attention(attention, peaked)
            # q_scale > 1 sharpens attention (Gaussian q, K: scores have standard deviation q_scale)
            self.q = (torch.randn(b, h, d, device=device, generator=g) * q_scale).to(dtype)
            self.k = torch.randn(b, hkv, n, d, device=device, dtype=dtype, generator=g)
        self.v = torch.randn(b, hkv, n, d, device=device, dtype=dtype, generator=g)
        self.lens = torch.full((b,), n, device=device, dtype=torch.int32)
        self.scale = d ** -0.5
        self._nhd = None

    def nhd(self):
        if self._nhd is None:
            self._nhd = (self.k[0].transpose(0, 1).contiguous(), self.v[0].transpose(0, 1).contiguous())
        return self._nhd


# A variant builds, for one case's inputs, a budget (None where it takes none) and a seed, the call of one
# decode step (returning the output) and, for sampling methods, a function giving the V rows that step reads
# ([B, Hkv, N] bool, the union over each GQA group; None: all of V).
Call = Callable[[], torch.Tensor]
VariantFactory = Callable[[Inputs, "int | None", int], tuple[Call, "Callable[[], torch.Tensor] | None"]]


@dataclass(frozen=True)
class Variant:
    make: VariantFactory
    takes_budget: bool
    peer: bool  # another library's kernel (the comparison), not one of kvsieve's methods


VARIANTS: dict[str, Variant] = {}


def register_variant(name: str, *, budget: bool = False, peer: bool = False):
    """Adds ``make(inputs, budget, seed) -> (call, v_rows or None)`` to the benchmark as ``name`` (``name:S``
    when it takes a budget). A method with a GPU path registers it here under the method's name."""
    def register(make: VariantFactory) -> VariantFactory:
        VARIANTS[name] = Variant(make, budget, peer)
        return make
    return register


def parse_variant(spec: str) -> tuple[str, int | None]:
    name, _, budget = spec.partition(":")
    if name not in VARIANTS:
        raise ValueError(f"variant: expected one of {', '.join(VARIANTS)} (those with a budget as name:S), "
                         f"got {spec!r}")
    if VARIANTS[name].takes_budget:
        if not budget.isdigit() or int(budget) < 1:
            raise ValueError(f"variant {spec!r}: expected a budget, e.g. {name}:128")
        return name, int(budget)
    if budget:
        raise ValueError(f"variant {spec!r}: {name} takes no budget")
    return name, None


@functools.cache
def load_flashinfer():
    """The flashinfer module, or the exception that importing it raised (FlashInfer is optional)."""
    try:
        import flashinfer

        return flashinfer
    except Exception as exc:  # noqa: BLE001 - its absence is reported, and its rows are skipped
        return exc


def timing_setup(*, flashinfer: bool = True, log: Callable[[str], None] = print):
    """``(flashinfer, copy rate in bytes/s, ColdL2Timer)``: what every GPU timing run starts from.
    ``flashinfer`` is the module, the exception that importing it raised (logged: its rows are then
    skipped), or None when not asked for."""
    module = load_flashinfer() if flashinfer else None
    if isinstance(module, Exception):
        log(f"FlashInfer unavailable ({module}); its rows are skipped")
    peak = copy_bandwidth()
    log(f"device-to-device copy: {peak / 1e12:.2f} TB/s (bytes read + written)")
    return module, peak, ColdL2Timer()


@register_variant("flashinfer", peer=True)
def _flashinfer(x: Inputs, budget, seed):
    flashinfer = load_flashinfer()
    if isinstance(flashinfer, Exception):
        raise RuntimeError(f"FlashInfer is not importable: {flashinfer}")
    case = x.case
    if case.batch == 1:
        kn, vn = x.nhd()
        q0 = x.q[0]
        return (lambda: flashinfer.single_decode_with_kv_cache(q0, kn, vn, kv_layout="NHD")), None
    # FlashInfer's batch decode reads a paged cache: pages of 16 keys in its HND page layout
    # [pages, Hkv, 16, d], copied from ours outside the timed region.
    ws = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")
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
    return (lambda: wrapper.run(x.q, (kp, vp))), None


@register_variant("sdpa", peer=True)
def _sdpa(x: Inputs, budget, seed):
    q4 = x.q[:, :, None, :]
    return (lambda: F.scaled_dot_product_attention(q4, x.k, x.v, enable_gqa=True)), None


@register_variant("dense")
def _dense(x: Inputs, budget, seed):
    from ..kernels.shared.dense import dense_decode_triton

    return (lambda: dense_decode_triton(x.q, x.k, x.v, x.lens, x.scale)), None


def _v_rows(counts: torch.Tensor, x: Inputs) -> torch.Tensor:
    """[B, Hkv, N]: the V rows some head of each GQA group sampled."""
    b, hq, n = counts.shape
    return (counts > 0).view(b, x.case.kv_heads, hq // x.case.kv_heads, n).any(2)


def _santa_variant(entry: str):
    """santa-prop / santa-flash through their entry point ``kernels.santa.decode.<entry>`` (the default path)."""
    def make(x: Inputs, budget, seed):
        from ..kernels.santa import decode
        from ..kernels.santa.reference import auto_tile_size

        run = getattr(decode, entry)
        tile = auto_tile_size(x.case.n)
        args = (x.q, x.k, x.v, x.lens, x.scale, budget, tile, seed)
        return (lambda: run(*args)[0]), (lambda: _v_rows(run(*args, write_counts=True)[1], x))
    return make


register_variant("santa-prop", budget=True)(_santa_variant("santa_prop_triton"))
register_variant("santa-flash", budget=True)(_santa_variant("santa_flash_triton"))


def bytes_touched(v_rows: Callable[[], torch.Tensor] | None, x: Inputs) -> dict[str, float]:
    """Bytes the method must read (all of K; all of V, or the V rows it sampled on these inputs)."""
    case = x.case
    row = case.head_dim * x.k.element_size()
    k_bytes = case.batch * case.kv_heads * case.n * row
    if v_rows is None:
        return {"bytes": 2.0 * k_bytes, "v_row_fraction": 1.0}
    used = float(v_rows().sum())
    return {"bytes": k_bytes + used * row, "v_row_fraction": used / (case.batch * case.kv_heads * case.n)}


def run_decode_bench(*, shapes=("llama-3.1-8b", "smollm2-135m"), contexts=DEFAULT_CONTEXTS, batches=(1, 8),
                     variants=DEFAULT_VARIANTS, warmup: int = 10, iters: int = 40, seed: int = 0,
                     dtype: torch.dtype = torch.bfloat16, max_kv_bytes: float = 24e9, q_scale: float = 1.0,
                     attention: str = "uniform", log: Callable[[str], None] = print) -> dict:
    """Rows per (shape, batch, n, variant); ``attention``: ``uniform`` (Gaussian q, K) or ``peaked``
    (``bench.peaked``, the shape's committed fit); the results carry each case's attention profile."""
    from .peaked import calibration_record, check_attention, decode_profile, fitted

    check_attention(attention)
    if not torch.cuda.is_available():
        raise RuntimeError("kvsieve bench decode needs a CUDA GPU")
    parsed = [(spec, *parse_variant(spec)) for spec in variants]
    flashinfer, peak, timer = timing_setup(flashinfer=any(p[1] == "flashinfer" for p in parsed), log=log)
    rows, profiles = [], {}
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
            x = Inputs(case, dtype, seed, q_scale, attention=attention)
            profiles[f"{case.shape} n={case.n} b={case.batch}"] = decode_profile(x.q, x.k, x.scale)
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
                call, v_rows = VARIANTS[name].make(x, budget, seed)
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
                row.update(bytes_touched(v_rows, x))
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
        call = v_rows = None  # FlashInfer's workspace and paged copies go with its call
        del x, reference
        torch.cuda.empty_cache()
    return {
        "kind": "decode",
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": library_version("triton"),
        "flashinfer": (None if isinstance(flashinfer, Exception) or flashinfer is None
                       else library_version("flashinfer")),
        "dtype": str(dtype).replace("torch.", ""),
        "inputs": (f"i.i.d. Gaussian q (times {q_scale}), K, V; all keys valid" if attention == "uniform" else
                   "peaked: q and K as one layer of the shape's peaked random-weight model makes them (bench.peaked: "
                   "sink, local window, strong matches, fitted to real models' attention), V Gaussian; all keys valid"),
        "attention": attention,
        "calibration": {s: calibration_record(s, fitted(s)[0] if attention == "peaked" else None, None)
                        for s in shapes},
        "attention_profiles": profiles,
        "protocol": f"512 MB L2 flush before every call, CUDA events, {warmup} warm-up + {iters} timed, median; "
                    "'graph' = the same with the call captured in a CUDA graph and replayed",
        "copy_bandwidth_bytes_per_s": peak,
        "rows": rows,
    }


def geometric_mean(values) -> float:
    values = [v for v in values if v > 0]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")
