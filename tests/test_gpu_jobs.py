"""Several runs sharing one GPU (issue 24): --jobs on CUDA, the default rule, the workers' threads, and the
cost model's wall time by jobs; on a CPU, one run per core within RAM (issue 52). CUDA is reported available (or
not) by a patch (restored); nothing runs on a GPU."""
from __future__ import annotations

import operator
from unittest import mock

import pytest
import torch

import checks
from lab import costs
import reproduce

GiB = 1 << 30


@pytest.fixture
def cuda_reported():
    """torch.cuda.is_available() returns True inside the test, the real function again after it."""
    with mock.patch.object(torch.cuda, "is_available", return_value=True):
        yield


@pytest.fixture(scope="module")
def smoke_plan(tmp_path_factory):
    import configs
    plan = configs.PLANS["smoke"]
    data, _ = reproduce.stage_data(plan)
    ladder = reproduce.stage_ladder(plan, data, tmp_path_factory.mktemp("ladder"))
    return plan, ladder, data, reproduce.plan_cost(plan, ladder, len(data.train))


def test_parse_args_accepts_several_jobs_and_leaves_the_default_to_the_machine(cuda_reported):
    assert reproduce.parse_args(["--jobs", "4"]).jobs == 4
    assert reproduce.parse_args([]).jobs is None                 # the default is chosen from the machine


