"""bench_harness.py's budgeted runner and scripts/gpu_check.sh, on CPU: every figure reaches the JSON as soon as
it exists (a timeout or a kill keeps the earlier ones), each benchmark's limit comes from what is left.
The benchmarks themselves need CUDA (flex, steps) or are timed, not tested (docs/bench.md)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lab import bench
from lab import bench_harness

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_script_parses():
    r = subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def _partial_then_hang(save, deadline):
    save({"first": 1.0})
    time.sleep(30)
    return {"first": 1.0, "second": 2.0}


@pytest.mark.fault("kills")
def test_a_benchmark_timed_out_keeps_its_partial_figures_and_the_next_still_runs(tmp_path):
    limits = {"flex": (1.0, 0.5), "steps": (5.0, 0.5)}
    path = str(tmp_path / "bench.json")
    runs = {"flex": _partial_then_hang, "steps": lambda save, deadline: {"done": deadline is not None}}
    failed = bench_harness.run_benchmarks(runs, ["flex", "steps"], path, limits, budget_s=10)
    d = json.loads(Path(path).read_text())
    assert failed == ["flex"]
    # the 30 s sleep was cut: it timed out with its partial figures, before it could return the second
    assert d["flex"]["first"] == 1.0 and "timed out" in d["flex"]["error"] and "second" not in d["flex"]
    assert d["steps"]["done"] is True


def test_a_benchmark_without_time_left_is_skipped_and_recorded(tmp_path):
    limits = {"flex": (100.0, 5.0), "steps": (100.0, 8.0)}
    path = str(tmp_path / "bench.json")
    ran = []
    runs = {n: (lambda save, deadline, n=n: ran.append((n, deadline)) or {"ok": True}) for n in ("flex", "steps")}
    t0 = time.monotonic()
    failed = bench_harness.run_benchmarks(runs, ["flex", "steps"], path, limits, budget_s=10)   # flex: 10 - 8 = 2 s < its floor
    t1 = time.monotonic()
    d = json.loads(Path(path).read_text())
    assert failed == ["flex"] and "skipped" in d["flex"]
    # steps, the last, gets all that is left of the 10 s budget (not its 100 s cap): its deadline is the budget's end
    assert [n for n, _ in ran] == ["steps"] and t0 + 10 - 1e-6 <= ran[0][1] <= t1 + 10
    assert d["steps"]["ok"] is True and d["steps"]["bench_seconds"] >= 0


@pytest.mark.fault("kills")
def test_a_killed_bench_process_keeps_the_figures_written_before(tmp_path):
    """SIGKILL (what `timeout --kill-after` sends last) mid-benchmark: the JSON keeps the first benchmark's
    result and the second's partial figures, and is valid JSON (each write is atomic)."""
    path = tmp_path / "bench.json"
    code = textwrap.dedent(f"""
        import time
        from lab import bench_harness
        def hang(save, deadline):
            save({{"partial": 3.0}})
            time.sleep(60)
        bench_harness.run_benchmarks({{"flex": lambda s, d: {{"full": 1.0}}, "steps": hang}}, ["flex", "steps"],
                                     {str(path)!r}, {{}})
    """)
    p = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        for _ in range(600):
            if path.exists() and "steps" in json.loads(path.read_text()):
                break
            time.sleep(0.1)
    finally:
        p.kill()
        p.wait()
    d = json.loads(path.read_text())
    assert d["flex"]["full"] == 1.0 and d["steps"] == {"partial": 3.0}


def test_time_limit_without_seconds_does_not_interrupt():
    with bench_harness.time_limit(None):
        time.sleep(0.01)
    with pytest.raises(bench_harness.BenchTimeout, match="timed out"):
        with bench_harness.time_limit(0.05):
            time.sleep(1)


