"""The output directory of a run: one run at a time, and only files nalu-cuda wrote are replaced.

* Lock: ``DIR/.nalu-cuda.lock`` is held with ``fcntl.flock`` for the whole run. The kernel releases
  a flock when its holder exits in any way (SIGKILL included), so a lock file left behind by a dead
  process never blocks a later run. The file holds the holder's pid, host and start time, which a
  refused second run prints, and the name of its run: the other ranks of a sharded run
  (:mod:`nalu_cuda.experiments.distributed`) *join* the lock their rank 0 holds on a shared ``DIR``.
* Manifest: ``DIR/.nalu-cuda-manifest.json`` lists the top-level files nalu-cuda wrote; it also
  marks ``DIR`` as a nalu-cuda output directory. A non-empty directory without it is refused
  (unless it holds only what an older nalu-cuda wrote: its ``runs/`` or its ``summary.json``), and
  so is replacing a file that exists but is not in the manifest; ``overwrite`` lifts both refusals.
* Files are written atomically (a temporary file, fsync, rename) with the mode the umask gives.
"""
from __future__ import annotations

import datetime as _dt
import errno
import fcntl
import fnmatch
import json
import os
import socket
import tempfile
import time
from typing import Any, Callable, List, Optional, Set

__all__ = ["RunError", "OutputDir", "atomic_write", "LOCK_NAME", "MANIFEST_NAME"]

LOCK_NAME = ".nalu-cuda.lock"
MANIFEST_NAME = ".nalu-cuda-manifest.json"
# What nalu-cuda writes at the top of DIR (an older nalu-cuda left these without a manifest).
OUTPUT_PATTERNS = ("summary.json", "report.md", "per_seed_*.csv", "*.png", "runs")


