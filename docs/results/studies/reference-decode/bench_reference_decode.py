"""CPU time of one reference decode step per method, against the dense reference (a benchmark, not a test).

Real q/k/v of the default model at N keys by default (``--source random``: Gaussian inputs). Every
method runs at about 10% density where it has a knob; state (Quest pages, MagicPIG hashes) is warm,
as in decoding, where it is updated incrementally. Reports the median over repetitions and, for
methods slower than ``--flag`` × dense, the three torch calls with the most self time.

    python docs/results/studies/reference-decode/bench_reference_decode.py --out docs/results/reference-decode-bench
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time
from pathlib import Path

import torch

import kvsieve

SPECS = [
    "dense",
    "streaming",
    "oracle-topk:top_k=0.07",
    "oracle-topp:top_p=0.9",
    "random:budget=0.07",
    "quest:top_k=0.07",
    "magicpig:bits=8,tables=48",
    "vattention:bound=denominator",  # the default until issue 13, as these results were measured
    "vattention:bound=full",
    "vattention:predictor=quest,bound=denominator",
    "vattention:share_kv_group=true,bound=denominator",
]


def time_method(spec, q, k, v, reps):
    m = kvsieve.method(spec)
    state = m.new_state()
    m.decode(q, k, v, seed=0, state=state, check_finite=False)  # warm state and allocator
    times = []
    for i in range(reps):
        t = time.perf_counter()
        _, st = m.decode(q, k, v, seed=i + 1, state=state, check_finite=False)
        times.append(time.perf_counter() - t)
    return statistics.median(times), st


def top_ops(spec, q, k, v, n=3):
    m = kvsieve.method(spec)
    state = m.new_state()
    m.decode(q, k, v, seed=0, state=state, check_finite=False)
    prof = cProfile.Profile()
    prof.enable()
    for i in range(5):
        m.decode(q, k, v, seed=i, state=state, check_finite=False)
    prof.disable()
    s = io.StringIO()
    stats = pstats.Stats(prof, stream=s).sort_stats("tottime")
    rows = []
    for (file, line, func), (_cc, _nc, tt, _ct, _callers) in sorted(stats.stats.items(), key=lambda x: -x[1][2])[:n]:
        where = func if file == "~" else f"{Path(file).name}:{line}({func})"
        rows.append(f"{where} {tt / 5 * 1000:.1f} ms")
    return rows


def captured_layers(n_tokens, layers):
    """q/k/v ``[1, ...]`` of one decode step of the default model after ``n_tokens`` of essay text."""
    from transformers import DynamicCache

    from kvsieve.assets import essay_texts
    from kvsieve.integrations.hf import capture_attention

    model, tok = kvsieve.load_model("default")
    ids = tok("\n\n".join(essay_texts()), return_tensors="pt").input_ids[:, : n_tokens - 1]
    cache = DynamicCache()
    with torch.no_grad():
        out = model(ids, past_key_values=cache)
        with capture_attention(model, layers=layers) as cap:
            model(out.logits[:, -1:].argmax(-1), past_key_values=cache)
    return [(q[:, :, 0].contiguous(), k.contiguous(), v.contiguous()) for _, q, k, v in cap.calls]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="docs/results/reference-decode-bench")
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--flag", type=float, default=1.5)
    p.add_argument("--source", choices=("random", "model"), default="model",
                   help="'model': q/k/v of one real decode step of the default model (essay text) at --layers; "
                        "'random': Gaussian inputs (near-uniform attention, the worst case for sampling budgets)")
    p.add_argument("--layers", type=int, nargs="+", default=[2, 14, 26])
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    captured = captured_layers(args.n, args.layers) if args.source == "model" else None
    for b in args.batch:
        if captured is None:
            g = torch.Generator().manual_seed(0)
            calls = [(torch.randn(b, 9, 64, generator=g), torch.randn(b, 3, args.n, 64, generator=g),
                      torch.randn(b, 3, args.n, 64, generator=g))]
        else:
            calls = [tuple(t.expand(b, *t.shape[1:]).contiguous() for t in c) for c in captured]
        dense_t = None
        for spec in SPECS:
            results = [time_method(spec, q, k, v, args.reps) for q, k, v in calls]
            t = sum(r[0] for r in results) / len(results)
            st = results[0][1]
            st = type("S", (), dict(density=sum(r[1].density for r in results) / len(results),
                                    kv_density=sum(r[1].kv_density for r in results) / len(results)))
            q, k, v = calls[0]
            dense_t = t if spec == "dense" else dense_t
            ratio = t / dense_t
            row = dict(batch=b, spec=spec, ms=t * 1000, ratio=ratio, density=st.density, kv_density=st.kv_density)
            if ratio > args.flag:
                row["top_ops"] = top_ops(spec, q, k, v)
            rows.append(row)
            print(f"B={b} {spec:35s} {t * 1000:8.2f} ms  x{ratio:5.2f}  density {st.density:.3f}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(dict(rows=rows, args=vars(args)), indent=1))
    lines = [
        f"# Reference decode step on CPU, N = {args.n}",
        "",
        f"Command: `python docs/results/studies/reference-decode/bench_reference_decode.py --n {args.n} "
        f"--batch {' '.join(map(str, args.batch))} --reps {args.reps} --threads {args.threads} --source {args.source}"
        + (f" --layers {' '.join(map(str, args.layers))}`" if args.source == "model" else "`"),
        "",
        ("Real q/k/v of one decode step of the default model after N tokens of essay text, layers "
         f"{', '.join(map(str, args.layers))} (time = mean over those layers; batch rows repeat the row). "
         if args.source == "model" else "Random Gaussian q/k/v (near-uniform attention). ")
        + "Default-model layer shape (9 q / 3 KV heads, d = 64, float32), median of "
        f"{args.reps} steps, {args.threads} thread(s) on a shared 2-core CPU (timings are noisy). Input "
        "checks off (`check_finite=False`) for every method alike. Ratio = time / dense reference time.",
        "",
        "| B | method | ms | × dense | density | kv density | most self time (> "
        f"{args.flag}× dense) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['batch']} | `{r['spec']}` | {r['ms']:.2f} | {r['ratio']:.2f} | {r['density']:.3f} | "
                     f"{r['kv_density']:.3f} | {'; '.join(r.get('top_ops', []))} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