@pytest.mark.parametrize("device,cpus,free,per_run,want", [
    ("cpu", 1, None, None, 1), ("cpu", 2, None, None, 2), ("cpu", 64, None, None, 64),   # one per core
    ("cpu", 16, 100 * GiB, 13 * GiB // 10, 16), ("cpu", 2, 100 * GiB, GiB, 2),            # plenty of RAM
    ("cpu", 16, 7 * GiB, 2 * GiB, 3), ("cpu", 16, GiB // 2, GiB, 1),                       # capped by RAM, never 0
    ("cuda", 2, None, None, 1), ("cuda", 8, None, None, 2), ("cuda", 16, None, None, 4), ("cuda", 64, None, None, 4),
    ("cuda", 16, 139 * GiB, 7 * GiB, 4),                       # the lent H200 host at the small preset: not capped
    ("cuda", 16, 10 * GiB, 4 * GiB, 2), ("cuda", 16, 3 * GiB, 4 * GiB, 1)])   # capped by memory, never below 1
def test_default_jobs_rule(device, cpus, free, per_run, want):
    assert reproduce.default_jobs(device, cpus, free, per_run) == want


def test_default_jobs_refuses_what_it_cannot_mean():
    for args in (("mps", 8), ("cuda", 0)):
        with pytest.raises(ValueError, match="default_jobs"):
            reproduce.default_jobs(*args)


def test_choose_jobs_on_cuda_shares_the_cores_and_refuses_jobs_beyond_gpu_memory(cuda_reported, smoke_plan):
    plan, ladder, *_ = smoke_plan
    per_run = reproduce.gpu_bytes_per_run(plan, ladder)
    assert per_run > reproduce.CUDA_WORKER_OVERHEAD_BYTES
    with mock.patch.object(reproduce.os, "cpu_count", return_value=16), \
            mock.patch.object(reproduce, "free_gpu_bytes", return_value=100 * GiB):
        jobs, rt = reproduce.choose_jobs(None, plan, ladder)
        assert (jobs, rt["jobs"], rt["threads_per_worker"], rt["device"]) == (4, 4, 4, "cuda")
        assert rt["jobs_from"].startswith("default_jobs") and "16 cores" in rt["jobs_from"]
        assert reproduce.choose_jobs(2, plan, ladder)[1]["threads_per_worker"] == 8
    with mock.patch.object(reproduce, "free_gpu_bytes", return_value=3 * per_run // 2):
        with pytest.raises(checks.UserError, match="--jobs 3 on one GPU needs .* use --jobs 1"):
            reproduce.choose_jobs(3, plan, ladder)


def test_choose_jobs_on_cpu_follows_the_cores_and_the_memory(smoke_plan):
    """One single-threaded worker per core, at most the runs RAM holds at cpu_bytes_per_run; the why is printed."""
    plan, ladder, *_ = smoke_plan
    per_run = reproduce.cpu_bytes_per_run(plan, ladder)
    assert per_run > reproduce.CPU_WORKER_OVERHEAD_BYTES
    with mock.patch.object(torch.cuda, "is_available", return_value=False), \
            mock.patch.object(reproduce.os, "cpu_count", return_value=16):
        for free, want in ((100 * GiB, 16), (3 * per_run + per_run // 2, 3), (per_run // 2, 1), (None, 16)):
            with mock.patch.object(reproduce, "free_cpu_bytes", return_value=free):
                jobs, rt = reproduce.choose_jobs(None, plan, ladder)
                threads = 1 if want > 1 else torch.get_num_threads()   # one job trains in-process
                assert (jobs, rt["jobs"], rt["threads_per_worker"], rt["device"]) == (want, want, threads, "cpu"), free
                assert rt["jobs_from"].startswith("default_jobs: 16 cores, ")
                assert ("memory unknown" if free is None else f"{free / GiB:.1f} GiB available") in rt["jobs_from"]
        with mock.patch.object(reproduce, "free_cpu_bytes", return_value=100 * GiB):
            jobs, rt = reproduce.choose_jobs(5, plan, ladder)
            assert (jobs, rt["jobs_from"][:len("--jobs: 16 cores")]) == (5, "--jobs: 16 cores")
        with mock.patch.object(reproduce.os, "cpu_count", return_value=2), \
                mock.patch.object(reproduce, "free_cpu_bytes", return_value=100 * GiB):
            assert reproduce.choose_jobs(None, plan, ladder)[0] == 2


def test_pool_workers_get_the_threads_they_are_given():
    assert reproduce.pool_run(operator.call, [torch.get_num_threads] * 2, 2, threads=3) == [3, 3]


def test_cost_model_wall_time_falls_with_jobs_by_the_compiles_only(smoke_plan):
    plan, ladder, data, cost = smoke_plan
    by = {j: costs.stage_costs(plan, ladder, data, cost, j) for j in (1, 2, 4, 100)}
    runs = by[1]["runs"]
    one = by[1]["total"]
    for i in (0, 1):                                              # best and worst ends
        assert by[1]["total"]["seconds"][i] > by[2]["total"]["seconds"][i] > by[4]["total"]["seconds"][i]
        compiled = sum(by[1]["stages"][s]["compile_seconds"][i] for s in ("train", "validation"))
        for j, c in by.items():
            assert c["total"]["seconds"][i] == pytest.approx(one["seconds"][i] - compiled * (1 - 1 / min(j, runs)))
            assert c["total"]["seconds_one_job"][i] == pytest.approx(one["seconds"][i])
            assert c["total"]["compile_seconds"][i] == one["compile_seconds"][i]   # the same compiles, overlapped
    assert costs.format_costs(by[4]).count("4 at a time") == 1 and "(1 job)" in costs.format_costs(by[4])
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="jobs must be an int >= 1"):
            costs.stage_costs(plan, ladder, data, cost, bad)
    with pytest.raises(ValueError, match="plan_cost has 1 runs"):
        costs.stage_costs(plan, ladder, data, {**cost, "runs": cost["runs"][:1]})


def test_plan_line_epochs_are_configs_plan_epochs(smoke_plan):
    """The plan line's epochs count the data read (stable phase + the one decay window the branches share,
    configs.plan_epochs), not the tokens trained on (every branch's decay)."""
    import configs
    plan, _, data, cost = smoke_plan
    assert cost["epochs_per_run"] == configs.plan_epochs(plan, len(data.train))
    assert cost["epochs_per_run"] < cost["tokens_per_run"] / len(data.train)   # smoke has 3 branches


def test_decay_data_not_fresh_is_said_in_the_plan_line_and_the_report(smoke_plan, capsys):
    """A plan reading over one epoch repeats stable-phase data in its decay window (SMELT 3.1 decays on fresh
    data): the plan line warns, the report's plan section says "not fresh"; at most one epoch is "fresh"."""
    import configs
    from lab import report
    plan, ladder, data, cost = smoke_plan
    for epochs, fresh in ((0.96, True), (1.0, True), (17.2, False)):
        reproduce.log_plan_cost({**cost, "epochs_per_run": epochs})
        out = capsys.readouterr().out
        assert ("WARNING: decay data not fresh: one run reads 17.20 epochs" in out) is not fresh
        text = "\n".join(report._section_plan(plan, ladder, [], {**cost, "epochs_per_run": epochs}))
        assert f"Decay data: {'fresh' if fresh else 'not fresh'}: one run reads {epochs:.2f} epochs" in text
    assert configs.decay_freshness(1.01).startswith("not fresh")
    reproduce.log_plan_cost({**cost, "epochs_per_run": None})     # no prepared data: no epochs, no sentence
    assert "epochs" not in capsys.readouterr().out
    assert "Decay data" not in "\n".join(report._section_plan(plan, ladder, [], {**cost, "epochs_per_run": None}))


def test_a_fresh_plan_line_warns_of_nothing(smoke_plan, capsys):
    """At most one epoch per run (0.5 or exactly 1.0) the decay data are fresh: the plan line prints no warning."""
    plan, ladder, data, cost = smoke_plan
    for epochs in (0.5, 1.0):
        reproduce.log_plan_cost({**cost, "epochs_per_run": epochs})
        assert "WARNING" not in capsys.readouterr().out, epochs


def test_plan_cost_rates_the_longest_endpoint(smoke_plan):
    """Tokens per parameter and TPP are stated at the longest branch's endpoint: its stable steps and its
    decay window (not the run's total tokens, which count every branch's decay)."""
    from pathlib import Path

    import budget
    import configs
    from model import ModelConfig
    plan, ladder, _, cost = smoke_plan
    final = (max(plan.branch_steps) + plan.decay_steps) * plan.batch_size * plan.block_size
    runs = {r.name: ModelConfig.from_dict(r.cell[r.arch]) for r in configs.plan_runs(Path("."), ladder, plan)}
    assert [r["run"] for r in cost["runs"]] == list(runs) and final < cost["tokens_per_run"]
    for r in cost["runs"]:
        assert r["tokens_per_param_final"] == pytest.approx(final / budget.count_params(runs[r["run"]])["blocks"])
        assert r["tpp_final"] == pytest.approx(final / (r["F"] / 6))


@pytest.mark.fault("api")
def test_choose_jobs_refuses_a_plan_whose_run_cannot_fit(smoke_plan):
    """A run whose step alone exceeds the free memory is named before any training (budget.refuse_oversized)."""
    plan, ladder, *_ = smoke_plan
    with mock.patch.object(torch.cuda, "is_available", return_value=False), \
            mock.patch.object(reproduce, "free_cpu_bytes", return_value=10**6), \
            mock.patch.object(checks, "available_memory", return_value=10**6):
        with pytest.raises(checks.TooLargeError, match=r"^\w+=\d+: run m48_\w+'s training step needs at least .* "
                                                       r"more than the 1.0 MB available there"):
            reproduce.choose_jobs(None, plan, ladder)
