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

Under ``torchrun`` the configurations are split across the ranks and gathered on rank 0
(:mod:`nalu_cuda.experiments.distributed`); each rank runs its share with :func:`run_one`, and the
rules below hold per file system.

Rules (each violation is a :class:`RunError` with a message saying what to do), applied to every
configuration of a run before any of them trains:

* one run at a time in ``DIR`` (a lock, :mod:`nalu_cuda.experiments.outdir`), and no file that
  nalu-cuda did not write is replaced without ``--overwrite``;
* every result and checkpoint is sealed (:func:`seal`): it carries its configuration's fingerprint
  (hash of the configuration) and a ``checksum`` (sha256 of its content, :func:`checksum`);
* a result or checkpoint whose fingerprint differs from the configuration being run is never reused;
* a damaged result or checkpoint (unreadable, truncated, fields missing, a checksum that does not
  match its content or a fingerprint that is not its own configuration's: edited by hand) is named
  with what is wrong; under ``--resume`` it is moved aside (:func:`keep_damaged`: ``result.json.damaged``,
  then ``.damaged-2``, ...; nothing is deleted) and its configuration recomputed from the start, with a
  warning. A file without a checksum (written before result version 2) cannot be verified and counts
  as damaged: ``--resume`` recomputes it, the old file kept;
* a sealed checkpoint is still checked field by field before use (:class:`CheckpointState`, and
  :func:`.parts.training.checked_checkpoint` against the state the run saves): a field of the wrong
  kind, shape or range is a :class:`RunError` naming the file, the field, what was expected and what came;
* without ``--resume``, existing results or checkpoints of the run's configurations are an error
  unless ``--overwrite`` is given, which deletes every one of them before the run starts.
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
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

import nalu_cuda

from . import report as _report
from . import seed_blocks
from .integrity import (CheckpointState, checkpoint_path, checksum, config_dir, keep_damaged,  # noqa: F401
                        load_checkpoint, load_result, read_checkpoint, read_result, result_path, seal)
from .integrity import damaged as _damaged
from .outdir import OutputDir, RunError, atomic_write
from .registry import Config, ConfigResult, Context, RunOutput, all_experiments, get

__all__ = ["RunError", "run_configs", "load_results", "write_outputs", "atomic_write_text", "atomic_torch_save",
           "result_path", "RESULT_VERSION", "checksum", "seal", "keep_damaged", "CheckpointState"]

RESULT_VERSION = 2  # 2: results and checkpoints carry a checksum


def log_default(msg: str) -> None:
    """The default ``log``: a line on stderr that does not break tqdm's progress bars."""
    try:
        from tqdm.auto import tqdm  # local: tqdm is slow to import, and optional here

        tqdm.write(msg, file=sys.stderr)
    except Exception:  # pragma: no cover
        print(msg, file=sys.stderr)


# ------------------------------------------------------------------------------------------------
# Atomic files
# ------------------------------------------------------------------------------------------------


def atomic_write_text(path: str, text: str) -> None:
    atomic_write(path, lambda f: f.write(text), "w")


def atomic_torch_save(path: str, obj: Any) -> None:
    atomic_write(path, lambda f: torch.save(obj, f), "wb")


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


def result_from_data(data: Dict[str, Any]) -> ConfigResult:
    cfg = Config.from_dict(data["config"])
    summaries = data.get("summaries") or []
    return ConfigResult(config=cfg, records=data["records"], summary=summaries[0] if summaries else {},
                        extra=data.get("extra", {}), wall_s=float(data.get("wall_s", 0.0)), summaries=summaries)


def _make_context(out_dir: str, cfg: Config, device: str, progress: bool, resume: bool, log,
                  checkpoint_every_s: float) -> Context:
    ck = checkpoint_path(out_dir, cfg)
    fp = cfg.fingerprint()

    def save(state: Any) -> None:
        atomic_torch_save(ck, seal({"fingerprint": fp, "config": cfg.to_dict(), "version": RESULT_VERSION,
                                    "state": state}))

    def load() -> Optional[Any]:
        if not resume or not os.path.exists(ck):
            return None
        return read_checkpoint(ck, fp)

    return Context(device=device, work_dir=config_dir(out_dir, cfg), progress=progress, save_checkpoint=save,
                   load_checkpoint=load, log=log, checkpoint_every_s=checkpoint_every_s)


def _existing(cfg: Config, out_dir: str, *, resume: bool, overwrite: bool, log) -> Optional[Dict[str, Any]]:
    """Apply the rules to what ``out_dir`` holds for ``cfg``: the result to keep (``--resume``), or ``None``
    when ``cfg`` is to run. ``overwrite`` deletes its result and checkpoint; ``resume`` moves a damaged
    result or checkpoint aside (with a warning) and checks the checkpoint it will continue from."""
    rp, ck = result_path(out_dir, cfg), checkpoint_path(out_dir, cfg)
    fp = cfg.fingerprint()
    seed_blocks.check_existing(cfg, out_dir, resume=resume, overwrite=overwrite, log=log)
    if overwrite:
        for p in (rp, ck):
            if os.path.exists(p):
                os.unlink(p)
        return None
    if os.path.exists(rp):
        data, problem = load_result(rp)
        if problem is not None:
            _damaged(rp, "result file", problem, cfg, resume, log)
        elif data["fingerprint"] != fp:
            raise RunError(f"{rp} holds results of a different configuration named {cfg.name!r} (fingerprint "
                           f"{data['fingerprint']}, this run {fp}). Use another --out, or --overwrite to "
                           "replace them")
        elif not resume:
            raise RunError(f"{rp} already holds the results of this configuration: pass --resume to keep them "
                           "(and continue with the rest), or --overwrite to recompute")
        else:
            return data
    if os.path.exists(ck):
        _, problem = load_checkpoint(ck, fp)  # one of other settings is a RunError
        if problem is not None:
            _damaged(ck, "checkpoint", problem, cfg, resume, log)
        elif not resume:
            raise RunError(f"{ck} is the checkpoint of an interrupted run of this configuration: pass --resume to "
                           "continue it, or --overwrite to start again")
    return None


def run_one(cfg: Config, out_dir: str, *, device: str = "cpu", resume: bool = False, overwrite: bool = False,
            progress: bool = True, log=log_default, checkpoint_every_s: float = 60.0) -> ConfigResult:
    """Run (or, with ``resume``, reuse) one configuration; returns its result."""
    exp = get(cfg.experiment)
    ck = checkpoint_path(out_dir, cfg)
    kept = _existing(cfg, out_dir, resume=resume, overwrite=overwrite, log=log)
    if kept is not None:
        log(f"[skip] {cfg.key}: finished earlier (kept)")
        return result_from_data(kept)
    if resume and not os.path.exists(ck):  # blocks of seeds that a sharded run finished or started
        done, started, _ = seed_blocks.on_disk(out_dir, cfg)
        if done or started:
            blocks = seed_blocks.layout(cfg.seeds, done, started, lambda lo, hi: 1)
            log(f"{cfg.key}: continuing from its blocks of seeds ({len(done)} of {len(blocks)} finished)")
            return run_blocks(cfg, out_dir, blocks, device=device, resume=True, progress=progress,
                                          log=log, checkpoint_every_s=checkpoint_every_s)
    os.makedirs(config_dir(out_dir, cfg), exist_ok=True)
    ctx = _make_context(out_dir, cfg, device, progress, resume, log, checkpoint_every_s)
    resuming = resume and os.path.exists(ck)
    t0 = time.perf_counter()
    try:
        out: RunOutput = exp.run(cfg, ctx)
    except RuntimeError as exc:  # torch's load_state_dict on a checkpoint whose tensors were edited
        if not (resuming and str(exc).startswith("Error(s) in loading state_dict")):
            raise
        why = " ".join(str(exc).split())
        raise RunError(f"checkpoint {ck} does not fit the model of {cfg.key} ({why}); delete it, or rerun with "
                       "--overwrite to start this configuration again") from None
    more = {"nonfinite": seed_blocks.nonfinite(out.records)} if seed_blocks.is_block(cfg) else {}
    return _write_result(cfg, out_dir, out, time.perf_counter() - t0, device, more)


def _write_result(cfg: Config, out_dir: str, out: RunOutput, wall: float, device: str,
                  more: Optional[Dict[str, Any]] = None) -> ConfigResult:
    """Summarise ``out`` and write ``cfg``'s ``result.json`` (atomically); its checkpoint goes."""
    rp, ck = result_path(out_dir, cfg), checkpoint_path(out_dir, cfg)
    summ = get(cfg.experiment).summary(cfg, out.records, out.extra)
    summaries = summ if isinstance(summ, list) else [summ]
    for s in summaries:
        s.setdefault("wall_s", wall)
    data = {"version": RESULT_VERSION, "fingerprint": cfg.fingerprint(), "config": cfg.to_dict(),
            "records": out.records, "extra": out.extra, "summaries": summaries, "wall_s": wall, "device": device,
            "threads": torch.get_num_threads(), "finished": _dt.datetime.now().isoformat(timespec="seconds"), **(more or {})}
    data = seal(json.loads(dumps(data)))  # the checksum of what the file reads back as
    atomic_write_text(rp, dumps(data))
    if os.path.exists(ck):
        os.unlink(ck)
    return result_from_data(data)


def write_merged(cfg: Config, out_dir: str, parts) -> ConfigResult:
    """Write ``cfg``'s result from its blocks of seeds (``[((lo, hi), result data), ...]``, see
    :func:`.seed_blocks.merge`), then remove the block directories."""
    out, wall, device = seed_blocks.merge(cfg, parts)
    os.makedirs(config_dir(out_dir, cfg), exist_ok=True)
    r = _write_result(cfg, out_dir, out, wall, device, {"seed_blocks": [list(b) for b, _ in sorted(parts)]})
    seed_blocks.remove_blocks(out_dir, cfg)
    return r


def run_blocks(cfg: Config, out_dir: str, blocks: Sequence[Tuple[int, int]], **run_kw) -> ConfigResult:
    """Run (or, with ``resume``, keep) every block of seeds of ``cfg`` (:mod:`.seed_blocks`) in one
    process, then write its merged result."""
    parts = []
    for lo, hi in blocks:
        b = seed_blocks.block_config(cfg, lo, hi)
        run_one(b, out_dir, **run_kw)
        parts.append(((lo, hi), read_result(result_path(out_dir, b))))
    return write_merged(cfg, out_dir, parts)


def _result_files(out_dir: str) -> List[str]:
    """Every ``runs/<experiment>/<config>/result.json`` under ``out_dir``, sorted."""
    root = os.path.join(out_dir, "runs")
    found = []
    if os.path.isdir(root):
        for exp_name in sorted(os.listdir(root)):
            d = os.path.join(root, exp_name)
            for name in sorted(os.listdir(d)) if os.path.isdir(d) else []:
                rp = os.path.join(d, name, "result.json")
                if os.path.exists(rp):
                    found.append(rp)
    return found


def prepare(configs: Sequence[Config], od: OutputDir, *, resume: bool, overwrite: bool, log) -> None:
    """Every rule checked before any configuration trains; all problems in one :class:`RunError`."""
    out_dir = od.path
    problems = []
    ours = {os.path.abspath(result_path(out_dir, c)) for c in configs}
    experiments = {c.experiment for c in configs}
    for rp in _result_files(out_dir):
        data, problem = load_result(rp)
        if problem is None:
            experiments.add(data["config"]["experiment"])
        elif os.path.abspath(rp) not in ours:
            problems.append(f"result file {rp} is damaged ({problem}); its configuration is not part of this run, "
                            "whose summary and report gather every result in --out: delete that file, or choose "
                            "another --out")
    for name in ["summary.json", "report.md"] + [f"per_seed_{e}.csv" for e in sorted(experiments)]:
        try:
            od.check_replaceable(name)
        except RunError as exc:
            problems.append(str(exc))
    if problems:  # before --overwrite deletes anything
        raise RunError("\n".join(problems))
    for cfg in configs:
        try:
            _existing(cfg, out_dir, resume=resume, overwrite=overwrite, log=log)
        except RunError as exc:
            problems.append(str(exc))
    if problems:
        raise RunError("\n".join(problems))


def run_configs(configs: Sequence[Config], out_dir: str, *, device: str = "cpu", resume: bool = False,
                overwrite: bool = False, progress: bool = True, log=log_default, meta: Optional[dict] = None,
                checkpoint_every_s: float = 60.0, report_every_s: float = 60.0) -> List[ConfigResult]:
    """Run every configuration in order, rebuilding the outputs after each; returns the results.

    ``out_dir`` is locked for the whole call (a second run into it is a :class:`RunError`)."""
    names = [c.key for c in configs]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ValueError(f"configuration names repeat: {sorted(dup)}")
    with OutputDir(out_dir, overwrite=overwrite) as od:
        prepare(configs, od, resume=resume, overwrite=overwrite, log=log)
        results = []
        t_start = time.perf_counter()
        last_report = -math.inf
        for i, cfg in enumerate(configs):
            log(f"[{i + 1}/{len(configs)}] {cfg.key}: {cfg.seeds} seeds x {cfg.steps} steps "
                f"(elapsed {time.perf_counter() - t_start:.0f} s)")
            r = run_one(cfg, out_dir, device=device, resume=resume, overwrite=overwrite, progress=progress, log=log,
                        checkpoint_every_s=checkpoint_every_s)
            log(f"[{i + 1}/{len(configs)}] {cfg.key}: done in {r.wall_s:.0f} s; " + headline(r))
            results.append(r)
            # summary.json and the CSVs after every configuration; the report and its plots (slower)
            # at most once a minute, and always at the end (below).
            with_report = i + 1 < len(configs) and time.perf_counter() - last_report >= report_every_s
            write_outputs(out_dir, meta=meta, order=names, report=with_report, outdir=od)
            if with_report:
                last_report = time.perf_counter()
        meta = dict(meta or {})
        meta["invocation_wall_s"] = time.perf_counter() - t_start
        write_outputs(out_dir, meta=meta, order=names, outdir=od)
    return results


def headline(r: ConfigResult) -> str:
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
    found = []
    for rp in _result_files(out_dir):
        data, problem = load_result(rp)
        if problem is not None:
            raise RunError(f"result file {rp} is damaged ({problem}); delete it, or rerun its configuration with "
                           "--resume to recompute it")
        found.append(result_from_data(data))
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
                  report: bool = True, outdir: Optional[OutputDir] = None) -> None:
    """Rebuild ``summary.json``, ``per_seed_<experiment>.csv`` and (``report``) ``report.md`` and plots.

    ``outdir``: the locked :class:`OutputDir` of a run in progress (else ``out_dir`` is locked here)."""
    if outdir is None:
        with OutputDir(out_dir) as od:
            return write_outputs(out_dir, meta, order, report, outdir=od)
    results = load_results(out_dir, order)
    meta = dict(meta or {})
    meta.setdefault("generated", _dt.datetime.now().isoformat(timespec="seconds"))
    meta.setdefault("torch", torch.__version__)
    meta.setdefault("python", platform.python_version())
    meta.setdefault("machine", f"{platform.machine()} {platform.system()}, {os.cpu_count()} CPUs")
    try:
        meta.setdefault("nalu_cuda", nalu_cuda.__version__)
        meta.setdefault("native_extension", nalu_cuda.has_extension())
    except Exception:  # pragma: no cover
        pass
    meta["total_wall_s"] = sum(r.wall_s for r in results)
    records = [s for r in results for s in (r.summaries or [r.summary])]
    by_exp: Dict[str, List[ConfigResult]] = {}
    for r in results:
        by_exp.setdefault(r.config.experiment, []).append(r)
    names = ["summary.json"] + [f"per_seed_{e}.csv" for e in by_exp] + (["report.md"] if report else [])
    for name in names:  # all refusals before the first write
        outdir.check_replaceable(name)
    outdir.write_text("summary.json", dumps({"meta": meta, "records": records}))
    for exp_name, rs in by_exp.items():
        rows = []
        for r in rs:
            for rec in r.records:
                rows.append({"experiment": exp_name, "config": r.config.name, **rec})
        outdir.write_text(f"per_seed_{exp_name}.csv", _csv_text(rows))
    if report:
        # The experiments' report sections write their plots themselves: into a staging directory,
        # from which each moves to DIR only if it replaces nothing that nalu-cuda did not write.
        with tempfile.TemporaryDirectory(prefix=".tmp-report-", dir=out_dir) as stage:
            text = _report.build_report(by_exp, stage, meta)
            plots = sorted(os.listdir(stage))
            for name in plots:
                outdir.check_replaceable(name)
            for name in plots:
                os.replace(os.path.join(stage, name), os.path.join(out_dir, name))
            outdir.record(plots)
        outdir.write_text("report.md", text)
