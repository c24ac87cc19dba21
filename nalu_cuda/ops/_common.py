"""What every op family shares: the loading of the native library, the op lists read back from it,
the kernel lookups, the metadata checks the fakes are built from, and the flop-counting units.

The library comes from the extension module ``nalu_cuda._C`` or, when the environment variable
``NALU_CUDA_LIBRARY`` names a file, from that shared library (the CMake build). The schemas are
declared once per op family in C++ (``csrc/ops/<family>/schema.cpp``, the experiments' op in
``csrc/experiments/schema.cpp``), and the op names here are read back from the loaded library
(``OP_NAMES`` and the others, below), never written in Python. The counterpart of
``csrc/common/``: no family's name in it, except where a lookup needs one op that stands for them.
"""
from __future__ import annotations

import importlib
import math
import numbers
import os
from typing import Optional, Tuple

import torch
from torch import Tensor

# ------------------------------------------------------------------------------------------------
# What every family's specification shares (the pure-PyTorch side, :mod:`nalu_cuda.reference`'s
# conventions): the default eps, the scalar checks (the same words as csrc/common/checks.cpp), the
# plain-or-ensemble product, the clamp with the kernels' derivative, a per-member vector's broadcast.
# ------------------------------------------------------------------------------------------------

DEFAULT_EPS = 1e-7


def scalar_problem(name: str, value, dtype: Optional[torch.dtype] = None, positive: bool = True) -> Optional[str]:
    """What is wrong with a scalar argument (``eps``, ``omega``), or None: a real number (not a bool),
    finite and, for ``positive``, above 0; with ``dtype``, still so in the precision the ops compute
    in for tensors of that dtype (float64 for float64, float32 for every narrower type: an eps of
    1e-50 is 0 in float32 and 1e39 is inf). The fused ops' checks (csrc/common/checks.cpp
    ``check_scalar``) say the same words."""
    what = "a positive finite number" if positive else "a finite number"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return f"argument '{name}' must be {what}, got {value!r}"
    v = float(value)
    if not (math.isfinite(v) and (v > 0 or not positive)):
        return f"argument '{name}' must be {what}, got {value!r}"
    if dtype is None or dtype == torch.float64:
        return None
    fits = abs(v) <= torch.finfo(torch.float32).max
    narrow = float(torch.tensor(v, dtype=torch.float64).to(torch.float32)) if fits else 0.0
    if fits and (narrow > 0 or not positive):
        return None
    there = "0" if fits else ("inf" if v > 0 else "-inf")
    return (f"argument '{name}' must be {what} in float32 (the precision the op computes in for tensors of "
            f"dtype {str(dtype).replace('torch.', '')}), got {value!r}, which is {there} there")


def _check_spec_scalar(fn: str, name: str, value, dtype: torch.dtype, positive: bool = True) -> None:
    problem = scalar_problem(name, value, dtype, positive)
    if problem:
        raise ValueError(f"nalu_cuda.reference.{fn}: {problem}")


def _matmul(x: Tensor, W: Tensor) -> Tensor:
    """``x W`` for a plain layer (W ``(I, O)``) or an ensemble (W ``(E, I, O)``, x ``(E, ..., I)``)."""
    if W.dim() == 2:
        return torch.matmul(x, W)
    E, I, O = W.shape
    rows = 1
    for d in x.shape[1:-1]:
        rows *= d
    out = torch.bmm(x.reshape(E, rows, I), W)  # (not -1: x may have no elements)
    return out.reshape(*x.shape[:-1], O)


def _clamp(t: Tensor, low: float, high: float) -> Tensor:
    """``clamp(t, low, high)`` whose derivative is 1 on the closed interval [low, high] and 0
    outside it, written out so that it does not depend on how a torch release differentiates
    ``torch.clamp`` at the bounds (the kernels follow this convention)."""
    inside = (t >= low) & (t <= high)
    return torch.where(inside, t, t.detach().clamp(low, high))


def _per_member(t: Tensor, x: Tensor, ensemble: bool) -> Tensor:
    """A per-member vector ``(E, K)`` as ``(E, 1, ..., 1, K)`` against ``x`` of shape ``(E, ..., *)``."""
    if not ensemble:
        return t
    return t.reshape(t.shape[0], *([1] * (x.dim() - 2)), t.shape[-1])


ops = None  # torch.ops.nalu_cuda once loaded
_LIBRARY_FILE: Optional[str] = None  # the shared library that holds the ops
fast = None  # nalu_cuda._C: direct eager entry points of the forward ops (see csrc/module.cpp)
LOAD_ERROR: Optional[BaseException] = None
BUILD_INFO: dict = {}


def _load() -> None:
    global ops, fast, BUILD_INFO, _LIBRARY_FILE
    path = os.environ.get("NALU_CUDA_LIBRARY")
    if path:
        torch.ops.load_library(path)
        BUILD_INFO = {"library": os.path.basename(path)}
        _LIBRARY_FILE = path
    else:
        # loading it registers the ops (a compiled module, no Python import back into the package;
        # by name, so that an import graph read from the sources sees no edge to nalu_cuda itself)
        _C = importlib.import_module("nalu_cuda._C")

        BUILD_INFO = dict(_C.build_info())
        fast = _C
        _LIBRARY_FILE = _C.__file__
    ops = torch.ops.nalu_cuda


