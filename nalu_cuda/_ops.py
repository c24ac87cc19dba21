"""Loading of the native ops, and their fake (meta) implementations.

The schemas are declared once per op family in C++ (``csrc/ops/<family>/schema.cpp``, the
experiments' op in ``csrc/experiments/schema.cpp``), and the op names here are read back from the
loaded library (``OP_NAMES`` and the others, below); kernels and autograd are registered per
family in C++. Here, for every op, ``torch.library.register_fake`` (shapes only, so
``torch.compile`` traces the ops without running them).

The library comes from the extension module ``nalu_cuda._C`` or, when the environment variable
``NALU_CUDA_LIBRARY`` names a file, from that shared library (the CMake build).
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import reference

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
        from . import _C  # loading it registers the ops

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
# under torch.compile.
KERNEL_DTYPES = frozenset(
    ([("cpu", torch.float32), ("cpu", torch.float64)] if has_kernel("cpu") else [])
    + ([("cuda", dt) for dt in (torch.float32, torch.float64, torch.float16, torch.bfloat16)] if has_kernel("cuda") else [])
)

# The same for the power units and iNALU (npu_forward, inalu_forward: registered together).
POWER_KERNEL_DTYPES = frozenset(
    (dev, dt) for dev, dt in KERNEL_DTYPES if has_kernel(dev, "npu_forward") and has_kernel(dev, "inalu_forward")
)


# ------------------------------------------------------------------------------------------------
# Shape logic of the fakes: the same checks and messages as csrc/ops/nac_nalu/checks.cpp, on metadata only.
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
    problem = reference.scalar_problem(name, value, dtype, positive)
    if problem:
        _fail(op, problem)


def _nac_out_shape(op: str, x: Tensor, W_hat: Tensor, M_hat: Tensor, eps: Optional[float] = None) -> list:
    """The checks of ``x`` and the weight pair of a NAC layer (and of ``eps`` when given); returns y's shape."""
    _check_float(op, "x", x)
    _check_pair(op, W_hat, M_hat)
    _check_match(op, "W_hat", W_hat, "x", x)
    _, O = _check_x_matches(op, x, W_hat, "W_hat")
    if eps is not None:
        _check_scalar(op, "eps", eps, x.dtype)
    return list(x.shape[:-1]) + [O]


def _nalu_out_shape(op: str, x: Tensor, W_hat: Tensor, M_hat: Tensor, W_hat_m: Optional[Tensor],
                    M_hat_m: Optional[Tensor], G: Optional[Tensor], input_gate: bool, eps: float) -> list:
    """The NAC checks, then the separate weights of the multiplicative path, the gate and eps."""
    shape = _nac_out_shape(op, x, W_hat, M_hat)
    if (W_hat_m is None) != (M_hat_m is None):
        _fail(op, "separate multiplicative weights need both 'W_hat_m' and 'M_hat_m'")
    if W_hat_m is not None:
        _check_pair(op, W_hat_m, M_hat_m, "W_hat_m", "M_hat_m")
        if W_hat_m.shape != W_hat.shape:
            _fail(op, f"argument 'W_hat_m' must have the shape of 'W_hat' {list(W_hat.shape)}, "
                      f"got {list(W_hat_m.shape)}")
        _check_match(op, "W_hat_m", W_hat_m, "x", x)
    if G is not None:
        _check_float(op, "G", G)
        _check_match(op, "G", G, "x", x)
        if input_gate and G.shape != W_hat.shape:
            _fail(op, f"argument 'G' of an input-dependent gate must have the shape of 'W_hat' "
                      f"{list(W_hat.shape)}, got {list(G.shape)}")
        want = list(W_hat.shape[:-2]) + [W_hat.shape[-1]]
        if not input_gate and list(G.shape) != want:
            _fail(op, f"argument 'G' of an input-independent gate must have shape {want}, got {list(G.shape)}")
    _check_scalar(op, "eps", eps, x.dtype)
    return shape


def _like(t: Tensor) -> Tensor:
    """A contiguous tensor of t's shape, as the kernels return (empty_like would keep t's strides)."""
    return t.new_empty(t.shape)


