"""Digit images for the counting, addition and parity experiments, offline.

* Default: scikit-learn's bundled 8x8 handwritten digits (``sklearn.datasets.load_digits``, 1797
  images shipped inside the scikit-learn package; nothing is downloaded).
* ``mnist_dir``: a directory with the four MNIST IDX files (``train-images-idx3-ubyte``,
  ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte``, each
  optionally ``.gz``; the ``.idx3-ubyte`` spelling also works). Read by :func:`read_idx`; no code
  path here downloads anything.

Images are float32 in ``[0, 1]`` of shape ``(N, H, W)``; labels int64 in ``0..9``.
"""
from __future__ import annotations

import argparse
import gzip
import os
import struct
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

__all__ = ["DigitImages", "read_idx", "write_idx", "load_digit_images", "find_mnist_files", "mnist_directory"]

# IDX type codes (the third byte of the magic number) -> numpy dtype (big-endian)
_IDX_TYPES = {0x08: np.dtype(">u1"), 0x09: np.dtype(">i1"), 0x0B: np.dtype(">i2"), 0x0C: np.dtype(">i4"),
              0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}
_IDX_CODES = {(v.kind, v.itemsize): k for k, v in _IDX_TYPES.items()}


def _open(path: str, mode: str):
    return gzip.open(path, mode) if path.endswith(".gz") else open(path, mode)


def read_idx(path: str) -> np.ndarray:
    """Read an IDX file (the MNIST format), plain or gzip-compressed (``.gz``)."""
    with _open(path, "rb") as f:
        data = f.read()
    if len(data) < 4:
        raise ValueError(f"read_idx: {path!r} is too short to be an IDX file")
    zero, code, ndim = data[0] << 8 | data[1], data[2], data[3]
    if zero != 0 or code not in _IDX_TYPES:
        raise ValueError(f"read_idx: {path!r} has a bad IDX magic number {data[:4].hex()}")
    dims = struct.unpack(f">{ndim}I", data[4:4 + 4 * ndim])
    dtype = _IDX_TYPES[code]
    count = int(np.prod(dims)) if ndim else 1
    offset = 4 + 4 * ndim
    if len(data) - offset != count * dtype.itemsize:
        raise ValueError(f"read_idx: {path!r} holds {len(data) - offset} data bytes, its header says "
                         f"{count * dtype.itemsize} (dims {dims})")
    arr = np.frombuffer(data, dtype=dtype, count=count, offset=offset)
    return arr.reshape(dims).astype(dtype.newbyteorder("="))


