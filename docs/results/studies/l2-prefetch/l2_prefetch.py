# ruff: noqa: B023 - every closure below is captured and timed before its loop variables change
"""Does prefetching the output projection into L2 during a method's latency-bound tail pay? (GPU)

A sparse method's decode call streams the cache once (S²ANTA's statistics pass, Quest's page bounds) and then
runs a tail of few-program launches (budgets, a select, sampling, a merge) during which the memory bus is nearly
idle; the layer's output projection (``o_proj``, 32 MB at the Llama-3.1-8B shape) follows it and reads its
weights from HBM. This bench forks a side stream once the method's stream is launched, prefetches ``o_proj``'s
weight into L2 there, and joins it before the product — all captured in one CUDA graph, cold L2 per replay.

Ways of prefetching (each timed alone and in front of the product): ``bulk`` (``cp.async.bulk.prefetch.L2``,
sm_90+), ``line`` (``prefetch.global.L2::evict_last`` per 128-byte line), ``load`` (loads through L2 into a
discarded sum). Cases: the method call followed by the product, without prefetch, with the prefetch forked after
the stream (``tail``), and forked at the call's start (``start``, racing the stream).

    python docs/results/studies/l2-prefetch/l2_prefetch.py --out DIR [--cases 1x128k,8x32k]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "src"))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import kvsieve  # noqa: E402
from kvsieve.bench.timing import ColdL2Timer, capture_graph  # noqa: E402
from kvsieve.core.context import CallContext  # noqa: E402


@triton.jit
def _prefetch_kernel(ptr, n_bytes, flag_ptr, CHUNK: tl.constexpr, PER_PROG: tl.constexpr, MODE: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    base = ptr.to(tl.pointer_type(tl.int8))
    if MODE == 0:  # one bulk prefetch of CHUNK bytes per element
        offs = (pid * PER_PROG + tl.arange(0, PER_PROG)).to(tl.int64) * CHUNK
        ok = offs < n_bytes
        size = tl.minimum(n_bytes - offs, CHUNK).to(tl.int32)
        r = tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r,r", [base + offs, size, ok.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
    elif MODE == 1:  # one line prefetch per 128 bytes
        offs = (pid * PER_PROG + tl.arange(0, PER_PROG)).to(tl.int64) * 128
        ok = offs < n_bytes
        r = tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0; }",
            "=r,l,r", [base + offs, ok.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
    else:  # loads through L2 only, summed and dropped
        offs = (pid * PER_PROG + tl.arange(0, PER_PROG)).to(tl.int64) * 16
        ok = offs < n_bytes
        w = tl.load(base.to(tl.pointer_type(tl.int32)) + offs // 4, mask=ok, other=0, cache_modifier=".cg")
        r = w
    total = tl.sum(r, 0)
    flag = tl.load(flag_ptr)
    tl.store(flag_ptr + 1, total, mask=flag != 0)  # never taken (flag is 0): keeps the loads


WAYS = {"bulk": (0, 65536, 16), "line": (1, 128, 1024), "load": (2, 16, 4096)}


def prefetch(t: torch.Tensor, way: str, flag: torch.Tensor) -> None:
    mode, chunk, per_prog = WAYS[way]
    n_bytes = t.numel() * t.element_size()
    if way == "load":  # each element reads 4 bytes of every 16: the line is fetched whole
        per_prog = 4096
    grid = (triton.cdiv(triton.cdiv(n_bytes, chunk), per_prog),)
    _prefetch_kernel[grid](t, n_bytes, flag, CHUNK=chunk, PER_PROG=per_prog, MODE=mode, num_warps=4)


class Fork:
    """A side stream that prefetches ``weight`` when ``fire()`` is called, joined by ``join()``."""

    def __init__(self, weight, way, flag):
        self.weight, self.way, self.flag = weight, way, flag
        self.side = torch.cuda.Stream()
        self.fired = False

    def fire(self):
        if self.way is None or self.fired:
            return
        self.fired = True
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            prefetch(self.weight, self.way, self.flag)

    def join(self):
        if self.fired:
            torch.cuda.current_stream().wait_stream(self.side)
        self.fired = False


@contextlib.contextmanager
def patched(method_name: str, fork: Fork, where: str):
    """Patches that fire the fork once the method's stream is launched (``where="tail"``)."""
    from kvsieve.kernels.quest import quest_pages
    from kvsieve.kernels.santa import overlap, split_merge

    if where != "tail":
        yield
        return
    if method_name.startswith(("santa", "bernoulli")):
        real_budgets, real_ordered = split_merge.prop_budgets, overlap.ordered_stats_pass

        def budgets(*a, **kw):
            fork.fire()
            return real_budgets(*a, **kw)

        def ordered(*a, **kw):
            got = real_ordered(*a, **kw)
            fork.fire()
            return got

        with mock.patch.object(split_merge, "prop_budgets", budgets), \
                mock.patch.object(overlap, "ordered_stats_pass", ordered):
            yield
    elif method_name.startswith("quest"):
        real = quest_pages.page_bounds_triton

        def bounds(*a, **kw):
            got = real(*a, **kw)
            fork.fire()
            return got

        with mock.patch.object(quest_pages, "page_bounds_triton", bounds):
            yield
    else:
        raise ValueError(f"no hook for {method_name}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default="1x128k,8x32k")
    ap.add_argument("--methods", default="santa-prop:budget=128;quest:top_k=0.05,share_kv_group=true")
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    timer = ColdL2Timer(dev)
    flag = torch.zeros(2, dtype=torch.int32, device=dev)
    hidden = 4096
    g = torch.Generator(dev).manual_seed(0)
    w = torch.randn(hidden, hidden, device=dev, dtype=torch.bfloat16, generator=g) / 64
    rows = []

    def record(**kw):
        rows.append(kw)
        print(json.dumps(kw), flush=True)

    # the prefetch ways alone and in front of the product
    for batch in (1, 8):
        x = torch.randn(batch, hidden, device=dev, dtype=torch.bfloat16, generator=g)
        y = torch.empty(batch, hidden, device=dev, dtype=torch.bfloat16)
        record(case=f"b{batch}", what="o_proj cold", **timer.time_graph_us(lambda: torch.mm(x, w.t(), out=y),
                                                                           iters=args.iters))
        graph = capture_graph(lambda: torch.mm(x, w.t(), out=y))
        warm = ColdL2Timer(dev, flush_bytes=4096)
        record(case=f"b{batch}", what="o_proj warm", **warm.time_us(graph.replay, iters=args.iters))
        for way in WAYS:
            record(case=f"b{batch}", what=f"prefetch {way} alone",
                   **timer.time_graph_us(lambda: prefetch(w, way, flag), iters=args.iters))

            def both():
                prefetch(w, way, flag)
                torch.mm(x, w.t(), out=y)

            record(case=f"b{batch}", what=f"prefetch {way} then o_proj", **timer.time_graph_us(both, iters=args.iters))

    for case in args.cases.split(","):
        batch, n = case.split("x")
        batch, n = int(batch), int(n[:-1]) * 1024
        q = torch.randn(batch, 32, 128, device=dev, dtype=torch.bfloat16, generator=g)
        k = torch.randn(batch, 8, n + 16, 128, device=dev, dtype=torch.bfloat16, generator=g)
        v = torch.randn(batch, 8, n + 16, 128, device=dev, dtype=torch.bfloat16, generator=g)
        k[:, :, :4] *= 4  # some peaked keys
        lengths = torch.full((batch,), n, dtype=torch.int32, device=dev)
        y = torch.empty(batch, hidden, device=dev, dtype=torch.bfloat16)
        for name in args.methods.split(";"):
            m = kvsieve.method(name)
            state = m.new_state()
            ctx = CallContext(layer=0, count_reads=False, min_length=n, capacity=n + 16)
            for way in (None, *WAYS):
                for where in (("tail", "start") if way else ("none",)):
                    fork = Fork(w, way, flag)

                    def call():
                        if where == "start":
                            fork.fire()
                        o, _ = m.decode(q, k, v, lengths=lengths, seed=1, state=state, context=ctx,
                                        check_finite=False)
                        fork.join()
                        torch.mm(o.reshape(batch, hidden), w.t(), out=y)

                    try:
                        with patched(name, fork, where):
                            ref = None
                            t = timer.time_graph_us(call, iters=args.iters)
                            call()
                            ref = y.clone()
                        record(case=case, method=name, way=way or "none", where=where, **t,
                               finite=bool(torch.isfinite(ref).all()))
                    except Exception as e:  # noqa: BLE001 - a way that fails is reported, the rest run
                        record(case=case, method=name, way=way or "none", where=where, error=repr(e)[:300])
            # the call alone
            record(case=case, method=name, what="call alone",
                   **timer.time_graph_us(lambda: m.decode(q, k, v, lengths=lengths, seed=1, state=state, context=ctx,
                                                          check_finite=False), iters=args.iters))
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "triton": triton.__version__, "command": " ".join(sys.argv)}
    (out / "l2_prefetch.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
