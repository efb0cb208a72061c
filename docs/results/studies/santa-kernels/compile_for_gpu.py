"""Compile the Triton kernels of the santa/dense paths for a GPU target on a machine without a GPU, and
print each kernel's registers, spills (stack) and shared memory: compile failures and register counts
cost no device time this way.

The launches are those of real calls on CPU tensors (shapes below); instead of running, each launch is
compiled ahead of time (``triton.compile`` of an ``ASTSource`` with the launch's signature, its ints equal
to 1 as constants and 16-byte divisibility where Triton would specialise on it), so the binaries match
what the GPU would build. Use the GPU machine's Triton version (3.6 on the H100), e.g.

    python3.11 -m venv /tmp/t36 && /tmp/t36/bin/pip install triton==3.6.0 torch==2.13.0 numpy
    PYTHONPATH=src /tmp/t36/bin/python \
        docs/results/studies/santa-kernels/compile_for_gpu.py --n 32768 --paths prop,flash
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "src"))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kvsieve.kernels.santa import common, decode, fused, overlap, two_pass  # noqa: E402
from kvsieve.kernels.shared import dense, triton_utils  # noqa: E402

TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int32: "i32",
         torch.int64: "i64"}
OPTIONS = ("num_warps", "num_stages", "maxnreg")


def resources(cubin: bytes) -> str:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    return " ".join(line.strip() for line in out.splitlines() if "REG" in line)


def compile_launch(kernel, grid, *args, capability: int, ptx_dir: str | None = None, **meta) -> None:
    options = {k: meta.pop(k) for k in list(meta) if k in OPTIONS}
    meta.pop("launch_pdl", None)
    names = kernel.arg_names
    signature, constants, attrs = {}, {}, {}
    for i, name in enumerate(names):
        a = args[i] if i < len(args) else None
        if name in meta:
            signature[name], constants[(i,)] = "constexpr", meta[name]
            continue
        if isinstance(a, torch.Tensor):
            signature[name] = "*" + TYPES[a.dtype]
            if a.data_ptr() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(a, bool):
            signature[name] = "i1"
        elif isinstance(a, int):
            if a == 1 and not kernel.params[i].do_not_specialize:
                signature[name], constants[(i,)] = "constexpr", 1
                continue
            signature[name] = "i64" if abs(a) >= 2 ** 31 else "i32"
            if a % 16 == 0 and not kernel.params[i].do_not_specialize:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(a, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{kernel.__name__}: argument {name} of type {type(a).__name__}")
    try:
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs),
                                  target=GPUTarget("cuda", capability, 32), options=options)
        if ptx_dir:
            Path(ptx_dir, f"{kernel.__name__}.ptx").write_text(compiled.asm["ptx"])
        print(f"OK   {kernel.__name__:28s} {options} dynamic shared {compiled.metadata.shared} B; "
              f"{resources(compiled.asm['cubin'])}", flush=True)
    except Exception as exc:  # noqa: BLE001 - every failure is reported, the other kernels still compile
        print(f"FAIL {kernel.__name__}: {exc}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=32768, help="keys (Llama-3.1-8B heads 32/8/128, bf16, batch 1)")
    ap.add_argument("--paths", default="dense,prop,flash,flash-fused,prop-v10,flash-v10")
    ap.add_argument("--prop-budget", type=int, default=128)
    ap.add_argument("--flash-budget", type=int, default=2048)
    ap.add_argument("--capability", type=int, default=90, help="compute capability, e.g. 90 for H100")
    ap.add_argument("--ptx", default=None, help="also write each kernel's PTX into this folder")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        ap.error("unset TRITON_INTERPRET: the kernels must be compiled, not interpreted")

    def fake_launch(kernel, grid, *a, **meta):
        compile_launch(kernel, grid, *a, capability=args.capability, ptx_dir=args.ptx, **meta)

    for module in (triton_utils, dense, fused, overlap, two_pass):
        module.launch = fake_launch
    for module in (common, decode):  # programmatic dependent launch as the target would have it
        module.pdl_available = lambda: args.capability >= 90
    torch.cuda.current_device = lambda: 0
    q = torch.randn(1, 32, 128).to(torch.bfloat16)
    k = torch.randn(1, 8, args.n, 128).to(torch.bfloat16)
    v = torch.randn(1, 8, args.n, 128).to(torch.bfloat16)
    lens = torch.full((1,), args.n, dtype=torch.int32)
    scale = 128 ** -0.5
    pb, fb = args.prop_budget, args.flash_budget
    for path in args.paths.split(","):
        print(f"# {path}")
        calls = {"dense": lambda: dense.dense_decode_triton(q, k, v, lens, scale),
                 "prop": lambda: two_pass.santa_prop_two_pass(q, k, v, lens, scale, pb, 256, 1),
                 "flash": lambda: two_pass.santa_flash_two_pass(q, k, v, lens, scale, fb, 256, 1),
                 "flash-fused": lambda: fused.santa_flash_fused(q, k, v, lens, scale, fb, 256, 1),
                 "prop-v10": lambda: overlap.santa_prop_overlap(q, k, v, lens, scale, pb, 256, 1),
                 "flash-v10": lambda: overlap.santa_flash_overlap(q, k, v, lens, scale, fb, 256, 1)}
        if path not in calls:
            ap.error(f"--paths: unknown path {path!r} ({', '.join(calls)})")
        calls[path]()
    return 0


if __name__ == "__main__":
    sys.exit(main())
