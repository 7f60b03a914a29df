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


FAULT_CLASSES = ("kills", "corruption", "disk", "cli", "api", "numerical", "concurrency")   # docs/faults.md


def pytest_collection_modifyitems(config, items):
    """Every @pytest.mark.fault("<class>") case names one of FAULT_CLASSES: a typo would drop it from its class."""
    for item in items:
        m = item.get_closest_marker("fault")
        if m is not None and (len(m.args) != 1 or m.args[0] not in FAULT_CLASSES):
            raise pytest.UsageError(f"{item.nodeid}: fault class {m.args} is not one of {', '.join(FAULT_CLASSES)}")


def pytest_report_collectionfinish(config, items):
    """Under -m fault, one line: the selected cases per class (each parametrization is a case)."""
    if "fault" not in (config.option.markexpr or ""):
        return []
    got = [m.args[0] for m in (i.get_closest_marker("fault") for i in items) if m is not None]
    return "fault cases: " + ", ".join(f"{k} {got.count(k)}" for k in FAULT_CLASSES) + f", all {len(got)}"


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread: far faster for tiny tensors on a shared CPU (opt in with usefixtures("one_thread"))."""
    from lab.bench_harness import threads
    with threads(1):
        yield


@pytest.fixture(scope="module")
def scripts_importable():
    """scripts/ on sys.path for a test module (its scripts import their common.py), restored after it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(os.path.join(os.path.dirname(os.path.realpath(__file__)), "scripts"))
        yield


def _process_state() -> dict:
    """What a test must leave as it found it, flat: {"name" or "name['key']": value}."""
    import torch
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config
    state = {"torch.get_num_threads()": torch.get_num_threads(), "torch.get_default_dtype()": torch.get_default_dtype(),
             "torch.is_grad_enabled()": torch.is_grad_enabled(), "os.getcwd()": os.getcwd(), "sys.path": list(sys.path)}
    # os.environ less pytest's own variable and inductor's private ones (it sets them for its worker processes)
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST" and not k.startswith("_TORCHINDUCTOR")}
    for name, d in (("torch._dynamo.config", dynamo_config.get_config_copy()),
                    ("torch._inductor.config", inductor_config.get_config_copy()), ("os.environ", env)):
        state.update({f"{name}[{k!r}]": v for k, v in d.items()})
    return state


@pytest.fixture(autouse=True)
def _leaves_process_state_as_found():
    """Fails a test that changes process-wide state without restoring it (use config.patch, monkeypatch or
    try/finally); autouse, so it looks after the test's own monkeypatch has been undone."""
    before = _process_state()
    yield
    after = _process_state()
    keys = sorted(k for k in before.keys() | after.keys() if k not in before or k not in after or before[k] != after[k])
    changed = [f"{k}: {before.get(k, '<absent>')!r} -> {after.get(k, '<absent>')!r}" for k in keys]
    if changed:
        pytest.fail("the test left process-wide state changed:\n  " + "\n  ".join(changed), pytrace=False)


@pytest.fixture(scope="session")
def smoke_reproduction(tmp_path_factory):
    """One `reproduce.py --preset smoke` per session: its out dir, which tests only copy (`smoke_copy`)."""
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
    from toys import tiny_model, tiny_train
    run = tmp_path_factory.mktemp("finished")
    return train.train(tiny_model(), tiny_train(), train.SyntheticData(64), str(run)), run