def _grad_or_empty(flag: bool, like: Tensor, ref: Tensor) -> Tensor:
    return _like(like) if flag else ref.new_empty((0,))


def _register_fakes() -> None:
    reg = torch.library.register_fake

    @reg("nalu_cuda::nac_weight")
    def _(W_hat, M_hat):
        _check_pair("nac_weight", W_hat, M_hat, layer_shape=False)
        return _like(W_hat)

    @reg("nalu_cuda::nac_weight_backward")
    def _(grad_W, W_hat, M_hat):
        _check_pair("nac_weight_backward", W_hat, M_hat, layer_shape=False)
        return _like(W_hat), _like(M_hat)

    @reg("nalu_cuda::nac_forward")
    def _(x, W_hat, M_hat):
        return x.new_empty(_nac_out_shape("nac_forward", x, W_hat, M_hat))

    @reg("nalu_cuda::nac_backward")
    def _(grad_y, x, W_hat, M_hat, compute_grad_x):
        _nac_out_shape("nac_backward", x, W_hat, M_hat)
        return _grad_or_empty(compute_grad_x, x, x), _like(W_hat), _like(M_hat)

    @reg("nalu_cuda::nac_mul_forward")
    def _(x, W_hat, M_hat, eps):
        return x.new_empty(_nac_out_shape("nac_mul_forward", x, W_hat, M_hat, eps)), _like(x)

    @reg("nalu_cuda::nac_mul_backward")
    def _(grad_y, x, W_hat, M_hat, y, lx, eps, compute_grad_x):
        _nac_out_shape("nac_mul_backward", x, W_hat, M_hat, eps)
        return _grad_or_empty(compute_grad_x, x, x), _like(W_hat), _like(M_hat)

    @reg("nalu_cuda::nalu_forward")
    def _(x, W_hat, M_hat, W_hat_m, M_hat_m, G, eps, input_gate):
        shape = _nalu_out_shape("nalu_forward", x, W_hat, M_hat, W_hat_m, M_hat_m, G, input_gate, eps)
        g = x.new_empty(shape) if input_gate else _like(G)
        return x.new_empty(shape), x.new_empty(shape), x.new_empty(shape), g, _like(x)

    @reg("nalu_cuda::nalu_backward")
    def _(grad_y, x, W_hat, M_hat, W_hat_m, M_hat_m, G, a, m, g, lx, eps, input_gate, compute_grad_x):
        _nalu_out_shape("nalu_backward", x, W_hat, M_hat, W_hat_m, M_hat_m, G, input_gate, eps)
        sep = W_hat_m is not None
        return (
            _grad_or_empty(compute_grad_x, x, x),
            _like(W_hat),
            _like(M_hat),
            _grad_or_empty(sep, W_hat, x),
            _grad_or_empty(sep, W_hat, x),
            _like(G),
        )


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


