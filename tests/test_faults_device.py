"""Fault cases for issue 55: a --device this machine lacks, and a pool_run worker killed from outside. Each is
one line on stderr with exit status 2 (a UserError under checks.run_main), never a traceback asking for a report."""
import os
import signal
import time

import pytest
import torch

import checks
import reproduce
from lab import bench, evaluate, probe_pairs
from test_faults_cli import refused

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")


@no_cuda
@pytest.mark.fault("cli")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_resolve_device_refuses_a_missing_gpu(device):
    with pytest.raises(checks.UserError, match=rf"--device {device}: torch sees no CUDA device.*--device cpu or auto"):
        checks.resolve_device(device)
    assert checks.resolve_device("auto") == "cpu" and checks.resolve_device("cpu") == "cpu"


@no_cuda
@pytest.mark.fault("cli")
@pytest.mark.parametrize("cmd", ["evaluate", "bench", "probe_pairs"])
def test_device_cuda_without_cuda_is_one_line(tmp_path, capsys, cmd):
    run = str(tmp_path)   # exists; the device is refused before anything reads it
    main, argv = {"evaluate": (evaluate.main, ["--run", run]),
                  "bench": (bench.main, ["moe"]),
                  "probe_pairs": (probe_pairs.main, ["--pair", "p", run, run])}[cmd]
    refused(main, [*argv, "--device", "cuda"], cmd, capsys, "--device cuda", "no CUDA device", "--device cpu")


def kill_self(job: int) -> int:
    """A pool_run job: job 1 SIGKILLs its own worker; the others finish."""
    if job == 1:
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(10)
    return job


@pytest.mark.fault("kills")
def test_a_worker_killed_from_outside_is_one_line(capsys):
    import multiprocessing as mp
    pool = lambda argv: reproduce.pool_run(kill_self, [0, 1, 2], 2, name=lambda j: f"run_{j}")
    refused(pool, [], "reproduce.py", capsys, "worker process died", "signal SIGKILL", "run_1",
            "run the same command again")
    assert not mp.active_children()   # the pool's workers are all joined