try:
    _load()
except (ImportError, OSError) as exc:  # not built, or built against another torch
    LOAD_ERROR = exc
    if os.environ.get("NALU_CUDA_REQUIRE_EXT", "0") == "1":
        raise ImportError(
            "nalu_cuda: the native extension could not be loaded and NALU_CUDA_REQUIRE_EXT=1 "
            f"forbids falling back to the reference path: {exc}"
        ) from exc


def _op_families() -> dict:
    """{family: (kind, op names)} of the loaded library, as its schemas declare them: the C function
    ``nalu_cuda_op_list`` (``csrc/common/registration.cpp``), one line "kind family op op ..." per
    family, kind "layer" or "training". Empty without the library (or for one built before the list)."""
    if _LIBRARY_FILE is None:
        return {}
    import ctypes

    try:
        op_list = ctypes.CDLL(_LIBRARY_FILE).nalu_cuda_op_list
    except (OSError, AttributeError):
        return {}
    op_list.restype = ctypes.c_char_p
    rows = [line.split() for line in op_list().decode().splitlines() if line.strip()]
    return {row[1]: (row[0], tuple(row[2:])) for row in rows}


OP_FAMILIES = _op_families()
# Every layer op (each family's schema.cpp), the NAU/NMU's among them, and the training ops
# (csrc/experiments/): derived from the library's op list, never written here.
OP_NAMES = tuple(op for kind, names in OP_FAMILIES.values() if kind == "layer" for op in names)
UNIT_OP_NAMES = OP_FAMILIES.get("nau_nmu", ("layer", ()))[1]
TRAINING_OP_NAMES = tuple(op for kind, names in OP_FAMILIES.values() if kind == "training" for op in names)


def has_kernel(device_type: str, op: str = "nalu_forward") -> bool:
    """Whether the loaded library has a kernel of ``op`` for ``device_type`` ("cpu", "cuda", ...)."""
    if ops is None:
        return False
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(device_type)
    if key is None:
        return False
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"nalu_cuda::{op}", key)
    except RuntimeError:  # a library built before the op existed: no kernel, not an import error
        return False


# (device type, dtype) pairs with a fused kernel; fixed at import so that lookups are constant
# under torch.compile. (The power family's narrower set: nalu_cuda.ops.power.POWER_KERNEL_DTYPES.)
KERNEL_DTYPES = frozenset(
    ([("cpu", torch.float32), ("cpu", torch.float64)] if has_kernel("cpu") else [])
    + ([("cuda", dt) for dt in (torch.float32, torch.float64, torch.float16, torch.bfloat16)] if has_kernel("cuda") else [])
)


# ------------------------------------------------------------------------------------------------
# The wrappers' access to the ops (used by every family's wrappers at call time).
# ------------------------------------------------------------------------------------------------


def _ops_or_raise():
    if ops is None:
        raise RuntimeError(
            f"nalu_cuda: the native extension is not loaded ({LOAD_ERROR}); build it with "
            "`pip install --no-build-isolation -e .` or use the reference path (backend='reference')"
        )
    return ops


_PLAIN_TENSORS = (Tensor, torch.nn.Parameter)


def _fast(x: Tensor):
    """The direct bindings, or None where torch.ops must be used: while compiling, without the _C
    module (a library loaded from NALU_CUDA_LIBRARY), and where __torch_function__ could apply (a
    Tensor subclass input, or an active TorchFunctionMode), which the bindings would bypass."""
    if (
        fast is None
        or torch.compiler.is_compiling()
        or type(x) not in _PLAIN_TENSORS
        or torch._C._is_torch_function_mode_enabled()
    ):
        return None
    return fast


# ------------------------------------------------------------------------------------------------
# Shape logic of the fakes, on metadata only: the pieces every family's checks are made of, with
# the messages of csrc/common/checks.cpp.
# ------------------------------------------------------------------------------------------------


def _fail(op: str, msg: str):
    raise RuntimeError(f"nalu_cuda::{op}: {msg}")


def _check_float(op: str, name: str, t: Optional[Tensor]) -> None:
    if t is None:
        _fail(op, f"argument '{name}' must be a tensor, got None")
    if not t.dtype.is_floating_point:
        _fail(op, f"argument '{name}' must be a floating-point tensor, got dtype {t.dtype}")


def _check_match(op: str, name: str, t: Tensor, ref_name: str, ref: Tensor) -> None:
    if t.dtype != ref.dtype:
        _fail(op, f"argument '{name}' must have the dtype of '{ref_name}' ({ref.dtype}), got {t.dtype}")
    if t.device != ref.device:
        _fail(op, f"argument '{name}' must be on the device of '{ref_name}' ({ref.device}), got {t.device}")