def _register_flop_formulas() -> None:
    """torch.utils.flop_counter formulas for every op.

    Matrix products count as FlopCounterMode counts the reference's (2 flops per multiply-add;
    elementwise work counts 0 there, and here). Forward: one product per path (NAC, NAU: a = x W;
    NAC*: lx W; NALU: a = x W, u = lx W_m and, for an input gate, z = x G; RealNPU: lr W_r and
    k W_r; NPU: those two and lr W_i, k W_i; iNALU: a = x W, u = lx W_m). Backward: per product,
    the weight gradient, and the input gradient when compute_grad_x. The NPU's backward always has
    the input-side products: the gate's gradient needs d lr and d k, with or without grad_x (the
    reference counts them too, g requiring grad). The NMU and iNALU's sign product msv are product
    reductions, counted per factor by the rule above (PRODUCT_*_FLOPS); msv has no x gradient
    (sign(x) is flat).
    """
    from torch.utils.flop_counter import register_flop_formula

    @register_flop_formula([ops.nac_forward, ops.nac_mul_forward, ops.nau_forward])
    def _(x, W, *args, out_shape=None, **kwargs):
        return _matmul_flops(x, W)

    @register_flop_formula(ops.nalu_forward)
    def _(x, W_hat, M_hat, W_hat_m, M_hat_m, G, eps, input_gate, *args, out_shape=None, **kwargs):
        return (3 if input_gate else 2) * _matmul_flops(x, W_hat)

    @register_flop_formula([ops.nac_backward, ops.nac_mul_backward, ops.nau_backward])
    def _(grad_y, x, W, *args, out_shape=None, **kwargs):
        compute_grad_x = args[-1] if args else kwargs["compute_grad_x"]
        return (2 if compute_grad_x else 1) * _matmul_flops(x, W)

    @register_flop_formula(ops.nalu_backward)
    def _(grad_y, x, W_hat, M_hat, W_hat_m, M_hat_m, G, a, m, g, lx, eps, input_gate, compute_grad_x,
          *args, out_shape=None, **kwargs):
        products = 3 if input_gate else 2
        return products * (2 if compute_grad_x else 1) * _matmul_flops(x, W_hat)

    @register_flop_formula(ops.npu_forward)
    def _(x, W_r, W_i, g, eps, *args, out_shape=None, **kwargs):
        return (4 if W_i is not None else 2) * _matmul_flops(x, W_r)

    @register_flop_formula(ops.npu_backward)
    def _(grad_y, x, W_r, W_i, g, y, s, lr, eps, compute_grad_x, *args, out_shape=None, **kwargs):
        return 2 * (4 if W_i is not None else 2) * _matmul_flops(x, W_r)

    @register_flop_formula(ops.inalu_forward)
    def _(x, W_hat, M_hat, W_hat_m, M_hat_m, G, eps, omega, *args, out_shape=None, **kwargs):
        return 2 * _matmul_flops(x, W_hat) + _product_flops(x, W_hat_m)

    @register_flop_formula(ops.inalu_backward)
    def _(grad_y, x, W_hat, M_hat, W_hat_m, M_hat_m, G, a, u, msv, lx, eps, omega, compute_grad_x,
          *args, out_shape=None, **kwargs):
        return (2 * (2 if compute_grad_x else 1) * _matmul_flops(x, W_hat)
                + _product_flops(x, W_hat_m, backward=True))

    @register_flop_formula(ops.nmu_forward)
    def _(x, W, *args, out_shape=None, **kwargs):
        return _product_flops(x, W)

    @register_flop_formula(ops.nmu_backward)
    def _(grad_y, x, W, compute_grad_x, *args, out_shape=None, **kwargs):
        return _product_flops(x, W, backward=True, grad_x=compute_grad_x)


def _npu_out_shape(op: str, x: Tensor, W_r: Tensor, W_i: Optional[Tensor], g: Tensor, eps: float) -> list:
    """The checks of csrc/ops/power/checks.cpp (check_npu) on metadata; returns y's shape."""
    _check_float(op, "x", x)
    _check_float(op, "W_r", W_r)
    _check_match(op, "W_r", W_r, "x", x)
    if W_r.dim() not in (2, 3):
        _fail(op, f"argument 'W_r' must have shape (in, out) or (E, in, out), got {list(W_r.shape)}")
    if W_i is not None:
        _check_float(op, "W_i", W_i)
        _check_match(op, "W_i", W_i, "x", x)
        if W_i.shape != W_r.shape:
            _fail(op, f"argument 'W_i' must have the shape of 'W_r' {list(W_r.shape)}, got {list(W_i.shape)}")
    I, O = _check_x_matches(op, x, W_r, "W_r")
    _check_float(op, "g", g)
    _check_match(op, "g", g, "x", x)
    want = list(W_r.shape[:-2]) + [I]
    if list(g.shape) != want:
        _fail(op, f"argument 'g' (the relevance gate) must have shape {'(E, in)' if W_r.dim() == 3 else '(in,)'} = "
                  f"{want}, got {list(g.shape)}")
    _check_scalar(op, "eps", eps, x.dtype)
    return list(x.shape[:-1]) + [O]


def _inalu_out_shape(op: str, x, W_hat, M_hat, W_hat_m, M_hat_m, G, eps, omega) -> list:
    shape = _nalu_out_shape(op, x, W_hat, M_hat, W_hat_m, M_hat_m, G, False, eps)
    _check_scalar(op, "omega", omega, x.dtype, positive=False)
    return shape


