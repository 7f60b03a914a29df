"""pytest setup: the flat top-level modules (model.py, moe.py, ...) importable from tests/, the
`one_thread` fixture, and a guard that fails any test leaving process-wide state changed."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytest  # noqa: E402
import threadpoolctl  # noqa: E402,F401  -- sets KMP_DUPLICATE_LIB_OK on import: once, before any test's snapshot
import train  # noqa: E402

# glibc's mmap / trim thresholds cannot be read back, so the state guard below cannot check them, and every
# CPU Trainer raises them (train.machine_settings): raised once here, every test sees the same allocator.
train.machine_settings(allocator=True)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: one intra-op thread is faster, and far faster on a shared, busy 2-core CPU.
    Test modules opt in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _process_state():
    """What a test must leave as it found it: torch's dynamo / inductor config, threads, default
    dtype, grad mode, the environment and the working directory."""
    import torch
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config
    return {
        "torch._dynamo.config": dynamo_config.get_config_copy(),
        "torch._inductor.config": inductor_config.get_config_copy(),
        "torch.get_num_threads()": torch.get_num_threads(),
        "torch.get_default_dtype()": torch.get_default_dtype(),
        "torch.is_grad_enabled()": torch.is_grad_enabled(),
        # pytest's own variable, and inductor's private ones (it sets them for its worker processes)
        "os.environ": {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST" and not k.startswith("_TORCHINDUCTOR")},
        "os.getcwd()": os.getcwd(),
    }


def _changes(before, after):
    out = []
    for name, old in before.items():
        new = after[name]
        if isinstance(old, dict):
            keys = sorted(k for k in old.keys() | new.keys() if k not in old or k not in new or old[k] != new[k])
            out += [f"{name}[{k!r}]: {old.get(k, '<absent>')!r} -> {new.get(k, '<absent>')!r}" for k in keys]
        elif old != new:
            out.append(f"{name}: {old!r} -> {new!r}")
    return out


@pytest.fixture(autouse=True)
def _leaves_process_state_as_found():
    """Fails a test that changes process-wide state without restoring it (use torch's
    `config.patch(...)`, pytest's monkeypatch.setenv / chdir, or try/finally). Autouse fixtures set
    up first and tear down last, so a test's own monkeypatch has been undone when this looks."""
    before = _process_state()
    yield
    changed = _changes(before, _process_state())
    if changed:
        pytest.fail("the test left process-wide state changed:\n  " + "\n  ".join(changed), pytrace=False)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """An uninterrupted toy run (tests/toys.py sizes): its results rows and directory, once per test module."""
    import train
    from toys import tiny_model, tiny_train
    run = tmp_path_factory.mktemp("finished")
    return train.train(tiny_model(), tiny_train(), train.SyntheticData(64), str(run)), run