def write_idx(path: str, array: np.ndarray) -> None:
    """Write ``array`` as an IDX file (gzip-compressed when ``path`` ends in ``.gz``)."""
    array = np.asarray(array)
    code = _IDX_CODES.get((array.dtype.kind, array.dtype.itemsize))
    if code is None:
        raise ValueError(f"write_idx: dtype {array.dtype} has no IDX type code")
    header = bytes([0, 0, code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    with _open(path, "wb") as f:
        f.write(header + array.astype(_IDX_TYPES[code]).tobytes())


def find_mnist_files(mnist_dir: str) -> dict:
    """The paths of the four MNIST files in ``mnist_dir`` (a clear error naming what is missing)."""
    out = {}
    for key, stem in (("train_images", "train-images"), ("train_labels", "train-labels"),
                      ("test_images", "t10k-images"), ("test_labels", "t10k-labels")):
        kind = "idx3" if "images" in key else "idx1"
        found = None
        for sep in ("-", "."):
            for ext in ("", ".gz"):
                p = os.path.join(mnist_dir, f"{stem}{sep}{kind}-ubyte{ext}")
                if os.path.exists(p):
                    found = p
                    break
            if found:
                break
        if found is None:
            raise FileNotFoundError(f"--mnist-dir {mnist_dir!r}: no {stem}-{kind}-ubyte[.gz] file "
                                    "(expected the four MNIST IDX files; nothing is downloaded)")
        out[key] = found
    return out


def mnist_directory(text: str) -> str:
    """An argument type (``--mnist-dir``): a directory holding the four MNIST IDX files; returned absolute."""
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"expected a directory with the four MNIST IDX files, got {text!r}, "
                                         "which is not a directory")
    try:
        find_mnist_files(text)
    except FileNotFoundError as exc:
        raise argparse.ArgumentTypeError(str(exc).replace(f"--mnist-dir {text!r}: ", f"{text!r} has ")) from None
    return os.path.abspath(text)


@dataclass
class DigitImages:
    """Train / validation / test digit images (``(N, H, W)`` float32 in [0, 1]) and labels."""

    source: str
    train_x: torch.Tensor
    train_y: torch.Tensor
    val_x: torch.Tensor
    val_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor

    @property
    def image_shape(self):
        return tuple(self.train_x.shape[1:])

    def to(self, device) -> "DigitImages":
        return DigitImages(self.source, *(t.to(device) for t in (self.train_x, self.train_y, self.val_x, self.val_y,
                                                                  self.test_x, self.test_y)))

    def sizes(self) -> dict:
        return {"train": len(self.train_y), "val": len(self.val_y), "test": len(self.test_y)}


def _split_indices(labels: np.ndarray, fractions, seed: int):
    """A stratified split of ``range(len(labels))`` into parts of the given fractions."""
    rng = np.random.default_rng(seed)
    parts = [[] for _ in fractions]
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        bounds = np.round(np.cumsum(fractions) * len(idx)).astype(int)
        start = 0
        for k, b in enumerate(bounds):
            parts[k].extend(idx[start:b].tolist())
            start = b
    return [np.sort(np.array(p, dtype=np.int64)) for p in parts]


def load_digit_images(mnist_dir: Optional[str] = None, *, split_seed: int = 0, max_train: Optional[int] = None,
                      max_test: Optional[int] = None) -> DigitImages:
    """Digit images, split into train / validation / test.

    Without ``mnist_dir``: scikit-learn's 8x8 digits (values 0..16 scaled to [0, 1]), a stratified
    split 60% / 15% / 25% fixed by ``split_seed``; test images are never used for training or
    model selection. With ``mnist_dir``: the MNIST training file gives train (the first 5/6) and
    validation (the last 1/6), the t10k file gives test; ``max_train`` / ``max_test`` keep the first
    images only (to bound CPU time).
    """
    if mnist_dir is None:
        from sklearn.datasets import load_digits

        d = load_digits()
        images = (d.images / 16.0).astype(np.float32)
        labels = d.target.astype(np.int64)
        tr, va, te = _split_indices(labels, (0.60, 0.15, 0.25), split_seed)
        if max_train is not None:
            tr = tr[:max_train]
        if max_test is not None:
            te = te[:max_test]
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
        return DigitImages("sklearn-digits-8x8", t(images[tr]), t(labels[tr]), t(images[va]), t(labels[va]),
                           t(images[te]), t(labels[te]))
    files = find_mnist_files(mnist_dir)
    tr_x = read_idx(files["train_images"])
    tr_y = read_idx(files["train_labels"])
    te_x = read_idx(files["test_images"])
    te_y = read_idx(files["test_labels"])
    for name, x, y in (("train", tr_x, tr_y), ("t10k", te_x, te_y)):
        if x.ndim != 3 or y.ndim != 1 or len(x) != len(y):
            raise ValueError(f"--mnist-dir: {name} images {x.shape} and labels {y.shape} do not match")
    n_val = max(1, len(tr_y) // 6)
    va_x, va_y = tr_x[-n_val:], tr_y[-n_val:]
    tr_x, tr_y = tr_x[:-n_val], tr_y[:-n_val]
    if max_train is not None:
        tr_x, tr_y = tr_x[:max_train], tr_y[:max_train]
        va_x, va_y = va_x[:max(1, max_train // 5)], va_y[:max(1, max_train // 5)]
    if max_test is not None:
        te_x, te_y = te_x[:max_test], te_y[:max_test]
    scale = 255.0 if tr_x.dtype == np.uint8 else max(1.0, float(tr_x.max()))
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a.astype(np.float32) / scale))  # noqa: E731
    lab = lambda a: torch.from_numpy(np.ascontiguousarray(a.astype(np.int64)))  # noqa: E731
    return DigitImages(f"mnist-idx-{tr_x.shape[1]}x{tr_x.shape[2]}", t(tr_x), lab(tr_y), t(va_x), lab(va_y),
                       t(te_x), lab(te_y))
