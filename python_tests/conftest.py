import os
import subprocess
import sys

# The suite tests the native ops: a missing extension must fail loudly, not fall back.
os.environ.setdefault("NALU_CUDA_REQUIRE_EXT", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from nalu_cuda import testing  # noqa: E402

DEVICES = testing.devices()

# The shapes of the unit tests: (E or None, batch shape, I, O).
UNIT_SHAPES = [
    (None, (1,), 1, 1),
    (None, (7,), 5, 3),
    (None, (128,), 100, 2),
    (None, (33,), 17, 20),
    (None, (4, 6), 9, 2),
    (None, (), 6, 3),
    (3, (9,), 6, 2),
    (4, (2, 3), 5, 2),
    (4, (2, 3), 5, 7),
]


def unit_cases(units, shapes):
    """Parametrize a test ``(unit, shape, dtype, device)`` over every unit, shape, float64/float32
    and device."""
    def mark(fn):
        fn = pytest.mark.parametrize("unit", list(units))(fn)
        fn = pytest.mark.parametrize("shape", shapes, ids=shape_ids(shapes))(fn)
        fn = pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])(fn)
        return pytest.mark.parametrize("device", DEVICES)(fn)

    return mark


def shape_ids(shapes):
    """Test ids ``E<e>-B<batch>-I<i>-O<o>`` of ``(E, batch shape, I, O, ...)`` tuples."""
    return [f"E{s[0]}-B{'x'.join(map(str, s[1])) or 'none'}-I{s[2]}-O{s[3]}" for s in shapes]


def run_fresh_interpreter(code, isa=None) -> None:
    """Runs ``code`` in a fresh interpreter from the repository root, this tree first on its path, with
    ``NALU_CUDA_CPU_ISA=isa`` when given (the instruction set is chosen once per process); fails with
    the end of its output unless it exits 0. ``code`` is Python source, or a function of no arguments
    at the top level of a module of this tree, which the interpreter imports and calls."""
    if callable(code):
        code = f"from {code.__module__} import {code.__name__}\n{code.__name__}()\n"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if isa:
        env["NALU_CUDA_CPU_ISA"] = isa
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=root)
    assert out.returncode == 0, out.stderr[-4000:] + out.stdout[-2000:]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def pytest_report_header(config):
    import nalu_cuda

    return f"nalu_cuda: extension={nalu_cuda.has_extension()} build={nalu_cuda.build_info()} devices={DEVICES}"
