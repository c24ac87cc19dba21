import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    # The experiment models are tiny: a second intra-op thread only adds synchronisation, and on a
    # loaded 2-core machine it slows training steps by an order of magnitude.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
