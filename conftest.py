"""pytest setup: the flat top-level modules (model.py, moe.py, ...) importable from tests/, the
`one_thread` fixture, and a guard that fails any test leaving process-wide state changed."""
import contextlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.realpath(__file__)))   # resolved, as the scripts compare it

import pytest  # noqa: E402
import threadpoolctl  # noqa: E402,F401  -- sets KMP_DUPLICATE_LIB_OK on import: once, before any test's snapshot
with contextlib.suppress(ImportError):   # appends its _vendor folder to sys.path on import (inductor imports it)
    import setuptools  # noqa: E402,F401
import train  # noqa: E402  -- imported once, before any test's snapshot

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


@pytest.fixture(scope="module")
def scripts_importable():
    """scripts/ on sys.path for a test module (its scripts import their common.py), sys.path as it was after it."""
    with pytest.MonkeyPatch.context() as mp:      # restores the whole of sys.path when the module is done
        mp.syspath_prepend(os.path.join(os.path.dirname(os.path.realpath(__file__)), "scripts"))
        yield


def _process_state():
    """What a test must leave as it found it: torch's dynamo / inductor config, threads, default
    dtype, grad mode, the environment, the working directory and the import path."""
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
        "sys.path": list(sys.path),
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
    `config.patch(...)`, pytest's monkeypatch.setenv / chdir / syspath_prepend, or try/finally). Autouse fixtures set
    up first and tear down last, so a test's own monkeypatch has been undone when this looks."""
    before = _process_state()
    yield
    changed = _changes(before, _process_state())
    if changed:
        pytest.fail("the test left process-wide state changed:\n  " + "\n  ".join(changed), pytrace=False)


@pytest.fixture(scope="session")
def smoke_reproduction(tmp_path_factory):
    """One whole smoke reproduction (`reproduce.py --preset smoke`) per session: its out dir, which tests only
    copy (`smoke_copy`), never change."""
    import reproduce
    out = tmp_path_factory.mktemp("smoke_reproduction") / "out"
    assert reproduce.main(["--preset", "smoke", "--out-dir", str(out)]) == out / "REPORT.md"
    return out


@pytest.fixture(scope="module")
def smoke_copy(smoke_reproduction, tmp_path_factory):
    """A test module's own copy of the session's smoke reproduction (nothing in it names its folder)."""
    import shutil
    out = tmp_path_factory.mktemp("smoke") / "out"
    shutil.copytree(smoke_reproduction, out)
    return out


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """An uninterrupted toy run (tests/toys.py sizes): its results rows and directory, once per test module."""
    import train
    from toys import tiny_model, tiny_train
    run = tmp_path_factory.mktemp("finished")
    return train.train(tiny_model(), tiny_train(), train.SyntheticData(64), str(run)), run
