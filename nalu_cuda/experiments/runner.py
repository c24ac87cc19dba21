"""Runs configurations of registered experiments and writes everything under ``--out DIR``.

Layout of ``DIR``::

    runs/<experiment>/<config>/result.json     one finished configuration (written atomically)
    runs/<experiment>/<config>/checkpoint.pt   mid-run state of an unfinished one (deleted when done)
    summary.json                               one record per configuration (and operation)
    per_seed_<experiment>.csv                  one row per seed
    report.md                                  tables beside the published figures, links to plots
    *.png                                      plots

Every finished configuration is written as soon as it finishes, so an interruption loses at most
the configuration in progress, and that one continues from its last checkpoint with ``--resume``.
``summary.json``, the CSVs and the report are rebuilt from every ``result.json`` in ``DIR`` after
each configuration and at the end.

Rules (each violation is a :class:`RunError` with a message saying what to do):

* a result or checkpoint whose fingerprint (hash of the configuration) differs from the
  configuration being run is never reused;
* an unreadable (corrupt, truncated) result or checkpoint is never silently ignored;
* without ``--resume``, existing results or checkpoints of the same configuration are an error
  unless ``--overwrite`` is given (which deletes them and starts again).
"""
from __future__ import annotations

import csv
import datetime as _dt
import io
import json
import math
import os
import platform
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from .registry import Config, ConfigResult, Context, RunOutput, all_experiments, get

__all__ = ["RunError", "run_configs", "load_results", "write_outputs", "atomic_write_text", "atomic_torch_save",
           "result_path", "RESULT_VERSION"]

RESULT_VERSION = 1


class RunError(Exception):
    """A problem the user must resolve (mismatched or corrupt files, existing results)."""


def _log_default(msg: str) -> None:
    try:
        from tqdm.auto import tqdm

        tqdm.write(msg, file=sys.stderr)
    except Exception:  # pragma: no cover
        print(msg, file=sys.stderr)


# ------------------------------------------------------------------------------------------------
# Atomic files
# ------------------------------------------------------------------------------------------------


def _atomic(path: str, write: Callable[[Any], None], mode: str) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=d)
    try:
        with os.fdopen(fd, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str, text: str) -> None:
    _atomic(path, lambda f: f.write(text), "w")


def atomic_torch_save(path: str, obj: Any) -> None:
    _atomic(path, lambda f: torch.save(obj, f), "wb")


def _json_default(o):
    if isinstance(o, torch.Tensor):
        return o.tolist()
    if hasattr(o, "item"):
        return o.item()
    if hasattr(o, "tolist"):
        return o.tolist()
    return str(o)


