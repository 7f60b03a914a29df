"""The single-GPU path, checked on CPU: every small-preset cell's training forward on fake CUDA tensors, and
the GPU cost model (costs.py) on the smoke and tiny plans.

Fake CUDA (torch._subclasses.fake_tensor.FakeTensorMode) does no math: each op runs its meta function on
device="cuda" tensors, so torch._grouped_mm's CUDA rules (bf16, 16-byte strides, int32 offsets) hold or
fail here. What it cannot reach on a CPU-only build, said where it matters below:
  - flex attention is not linked: the cells run attn_backend="sdpa" (flex vs SDPA: tests/test_model.py, CUDA);
  - autograd on fake CUDA tensors aborts (so does autocast's cast cache of a weight that requires grad):
    forward only, under no_grad, weights without requires_grad (the backward: the traced fullgraph tests);
  - a few Python bindings (Tensor.__getitem__, .contiguous) take a CUDA device guard before dispatch, which
    is not linked: _MetaFallback reruns just those calls on meta tensors of the same shape and strides.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

import budget
import configs
from lab import costs
import moe
import train
from model import GPT, ModelConfig



def _small_ctx() -> float:
    """The small data's measured document length, as reproduce.stage_ladder matches at; 512 where the small
    data is not prepared (as docs/budget.md checks small), which moves a width by a few units at most."""
    try:
        return budget.preset_doc_length("small")
    except FileNotFoundError:
        return 512.0


SMALL_CELLS = budget.ladder_cells("small", _small_ctx())
NOT_LINKED = "not linked with support for cuda"


def _as(device: str):
    def f(t):
        if isinstance(t, torch.Tensor) and t.device.type != device:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
        return t
    return f


class _MetaFallback(TorchFunctionMode):
    """A call whose Python binding needs the (unlinked) CUDA device guard reruns on meta copies of its
    fake CUDA tensors; its outputs come back as fake CUDA tensors of the same shape, strides and dtype."""

    def __init__(self):
        super().__init__()
        self.fell_back = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            return func(*args, **kwargs)
        except RuntimeError as e:
            if NOT_LINKED not in str(e):
                raise
        self.fell_back[getattr(func, "__name__", str(func))] += 1
        out = func(*tree_map(_as("meta"), args), **tree_map(_as("meta"), kwargs))
        return tree_map(_as("cuda"), out)


def _to_fake_cuda(model: torch.nn.Module) -> torch.nn.Module:
    """Every parameter and buffer replaced by an uninitialised fake CUDA tensor, not requiring grad (tied stay tied)."""
    memo = {}
    for mod in model.modules():
        for store, param in ((mod._parameters, True), (mod._buffers, False)):
            for name, t in list(store.items()):
                if t is not None and id(t) not in memo:
                    e = torch.empty(t.shape, dtype=t.dtype, device="cuda")
                    memo[id(t)] = torch.nn.Parameter(e, requires_grad=False) if param else e   # see the docstring
                if t is not None:
                    store[name] = memo[id(t)]
    return model


@pytest.fixture
def hopper(monkeypatch):
    """An H200 as moe.fused_grouped_mm_available and torch.autocast see it; training's forward is compiled on
    CUDA, so its eager-only host-read checks (model._check_idx) are off, as when compiling."""
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d=None: SimpleNamespace(major=9, minor=0))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    calls = Counter()

    def counted(kind, fn):
        def f(*a, **k):
            calls[kind] += 1
            return fn(*a, **k)
        return f
    monkeypatch.setattr(torch, "_grouped_mm", counted("torch", torch._grouped_mm))
    monkeypatch.setattr(moe, "grouped_mm_padded", counted("padded", moe.grouped_mm_padded))
    return calls


def _cell_ids():
    return [f"{c['scale']}/{c['sparsity_label']}/{arch}" for c in SMALL_CELLS for arch in ("baseline", "smelt")]


def _cell_params():
    return [ModelConfig.from_dict(c[arch]) for c in SMALL_CELLS for arch in ("baseline", "smelt")]


@pytest.mark.parametrize("cfg", _cell_params(), ids=_cell_ids())
def test_small_cell_training_forward_on_fake_cuda_takes_the_fused_kernel(cfg, hopper):
    cfg = replace(cfg, attn_backend="sdpa")          # flex attention is not linked in a CPU build
    B, T = 1, 128                                    # shapes only: no math is done
    mf = _MetaFallback()
    with FakeTensorMode(), mf, torch.no_grad():          # autograd on fake CUDA tensors aborts (see above)
        obj = train.Objective(_to_fake_cuda(GPT(cfg)))
        idx = torch.empty(B, T, dtype=torch.long, device="cuda")
        doc = torch.zeros(B, T, dtype=torch.long, device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ce, n, aux, z, _ = obj(idx, idx, doc)
            loss = ce / n + cfg.aux_loss_coef * aux + cfg.z_loss_coef * z
    for t in (ce, n, loss):
        assert t.device.type == "cuda" and t.shape == ()
    assert loss.dtype == torch.float32 and ce.dtype == torch.float32
    assert set(mf.fell_back) <= {"__getitem__", "contiguous"}, mf.fell_back      # the bindings named above
    assert hopper["padded"] == 0, f"{cfg.d_model}/{cfg.d_ff}: the MoE padded {hopper['padded']} grouped matmuls"
    assert hopper["torch"] == 2 * len(obj.gpt.plan)              # w_in and w_out of every layer visit, fused


# ---------------------------------------------------------------- the cost model (costs.py)

@pytest.fixture(scope="module", params=["smoke", "tiny"])
def plan_costs(request, tmp_path_factory):
    import reproduce
    plan = configs.PLANS[request.param]
    data, _ = reproduce.stage_data(plan)
    ladder = reproduce.stage_ladder(plan, data, tmp_path_factory.mktemp(request.param))
    cost = reproduce.plan_cost(plan, ladder, len(data.train))
    return plan, ladder, data, cost, costs.stage_costs(plan, ladder, data, cost)


def test_cost_model_stages_are_positive_and_sum_to_the_total(plan_costs):
    *_, c = plan_costs
    for name, s in c["stages"].items():
        assert s["flops"] > 0 and s["forward_calls"] > 0, name
        lo, hi = s["seconds"]
        assert 0 < lo < hi, name
    # flex compiles only where it runs: training graphs, validation (one shape); scoring and probes do not
    assert c["stages"]["train"]["compiles"] == c["stages"]["validation"]["compiles"] == c["runs"]
    assert c["stages"]["eval"]["compiles"] == c["stages"]["probes"]["compiles"] == 0
    for k in ("flops", "compiles", "forward_calls", "host_reads", "eager_calls"):
        assert c["total"][k] == sum(s[k] for s in c["stages"].values())
    assert c["total"]["seconds"] == pytest.approx([sum(s["seconds"][i] for s in c["stages"].values())
                                                   for i in (0, 1)])
    text = costs.format_costs(c)
    assert all(name in text for name in (*c["stages"], "total"))


def test_cost_model_flops_agree_with_budget(plan_costs):
    plan, ladder, data, cost, c = plan_costs
    runs = configs.plan_runs(Path("."), ladder, plan)
    assert c["stages"]["train"]["flops"] == cost["total_flops"]
    assert c["stages"]["train"]["compiles"] == len(runs)
    steps = (plan.stable_steps + len(set(plan.branch_steps)) * plan.decay_steps) * len(runs)
    assert c["stages"]["train"]["forward_calls"] == steps
    fwd = sum(budget.flops_per_token(ModelConfig.from_dict(r.cell[r.arch]), r.cell["ctx_len"], include_head=True) / 3
              for r in runs)    # forward FLOPs per token, all runs
    v = costs.val_counts(data, plan.batch_size, plan.block_size, plan.eval_tokens)
    _, vals = costs.run_steps(plan)
    assert c["stages"]["validation"]["flops"] == pytest.approx(vals * v["tokens"] * fwd, rel=1e-9)
    assert c["stages"]["probes"]["flops"] == pytest.approx((plan.probe_tokens // plan.block_size) * plan.block_size
                                                           * fwd, rel=1e-9)


def test_cost_model_counts_per_stage(plan_costs):
    """Counted from the plan: one host read per optimizer step; four per validation batch; an endpoint per run and
    branch, each scoring every task; eval FLOPs the body on every padded token plus the head at the logit positions
    only; the probes' eager calls batches of PROBE_BATCH contexts per run."""
    plan, ladder, data, cost, c = plan_costs
    runs = configs.plan_runs(Path("."), ladder, plan)
    n, branches = len(runs), len(set(plan.branch_steps))
    st, sc = c["stages"], c["scoring_per_endpoint"]
    assert st["train"]["host_reads"] == (plan.stable_steps + branches * plan.decay_steps) * n
    v = costs.val_counts(data, plan.batch_size, plan.block_size, plan.eval_tokens)
    _, vals = costs.run_steps(plan)
    assert st["validation"]["host_reads"] == 4 * st["validation"]["forward_calls"] == 4 * vals * v["calls"] * n
    assert c["endpoints"] == branches * n and st["eval"]["forward_calls"] == branches * n * sc["calls"]
    body = [budget.flops_per_token(ModelConfig.from_dict(r.cell[r.arch]), r.cell["ctx_len"]) / 3 for r in runs]
    head = [budget.flops_per_token(ModelConfig.from_dict(r.cell[r.arch]), r.cell["ctx_len"], include_head=True) / 3 - b
            for r, b in zip(runs, body)]
    assert sc["positions"] < sc["tokens"]
    assert st["eval"]["flops"] == pytest.approx(branches * sum(sc["tokens"] * b + sc["positions"] * h
                                                               for b, h in zip(body, head)), rel=1e-9)
    contexts = plan.probe_tokens // plan.block_size
    assert st["probes"]["eager_calls"] == st["probes"]["forward_calls"] == -(-contexts // costs.PROBE_BATCH) * n


def test_stage_wall_time_by_hand(monkeypatch):
    """_stage's wall time, best and worst end: FLOPs / (peak x MFU) + compiles x compile seconds / overlap
    + eager calls x launch overhead + host reads x sync cost (round assumptions, so by hand); the compile
    seconds are the eager flex kernel's unless the training graph's are named."""
    monkeypatch.setattr(costs, "PEAK_FLOPS", 1e12)
    monkeypatch.setattr(costs, "ASSUMED", {"mfu": (0.5, 0.25), "compile_s": (10.0, 20.0), "flex_compile_s": (1.0, 2.0),
                                           "eager_call_s": (0.1, 0.2), "host_read_s": (0.01, 0.02)})
    s = costs._stage(2e12, 4, 50, 70, 20, "compile_s", overlap=2)
    assert s["seconds"] == pytest.approx([4 + 20 + 2 + 0.7, 8 + 40 + 4 + 1.4])
    assert s["compile_seconds"] == pytest.approx([40.0, 80.0]) and s["forward_calls"] == 50
    flex = costs._stage(0.0, 3, 0, 0, 0)
    assert flex["seconds"] == flex["compile_seconds"] == pytest.approx([3.0, 6.0])


def test_run_steps_count_validations_by_hand():
    """run_steps: stable 10 steps, branches forking at 4 and 10 with 5 decay steps each, validation every 4 steps:
    20 optimizer steps; validations after steps 4 and 8 (stable), 8 (branch 4's 5..9), 12 (branch 10's 11..15),
    plus one at each branch end: 6."""
    plan = replace(configs.PLANS["smoke"], stable_steps=10, branch_steps=[4, 10], decay_steps=5, eval_interval=4)
    assert costs.run_steps(plan) == (20, 6)
    assert costs.run_steps(replace(plan, eval_interval=0)) == (20, 2)


def test_plan_cost_gpu_minutes_use_the_cost_models_mfu(plan_costs, capsys):
    """The plan line's GPU minutes are its training FLOPs (head included) at costs.ASSUMED's MFU range on one
    H200: one MFU assumption for the plan line and the cost model."""
    import reproduce
    plan, ladder, data, cost, _ = plan_costs
    cfgs = {r.name: ModelConfig.from_dict(r.cell[r.arch]) for r in configs.plan_runs(Path("."), ladder, plan)}
    for r in cost["runs"]:
        cfg = cfgs[r["run"]]
        assert r["flops_with_head"] == pytest.approx(r["F_with_head"] * r["tokens"], rel=1e-12)
        assert r["tpp"] == pytest.approx(r["tokens"] / (r["F"] / 6), rel=1e-12)    # D / (F/6): SMELT's TPP
        assert r["tokens_per_param"] == pytest.approx(r["tokens"] / budget.count_params(cfg)["blocks"], rel=1e-12)
        assert r["gpu_minutes"] == pytest.approx([r["flops_with_head"] / (costs.PEAK_FLOPS * m) / 60
                                                  for m in costs.ASSUMED["mfu"]], rel=1e-12)
    assert cost["gpu_minutes"] == pytest.approx([cost["total_flops"] / (costs.PEAK_FLOPS * m) / 60
                                                 for m in costs.ASSUMED["mfu"]], rel=1e-9)
    reproduce.log_plan_cost(cost)
    lo, hi = cost["gpu_minutes"]
    assert f"= {lo:.1f}-{hi:.1f} min on one H200 at an assumed 15-5 % MFU" in capsys.readouterr().out
    with pytest.raises(ValueError, match="tokens must be a finite number > 0"):
        costs.run_cost(ModelConfig.from_dict(ladder[0]["baseline"]), 64, 0)


class _HostReads(TorchFunctionMode):
    """Counts the calls that read a tensor's values to the host (float(t), int(t), bool(t), t.item(),
    t.tolist(), t.cpu(), t.numpy()): each one a sync on CUDA."""
    READS = {torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__bool__, torch.Tensor.item,
             torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy}

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.n += func in self.READS
        return func(*args, **(kwargs or {}))


class _NoMath(torch.nn.Module):
    """A stand-in GPT for the task scorer: zero logits, no parameters (so it takes score_continuations, the
    path CUDA takes: no new_cache), a norm_f for tasks._head_at to hook (logits only at the answer positions)."""

    def __init__(self, vocab_size: int, block_size: int):
        super().__init__()
        self.cfg = SimpleNamespace(vocab_size=vocab_size, block_size=block_size)
        self.norm_f = torch.nn.Identity()

    def forward(self, idx, doc_ids=None):
        h = self.norm_f(torch.zeros(*idx.shape, 1))          # (B, M, 1) once _head_at selects positions
        return h.new_zeros(*h.shape[:2], self.cfg.vocab_size)


def _scored_by_a_stand_in(plan, data) -> tuple[Counter, int]:
    """The slow reference of costs.scoring_counts: every task and k evaluate_endpoint scores, run through
    tasks.evaluate_task on _NoMath at CUDA's batch size, its forwards and host reads counted; and the
    sequences evaluate_task's own results say it scored (one per item, seed and option)."""
    from lab import tasks as tasks_mod
    enc, model = data.tokenizer(), _NoMath(data.vocab_size, plan.block_size)
    n, rows = Counter(), 0
    model.register_forward_pre_hook(lambda _m, args: n.update(calls=1, rows=args[0].shape[0],
                                                              tokens=args[0].numel()))
    model.register_forward_hook(lambda _m, _a, out: n.update(positions=out.shape[0] * out.shape[1]))
    reads = _HostReads()
    with reads:
        for name in tasks_mod.resolve_tasks(plan.tasks):
            task = tasks_mod.get_task(name)
            for k in (k for k in plan.shots if k <= tasks_mod.demos_available(task)):
                r = tasks_mod.evaluate_task(model, enc, task, k, plan.seeds, plan.max_items, plan.block_size,
                                            batch_tokens=tasks_mod.BATCH_TOKENS["cuda"])
                options = [len(task.items[i].options) if task.kind == "mc" else 1 for i in r["items"]]
                rows += r["seeds"] * sum(options)
    n["host_reads"] = reads.n
    return n, rows


def test_scoring_counts_equal_what_a_stand_in_model_scores(plan_costs):
    """costs.scoring_counts (no model: the batches tasks.scoring_batches plans) against evaluate_task run on
    a stand-in that does no math: the same forward calls, rows, padded tokens, logit positions and host
    reads, and the rows evaluate_task's results say it scored; the eval stage holds every endpoint's."""
    plan, _, data, _, c = plan_costs
    sc = c["scoring_per_endpoint"]
    slow, rows = _scored_by_a_stand_in(plan, data)
    assert sc == dict(slow) and sc["rows"] == rows > 0
    assert sc["calls"] < sc["rows"] and sc["host_reads"] == sc["calls"]        # batched, one read per batch
    assert c["stages"]["eval"]["forward_calls"] == c["endpoints"] * sc["calls"]
    assert c["stages"]["eval"]["host_reads"] == c["endpoints"] * sc["host_reads"]


def test_plan_only_prints_the_cost_model_and_the_disk_and_refuses_nothing(tmp_path, capsys, monkeypatch):
    import collections
    import json
    import shutil
    import reproduce
    full = collections.namedtuple("usage", "total used free")(1, 1, 0)   # a full disk: a real run would refuse
    monkeypatch.setattr(shutil, "disk_usage", lambda path: full)
    assert reproduce.main(["--preset", "smoke", "--plan-only", "--out-dir", str(tmp_path)]).name == "plan.json"
    out = capsys.readouterr().out
    assert "cost model on one GPU" in out and all(s in out for s in ("train", "validation", "eval", "probes"))
    assert "disk: the 10 runs keep" in out and "0 B free" in out
    # the design line: smoke's grid fails the data rules, named, and plan.json keeps the design
    assert "plan: design 2 fitted cells x 3 endpoints = 6 points per surface" in out
    assert "no fit can be identified" in out
    design = json.loads((tmp_path / "plan.json").read_text())["design"]
    assert design["shape"]["points"] == 6 and design["power"]["datasets"] == 0 and design["power"]["why"]
