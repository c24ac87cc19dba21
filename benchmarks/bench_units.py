"""Benchmark of the NAU and NMU ops: fused against the eager reference, and the NMU's memory.

    python benchmarks/bench_units.py                       # CPU, every check
    python benchmarks/bench_units.py --rounds 7 --min-run-time 0.3 --skip-memory

Speed: forward+backward (one autograd round trip, gradients of x and W) of
  fused      nalu_cuda.functional.nau / nmu (one fused op per direction)
  reference  nalu_cuda.reference.nau / nmu (the pure-PyTorch specification; the NMU's materialises
             the (B, I, O) factors)
at the paper's layer (B=128, I=100, O=2) and at the 100-seed ensemble (E=100 of those). The providers
run in interleaved rounds (each round times every provider with torch.utils.benchmark); the table
gives the median over rounds and the median of the per-round ratios, after a correctness check.

Memory (NMU, B=4096, I=O=1024, float32): the peak memory of one fused forward+backward against the
bytes of its inputs, output and gradients (x, W, y, grad_y, grad_x, grad_W). Peak = the inputs plus
what the call adds at its highest: on the CPU the growth of the peak resident size of a fresh
process (Linux: /proc/self/clear_refs and VmHWM) over its size after a warm-up call; on a GPU,
torch.cuda.max_memory_allocated over memory_allocated. The reference would
need the (B, I, O) factors alone: B I O * 4 bytes, printed beside it.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import harness  # noqa: E402

import nalu_cuda  # noqa: E402
from nalu_cuda import functional as F  # noqa: E402
from nalu_cuda import reference as R  # noqa: E402
from nalu_cuda.testing import rand_input, tolerances  # noqa: E402

SHAPES = {"paper": dict(E=None, B=128, I=100, O=2), "ensemble": dict(E=100, B=128, I=100, O=2)}
UNITS = {"nau": (F.nau, R.nau, (-0.5, 0.5)), "nmu": (F.nmu, R.nmu, (0.25, 0.75))}


def make_inputs(shape, init, device, dtype=torch.float32):
    lead = () if shape["E"] is None else (shape["E"],)
    x = rand_input(lead + (shape["B"], shape["I"]), dtype=dtype, device=device, low=0.9, high=1.1)
    lo, hi = init
    W = (torch.rand(lead + (shape["I"], shape["O"]), dtype=dtype) * (hi - lo) + lo).to(device)
    gy = torch.randn(lead + (shape["B"], shape["O"]), dtype=dtype, device=device)
    return x.requires_grad_(), W.requires_grad_(), gy


def round_trip(fn, x, W, gy):
    def run():
        y = fn(x, W)
        torch.autograd.grad(y, (x, W), gy)
    return run


def check(fused, ref, x, W, gy):
    # the test suite's tolerances: the kernels sum the I products in another order than BLAS
    y_f, y_r = fused(x, W), ref(x, W)
    fan_in = x.shape[-1]
    torch.testing.assert_close(y_f, y_r, **dict(zip(("rtol", "atol"), tolerances(x.dtype, fan_in))))
    grad_tol = dict(zip(("rtol", "atol"), tolerances(x.dtype, fan_in, grad=True)))
    for a, b in zip(torch.autograd.grad(y_f, (x, W), gy), torch.autograd.grad(y_r, (x, W), gy)):
        torch.testing.assert_close(a, b, **grad_tol)


def bench_speed(args, device):
    """Rows (one per unit and shape) of interleaved fused/reference timings, after a check."""
    rows, cells = [], []
    for unit, (fused, ref, init) in UNITS.items():
        for name, shape in SHAPES.items():
            x, W, gy = make_inputs(shape, init, device)
            check(fused, ref, x, W, gy)
            runs = {"fused": round_trip(fused, x, W, gy), "reference": round_trip(ref, x, W, gy)}
            # interleaved: every provider once per round; a round's value is its median per call (ms)
            times = harness.interleaved({k: (lambda fn=fn: harness.cpu_timer(fn, args.min_run_time)["median_ms"])
                                         for k, fn in runs.items()}, args.rounds)
            ratio = statistics.median(r / f for r, f in zip(times["reference"], times["fused"]))
            fm, rm = statistics.median(times["fused"]), statistics.median(times["reference"])
            rows.append({"unit": unit, "shape": name, "fused_ms": fm, "reference_ms": rm, "ratio": ratio,
                         "rounds": times})
            cells.append([unit, name, f"{fm:.3f}", f"{rm:.3f}", f"{ratio:.1f}x"])
            print(f"| {unit} | {name} | {fm:.3f} | {rm:.3f} | {ratio:.1f}x |", flush=True)
    return rows, harness.markdown_table(["unit", "shape", "fused fwd+bwd (ms)", "reference fwd+bwd (ms)",
                                         "reference / fused"], cells)


MEMORY_CHILD = """
import sys, torch
sys.path.insert(0, {root!r})
import nalu_cuda
B, I, O, dev = {B}, {I}, {O}, {device!r}
def rss_kb(field):
    for line in open('/proc/self/status'):
        if line.startswith(field):
            return int(line.split()[1])