def _register_power_fakes() -> None:
    reg = torch.library.register_fake

    @reg("nalu_cuda::npu_forward")
    def _(x, W_r, W_i, g, eps):
        shape = _npu_out_shape("npu_forward", x, W_r, W_i, g, eps)
        return x.new_empty(shape), x.new_empty(shape), _like(x)

    @reg("nalu_cuda::npu_backward")
    def _(grad_y, x, W_r, W_i, g, y, s, lr, eps, compute_grad_x):
        _npu_out_shape("npu_backward", x, W_r, W_i, g, eps)
        return _grad_or_empty(compute_grad_x, x, x), _like(W_r), _grad_or_empty(W_i is not None, W_r, x), _like(g)

    @reg("nalu_cuda::inalu_forward")
    def _(x, W_hat, M_hat, W_hat_m, M_hat_m, G, eps, omega):
        shape = _inalu_out_shape("inalu_forward", x, W_hat, M_hat, W_hat_m, M_hat_m, G, eps, omega)
        return tuple(x.new_empty(shape) for _ in range(4)) + (_like(x),)

    @reg("nalu_cuda::inalu_backward")
    def _(grad_y, x, W_hat, M_hat, W_hat_m, M_hat_m, G, a, u, msv, lx, eps, omega, compute_grad_x):
        _inalu_out_shape("inalu_backward", x, W_hat, M_hat, W_hat_m, M_hat_m, G, eps, omega)
        return (_grad_or_empty(compute_grad_x, x, x), _like(W_hat), _like(M_hat), _like(W_hat_m), _like(M_hat_m),
                _like(G))


if ops is not None:
    _register_fakes()
    _register_flop_formulas()
    _register_power_fakes()



# ------------------------------------------------------------------------------------------------
# NAU and NMU (csrc/ops/nau_nmu/): one weight W, checks as csrc/ops/nau_nmu/checks.cpp's check_unit.
# ------------------------------------------------------------------------------------------------


def _unit_out_shape(op: str, x: Tensor, W: Tensor) -> list:
    _check_float(op, "x", x)
    _check_float(op, "W", W)
    if W.dim() not in (2, 3):
        _fail(op, f"argument 'W' must have shape (in, out) or (E, in, out), got {list(W.shape)}")
    if W.dtype != x.dtype:
        _fail(op, f"argument 'W' must have the dtype of 'x' ({x.dtype}), got {W.dtype}")
    if W.device != x.device:
        _fail(op, f"argument 'W' must be on the device of 'x' ({x.device}), got {W.device}")
    _, O = _check_x_matches(op, x, W, "W")
    return list(x.shape[:-1]) + [O]


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


def _register_unit_fakes() -> None:
    reg = torch.library.register_fake

    def forward(name):
        @reg(f"nalu_cuda::{name}")
        def _(x, W):
            return x.new_empty(_unit_out_shape(name, x, W))

    def backward(name):
        @reg(f"nalu_cuda::{name}")
        def _(grad_y, x, W, compute_grad_x):
            _check_grad_y(name, grad_y, _unit_out_shape(name, x, W), x)
            return _grad_or_empty(compute_grad_x, x, x), _like(W)

    for unit in ("nau", "nmu"):
        forward(f"{unit}_forward")
        backward(f"{unit}_backward")


if ops is not None:
    _register_unit_fakes()


# ------------------------------------------------------------------------------------------------
# Training ops (not layers): the resident Adam step of experiments.parts.optim.FlatAdam, a CUDA
# kernel only (csrc/experiments/cuda/flat_adam_cuda.cpp; other devices get an error, FlatAdam tensor ops).
# ------------------------------------------------------------------------------------------------

def _register_training_fakes() -> None:
    @torch.library.register_fake("nalu_cuda::flat_adam_step_resident")
    def _(param, grad, exp_avg, exp_avg_sq, segments, frozen, step_t, lr, beta1, beta2, eps):
        return frozen.new_empty(frozen.shape, dtype=torch.bool)


if ops is not None and torch._C._jit_get_schemas_for_operator("nalu_cuda::flat_adam_step_resident"):
    _register_training_fakes()  # (a library built before the op has none)