def _clean(o):
    """JSON without NaN/Infinity (strict parsers reject them): non-finite floats become null."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    return o


def dumps(obj) -> str:
    return json.dumps(_clean(json.loads(json.dumps(obj, default=_json_default))), indent=1, allow_nan=False)


# ------------------------------------------------------------------------------------------------
# Results and checkpoints of one configuration
# ------------------------------------------------------------------------------------------------


def config_dir(out_dir: str, cfg: Config) -> str:
    return os.path.join(out_dir, "runs", cfg.experiment, cfg.name)


def result_path(out_dir: str, cfg: Config) -> str:
    return os.path.join(config_dir(out_dir, cfg), "result.json")


def checkpoint_path(out_dir: str, cfg: Config) -> str:
    return os.path.join(config_dir(out_dir, cfg), "checkpoint.pt")


def _read_result(path: str) -> Dict[str, Any]:
    try:
        with open(path) as f:
            data = json.load(f)
        if not isinstance(data, dict) or "fingerprint" not in data or "config" not in data or "records" not in data:
            raise ValueError("missing fields")
        return data
    except (OSError, ValueError) as exc:
        raise RunError(f"result file {path} is unreadable or corrupt ({exc}); delete it, or rerun with "
                       "--overwrite to recompute that configuration") from None


def _result_from_data(data: Dict[str, Any]) -> ConfigResult:
    cfg = Config.from_dict(data["config"])
    summaries = data.get("summaries") or []
    return ConfigResult(config=cfg, records=data["records"], summary=summaries[0] if summaries else {},
                        extra=data.get("extra", {}), wall_s=float(data.get("wall_s", 0.0)), summaries=summaries)


def _make_context(out_dir: str, cfg: Config, device: str, progress: bool, resume: bool, log,
                  checkpoint_every_s: float) -> Context:
    ck = checkpoint_path(out_dir, cfg)
    fp = cfg.fingerprint()

    def save(state: Any) -> None:
        atomic_torch_save(ck, {"fingerprint": fp, "config": cfg.to_dict(), "version": RESULT_VERSION,
                               "state": state})

    def load() -> Optional[Any]:
        if not resume or not os.path.exists(ck):
            return None
        try:
            data = torch.load(ck, map_location="cpu", weights_only=True)
        except Exception as exc:  # truncated, garbage, wrong format
            raise RunError(f"checkpoint {ck} is corrupt ({type(exc).__name__}: {exc}); delete it or rerun with "
                           "--overwrite to start this configuration again") from None
        if not isinstance(data, dict) or data.get("fingerprint") != fp:
            got = data.get("fingerprint") if isinstance(data, dict) else None
            raise RunError(f"checkpoint {ck} belongs to a different configuration (fingerprint {got}, this run "
                           f"{fp}); the settings changed since it was written. Use another --out, or --overwrite "
                           "to discard it")
        return data["state"]

    return Context(device=device, work_dir=config_dir(out_dir, cfg), progress=progress, save_checkpoint=save,
                   load_checkpoint=load, log=log, checkpoint_every_s=checkpoint_every_s)


def run_one(cfg: Config, out_dir: str, *, device: str = "cpu", resume: bool = False, overwrite: bool = False,
            progress: bool = True, log=_log_default, checkpoint_every_s: float = 60.0) -> ConfigResult:
    """Run (or, with ``resume``, reuse) one configuration; returns its result."""
    exp = get(cfg.experiment)
    rp, ck = result_path(out_dir, cfg), checkpoint_path(out_dir, cfg)
    fp = cfg.fingerprint()
    if os.path.exists(rp):
        if overwrite:
            os.unlink(rp)
        else:
            data = _read_result(rp)
            if data["fingerprint"] != fp:
                raise RunError(f"{rp} holds results of a different configuration named {cfg.name!r} (fingerprint "
                               f"{data['fingerprint']}, this run {fp}). Use another --out, or --overwrite to "
                               "replace them")
            if not resume:
                raise RunError(f"{rp} already holds the results of this configuration: pass --resume to keep them "
                               "(and continue with the rest), or --overwrite to recompute")
            log(f"[skip] {cfg.key}: finished earlier (kept)")
            return _result_from_data(data)
    if os.path.exists(ck):
        if overwrite:
            os.unlink(ck)
        elif not resume:
            raise RunError(f"{ck} is the checkpoint of an interrupted run of this configuration: pass --resume to "
                           "continue it, or --overwrite to start again")
    os.makedirs(config_dir(out_dir, cfg), exist_ok=True)
    ctx = _make_context(out_dir, cfg, device, progress, resume, log, checkpoint_every_s)
    t0 = time.perf_counter()
    out: RunOutput = exp.run(cfg, ctx)
    wall = time.perf_counter() - t0
    summ = exp.summary(cfg, out.records, out.extra)
    summaries = summ if isinstance(summ, list) else [summ]
    for s in summaries:
        s.setdefault("wall_s", wall)
    data = {"version": RESULT_VERSION, "fingerprint": fp, "config": cfg.to_dict(), "records": out.records,
            "extra": out.extra, "summaries": summaries, "wall_s": wall, "device": device,
            "finished": _dt.datetime.now().isoformat(timespec="seconds")}
    atomic_write_text(rp, dumps(data))
    if os.path.exists(ck):
        os.unlink(ck)
    return _result_from_data(json.loads(dumps(data)))


def run_configs(configs: Sequence[Config], out_dir: str, *, device: str = "cpu", resume: bool = False,
                overwrite: bool = False, progress: bool = True, log=_log_default, meta: Optional[dict] = None,
                checkpoint_every_s: float = 60.0, report_every_s: float = 60.0) -> List[ConfigResult]:
    """Run every configuration in order, rebuilding the outputs after each; returns the results."""
    names = [c.key for c in configs]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ValueError(f"configuration names repeat: {sorted(dup)}")
    os.makedirs(out_dir, exist_ok=True)
    results = []
    t_start = time.perf_counter()
    last_report = -math.inf
    for i, cfg in enumerate(configs):
        log(f"[{i + 1}/{len(configs)}] {cfg.key}: {cfg.seeds} seeds x {cfg.steps} steps "
            f"(elapsed {time.perf_counter() - t_start:.0f} s)")
        r = run_one(cfg, out_dir, device=device, resume=resume, overwrite=overwrite, progress=progress, log=log,
                    checkpoint_every_s=checkpoint_every_s)
        log(f"[{i + 1}/{len(configs)}] {cfg.key}: done in {r.wall_s:.0f} s; " + _headline(r))
        results.append(r)
        # summary.json and the CSVs after every configuration; the report and its plots (slower)
        # at most once a minute, and always at the end.
        with_report = time.perf_counter() - last_report >= report_every_s
        write_outputs(out_dir, meta=meta, order=names, report=with_report)
        if with_report:
            last_report = time.perf_counter()
    meta = dict(meta or {})
    meta["invocation_wall_s"] = time.perf_counter() - t_start
    write_outputs(out_dir, meta=meta, order=names)
    return results


def _headline(r: ConfigResult) -> str:
    parts = []
    for s in r.summaries or [r.summary]:
        tag = s.get("op") or s.get("config")
        if s.get("success_rate") is not None:
            parts.append(f"{tag} {s.get('success_count')}/{s.get('n_records')} solved")
        elif s.get("divergence_rate") is not None:
            parts.append(f"{tag} {s.get('divergence_count')}/{s.get('n_records')} diverged")
    return ", ".join(parts) if parts else "ok"


# ------------------------------------------------------------------------------------------------
# Outputs
# ------------------------------------------------------------------------------------------------


def load_results(out_dir: str, order: Optional[Sequence[str]] = None) -> List[ConfigResult]:
    """Every finished configuration under ``out_dir`` (experiment order, then ``order``, then name)."""
    root = os.path.join(out_dir, "runs")
    found = []
    if os.path.isdir(root):
        for exp_name in sorted(os.listdir(root)):
            d = os.path.join(root, exp_name)
            for name in sorted(os.listdir(d)) if os.path.isdir(d) else []:
                rp = os.path.join(d, name, "result.json")
                if os.path.exists(rp):
                    found.append(_result_from_data(_read_result(rp)))
    exp_order = {e.name: i for i, e in enumerate(all_experiments())}
    pos = {k: i for i, k in enumerate(order or [])}
    found.sort(key=lambda r: (exp_order.get(r.config.experiment, 10_000), r.config.experiment,
                              pos.get(r.config.key, 10_000), r.config.name))
    return found


def _csv_text(rows: List[Dict[str, Any]]) -> str:
    cols: List[str] = []
    for r in rows:
        for k in r:
            if k not in cols:
                cols.append(k)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore")
    w.writeheader()
    for r in rows:
        w.writerow({k: ("" if v is None else (json.dumps(v) if isinstance(v, (list, dict)) else v))
                    for k, v in r.items()})
    return buf.getvalue()


def write_outputs(out_dir: str, meta: Optional[dict] = None, order: Optional[Sequence[str]] = None,
                  report: bool = True) -> None:
    """Rebuild ``summary.json``, ``per_seed_<experiment>.csv`` and (``report``) ``report.md`` and plots."""
    results = load_results(out_dir, order)
    meta = dict(meta or {})
    meta.setdefault("generated", _dt.datetime.now().isoformat(timespec="seconds"))
    meta.setdefault("torch", torch.__version__)
    meta.setdefault("python", platform.python_version())
    meta.setdefault("machine", f"{platform.machine()} {platform.system()}, {os.cpu_count()} CPUs")
    try:
        import nalu_cuda

        meta.setdefault("nalu_cuda", nalu_cuda.__version__)
        meta.setdefault("native_extension", nalu_cuda.has_extension())
    except Exception:  # pragma: no cover
        pass
    meta["total_wall_s"] = sum(r.wall_s for r in results)
    records = [s for r in results for s in (r.summaries or [r.summary])]
    atomic_write_text(os.path.join(out_dir, "summary.json"), dumps({"meta": meta, "records": records}))
    by_exp: Dict[str, List[ConfigResult]] = {}
    for r in results:
        by_exp.setdefault(r.config.experiment, []).append(r)
    for exp_name, rs in by_exp.items():
        rows = []
        for r in rs:
            for rec in r.records:
                rows.append({"experiment": exp_name, "config": r.config.name, **rec})
        atomic_write_text(os.path.join(out_dir, f"per_seed_{exp_name}.csv"), _csv_text(rows))
    if report:
        from . import report as _report

        atomic_write_text(os.path.join(out_dir, "report.md"), _report.build_report(by_exp, out_dir, meta))
