"""The timing harness every benchmark script of benchmarks/ uses: warm-up, timers, interleaved
rounds, the description of the machine, and the Markdown / CSV / JSON writers.

* ``cpu_timer(fn, min_run_time)``: torch.utils.benchmark's blocked_autorange (it warms up and
  picks the number of calls per block); the median and the 20th/80th percentiles of the blocks
  (``cpu_times``: the blocks' per-call times, to pool over interleaved rounds).
* ``cuda_timer(fn, reps, min_batch_ms)``: CUDA events around batches of calls (a few-microsecond
  op is not lost in the events' own overhead), after a warm-up; per-call statistics of the batches.
* ``graph_timer(fn, reps, min_batch_ms)``: ``fn`` captured once in a CUDA graph and timed by its
  replays: the kernels' time without the host's launch overhead.
* ``interleaved(runs, rounds)``: each round calls every configuration once, in order, so that a
  slow phase of a shared machine falls on all of them alike; every value of every round is kept.
* ``machine(device)``: what the figures depend on (CPU model and ISA, cores, torch, threads, load;
  on CUDA the GPU, driver, nvcc, clocks and the TF32 setting), for every results file.
* ``write(stem, meta, rows, table)``: ``stem.json`` (meta + rows), ``stem.csv`` (rows) and
  ``stem.md`` (meta + the Markdown table).
"""
from __future__ import annotations

import csv
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")


# ------------------------------------------------------------------------------------------------
# Statistics and timers
# ------------------------------------------------------------------------------------------------


def stats(times: Sequence[float], scale: float = 1e3, unit: str = "ms") -> Dict[str, float]:
    """Median and 20th/80th percentiles of per-call times in seconds, in `unit` (times `scale`)."""
    t = sorted(times)
    q = lambda p: t[min(len(t) - 1, int(round(p * (len(t) - 1))))]  # noqa: E731
    return {f"median_{unit}": statistics.median(t) * scale, f"p20_{unit}": q(0.2) * scale,
            f"p80_{unit}": q(0.8) * scale, "runs": len(t)}


def cpu_times(fn: Callable[[], object], min_run_time: float) -> List[float]:
    """Per-call times (seconds) of the blocks of torch.utils.benchmark's blocked_autorange."""
    from torch.utils import benchmark

    return list(benchmark.Timer(stmt="fn()", globals={"fn": fn}).blocked_autorange(min_run_time=min_run_time).times)


def cpu_timer(fn: Callable[[], object], min_run_time: float, scale: float = 1e3, unit: str = "ms") -> Dict[str, float]:
    return stats(cpu_times(fn, min_run_time), scale, unit)


def _batch_size(fn: Callable[[], object], sync: Callable[[], None], min_batch_ms: float, warmup: int) -> int:
    for _ in range(warmup):
        fn()
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    single = time.perf_counter() - t0
    return max(1, min(2000, int(min_batch_ms / 1e3 / max(single, 1e-7))))


def cuda_timer(fn: Callable[[], object], reps: int = 15, min_batch_ms: float = 2.0, warmup: int = 3,
               scale: float = 1e6, unit: str = "us") -> Dict[str, float]:
    """Per-call time of fn from CUDA events around batches (on the CPU: the wall clock)."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    per_batch = _batch_size(fn, sync, min_batch_ms, warmup)
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(per_batch):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / per_batch)
        else:
            t0 = time.perf_counter()
            for _ in range(per_batch):
                fn()
            times.append((time.perf_counter() - t0) / per_batch)
    return {**stats(times, scale, unit), "calls_per_batch": per_batch}


def graph_timer(fn: Callable[[], object], reps: int = 15, min_batch_ms: float = 2.0, scale: float = 1e6,
                unit: str = "us") -> Dict[str, float]:
    """Kernel-only time: fn captured in a CUDA graph (after a warm-up on a side stream, as torch
    requires), then the replays timed with cuda_timer. Needs a GPU."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return cuda_timer(graph.replay, reps, min_batch_ms, warmup=2, scale=scale, unit=unit)


def interleaved(runs: Dict[str, Callable[[], float]], rounds: int, warmup: bool = False) -> Dict[str, List[float]]:
    """Each round calls every run once, in order; returns every round's value per run. With
    `warmup`, one untimed call of each first (a lazy initialisation then stays out of round 1)."""
    if warmup:
        for fn in runs.values():
            fn()
    out: Dict[str, List[float]] = {key: [] for key in runs}
    for _ in range(rounds):
        for key, fn in runs.items():
            out[key].append(fn())
    return out


