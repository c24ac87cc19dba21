import os

# The suite tests the native ops: a missing extension must fail loudly, not fall back.
os.environ.setdefault("NALU_CUDA_REQUIRE_EXT", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from nalu_cuda import testing  # noqa: E402

DEVICES = testing.devices()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def pytest_report_header(config):
    import nalu_cuda

    return f"nalu_cuda: extension={nalu_cuda.has_extension()} build={nalu_cuda.build_info()} devices={DEVICES}"