def _check_pair(op: str, W_hat: Tensor, M_hat: Tensor, w: str = "W_hat", m: str = "M_hat",
                layer_shape: bool = True) -> None:
    _check_float(op, w, W_hat)
    _check_float(op, m, M_hat)
    if layer_shape and W_hat.dim() not in (2, 3):
        _fail(op, f"argument '{w}' must have shape (in, out) or (E, in, out), got {list(W_hat.shape)}")
    if M_hat.shape != W_hat.shape:
        _fail(op, f"argument '{m}' must have the shape of '{w}' {list(W_hat.shape)}, got {list(M_hat.shape)}")
    _check_match(op, m, M_hat, w, W_hat)


def _check_scalar(op: str, name: str, value: float, dtype: torch.dtype, positive: bool = True) -> None:
    problem = scalar_problem(name, value, dtype, positive)
    if problem:
        _fail(op, problem)


def _check_x_matches(op: str, x: Tensor, W: Tensor, name: str) -> Tuple[int, int]:
    """``x`` of shape (..., in) for weights (in, out), or (E, ..., in) for (E, in, out); returns (in, out)."""
    I, O = W.shape[-2], W.shape[-1]
    if W.dim() == 3:
        E = W.shape[0]
        if x.dim() < 2 or x.shape[0] != E or x.shape[-1] != I:
            _fail(op, f"argument 'x' must have shape (E, ..., in) = ({E}, ..., {I}) to match ensemble "
                      f"weights '{name}' {list(W.shape)}, got {list(x.shape)}")
    elif x.dim() < 1 or x.shape[-1] != I:
        _fail(op, f"argument 'x' must have shape (..., in) = (..., {I}) to match '{name}' {list(W.shape)}, "
                  f"got {list(x.shape)}")
    return I, O


def _check_grad_y(op: str, grad_y: Tensor, shape: list, x: Tensor) -> None:
    if list(grad_y.shape) != shape:
        _fail(op, f"argument 'grad_y' must have shape {shape}, got {list(grad_y.shape)}")
    _check_match(op, "grad_y", grad_y, "x", x)


def _like(t: Tensor) -> Tensor:
    """A contiguous tensor of t's shape, as the kernels return (empty_like would keep t's strides)."""
    return t.new_empty(t.shape)


def _grad_or_empty(flag: bool, like: Tensor, ref: Tensor) -> Tensor:
    return _like(like) if flag else ref.new_empty((0,))


# ------------------------------------------------------------------------------------------------
# Flop counting (torch.utils.flop_counter): the units every family's formulas are written in.
# ------------------------------------------------------------------------------------------------


def _terms(x_shape, W_shape) -> int:
    """Terms of x W (or factors of a product unit): every row of x (ensemble members included)
    against an (I, O) matrix, rows * I * O."""
    rows = 1
    for d in x_shape[:-1]:
        rows *= d
    return rows * W_shape[-2] * W_shape[-1]


def _matmul_flops(x_shape, W_shape) -> int:
    """Flops of x W (2 per multiply-add), as torch.utils.flop_counter counts the reference's mm/bmm."""
    return 2 * _terms(x_shape, W_shape)


# A product reduction y[..., o] = prod_i f(W[i, o], x[..., i]) (NMU; iNALU's sign product msv), in
# flops per factor, rows * I * O factors. Its reference (torch.prod over materialised factors)
# counts 0 under FlopCounterMode, which counts matrix products only; this is the library's rule,
# in the matrix products' unit (a multiply-add is 2 flops):
#   forward   3: the factor W x + 1 - W (one multiply-add) and one multiply into the product.
#   backward  8: the factor again (2; nothing is saved), the exclusive product prod_{k != i} f_k
#             from a prefix and a suffix product (3 multiplies), grad_y times it (1), and the W
#             gradient's multiply-add (2); plus 2 with the x gradient (its multiply-add).
PRODUCT_FORWARD_FLOPS = 3
PRODUCT_BACKWARD_FLOPS = 8
PRODUCT_GRAD_X_FLOPS = 2


def _product_flops(x_shape, W_shape, backward: bool = False, grad_x: bool = False) -> int:
    if not backward:
        per_factor = PRODUCT_FORWARD_FLOPS
    else:
        per_factor = PRODUCT_BACKWARD_FLOPS + (PRODUCT_GRAD_X_FLOPS if grad_x else 0)
    return per_factor * _terms(x_shape, W_shape)


def _one_product_flops(x, W, *args, out_shape=None, **kwargs):
    """The forward of an op that is one product x W (NAC+, NAC*'s lx W, NAU)."""
    return _matmul_flops(x, W)


def _one_product_backward_flops(grad_y, x, W, *args, out_shape=None, **kwargs):
    """Its backward: the weight gradient, and the input gradient when compute_grad_x."""
    compute_grad_x = args[-1] if args else kwargs["compute_grad_x"]
    return (2 if compute_grad_x else 1) * _matmul_flops(x, W)