# ------------------------------------------------------------------------------------------------
# The machine
# ------------------------------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_flags() -> List[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return [f for f in ("avx2", "fma", "avx512f") if f in have]
    except OSError:
        pass
    return []


def _run(cmd: List[str]) -> Optional[str]:
    if not shutil.which(cmd[0]):
        return None
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _nvcc() -> Optional[str]:
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    nvcc = shutil.which("nvcc") or os.path.join(home, "bin", "nvcc")
    if not os.path.exists(nvcc):
        return None
    out = _run([nvcc, "--version"])
    return out.splitlines()[-1].strip() if out else None


def gpu_description() -> Dict[str, object]:
    """The GPU, its driver and clocks (nvidia-smi), nvcc, and the TF32 settings in force now."""
    d: Dict[str, object] = {
        "gpu": torch.cuda.get_device_name(),
        "capability": ".".join(map(str, torch.cuda.get_device_capability())),
        "torch_cuda": torch.version.cuda,
        "nvcc": _nvcc(),
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "tf32_cudnn": torch.backends.cudnn.allow_tf32,
    }
    q = _run(["nvidia-smi", "--query-gpu=driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu",
              "--format=csv,noheader"])
    if q:
        keys = ("driver", "sm_clock", "sm_clock_max", "mem_clock", "power", "temperature")
        d.update(zip(keys, (v.strip() for v in q.splitlines()[0].split(","))))
    return d


def commit(root: str = ROOT) -> Optional[str]:
    """The short commit of the git tree at `root` (None outside one)."""
    return _run(["git", "-C", root, "rev-parse", "--short", "HEAD"])


def machine(device: str = "cpu", **extra) -> Dict[str, object]:
    """What every results file records besides its command."""
    import nalu_cuda

    m: Dict[str, object] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": os.environ.get("NALU_CUDA_COMMIT") or commit(),
        "cpu": _cpu_model(),
        "cpu_flags": _cpu_flags(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "nalu_cuda": nalu_cuda.build_info(),
        "load": " ".join(f"{v:.1f}" for v in os.getloadavg()),
        "device": device,
    }
    if device == "cuda" and torch.cuda.is_available():
        m.update(gpu_description())
    m.update(extra)
    return m


def command(script: str, argv: Optional[Sequence[str]]) -> str:
    args = list(argv) if argv is not None else sys.argv[1:]
    return " ".join(["python", f"benchmarks/{os.path.basename(script)}"] + args)


# ------------------------------------------------------------------------------------------------
# Writers
# ------------------------------------------------------------------------------------------------


def timing_args(ap, stem: str, per: str = "side") -> None:
    """The options of an interleaved CPU timing on `ap` (an argparse parser): --rounds, --min-time
    (seconds per `per` per round), --seed, --out (the results stem, default RESULTS/`stem`)."""
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--min-time", type=float, default=0.5, help=f"seconds per {per} per round")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(RESULTS, stem), help="results stem")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def meta_lines(meta: Dict[str, object]) -> str:
    """The meta block of a Markdown file: the command first, then one `key: value` per line."""
    out = [f"`{meta['command']}`" if "command" in meta else ""]
    out += [f"- {k}: {v}" for k, v in meta.items() if k != "command"]
    return "\n".join(out)


def write(stem: str, meta: Dict[str, object], rows: List[dict], table: str, title: str = "") -> List[str]:
    """Writes stem.json, stem.csv and stem.md atomically (a reader never sees half a file);
    returns the paths."""
    os.makedirs(os.path.dirname(os.path.abspath(stem)), exist_ok=True)
    flat = [{k: (json.dumps(v) if isinstance(v, (list, dict)) else v) for k, v in r.items()} for r in rows]
    keys: List[str] = []
    for r in flat:
        keys += [k for k in r if k not in keys]

    def put(path: str, writer: Callable) -> None:
        tmp = path + ".tmp"
        with open(tmp, "w", newline="") as f:
            writer(f)
        os.replace(tmp, path)

    put(stem + ".json", lambda f: json.dump({"meta": meta, "rows": rows}, f, indent=1, default=str))

    def put_csv(f):
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(flat)

    put(stem + ".csv", put_csv)
    put(stem + ".md", lambda f: f.write((f"# {title}\n\n" if title else "") + meta_lines(meta) + "\n\n" + table + "\n"))
    return [stem + ext for ext in (".json", ".csv", ".md")]
