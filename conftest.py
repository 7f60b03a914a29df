# Makes the flat top-level modules (model.py, moe.py, ...) importable from tests/.
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytest  # noqa: E402


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: one intra-op thread is faster, and far faster on a shared, busy 2-core CPU.
    Test modules opt in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
