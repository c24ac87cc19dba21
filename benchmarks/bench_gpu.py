"""GPU benchmarks of the fused CUDA ops against the eager reference, torch.compile of the reference,
and the cuBLAS floor (the same matrix products alone).

    python benchmarks/bench_gpu.py [--out DIR] [--shapes paper,ensemble,large] [--dtype float32]

Run by benchmarks/gpu_check.sh after the build and the tests. For each unit and shape it:
  1. checks correctness first: the fused and the compiled results (values and every gradient)
     against the eager reference, in float32; a mismatch is reported and makes the exit status 1;
  2. times each provider with CUDA events around batches of calls (so a few-microsecond op is not
     lost in the event overhead), after warm-up; medians and 20th/80th percentiles per call;
  3. records peak GPU memory of one call per provider.
Modes: "fwd" (forward with parameters that require grad, as in training) and "fwd+bwd" (forward
plus torch.autograd.grad of every input).
Providers: fused (nalu_cuda.functional: the CUDA kernels), eager (nalu_cuda.reference), compile
(torch.compile(reference, fullgraph=True), default mode; compiled once per shape, warmed up, dynamo
reset between shapes; NALU only, to bound compile time), cublas (the unit's matrix products with
preallocated outputs: 3 forward + 6 backward for the paper's NALU; the floor a fused layer built on
cuBLAS can approach).
Ratios: eager/fused and compile/fused (> 1: fused is faster) and fused/cublas (>= 1; how far above
the matrix-product floor the whole fused layer runs).

Writes bench_gpu.json, bench_gpu.csv and bench_gpu.md to --out (default: $OUT if set, else
benchmarks/results/) and prints the short table last. `--device cpu` runs the same script on the CPU
kernels with wall-clock timing: a smoke test of this script only, not a benchmark.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

try:
    import nalu_cuda
except ModuleNotFoundError:  # not installed: use the checkout (an in-place build)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import nalu_cuda
from nalu_cuda import functional as F
from nalu_cuda import reference as R
from nalu_cuda import testing

SHAPES = {
    # name: (E or None, B, I, O)
    "paper": (None, 128, 100, 2),
    "ensemble": (100, 128, 100, 2),
    "large": (None, 8192, 2048, 2048),
}

# unit: (family, gate, separate weights)
UNITS = {
    "nalu": ("nalu", "input", False),  # the paper's NALU: tied weights, input-dependent gate
    "nalu_sep_indep": ("nalu", "independent", True),
    "nac": ("nac", None, False),
    "nac_mul": ("nac_mul", None, False),
}
COMPILED_UNITS = ("nalu",)
EPS = 1e-7


# ------------------------------------------------------------------------------------------------
# Inputs and the unit's functions
# ------------------------------------------------------------------------------------------------


def make_inputs(unit: str, shape, dtype, device) -> Dict[str, torch.Tensor]:
    family, gate, sep = UNITS[unit]
    E, B, I, O = shape
    lead = () if E is None else (E,)
    scale = 0.5 * min(1.0, math.sqrt(64.0 / I))  # keeps exp(lx W) O(1) at any width
    t = {
        "x": testing.rand_input(lead + (B, I), dtype=dtype, device=device),
        "W_hat": testing.rand_params(lead + (I, O), scale=scale, dtype=dtype, device=device),
        "M_hat": testing.rand_params(lead + (I, O), scale=scale, dtype=dtype, device=device),
    }
    if family == "nalu":
        if sep:
            t["W_hat_m"] = testing.rand_params(lead + (I, O), scale=scale, dtype=dtype, device=device)
            t["M_hat_m"] = testing.rand_params(lead + (I, O), scale=scale, dtype=dtype, device=device)
        t["G"] = testing.rand_params(lead + ((I, O) if gate == "input" else (O,)), scale=scale, dtype=dtype,
                                     device=device)
    return {k: v.requires_grad_() for k, v in t.items()}


def unit_fn(unit: str, mod) -> Callable:
    family, gate, _ = UNITS[unit]
    if family == "nac":
        return lambda x, W_hat, M_hat: mod.nac(x, W_hat, M_hat)
    if family == "nac_mul":
        return lambda x, W_hat, M_hat: mod.nac_mul(x, W_hat, M_hat, EPS)
    if UNITS[unit][2]:
        return lambda x, W_hat, M_hat, W_hat_m, M_hat_m, G: mod.nalu(x, W_hat, M_hat, G, W_hat_m, M_hat_m, EPS, gate)
    return lambda x, W_hat, M_hat, G: mod.nalu(x, W_hat, M_hat, G, None, None, EPS, gate)


def arg_names(unit: str) -> List[str]:
    family, _, sep = UNITS[unit]
    if family != "nalu":
        return ["x", "W_hat", "M_hat"]
    return ["x", "W_hat", "M_hat", "W_hat_m", "M_hat_m", "G"] if sep else ["x", "W_hat", "M_hat", "G"]


def products(unit: str, shape, dtype, device):
    """The (forward, backward) matrix products of the unit as (A, B, out) triples, A @ B -> out."""
    family, gate, sep = UNITS[unit]
    E, B, I, O = shape
    lead = () if E is None else (E,)

    def t(*s):
        return torch.randn(*lead, *s, dtype=dtype, device=device)

    x, lx, dx = t(B, I), t(B, I), t(B, I)
    W, Wm, G = t(I, O), t(I, O), t(I, O)
    dW, dWm, dG = t(I, O), t(I, O), t(I, O)
    a, u, z, da, du, dz = t(B, O), t(B, O), t(B, O), t(B, O), t(B, O), t(B, O)
    tr = lambda m: m.transpose(-1, -2)  # noqa: E731  (cuBLAS transposes in place of a copy)
    if family == "nac":
        return [(x, W, a)], [(tr(x), da, dW), (da, tr(W), dx)]
    if family == "nac_mul":
        return [(lx, W, u)], [(tr(lx), du, dW), (du, tr(W), dx)]
    fwd = [(x, W, a), (lx, Wm if sep else W, u)]
    bwd = [(tr(x), da, dW), (tr(lx), du, dWm if sep else dW), (da, tr(W), dx), (du, tr(Wm if sep else W), dx)]
    if gate == "input":
        fwd.append((x, G, z))
        bwd += [(tr(x), dz, dG), (dz, tr(G), dx)]
    return fwd, bwd


def run_products(triples):
    for A, Bm, out in triples:
        torch.matmul(A, Bm, out=out)


# ------------------------------------------------------------------------------------------------
# Timing
# ------------------------------------------------------------------------------------------------


class Timer:
    def __init__(self, device: str, reps: int, min_batch_ms: float):
        self.device, self.reps, self.min_batch_ms = device, reps, min_batch_ms

    def sync(self):
        if self.device == "cuda":
            torch.cuda.synchronize()

    def __call__(self, fn: Callable[[], object]) -> Dict[str, float]:
        for _ in range(3):
            fn()
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        single = time.perf_counter() - t0
        per_batch = max(1, min(2000, int(self.min_batch_ms / 1e3 / max(single, 1e-7))))
        times = []
        for _ in range(self.reps):
            if self.device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(per_batch):
                    fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3 / per_batch)  # us per call
            else:
                t0 = time.perf_counter()
                for _ in range(per_batch):
                    fn()
                times.append((time.perf_counter() - t0) * 1e6 / per_batch)
        times.sort()
        q = lambda p: times[min(len(times) - 1, int(round(p * (len(times) - 1))))]  # noqa: E731
        return {"median_us": statistics.median(times), "p20_us": q(0.2), "p80_us": q(0.8), "calls_per_batch": per_batch}

    def peak_mem(self, fn) -> Optional[int]:
        if self.device != "cuda":
            return None
        self.sync()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        self.sync()
        return torch.cuda.max_memory_allocated() - base


# ------------------------------------------------------------------------------------------------
# Correctness
# ------------------------------------------------------------------------------------------------


def fwd_bwd(fn, inputs: Sequence[torch.Tensor], gy: torch.Tensor):
    y = fn(*inputs)
    return [y.detach()] + list(torch.autograd.grad(y, list(inputs), gy))


def max_rel_err(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> float:
    worst = 0.0
    for g, w in zip(got, want):
        if g.shape != w.shape:
            return math.inf
        if w.numel() == 0:
            continue
        scale = w.double().abs().max().item() + 1e-30
        err = (g.double() - w.double()).abs().max().item() / scale
        worst = max(worst, err if math.isfinite(err) else math.inf)
    return worst


# ------------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------------


def bench(args) -> int:
    device = args.device
    dtype = getattr(torch, args.dtype)
    timer = Timer(device, args.reps, args.min_batch_ms)
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # the reference's default; stated in the results
        torch.backends.cudnn.allow_tf32 = False
    rows: List[dict] = []
    failures: List[str] = []
    shapes = [s for s in args.shapes.split(",") if s]
    units = [u for u in args.units.split(",") if u]
    t_start = time.perf_counter()
    for shape_name in shapes:
        shape = SHAPES[shape_name]
        for unit in units:
            torch.manual_seed(0)
            names = arg_names(unit)
            t = make_inputs(unit, shape, dtype, device)
            inputs = [t[n] for n in names]
            with torch.no_grad():
                y0 = unit_fn(unit, R)(*inputs)
            gy = torch.randn_like(y0)
            providers: Dict[str, Callable] = {"fused": unit_fn(unit, F), "eager": unit_fn(unit, R)}
            compile_s = None
            if unit in COMPILED_UNITS and not args.no_compile:
                torch._dynamo.reset()
                compiled = torch.compile(unit_fn(unit, R), fullgraph=True)
                t0 = time.perf_counter()
                fwd_bwd(compiled, inputs, gy)  # compiles forward and backward
                timer.sync()
                compile_s = time.perf_counter() - t0
                providers["compile"] = compiled

            # 1. correctness before timing
            want = fwd_bwd(providers["eager"], inputs, gy)
            check = {}
            for name in providers:
                if name == "eager":
                    continue
                err = max_rel_err(fwd_bwd(providers[name], inputs, gy), want)
                check[name] = err
                if not err <= args.rtol:
                    failures.append(f"{unit} {shape_name}: {name} differs from the eager reference "
                                    f"(max relative error {err:.3g} > {args.rtol})")
            fwd_products, bwd_products = products(unit, shape, dtype, device)

            # 2. timing
            for mode in ("fwd", "fwd+bwd"):
                for name, fn in providers.items():
                    if mode == "fwd":
                        call = lambda fn=fn: fn(*inputs)  # noqa: E731
                    else:
                        call = lambda fn=fn: torch.autograd.grad(fn(*inputs), inputs, gy)  # noqa: E731
                    r = timer(call)
                    rows.append(dict(unit=unit, shape=shape_name, E=shape[0] or 1, B=shape[1], I=shape[2], O=shape[3],
                                     dtype=args.dtype, mode=mode, provider=name, **r,
                                     peak_mem_bytes=timer.peak_mem(call),
                                     max_rel_err_vs_eager=check.get(name, 0.0),
                                     compile_s=compile_s if name == "compile" else None))
                triples = fwd_products + (bwd_products if mode == "fwd+bwd" else [])
                r = timer(lambda triples=triples: run_products(triples))
                rows.append(dict(unit=unit, shape=shape_name, E=shape[0] or 1, B=shape[1], I=shape[2], O=shape[3],
                                 dtype=args.dtype, mode=mode, provider="cublas", **r, peak_mem_bytes=None,
                                 max_rel_err_vs_eager=None, compile_s=None, n_products=len(triples)))
            del t, inputs, providers, fwd_products, bwd_products
            if device == "cuda":
                torch.cuda.empty_cache()
            write_results(args.out, rows, summarize(rows), failures, args)  # partial results survive a timeout
            print(f"[bench] {unit} {shape_name} done ({time.perf_counter() - t_start:.0f} s)", flush=True)
        torch._dynamo.reset()

    summary = summarize(rows)
    write_results(args.out, rows, summary, failures, args)
    print()
    print(markdown_table(summary, args))
    if failures:
        print("\nCORRECTNESS FAILURES:")
        for f in failures:
            print(f"  - {f}")
    return 1 if failures else 0


def summarize(rows: List[dict]) -> List[dict]:
    by_key: Dict[tuple, Dict[str, dict]] = {}
    for r in rows:
        by_key.setdefault((r["unit"], r["shape"], r["mode"]), {})[r["provider"]] = r
    out = []
    for (unit, shape, mode), p in by_key.items():
        f = p["fused"]["median_us"]
        s = dict(unit=unit, shape=shape, mode=mode, fused_us=f, eager_us=p["eager"]["median_us"],
                 compile_us=p["compile"]["median_us"] if "compile" in p else None,
                 cublas_us=p["cublas"]["median_us"])
        s["eager_over_fused"] = s["eager_us"] / f
        s["compile_over_fused"] = s["compile_us"] / f if s["compile_us"] else None
        s["fused_over_cublas"] = f / s["cublas_us"]
        out.append(s)
    return out


def fmt(v, unit=""):
    if v is None:
        return "-"
    if unit == "x":
        return f"{v:.2f}x"
    return f"{v:.1f}" if v < 1000 else f"{v:.0f}"


def markdown_table(summary: List[dict], args) -> str:
    lines = [f"nalu_cuda GPU benchmark ({args.dtype}, median us per call; ratios > 1 = fused faster)",
             "| unit | shape | mode | fused | eager | compile | cublas floor | eager/fused | compile/fused | fused/floor |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for s in summary:
        lines.append(f"| {s['unit']} | {s['shape']} | {s['mode']} | {fmt(s['fused_us'])} | {fmt(s['eager_us'])} | "
                     f"{fmt(s['compile_us'])} | {fmt(s['cublas_us'])} | {fmt(s['eager_over_fused'], 'x')} | "
                     f"{fmt(s['compile_over_fused'], 'x')} | {fmt(s['fused_over_cublas'], 'x')} |")
    return "\n".join(lines)


def environment(args) -> dict:
    env = {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "python": platform.python_version(),
           "nalu_cuda": nalu_cuda.build_info(), "device": args.device, "dtype": args.dtype,
           "allow_tf32": torch.backends.cuda.matmul.allow_tf32 if args.device == "cuda" else None}
    if args.device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    return env


def write_results(out_dir: str, rows, summary, failures, args) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "bench_gpu.json"), "w") as f:
        json.dump({"environment": environment(args), "rows": rows, "summary": summary, "failures": failures}, f,
                  indent=1)
    with open(os.path.join(out_dir, "bench_gpu.csv"), "w", newline="") as f:
        keys = sorted({k for r in rows for k in r})
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    with open(os.path.join(out_dir, "bench_gpu.md"), "w") as f:
        env = environment(args)
        f.write(f"# nalu_cuda GPU benchmark\n\n{json.dumps(env)}\n\n{markdown_table(summary, args)}\n\n")
        f.write("## All rows (median, 20th and 80th percentile, us per call; peak memory of one call)\n\n")
        f.write("| unit | shape | mode | provider | median | p20 | p80 | peak MiB | max rel err vs eager |\n")
        f.write("|---|---|---|---|---|---|---|---|---|\n")
        for r in rows:
            mem = "-" if r["peak_mem_bytes"] is None else f"{r['peak_mem_bytes'] / 2**20:.1f}"
            err = "-" if r["max_rel_err_vs_eager"] is None else f"{r['max_rel_err_vs_eager']:.2g}"
            f.write(f"| {r['unit']} | {r['shape']} | {r['mode']} | {r['provider']} | {fmt(r['median_us'])} | "
                    f"{fmt(r['p20_us'])} | {fmt(r['p80_us'])} | {mem} | {err} |\n")
        if failures:
            f.write("\n## Correctness failures\n\n" + "".join(f"- {x}\n" for x in failures))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                                         "results"))
    p.add_argument("--shapes", default="paper,ensemble,large", help=f"comma list of {list(SHAPES)}")
    p.add_argument("--units", default=",".join(UNITS), help=f"comma list of {list(UNITS)}")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "float16", "bfloat16"])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--min-batch-ms", type=float, default=2.0, help="time batches of calls lasting at least this")
    p.add_argument("--rtol", type=float, default=None, help="max relative error vs eager (default by dtype)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile provider")
    args = p.parse_args(argv)
    if args.rtol is None:
        args.rtol = {"float64": 1e-9, "float32": 1e-3, "float16": 2e-2, "bfloat16": 1e-1}[args.dtype]
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("bench_gpu: no CUDA device visible; nothing to benchmark (use --device cpu for a smoke test)")
            return 2
        if not nalu_cuda.has_cuda_kernels():
            print(f"bench_gpu: nalu_cuda has no CUDA kernels (build: {nalu_cuda.build_info()})")
            return 2
    else:
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    return bench(args)


if __name__ == "__main__":
    sys.exit(main())
