"""GPU benchmarks of the fused CUDA ops: what a GPU owner needs, in stages that each save results.

    python benchmarks/bench_gpu.py [--out DIR] [--stages copy,ops,memory_bound,large,training]
    python benchmarks/bench_gpu.py --stages compile          # cold torch.compile, run last
    python benchmarks/bench_gpu.py --stages sanitize_case    # one small forward+backward and gradient step (compute-sanitizer)
    python benchmarks/bench_gpu.py --device cpu --dry-run    # every stage's logic on the CPU, small shapes

Run by benchmarks/gpu_check.sh after the build and the tests. Stages (--stages, in this order):
  copy          the device's copy bandwidth (a 2 GiB device-to-device copy; bytes read + written)
  ops           each unit at the paper shape (B=128, I=100, O=2) and the 100-seed ensemble shape:
                correctness against the eager reference first (values and every gradient), then per
                call: fused, fused kernel-only (CUDA-graph replay), eager, eager graph replay;
                modes fwd and fwd+bwd (torch.autograd.grad of every input)
  memory_bound  NALU forward at E=1, B=4M, I=100, O=2: GB/s over the bytes the op must read and
                write (x in; y, a, m, g, lx out), against the copy bandwidth of the same run
  large         NALU at B=4096, I=O=1024: fused against the bare cuBLAS products of the layer
                (3 forward, + 6 backward), the goal being within 1.15x
  training      the static task's 100-seed ensemble (two NALU layers, 100 -> 2 -> 1, batch 128,
                data drawn on the device, Adam): steps per second, eager; the trainer's rows from
                the difference of a 2N- and an N-step run (the steady step, without a run's fixed
                costs: graph capture, evaluation), those costs as once_s
  compile       torch.compile(reference, fullgraph=True) beside the fused op at the paper and
                ensemble shapes (cold compile time recorded); separate, as compiles are slow
  sanitize_case one rowwise-path forward and backward and one static_ensemble_grad call, nothing timed
                (compute-sanitizer's target)
Every figure is stored beside the TF32 setting in force (off for every stage: the reference's
default) and the machine (benchmarks/harness.py: GPU, driver, nvcc, clocks, CPU, commit from
NALU_CUDA_COMMIT). After each stage bench_gpu.json/.csv/.md are rewritten (a timeout keeps what was
done; --append adds to the rows already there); --deadline SECONDS skips stages and units that
would start after it. Exit status: 1 when a correctness check failed, 0 otherwise. `--device cpu` runs the same logic on the CPU kernels with
wall-clock timing (graph replay skipped): a test of this script, not a benchmark.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import harness  # noqa: E402
import nalu_cuda  # noqa: E402
from nalu_cuda import functional as F  # noqa: E402
from nalu_cuda import reference as R  # noqa: E402
from nalu_cuda import testing  # noqa: E402

STAGES = ["copy", "ops", "memory_bound", "large", "training", "compile", "sanitize_case"]
DEFAULT_STAGES = ["copy", "ops", "memory_bound", "large", "training"]
# name: (E or None, B, I, O); --dry-run divides B (and the copy size) and caps I and O at 128.
SHAPES = {
    "paper": (None, 128, 100, 2),
    "ensemble": (100, 128, 100, 2),
    "memory_bound": (None, 4 * 2**20, 100, 2),
    "large": (None, 4096, 1024, 1024),
}
# unit: (family, gate, separate weights)
UNITS = {
    "nalu": ("nalu", "input", False),  # the paper's NALU: tied weights, input-dependent gate
    "nalu_sep_indep": ("nalu", "independent", True),
    "nac": ("nac", None, False),
    "nac_mul": ("nac_mul", None, False),
}
EPS = 1e-7
RTOL = {"float64": 1e-9, "float32": 1e-3, "float16": 2e-2, "bfloat16": 1e-1}


# ------------------------------------------------------------------------------------------------
# Inputs and the unit's functions
# ------------------------------------------------------------------------------------------------


def make_inputs(unit: str, shape, dtype, device) -> Dict[str, torch.Tensor]:
    family, gate, sep = UNITS[unit]
    E, B, I, O = shape
    lead = () if E is None else (E,)
    scale = 0.5 * min(1.0, math.sqrt(64.0 / I))  # keeps exp(lx W) O(1) at any width
    t = {"x": testing.rand_input(lead + (B, I), dtype=dtype, device=device)}
    names = ["W_hat", "M_hat"] + (["W_hat_m", "M_hat_m"] if family == "nalu" and sep else [])
    for n in names:
        t[n] = testing.rand_params(lead + (I, O), scale=scale, dtype=dtype, device=device)
    if family == "nalu":
        t["G"] = testing.rand_params(lead + ((I, O) if gate == "input" else (O,)), scale=scale, dtype=dtype,
                                     device=device)
    return {k: v.requires_grad_() for k, v in t.items()}


def unit_fn(unit: str, mod) -> Callable:
    family, gate, sep = UNITS[unit]
    if family == "nac":
        return lambda x, W_hat, M_hat: mod.nac(x, W_hat, M_hat)
    if family == "nac_mul":
        return lambda x, W_hat, M_hat: mod.nac_mul(x, W_hat, M_hat, EPS)
    if sep:
        return lambda x, W_hat, M_hat, W_hat_m, M_hat_m, G: mod.nalu(x, W_hat, M_hat, G, W_hat_m, M_hat_m, EPS, gate)
    return lambda x, W_hat, M_hat, G: mod.nalu(x, W_hat, M_hat, G, None, None, EPS, gate)


def products(shape, dtype, device):
    """The paper NALU's matrix products as (A, B, out) triples, A @ B -> out: 3 forward (a = x W,
    u = lx W, z = x G), 6 backward (dW twice, dG, and three into dx)."""
    E, B, I, O = shape
    lead = () if E is None else (E,)

    def t(*s):
        return torch.randn(*lead, *s, dtype=dtype, device=device)

    x, lx, dx = t(B, I), t(B, I), t(B, I)
    W, G, dW, dG = t(I, O), t(I, O), t(I, O), t(I, O)
    a, u, z, da, du, dz = (t(B, O) for _ in range(6))
    tr = lambda m: m.transpose(-1, -2)  # noqa: E731  (cuBLAS transposes in place of a copy)
    fwd = [(x, W, a), (lx, W, u), (x, G, z)]
    bwd = [(tr(x), da, dW), (tr(lx), du, dW), (tr(x), dz, dG), (da, tr(W), dx), (du, tr(W), dx), (dz, tr(G), dx)]
    return fwd, bwd


def run_products(triples):
    for A, Bm, out in triples:
        torch.matmul(A, Bm, out=out)


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
        err = (g.double() - w.double()).abs().max().item() / (w.double().abs().max().item() + 1e-30)
        worst = max(worst, err if math.isfinite(err) else math.inf)
    return worst


# ------------------------------------------------------------------------------------------------
# The run: stages, rows, results written after each stage
# ------------------------------------------------------------------------------------------------


class Run:
    def __init__(self, args):
        self.args = args
        self.device = args.device
        self.dtype = getattr(torch, args.dtype)
        self.cuda = self.device == "cuda"
        self.rows: List[dict] = []
        self.failures: List[str] = []
        self.skipped: List[str] = []
        self.t0 = time.perf_counter()
        self.copy_gbs: Optional[float] = None
        self.div = args.dry_run_divisor if args.dry_run else 1
        path = os.path.join(args.out, "bench_gpu.json")
        if args.append and os.path.exists(path):  # a later call of the same check adds its stages
            with open(path) as f:
                old = json.load(f)
            self.rows, self.failures, self.skipped = old["rows"], old["meta"]["failures"], old["meta"]["skipped"]

    # -- bookkeeping
    def shape(self, name):
        E, B, I, O = SHAPES[name]
        if self.div == 1:
            return (E, B, I, O)
        return (E, max(8, B // self.div), min(I, 128), min(O, 128))  # a dry run: small enough for a CPU

    def time_left(self) -> float:
        return math.inf if self.args.deadline is None else self.args.deadline - (time.perf_counter() - self.t0)

    def out_of_time(self, what: str, need: float = 0.0) -> bool:
        if self.time_left() <= need:
            self.skipped.append(f"{what}: not started, {self.time_left():.0f} s left before the deadline")
            print(f"[bench] skipped {what} (deadline)", flush=True)
            return True
        return False

    def timer(self, fn) -> Dict[str, float]:
        a = self.args
        return harness.cuda_timer(fn, a.reps, a.min_batch_ms)

    def graph_timer(self, fn) -> Optional[Dict[str, float]]:
        if not self.cuda:
            return None  # no graphs on the CPU
        try:
            return harness.graph_timer(fn, self.args.reps, self.args.min_batch_ms)
        except RuntimeError as e:  # a capture failure is a finding, not the end of the run
            self.failures.append(f"CUDA-graph capture failed: {str(e).splitlines()[0]}")
            return None

    def add(self, stage: str, **row):
        row = dict(stage=stage, dtype=self.args.dtype, tf32=self.tf32(), **row)
        self.rows.append(row)

    def tf32(self) -> bool:
        return bool(self.cuda and torch.backends.cuda.matmul.allow_tf32)

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def save(self) -> None:
        meta = {"command": harness.command(__file__, self.args.argv), **harness.machine(self.device),
                "seconds": round(time.perf_counter() - self.t0, 1), "failures": self.failures,
                "skipped": self.skipped, "dry_run": self.args.dry_run}
        title = "nalu_cuda GPU benchmark" + ("" if self.cuda else " (dry run on the CPU: no GPU figure)")
        harness.write(os.path.join(self.args.out, "bench_gpu"), meta, self.rows, self.table(), title=title)

    # -- the Markdown table
    def table(self) -> str:
        def f(v, spec=".1f"):
            return "-" if v is None else format(v, spec)

        out = []
        for r in self.rows:
            base = r.get("reference_us")
            ratio = f"{base / r['median_us']:.2f}x" if base and r.get("median_us") else "-"
            out.append([r["stage"], r.get("unit", "-"), r.get("shape", "-"), r.get("mode", "-"), r.get("provider", "-"),
                        f(r.get("median_us")), f(r.get("p20_us")), f(r.get("p80_us")), ratio, f(r.get("gb_per_s")),
                        f(r.get("seed_steps_per_s"), ",.0f"), f(r.get("max_rel_err"), ".2g"),
                        "on" if r["tf32"] else "off"])
        head = ["stage", "unit", "shape", "mode", "provider", "median us", "p20 us", "p80 us",
                "vs reference row", "GB/s", "seed-steps/s", "max rel err", "TF32"]
        notes = ["", "`vs reference row`: the reference's time over this row's (> 1: this row is faster). ops and "
                 "compile: eager per call for per-call rows, eager graph replay for graph rows (kernel-only); large: "
                 "the bare cuBLAS products. GB/s counts bytes read plus written. training: median us is one step of the "
                 "whole ensemble; seed-steps/s = members x steps per second."]
        if self.failures:
            notes += ["", "## Correctness failures", ""] + [f"- {x}" for x in self.failures]
        if self.skipped:
            notes += ["", "## Skipped", ""] + [f"- {x}" for x in self.skipped]
        return harness.markdown_table(head, out) + "\n" + "\n".join(notes)

    # -- stages
    def stage_copy(self):
        n = (2 * 2**30 // 4) // self.div  # 2 GiB of float32
        src = torch.randn(n, device=self.device)
        dst = torch.empty_like(src)
        r = self.timer(lambda: dst.copy_(src))
        self.copy_gbs = 2 * n * 4 / (r["median_us"] * 1e-6) / 1e9
        self.add("copy", shape=f"{n * 4 / 2**30:.2f} GiB", provider="copy_", gb_per_s=self.copy_gbs, **r)
        del src, dst

    def check(self, unit, shape_name, providers, inputs, gy) -> Dict[str, float]:
        want = fwd_bwd(providers["eager"], inputs, gy)
        errs = {}
        for name, fn in providers.items():
            if name != "eager":
                errs[name] = max_rel_err(fwd_bwd(fn, inputs, gy), want)
                if not errs[name] <= RTOL[self.args.dtype]:
                    self.failures.append(f"{unit} {shape_name}: {name} differs from the eager reference (max relative "
                                         f"error {errs[name]:.3g} > {RTOL[self.args.dtype]})")
        return errs

    def time_unit(self, stage, unit, shape_name, providers, graphs=True):
        shape = self.shape(shape_name)
        torch.manual_seed(0)
        t = make_inputs(unit, shape, self.dtype, self.device)
        inputs = list(t.values())
        with torch.no_grad():
            gy = torch.randn_like(unit_fn(unit, R)(*inputs))
        errs = self.check(unit, shape_name, providers, inputs, gy)
        for mode in ("fwd", "fwd+bwd"):
            eager_us: Dict[str, float] = {}  # per call / graph replay: each row's reference
            for name, fn in providers.items():
                call = (lambda fn=fn: fn(*inputs)) if mode == "fwd" else (
                    lambda fn=fn: torch.autograd.grad(fn(*inputs), inputs, gy))
                kinds = [("", self.timer)] + ([(" graph", self.graph_timer)] if graphs and name != "compile" else [])
                for suffix, timer in kinds:
                    r = timer(call)
                    if r is None:
                        continue
                    if name == "eager":
                        eager_us[suffix] = r["median_us"]
                    self.add(stage, unit=unit, shape=shape_name, mode=mode, provider=name + suffix,
                             reference_us=eager_us.get(suffix) if name != "eager" else None,
                             max_rel_err=errs.get(name), **r)
        self.sync()

    def stage_ops(self):
        for shape_name in ("paper", "ensemble"):
            for unit in UNITS:
                if self.out_of_time(f"ops {unit} {shape_name}", need=10):
                    continue
                self.time_unit("ops", unit, shape_name, {"eager": unit_fn(unit, R), "fused": unit_fn(unit, F)})
                print(f"[bench] ops {unit} {shape_name} done ({time.perf_counter() - self.t0:.0f} s)", flush=True)

    def stage_memory_bound(self):
        E, B, I, O = shape = self.shape("memory_bound")
        t = {k: v.detach() for k, v in make_inputs("nalu", shape, self.dtype, self.device).items()}
        op = torch.ops.nalu_cuda.nalu_forward
        args = (t["x"], t["W_hat"], t["M_hat"], None, None, t["G"], EPS, True)
        outs = op(*args)
        moved = sum(v.numel() * v.element_size() for v in t.values()) + sum(o.numel() * o.element_size() for o in outs)
        del outs
        r = self.timer(lambda: op(*args))
        gbs = moved / (r["median_us"] * 1e-6) / 1e9
        self.add("memory_bound", unit="nalu", shape=f"E=1 B={B} I={I} O={O}", mode="fwd op", provider="fused",
                 gb_per_s=gbs, bytes=moved, copy_gb_per_s=self.copy_gbs,
                 fraction_of_copy=gbs / self.copy_gbs if self.copy_gbs else None, **r)

    def stage_large(self):
        shape = self.shape("large")
        torch.manual_seed(0)
        t = make_inputs("nalu", shape, self.dtype, self.device)
        inputs = list(t.values())
        fn = unit_fn("nalu", F)
        with torch.no_grad():
            gy = torch.randn_like(fn(*inputs))
        err = self.check("nalu", "large", {"eager": unit_fn("nalu", R), "fused": fn}, inputs, gy)["fused"]
        fwd, bwd = products(shape, self.dtype, self.device)
        for mode, triples, call in (("fwd", fwd, lambda: fn(*inputs)),
                                    ("fwd+bwd", fwd + bwd, lambda: torch.autograd.grad(fn(*inputs), inputs, gy))):
            floor = self.timer(lambda triples=triples: run_products(triples))
            self.add("large", unit="nalu", shape="large", mode=mode, provider=f"cuBLAS products ({len(triples)})",
                     **floor)
            self.add("large", unit="nalu", shape="large", mode=mode, provider="fused", reference_us=floor["median_us"],
                     max_rel_err=err, **self.timer(call))
        self.sync()

    def stage_training(self):
        E, I, B = 100, 100, max(8, 128 // (self.div if self.div > 1 else 1))
        steps = 20 if self.args.dry_run else self.args.train_steps
        g = torch.Generator(device=self.device).manual_seed(0)
        model = torch.nn.Sequential(nalu_cuda.NALU(I, 2, ensemble=E), nalu_cuda.NALU(2, 1, ensemble=E)).to(self.device)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        mask = (torch.rand(E, I, 2, generator=g, device=self.device) < 0.1).to(torch.float32)  # two subsets a, b

        def step():
            x = torch.rand(E, B, I, generator=g, device=self.device) + 1
            target = torch.bmm(x, mask).sum(-1, keepdim=True)  # a + b, per member
            loss = torch.nn.functional.mse_loss(model(x), target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        for _ in range(10):
            step()
        self.sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        self.sync()
        rate = steps / (time.perf_counter() - t0)
        self.add("training", unit="nalu -> nalu", shape=f"E={E} B={B} I={I}", mode=f"{steps} steps",
                 provider="eager (fused ops, torch.optim.Adam)", steps_per_s=rate, seed_steps_per_s=rate * E,
                 median_us=1e6 / rate)
        # The experiments' trainer on the static task's 100-seed NALU cell, data drawn on the device:
        # the resident step eagerly, and captured in a CUDA graph and replayed (what `nalu-cuda static
        # --device cuda --stream counter` runs).
        from nalu_cuda.experiments.parts.arithmetic_data import Range, subset_layout
        from nalu_cuda.experiments.parts.arithmetic_models import build_static_model
        from nalu_cuda.experiments.parts.counter_stream import CounterStream
        from nalu_cuda.experiments.parts.seeding import member_generators
        from nalu_cuda.experiments.parts.training import EvalSet, train_ensemble

        seeds = list(range(E))
        masks = torch.stack([subset_layout(s, I, 0.25, 0.5).mask() for s in seeds])
        stream = CounterStream(seeds, (B, I), Range(((1.0, 2.0),)), device=self.device, masks=masks, ops=("add",))

        def batch_fn(step):
            return stream.draw(step)

        batch_fn.counter_stream = stream  # the native rows draw the batch inside their kernel (same bits)
        xv = torch.rand(256, I, generator=g, device=self.device) + 1
        val = EvalSet("valid", xv, torch.bmm(xv.unsqueeze(0).expand(E, 256, I), masks.to(self.device)).sum(-1, keepdim=True))
        # native: the gradient from static_ensemble_grad's CUDA kernel (one block per member) instead of
        # autograd ("resident-native"; on a CPU the trainer keeps the autograd resident step)
        for native in (False, True):
            for graph in (False, True):
                if self.out_of_time(f"training resident graph={graph} native={native}", need=30):
                    return
                model = build_static_model("nalu", I, 2, ensemble=E)
                model.reset_parameters(member_generators(seeds))
                model.to(self.device)
                warm = train_ensemble(model, E, batch_fn, 10, val, eval_every=10, resident=True, graph=graph,
                                      native=native)
                # Runs of N and 2N steps: their difference is the steady per-step cost, without what a
                # run costs once (the flat buffers, the graph's capture, the first and last evaluation).
                walls = []
                for n in (steps, 2 * steps):
                    model = build_static_model("nalu", I, 2, ensemble=E)
                    model.reset_parameters(member_generators(seeds))
                    model.to(self.device)
                    res = train_ensemble(model, E, batch_fn, n, val, eval_every=n, resident=True, graph=graph,
                                         native=native)
                    walls.append(res.wall_s)
                per_step = max(walls[1] - walls[0], 1e-9) / steps
                rate = 1.0 / per_step
                # the row names the step that ran (the trainer's record of it), not the one asked for
                kind = (" (native asked: on a CPU the autograd resident step)" if res.step_path != "resident-native"
                        else " (native gradient kernel, batch drawn in it)" if res.batch_in_kernel
                        else " (native gradient kernel, fed by batch_fn)")
                where = (("CUDA graph" if str(self.device).startswith("cuda") else "graph asked (no graphs on a CPU: "
                          "eager)") if graph else "eager")
                self.add("training", unit="nalu -> nalu", shape=f"E={E} B={B} I={I}", mode=f"{steps} steps (2N - N)",
                         provider=f"train_ensemble, resident step{kind if native else ''}, "
                                  + where,
                         steps_per_s=rate, seed_steps_per_s=rate * E, median_us=1e6 / rate,
                         once_s=max(walls[0] - steps * per_step, 0.0), diverged=int(res.diverged.sum()),
                         warmup_s=warm.wall_s)

    def stage_compile(self):
        for shape_name in ("paper", "ensemble"):
            if self.out_of_time(f"compile nalu {shape_name}", need=30):
                continue
            torch._dynamo.reset()
            compiled = torch.compile(unit_fn("nalu", R), fullgraph=True)
            t0 = time.perf_counter()
            t = make_inputs("nalu", self.shape(shape_name), self.dtype, self.device)
            fwd_bwd(compiled, list(t.values()), torch.ones_like(unit_fn("nalu", R)(*t.values())))
            self.sync()
            compile_s = time.perf_counter() - t0
            providers = {"eager": unit_fn("nalu", R), "fused": unit_fn("nalu", F), "compile": compiled}
            self.time_unit("compile", "nalu", shape_name, providers, graphs=False)
            self.add("compile", unit="nalu", shape=shape_name, provider="compile (cold: forward + backward)",
                     compile_s=compile_s)
            print(f"[bench] compile {shape_name} done ({time.perf_counter() - self.t0:.0f} s)", flush=True)
        torch._dynamo.reset()

    def stage_sanitize_case(self):
        t = make_inputs("nalu", (2, 64, 20, 2), self.dtype, self.device)
        y = unit_fn("nalu", F)(*t.values())
        torch.autograd.grad(y, list(t.values()), torch.randn_like(y))
        # The static task's gradient kernel (static_ensemble_grad), NALU -> NALU: one block per member,
        # its phases separated by __syncthreads (racecheck's case), segments on the host.
        E, B, I, H = 2, 64, 20, 2
        g = torch.Generator().manual_seed(0)
        ps = [torch.randn(s, generator=g) * 0.3 for s in [(E, I, H)] * 3 + [(E, H, 1)] * 3]
        offsets = [0] + torch.tensor([p.numel() for p in ps]).cumsum(0).tolist()[:-1]
        segments = torch.tensor([[o, p.numel() // E] for o, p in zip(offsets, ps)], dtype=torch.long)
        flat = torch.cat([p.reshape(-1) for p in ps]).to(self.device, self.dtype)
        x = (torch.rand(E, B, I, generator=g) + 0.5).to(self.device, self.dtype)
        target = torch.randn(E, B, 1, generator=g).to(self.device, self.dtype)
        grad = torch.empty_like(flat)
        flags = torch.zeros(E, dtype=torch.bool, device=self.device)
        torch.ops.nalu_cuda.static_ensemble_grad(x, target, flat, grad, segments, flags, "nalu", 1e-7, 0.0)
        self.sync()
        assert torch.isfinite(grad).all() and not flags.any(), "sanitize_case: the gradient kernel's result is not finite"
        print("[bench] sanitize_case: one rowwise-path nalu forward and backward and one static_ensemble_grad ran",
              flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or harness.RESULTS)
    p.add_argument("--stages", default=",".join(DEFAULT_STAGES), help=f"comma list of {STAGES}")
    p.add_argument("--dtype", default="float32", choices=list(RTOL))
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--min-batch-ms", type=float, default=2.0, help="time batches of calls lasting at least this")
    p.add_argument("--train-steps", type=int, default=500)
    p.add_argument("--deadline", type=float, default=None, help="seconds: start no stage or unit after this")
    p.add_argument("--append", action="store_true", help="add to the rows of --out/bench_gpu.json")
    p.add_argument("--dry-run", action="store_true",
                   help="small shapes (B and the copy divided by --dry-run-divisor, I and O at most 128)")
    p.add_argument("--dry-run-divisor", type=int, default=512)
    args = p.parse_args(argv)
    args.argv = argv
    stages = [s for s in args.stages.split(",") if s]
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        p.error(f"--stages: unknown {unknown}; choose from {STAGES}")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("bench_gpu: no CUDA device visible (use --device cpu --dry-run to test this script)")
            return 2
        if not nalu_cuda.has_cuda_kernels():
            print(f"bench_gpu: nalu_cuda has no CUDA kernels (build: {nalu_cuda.build_info()})")
            return 2
        torch.backends.cuda.matmul.allow_tf32 = False  # the reference's default; every row records it
        torch.backends.cudnn.allow_tf32 = False
    if args.dry_run:
        args.reps, args.min_batch_ms = 3, 0.5
    run = Run(args)
    for s in stages:
        if s != "sanitize_case" and run.out_of_time(f"stage {s}"):
            continue
        print(f"[bench] stage {s} ({time.perf_counter() - run.t0:.0f} s)", flush=True)
        getattr(run, f"stage_{s}")()
        if s != "sanitize_case":
            run.save()
    if stages != ["sanitize_case"]:
        print(run.table())
    for f in run.failures:
        print(f"CORRECTNESS: {f}")
    return 1 if run.failures else 0


if __name__ == "__main__":
    sys.exit(main())