def test_bench_train_saves_each_first_step_as_it_is_measured(tmp_path):
    """bench_train at smoke scale on CPU under run_benchmarks: the pair's setup first, then each model's
    first step (on CUDA its compile), each save keeping the earlier figures; a time limit hit during
    SMELT's first step (raised from the save after Baseline's) leaves the setup and Baseline's first step
    in the JSON beside the error; a full run returns the compile split."""
    import copy
    import torch
    saves = []

    def cut_after_baseline(save, deadline):
        def keep(res):
            saves.append(copy.deepcopy(res))
            save(res)
            if "baseline" in res and len(saves) == 2:
                raise bench_harness.BenchTimeout("timed out after 0 s")
        return bench.bench_train(torch.device("cpu"), "smoke", steps=2, batch_size=2, save=keep)
    path = str(tmp_path / "bench.json")
    with bench_harness.threads(1):
        assert bench_harness.run_benchmarks({"train": cut_after_baseline}, ["train"], path, {}) == ["train"]
        d = json.loads(Path(path).read_text())["train"]
        assert "timed out" in d["error"] and d["baseline"]["first_step_s"] > 0 and "smelt" not in d
        assert [sorted(set(s) & {"baseline", "smelt"}) for s in saves] == [[], ["baseline"]]
        assert {"cell", "match", "flops_ctx"} <= set(saves[0])
        saves.clear()
        res = bench.bench_train(torch.device("cpu"), "smoke", steps=2, batch_size=2,
                                save=lambda r: saves.append(copy.deepcopy(r)))
    assert [sorted(set(s) & {"baseline", "smelt"}) for s in saves] == [[], ["baseline"], ["baseline", "smelt"]]
    assert saves[-1]["baseline"] == {"first_step_s": res["baseline"]["first_step_s"]}
    for name in ("baseline", "smelt"):
        r = res[name]
        assert r["compile_s"] == pytest.approx(r["first_step_s"] - r["s_per_step"]) and r["tokens_per_s"] > 0


def test_visit_step_times_one_block_visit_inside_the_loop():
    """bench_cells' per-visit timing runs one visit of the plan's middle (a looped visit for SMELT) forward and
    backward: the gradient reaches that block's weights and no other block's."""
    import torch
    from loop import LoopConfig
    from model import GPT, ModelConfig
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, block_size=16, n_layer=4, d_model=32, n_head=2, n_kv_head=1, d_ff=32,
                      n_experts=4, top_k=2, loop=LoopConfig(start=1, length=2, n_loops=2))
    gpt = GPT(cfg)
    v = gpt.plan[len(gpt.plan) // 2]
    assert cfg.loop.in_span(v.layer) and len(gpt.plan) == 6
    idx = torch.randint(0, 64, (2, 16))
    doc = torch.zeros(2, 16, dtype=torch.long)
    bench._visit_step(gpt, idx, doc)()
    touched = {n.split(".")[1] for n, p in gpt.named_parameters() if n.startswith("blocks.") and p.grad is not None}
    assert touched == {str(v.layer)}
    assert gpt.blocks[v.layer].mlp.router.weight.grad.abs().sum() > 0


def test_profile_step_lists_the_step_operators(tmp_path, capsys, monkeypatch):
    """scripts/profile_step.py on a smoke cell: the matmuls are among the top operators, the shares are
    fractions of the profiled time, and the figures it prints are the ones it writes."""
    from lab import corpus
    corpus.prepare("smoke")
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))   # restored after the test
    import profile_step
    res = profile_step.main(["--preset", "smoke", "--steps", "1", "--top", "5", "--out-dir", str(tmp_path)])
    assert res["cell"] == ["m64", "S~85%"] and res["step_s"] > 0 and res["aten_calls_per_step"] > 100
    shares = [t["share"] for t in res["top"]]
    assert len(shares) == 5 and shares == sorted(shares, reverse=True) and 0 < sum(shares) <= 1
    assert "aten::mm" in {t["op"] for t in res["top"]}
    assert json.loads((tmp_path / "profile.json").read_text()) == json.loads(json.dumps(res))
    assert f"{res['aten_calls_per_step']:.0f} aten calls per step" in capsys.readouterr().out


def test_profile_step_dtype_bf16_runs_under_autocast(monkeypatch):
    """--dtype bf16 profiles the step under train.py's bf16 autocast: the casts autocast inserts show as
    extra aten::_to_copy calls per step beside the fp32 profile of the same cell."""
    from lab import corpus
    corpus.prepare("smoke")
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))   # restored after the test
    import profile_step
    casts = {}
    for dt in ("fp32", "bf16"):
        res = profile_step.main(["--preset", "smoke", "--steps", "1", "--top", "1000", "--dtype", dt])
        assert res["dtype"] == dt
        casts[dt] = next(t["calls_per_step"] for t in res["top"] if t["op"] == "aten::_to_copy")
    assert casts["bf16"] > casts["fp32"] + 100, casts