torch.manual_seed(0)
if dev == 'cuda':
    torch.cuda.init()
x = (torch.rand(B, I, device=dev) * 0.2 + 0.9).requires_grad_()
W = (torch.rand(I, O, device=dev) * 0.5 + 0.25).requires_grad_()
gy = torch.randn(B, O, device=dev)
y = nalu_cuda.functional.nmu(x, W)
gx, gW = torch.autograd.grad(y, (x, W), gy)   # warm-up (allocator, threads)
del y, gx, gW
if dev == 'cuda':
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); start = torch.cuda.memory_allocated()
else:
    start = rss_kb('VmRSS:')  # after the warm-up: code pages and thread stacks already resident
    open('/proc/self/clear_refs', 'w').write('5')  # resets VmHWM to the current size
y = nalu_cuda.functional.nmu(x, W)
gx, gW = torch.autograd.grad(y, (x, W), gy)
if dev == 'cuda':
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - start + sum(t.numel() * 4 for t in (x, W, gy))
else:
    peak = (rss_kb('VmHWM:') - start) * 1024 + sum(t.numel() * 4 for t in (x, W, gy))
need = sum(t.numel() * t.element_size() for t in (x, W, y, gy, gx, gW))
print(peak, need)
"""


def bench_memory(args, device):
    B, I, O = args.memory_shape
    code = MEMORY_CHILD.format(root=os.path.dirname(HERE), B=B, I=I, O=O, device=device)
    # A fixed mmap threshold: glibc then maps every large block and unmaps it when freed, so the
    # resident size follows the live tensors (its default threshold grows after the first free,
    # after which freed blocks stay resident and would count as peak).
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    peak, need = map(int, out.stdout.split()[-2:])
    row = {"unit": "nmu", "shape": f"B={B} I={I} O={O}", "peak_bytes": peak, "need_bytes": need,
           "reference_factors_bytes": B * I * O * 4}
    table = (f"NMU fused forward+backward, B={B}, I={I}, O={O}, float32, {device}:\n\n" + harness.markdown_table(
        ["peak memory (MiB)", "inputs+output+gradients (MiB)", "peak / those", "reference's (B, I, O) factors alone (MiB)"],
        [[f"{peak / 2**20:.1f}", f"{need / 2**20:.1f}", f"{peak / need:.2f}x", f"{B * I * O * 4 / 2**20:.0f}"]]))
    print("\n" + table)
    return [row], table


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--min-run-time", type=float, default=0.2)
    p.add_argument("--memory-shape", type=int, nargs=3, default=[4096, 1024, 1024], metavar=("B", "I", "O"))
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument("--out", default=None, help="results stem (default: benchmarks/results/units_<device>)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"# bench_units: torch {torch.__version__}, device {args.device}, threads {torch.get_num_threads()}, "
          f"nalu_cuda {nalu_cuda.build_info()}\n")
    rows, tables = [], []
    for skip, part in ((args.skip_speed, bench_speed), (args.skip_memory, bench_memory)):
        if not skip:
            r, t = part(args, args.device)
            rows += r
            tables.append(t)
    meta = {"command": harness.command(__file__, argv), **harness.machine(args.device, dtype="float32")}
    harness.write(args.out or os.path.join(harness.RESULTS, f"units_{args.device}"), meta, rows, "\n\n".join(tables),
                  title="NAU and NMU: fused vs reference")


if __name__ == "__main__":
    main()