class RunError(Exception):
    """A problem the user must resolve (mismatched or corrupt files, existing results, a busy or unusable
    output directory); the message says what to do."""


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: str, write: Callable[[Any], None], mode: str) -> None:
    """Write ``path`` through ``write(file)`` into a temporary file that replaces ``path`` when complete,
    so a reader or an interruption never sees half a file. The file gets ``0666 & ~umask`` (``mkstemp``
    alone would leave 0600)."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=d)
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


class OutputDir:
    """``DIR`` of one run, locked from :meth:`open` (or ``with``) to :meth:`close`.

    ``overwrite``: files nalu-cuda did not write may be replaced (the user said ``--overwrite``).
    ``run_id``: the name of the run, written into the lock file. ``join``: when ``DIR`` is locked by a
    holder with the same ``run_id`` (another rank of this run), open without the lock; :attr:`joined`
    says so, and such an instance writes nothing at the top of ``DIR`` (the holder does).
    """

    def __init__(self, path: str, *, overwrite: bool = False, run_id: Optional[str] = None,
                 join: bool = False) -> None:
        self.path = path
        self.overwrite = overwrite
        self.run_id = run_id
        self.join = join
        self.joined = False
        self._fd: Optional[int] = None
        self._files: Set[str] = set()

    # -- lock ------------------------------------------------------------------------------------

    def open(self) -> "OutputDir":
        path = self.path
        if not path:
            raise RunError("--out: expected a directory, got an empty path")
        if os.path.exists(path) and not os.path.isdir(path):
            raise RunError(f"--out {path}: this is an existing file, not a directory; choose a directory")
        try:
            os.makedirs(path, exist_ok=True)
            fd = os.open(os.path.join(path, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as exc:
            raise RunError(f"--out {path}: cannot write there ({exc.strerror or exc}); choose a writable "
                           "directory") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if self.join and self.run_id is not None and _holder_info(fd, wait_for=self.run_id).get("run") == self.run_id:
                os.close(fd)
                self.joined = True
                return self
            holder = _read_holder(fd)
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise RunError(f"--out {path} is in use by another nalu-cuda run ({holder}); wait for it to finish, "
                               "or choose another --out") from None
            raise RunError(f"--out {path}: cannot lock {LOCK_NAME} there ({exc.strerror or exc}); choose a "
                           "directory on a local file system") from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "run": self.run_id,
                                      "started": _dt.datetime.now().isoformat(timespec="seconds")}).encode(), 0)
            self._fd = fd
            self._load_manifest()
        except BaseException:
            if self._fd is None:
                os.close(fd)
            self.close()
            raise
        return self

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def __enter__(self) -> "OutputDir":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- manifest --------------------------------------------------------------------------------

    def _manifest_path(self) -> str:
        return os.path.join(self.path, MANIFEST_NAME)

    def _load_manifest(self) -> None:
        mp = self._manifest_path()
        if os.path.exists(mp):
            try:
                with open(mp) as f:
                    files = json.load(f)["files"]
                if not isinstance(files, list) or not all(isinstance(n, str) for n in files):
                    raise ValueError("'files' is not a list of names")
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise RunError(f"{mp} is damaged ({exc}); it lists the files nalu-cuda wrote in {self.path}. "
                               "Delete it and rerun with --overwrite, or choose another --out") from None
            self._files = set(files)
            return
        entries = [e for e in os.listdir(self.path) if e not in (LOCK_NAME, MANIFEST_NAME)
                   and not e.startswith(".tmp-")]
        ours = [e for e in entries if any(fnmatch.fnmatch(e, p) for p in OUTPUT_PATTERNS)]
        legacy = len(ours) == len(entries) and (os.path.isdir(os.path.join(self.path, "runs")) or self._our_summary())
        if entries and not legacy and not self.overwrite:
            shown = ", ".join(sorted(entries)[:5]) + (", ..." if len(entries) > 5 else "")
            raise RunError(f"--out {self.path} is not empty ({shown}) and is not a nalu-cuda output directory; "
                           "choose a new or empty directory, or pass --overwrite to let nalu-cuda write there "
                           "(it replaces summary.json, report.md, per_seed_*.csv, its plots and runs/)")
        self._files = set(ours) if legacy else set()
        self._save_manifest()

    def _our_summary(self) -> bool:
        """Whether ``DIR/summary.json`` is one that nalu-cuda wrote (its ``meta`` names the version)."""
        try:
            with open(os.path.join(self.path, "summary.json")) as f:
                return "nalu_cuda" in json.load(f)["meta"]
        except (OSError, ValueError, KeyError, TypeError):
            return False

    def _save_manifest(self) -> None:
        text = json.dumps({"written_by": "nalu-cuda", "files": sorted(self._files)}, indent=1)
        atomic_write(self._manifest_path(), lambda f: f.write(text), "w")

    def check_replaceable(self, name: str) -> None:
        """Refuse (``RunError``) to replace ``DIR/name`` when it exists and nalu-cuda did not write it."""
        p = os.path.join(self.path, name)
        if os.path.lexists(p) and name not in self._files and not self.overwrite:
            raise RunError(f"{p} exists and was not written by nalu-cuda; move it away, or pass --overwrite to "
                           "let nalu-cuda replace it")

    def record(self, names: List[str]) -> None:
        """Add ``names`` (top-level files nalu-cuda just wrote) to the manifest."""
        new = set(names) - self._files
        if new:
            self._files |= new
            self._save_manifest()

    def write_text(self, name: str, text: str) -> None:
        """Write the top-level file ``DIR/name`` (after :meth:`check_replaceable`) and record it."""
        self.check_replaceable(name)
        atomic_write(os.path.join(self.path, name), lambda f: f.write(text), "w")
        self.record([name])


# How long a rank waits for the holder of a lock to write its run's name (it locked the file this instant).
JOIN_PATIENCE_S = 5.0


def _holder_info(fd: int, wait_for: Optional[str] = None) -> dict:
    """The lock file's record of its holder (``{}`` when unreadable). ``wait_for``: a run name that may
    not be written yet: reread for up to :data:`JOIN_PATIENCE_S`."""
    deadline = time.monotonic() + JOIN_PATIENCE_S
    while True:
        try:
            info = json.loads(os.pread(fd, 4096, 0).decode())
            info = info if isinstance(info, dict) else {}
        except ValueError:
            info = {}
        if wait_for is None or info.get("run") == wait_for or time.monotonic() > deadline:
            return info
        time.sleep(0.05)


def _read_holder(fd: int) -> str:
    try:
        info = _holder_info(fd)
        return f"pid {info['pid']} on host {info['host']}, started {info['started']}"
    except Exception:  # written by the holder this instant, or by something else
        return "holder unknown"
