"""Peak memory of one NALU training step (forward + backward, float32): fused ops vs the eager
reference, at B=65536, I=O=1024 by default (issue 11, item 9).

    python benchmarks/bench_memory.py                      # CPU: both variants, x with and without grad
    python benchmarks/bench_memory.py --device cuda        # torch.cuda.max_memory_allocated
    python benchmarks/bench_memory.py --compare ../old     # fused step: this tree against another

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

Every child also times its step (the wall clock around it; on CUDA synchronised on both sides).
--compare ROOT runs the fused step from this tree and from ROOT, another source tree with its
extension built (a git worktree at an earlier commit, say), alternating in fresh processes (this
tree, ROOT, this tree, ROOT, ... for --rounds pairs, per x-gradient setting); the reference is not
run. It writes results/step_{device}.{md,csv,json}: every process's time and peak, and per tree
their medians, and this tree's time over ROOT's (of the medians, and of the minima: on a shared
machine the least disturbed run). The parameters are drawn the
same way under every version of the library (U(-0.1, 0.1) after seeding), so both trees compute
the same numbers.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

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


def child(backend: str, device: str, B: int, I: int, O: int, grad_x: bool, root: str = "") -> dict:
    """One variant's peak and time, measured in this (fresh) process; nalu_cuda from `root` if given."""
    if root:
        sys.path.insert(0, os.path.abspath(root))
    import nalu_cuda
    from nalu_cuda.testing import rand_input

    torch.manual_seed(0)
    layer = nalu_cuda.NALU(I, O, backend=backend).to(device)
    with torch.no_grad():
        for p in layer.parameters():
            p.uniform_(-0.1, 0.1)  # keeps exp() of the multiplicative path modest at I = 1024
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
        t0 = time.perf_counter()
        step(x, dy)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated() - base
        method = "torch.cuda.max_memory_allocated - memory_allocated before the step"
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident set
        base = _status_kib("VmRSS") * 1024
        t0 = time.perf_counter()
        step(x, dy)
        seconds = time.perf_counter() - t0
        peak = _status_kib("VmHWM") * 1024 - base
        method = "VmHWM after clear_refs - VmRSS before the step"
    return {"backend": backend, "device": device, "B": B, "I": I, "O": O, "grad_x": grad_x, "peak_bytes": peak,
            "baseline_bytes": base, "step_s": seconds, "method": method,
            "nalu_cuda_root": os.path.dirname(os.path.dirname(os.path.abspath(nalu_cuda.__file__)))}


def run_variant(backend: str, args, grad_x: bool, root: str = "") -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", backend, "--device", args.device,
           "--batch", str(args.batch), "--inputs", str(args.inputs), "--outputs", str(args.outputs),
           "--grad-x", "yes" if grad_x else "no", "--threads", str(args.threads)]
    if root:
        cmd += ["--root", root]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def compare(args, grads) -> int:
    """The fused step from this tree and from args.compare, alternating in fresh processes."""
    trees = {"this": harness.ROOT, "other": os.path.abspath(args.compare)}
    commits = {k: harness.commit(root) or root for k, root in trees.items()}
    rows = []
    for rnd in range(args.rounds):
        for gx in grads:
            for key, root in trees.items():
                r = run_variant("fused", args, gx, root)
                imported = r.pop("nalu_cuda_root")  # a path of this machine: checked, not written
                if os.path.realpath(imported) != os.path.realpath(root):
                    raise RuntimeError(f"the child imported nalu_cuda from {imported}, not {root}")
                rows.append({**r, "tree": key, "commit": commits[key], "round": rnd, "peak_gb": r["peak_bytes"] / 1e9})
                print(f"round {rnd} x-grad {'yes' if gx else 'no'} {commits[key]}: {r['step_s']:.2f} s, "
                      f"{r['peak_bytes'] / 1e9:.3f} GB", flush=True)
    table = []
    for gx in grads:
        t = {k: [r["step_s"] for r in rows if r["tree"] == k and r["grad_x"] == gx] for k in trees}
        peak = {k: statistics.median(r["peak_bytes"] for r in rows if r["tree"] == k and r["grad_x"] == gx)
                for k in trees}
        med = {k: statistics.median(v) for k, v in t.items()}
        each = {k: ", ".join(f"{v:.2f}" for v in t[k]) for k in trees}
        table.append([args.device, f"B={args.batch} I={args.inputs} O={args.outputs}", "yes" if gx else "no",
                      f"{med['this']:.2f} ({each['this']})", f"{med['other']:.2f} ({each['other']})",
                      f"{med['this'] / med['other']:.2f}x", f"{min(t['this']) / min(t['other']):.2f}x",
                      f"{peak['this'] / 1e9:.3f}", f"{peak['other'] / 1e9:.3f}"])
    meta = {"command": harness.command(__file__, None), **harness.machine(args.device),
            "this_tree": commits["this"], "other_tree": commits["other"], "rounds": args.rounds,
            "method": rows[0]["method"]}
    this, other = commits["this"], commits["other"]
    md = harness.markdown_table(
        ["device", "shape", "x requires grad", f"{this} step s, median (each)", f"{other} step s, median (each)",
         f"{this} / {other}, medians", f"{this} / {other}, minima", f"{this} peak GB", f"{other} peak GB"], table)
    harness.write(os.path.join(args.out, f"step_{args.device}"), meta, rows, md,
                  title="Time and peak memory of one fused NALU training step, two versions of the library")
    print(md)
    return 0


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
    ap.add_argument("--compare", metavar="ROOT",
                    help="another source tree with a built extension: time the fused step from both, alternating")
    ap.add_argument("--rounds", type=int, default=3, help="with --compare: processes per tree and x-gradient setting")
    ap.add_argument("--child", choices=["fused", "reference"], help=argparse.SUPPRESS)
    ap.add_argument("--root", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(child(args.child, args.device, args.batch, args.inputs, args.outputs,
                               args.grad_x == "yes", args.root)))
        return 0
    grads = {"both": [False, True], "yes": [True], "no": [False]}[args.grad_x]
    if args.compare:
        return compare(args, grads)
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
