"""Peak memory of one NALU training step (forward + backward, float32): fused ops vs the eager
reference, at B=65536, I=O=1024 by default (issue 11, item 9).

    python benchmarks/bench_memory.py                      # CPU: both variants, x with and without grad
    python benchmarks/bench_memory.py --device cuda        # torch.cuda.max_memory_allocated

Each variant runs in a fresh Python process, so that no allocator cache or earlier peak of another
variant is counted. In that process: the layer (tied weights, input gate), x (U[1, 2] magnitudes)
and the output gradient are made, one step at a small batch warms up the libraries (BLAS and
OpenMP buffers), the gradients are dropped; then the peak of one step over what is allocated just
before it is measured:
  cpu   the resident-set high-water mark (VmHWM of /proc/self/status) after resetting it to the
        current resident set (writing 5 to /proc/self/clear_refs), minus that resident set. torch's
        CPU allocator has no peak statistic; tensors this large (>= 32 MiB) are mapped and unmapped
        by the C library on every allocation and free, and every byte of them is written, so the
        resident set follows the live tensors. It also counts what the libraries allocate outside
        torch (BLAS packing buffers), as a user's machine would see it.
  cuda  torch.cuda.max_memory_allocated() after reset_peak_memory_stats(), minus
        memory_allocated() before the step: the caching allocator's own count of live tensors.
Writes benchmarks/results/memory_{device}.{md,csv,json} (--out) with both peaks and their ratio.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import harness  # noqa: E402


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {key} in /proc/self/status")


def child(backend: str, device: str, B: int, I: int, O: int, grad_x: bool) -> dict:
    """One variant's peak, measured in this (fresh) process."""
    import nalu_cuda
    from nalu_cuda.testing import rand_input

    torch.manual_seed(0)
    layer = nalu_cuda.NALU(I, O, backend=backend).to(device)
    with torch.no_grad():
        for p in layer.parameters():
            p.mul_(0.1)  # keeps exp() of the multiplicative path modest at I = 1024
    x = rand_input((B, I), dtype=torch.float32, device=device, low=1.0, high=2.0).requires_grad_(grad_x)
    dy = torch.randn(B, O, device=device)

    def step(xx, gy):
        layer(xx).backward(gy)

    step(x[:64].detach().requires_grad_(grad_x), dy[:64])  # warm-up: libraries, autograd, threads
    layer.zero_grad(set_to_none=True)
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step(x, dy)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        method = "torch.cuda.max_memory_allocated - memory_allocated before the step"
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident set
        base = _status_kib("VmRSS") * 1024
        step(x, dy)
        peak = _status_kib("VmHWM") * 1024 - base
        method = "VmHWM after clear_refs - VmRSS before the step"
    return {"backend": backend, "device": device, "B": B, "I": I, "O": O, "grad_x": grad_x, "peak_bytes": peak,
            "baseline_bytes": base, "method": method}


def run_variant(backend: str, args, grad_x: bool) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", backend, "--device", args.device,
           "--batch", str(args.batch), "--inputs", str(args.inputs), "--outputs", str(args.outputs),
           "--grad-x", "yes" if grad_x else "no", "--threads", str(args.threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--batch", type=int, default=65536)
    ap.add_argument("--inputs", type=int, default=1024)
    ap.add_argument("--outputs", type=int, default=1024)
    ap.add_argument("--grad-x", choices=["both", "yes", "no"], default="both",
                    help="whether x requires grad (a first layer does not)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=harness.RESULTS)
    ap.add_argument("--child", choices=["fused", "reference"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(child(args.child, args.device, args.batch, args.inputs, args.outputs,
                               args.grad_x == "yes")))
        return 0
    grads = {"both": [False, True], "yes": [True], "no": [False]}[args.grad_x]
    rows, table = [], []
    for gx in grads:
        fused = run_variant("fused", args, gx)
        ref = run_variant("reference", args, gx)
        for r in (fused, ref):
            rows.append({**r, "peak_gb": r["peak_bytes"] / 1e9})
        ratio = fused["peak_bytes"] / ref["peak_bytes"]
        rows[-2]["fused_over_reference"] = ratio
        table.append([args.device, f"B={args.batch} I={args.inputs} O={args.outputs}", "yes" if gx else "no",
                      f"{fused['peak_bytes'] / 1e9:.3f}", f"{ref['peak_bytes'] / 1e9:.3f}", f"{ratio:.2f}x"])
        print(table[-1], flush=True)
    meta = {"command": harness.command(__file__, argv), **harness.machine(args.device), "method": rows[0]["method"]}
    md = harness.markdown_table(["device", "shape", "x requires grad", "fused peak GB", "reference peak GB",
                                 "fused / reference"], table)
    harness.write(os.path.join(args.out, f"memory_{args.device}"), meta, rows, md,
                  title="Peak memory of one NALU training step (forward + backward, float32)")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
