"""Why does replaying a method's captured decode step cost the host 0.65–0.95 ms when dense costs 0.11?

Issue 16 asks for host time per step under 0.3 ms. ``step()`` of a captured runtime is one
``CUDAGraph.replay()``, so the difference lies in the graphs themselves. This study captures each
variant's decode step with CUDA's graph debug mode on, counts the graph's nodes by type (kernel,
memset, memcpy, event, host, ...) and by kernel name, and times ``replay()`` on the host with the
device idle. Two synthetic graphs separate the node count from the node kind: N small torch kernels
and N small Triton kernels.

    python docs/results/studies/runtime-host/graph_replay.py OUT [--n 8192] [--layers 32]
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from pathlib import Path

import torch


def host_replay_ms(graph, n: int = 30) -> float:
    """Median host time of ``graph.replay()`` with the device idle, as the e2e bench times ``step()``."""
    from kvsieve.bench.e2e import host_ms

    return host_ms(graph.replay, n)["host_ms"]


def dot_summary(path: Path) -> dict:
    text = path.read_text(errors="replace")
    kinds = collections.Counter(re.findall(r'label="\{?\s*([A-Z_]+)', text))
    names = collections.Counter(re.findall(r"\\n(?:name|kernel)[^\\]*?:\s*([\w:<>,\. ]+?)\\", text))
    edges = len(re.findall(r"->", text))
    # kernel parameter sizes, where the dump shows them
    params = [int(x) for x in re.findall(r"paramSize[^\d]*(\d+)", text)]
    return {"node_kinds": dict(kinds), "edges": edges, "top_kernels": names.most_common(15),
            "param_bytes_total": sum(params), "dot_bytes": len(text)}


class DebugGraphs:
    """Every CUDAGraph made while installed keeps its cudaGraph_t (so debug_dump works after capture)."""

    def __init__(self):
        self.made = []
        self._orig = torch.cuda.CUDAGraph

    def __enter__(self):
        orig, made = self._orig, self.made

        def factory(*a, **k):
            g = orig(*a, **{**k, "keep_graph": True})  # the cudaGraph_t outlives instantiation: debug_dump
            made.append(g)
            return g

        torch.cuda.CUDAGraph = factory
        return self

    def __exit__(self, *exc):
        torch.cuda.CUDAGraph = self._orig


def synthetic(out: Path, count: int) -> list[dict]:
    import triton
    import triton.language as tl

    @triton.jit
    def add_one(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=m) + 1, mask=m)

    x = torch.zeros(1024, device="cuda")
    rows = []
    for kind in ("torch", "triton"):
        def body(kind=kind):
            for _ in range(count):
                if kind == "torch":
                    x.add_(1)
                else:
                    add_one[(1,)](x, 1024, BLOCK=1024)
        body()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(g):
            body()
        g.replay()
        path = out / f"synthetic-{kind}.dot"
        g.debug_dump(str(path))
        rows.append({"variant": f"synthetic {count} {kind} kernels", "host_ms": host_replay_ms(g),
                     **dot_summary(path)})
        path.unlink()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--methods", default="dense;quest:top_k=0.05,share_kv_group=true;santa-prop:budget=128;"
                    "streaming:sink=128,window=1536;oracle-topk:top_k=0.05,share_kv_group=true")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from kvsieve.bench.e2e import build_model
    from kvsieve.runtime import DecodeRuntime

    rows = synthetic(out, 900)
    for r in rows:
        print(json.dumps(r)[:600], flush=True)
    model = build_model("llama-3.1-8b", num_hidden_layers=args.layers)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (args.n,), generator=g).cuda()
    rt = DecodeRuntime(model, "dense", batch_size=1, capacity=args.n + 64, max_new_tokens=60, eos_token_id=[],
                       graph="auto")
    with rt:
        rt.prefill([prompt])
        for method in args.methods.split(";"):
            with DebugGraphs() as dbg:
                rt.set_method(method)
                rt.rewind()
                for _ in range(3):
                    rt.step()
            graph = rt.graph_obj
            row = {"variant": method, "graph": rt.use_graph, "graphs_made": len(dbg.made)}
            if graph is not None:
                row["host_ms"] = host_replay_ms(graph)
                path = out / "step.dot"
                graph.debug_dump(str(path))
                row.update(dot_summary(path))
                if method.startswith("quest"):
                    path.rename(out / "quest-step.dot")
                elif method == "dense":
                    path.rename(out / "dense-step.dot")
                else:
                    path.unlink()
            rows.append(row)
            print(json.dumps(row)[:1500], flush=True)
        # The runtime as the e2e bench uses it (no debug graphs): the bench's host time of step() beside
        # the bare replay of the same graph, and where step()'s host time goes (cProfile).
        import cProfile
        import io
        import pstats

        from kvsieve.bench.e2e import host_ms
        for method in args.methods.split(";"):
            rt.set_method(method)
            rt.rewind()
            for _ in range(3):
                rt.step()
            row = {"variant": method, "plain": True, "host_step_ms": host_ms(rt.step, 9)}
            if rt.graph_obj is not None:
                row["host_replay_ms"] = host_replay_ms(rt.graph_obj, 9)
            prof = cProfile.Profile()
            for _ in range(5):
                torch.cuda.synchronize()
                prof.enable()
                rt.step()
                prof.disable()
            torch.cuda.synchronize()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(8)
            row["profile"] = buf.getvalue()[-2500:]
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
            print(row["profile"], flush=True)
    (out / "graph_replay.json").write_text(json.dumps({"n": args.n, "layers": args.layers, "rows": rows,
                                                       "torch": torch.__version__,
                                                       "device": torch.cuda.get_device_name()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
