"""Each Triton launch of variant=authors' decode step timed alone, and launch settings swept per launch (GPU).

``decode.py`` times the whole step and reports per-kernel device µs of an eager step, where a kernel launched with
programmatic dependent launch (PDL) counts its wait for the kernel before. Here one ``next`` step's launches are
recorded (kernel, grid, arguments, constexprs), then each is captured alone in a CUDA graph without PDL and replayed
with a cold L2; ``--sweep`` adds settings per kernel (warps, rows per program, tile width of the probabilities'
launch). A launch replayed alone repeats its own work on the state the step left (the same shapes and branches).

    python benchmarks/sketchwalk_authors/stage_sweep.py --out DIR [--n 131072] [--batch 1]
"""

# ruff: noqa: B023 - every closure below is captured and timed before its loop variables change

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "breakdown"))

from launch_sweep import kernel_name, recording, spying, time_launches  # noqa: E402

import kvsieve  # noqa: E402
from kvsieve import CallContext  # noqa: E402
from kvsieve.bench.report import environment  # noqa: E402
from kvsieve.bench.timing import ColdL2Timer  # noqa: E402
from kvsieve.kernels.sketchwalk import authors_decode as kd  # noqa: E402
from kvsieve.kernels.sketchwalk import authors_walk as aw  # noqa: E402


def extra_settings(kernel, grid, meta):
    """The probabilities' and logits' launches: rows and blocks per program beside the swept warps and stages."""
    name = kernel_name(kernel)
    out = []
    if name == "_row_probs_kernel":
        for br in (16, 32, 64, 128):
            for w in (1, 2, 4, 8):
                if (br, w) != (meta["BLOCK_R"], meta["num_warps"]):
                    out.append((f"BLOCK_R={br},warps={w}", grid, {**meta, "BLOCK_R": br, "num_warps": w}))
    if name == "_row_logits_kernel":
        for br in (16, 64):
            if br != meta["BLOCK_R"]:
                out.append((f"BLOCK_R={br}", grid, {**meta, "BLOCK_R": br}))
    return out


def main() -> None:
    from decode import case_arguments, prompt_state

    ap = case_arguments()
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()

    n, b, hq, hkv, d = args.n, args.batch, 32, 8, 128
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(b, hq, n, d, device=dev, generator=g).bfloat16()
    k = torch.randn(b, hkv, n, d, device=dev, generator=g).bfloat16()
    v = torch.randn(b, hkv, n, d, device=dev, generator=g).bfloat16()
    m = kvsieve.method(args.spec)
    prompt = prompt_state(m, q, k, v, n - 1)
    del q
    q_steps = torch.randn(2, b, hq, d, device=dev, generator=g).bfloat16()
    ctx = CallContext(capacity=n, count_reads=False)
    state = copy.deepcopy(prompt)
    m.decode(q_steps[0], k, v, lengths=torch.full((b,), n - 1, device=dev, dtype=torch.int32), state=state,
             context=ctx, check_finite=False)
    nxt = torch.full((b,), n, device=dev, dtype=torch.int32)

    def step():
        return m.decode(q_steps[1], k, v, lengths=nxt, state=state, context=ctx, check_finite=False)[0]

    timer = ColdL2Timer()
    whole = timer.time_graph_us(step, iters=args.iters)
    off = lambda: False  # noqa: E731
    with mock.patch.object(kd, "pdl_available", off), mock.patch.object(aw, "pdl_available", off):
        whole_no_pdl = timer.time_graph_us(step, iters=args.iters)
    launches: list = []
    with spying(), recording(launches):
        step()
    torch.cuda.synchronize()
    print(json.dumps({"step_us": whole["median_us"], "step_no_pdl_us": whole_no_pdl["median_us"],
                      "launches": len(launches)}), flush=True)
    rows = time_launches(launches, timer, args.iters, args.sweep, extra_settings)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {**environment("sketchwalk-stage-sweep", dev, torch.bfloat16), "n": n, "batch": b, "spec": args.spec,
            "command": " ".join(sys.argv), "step_us": whole, "step_no_pdl_us": whole_no_pdl}
    (out / f"stage_sweep_{n}_b{b}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
