"""train.py: WSD schedule, weight-decay groups, stable run + decay branches end to end (endpoints,
retention), exact resume after a crash, checkpoint safety (atomic, corrupt, mismatched), divergence,
and DDP / FSDP2 under torchrun on CPU (gloo) against a single process with the same global batch.
(Fault injection and bad inputs: tests/test_faults.py.)

Data is train.SyntheticData (random Zipf documents, TokenData's interface) or a subclass of it
that crashes / records, so these tests need no corpus.
"""
import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

import budget
import checkpoint
import data as data_mod
import checks
import train as T
from toys import tiny_model, tiny_train
from loop import LoopConfig
from model import GPT, ModelConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMING = ("tokens_per_s", "eta_s", "mfu")

pytestmark = pytest.mark.usefixtures("one_thread")


def read_jsonl(path):
    return checks.read_jsonl(path)   # each row checked against its sha256


def strip_timing(rows):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


class RecordingData(T.SyntheticData):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.steps = []

    def train_batch(self, step, *a, **kw):
        self.steps.append(step)
        return super().train_batch(step, *a, **kw)


class CrashingData(T.SyntheticData):
    """Dies when asked for training batch `crash_at` (a machine failure mid-run)."""

    def __init__(self, crash_at, *a, **kw):
        super().__init__(*a, **kw)
        self.crash_at = crash_at

    def train_batch(self, step, *a, **kw):
        if step == self.crash_at:
            raise RuntimeError("simulated crash")
        return super().train_batch(step, *a, **kw)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """An uninterrupted run: stable 6 steps, branches at 3 and 6, each decaying 2 steps."""
    run_dir = tmp_path_factory.mktemp("straight")
    data = RecordingData(64)
    rows = T.train(tiny_model(), tiny_train(), data, str(run_dir), {"scale": "toy", "sparsity_label": "test"})
    return rows, run_dir, data.steps


# ----------------------------------------------------------------------------------------
# Schedule and optimizer

def test_wsd_schedule_warmup_stable_and_cosine_branches():
    tc = T.TrainConfig(lr=1.0, min_lr_frac=0.1, warmup_steps=4, stable_steps=20, branch_steps=[10, 20], decay_steps=8)
    assert [T.lr_at(tc, s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert all(T.lr_at(tc, s) == 1.0 for s in range(4, 20))
    assert T.lr_at(tc, 9, branch=10) == 1.0                       # before the fork: the stable run
    decay = [T.lr_at(tc, 10 + j, branch=10) for j in range(8)]
    assert all(a > b for a, b in zip(decay, decay[1:])) and decay[0] < 1.0
    assert decay[3] == pytest.approx(0.55)                        # cosine midpoint between 1.0 and 0.1
    assert decay[-1] == pytest.approx(0.1)                        # ends at min_lr_frac * lr
    # a branch forked inside warmup decays from the lr it forked at (0.75 at step 2)
    assert T.lr_at(tc, 2 + 3, branch=2) == pytest.approx(0.1 + 0.65 * 0.5)


def _grad_norm_at_opt_step(trainer):
    """Wrap trainer.opt.step to record the global gradient norm the optimizer is handed (after clipping)."""
    seen, orig = [], trainer.opt.step

    def spy(*a, **kw):
        grads = [p.grad.detach().flatten() for p in trainer.gpt.parameters() if p.grad is not None]
        seen.append(torch.linalg.vector_norm(torch.cat(grads)).item())
        return orig(*a, **kw)
    trainer.opt.step = spy
    return seen


def test_step_clips_the_global_grad_norm_and_logs_the_unclipped_norm(tmp_path):
    """grad_clip=c: AdamW sees gradients of global norm exactly c; the row logs the pre-clip norm; 0: no clipping."""
    runs = {}
    for clip in (0.0, 0.05):
        t = T.Trainer(tiny_model(), tiny_train(grad_clip=clip), T.SyntheticData(64), tmp_path / f"c{clip}")
        seen = _grad_norm_at_opt_step(t)
        runs[clip] = (t.step(0, 0, 1e-3), seen[0])
    (row0, seen0), (row_c, seen_c) = runs[0.0], runs[0.05]
    assert row0["grad_norm"] > 0.5                                 # well above the clip: clipping must act
    assert seen0 == pytest.approx(row0["grad_norm"], rel=1e-5)    # 0: gradients untouched
    assert row_c["grad_norm"] == pytest.approx(row0["grad_norm"], rel=1e-6)   # logged before clipping
    assert seen_c == pytest.approx(0.05, rel=1e-4)


def test_step_row_loss_terms_match_the_models_own_loss(tmp_path):
    """Step 0's logged loss, ce, aux, z and load_max (worst visit's max/mean expert load) are GPT.run's on the same
    batch, and the step's lr is set on every parameter group."""
    cfg = tiny_model(aux_loss_coef=0.05, z_loss_coef=0.2)
    t = T.Trainer(cfg, tiny_train(), T.SyntheticData(64), tmp_path / "r")
    idx, tgt, doc = T.SyntheticData(64).train_batch(0, 4, 32)
    with torch.no_grad():
        out = t.gpt.run(idx, tgt, doc)
    row = t.step(0, 0, 1e-3)
    assert row["ce"] == pytest.approx(out.ce.item(), rel=1e-5)
    assert row["aux"] == pytest.approx(out.aux_loss.item(), rel=1e-5)
    assert row["z"] == pytest.approx(out.z_loss.item(), rel=1e-5)
    assert row["loss"] == pytest.approx(out.loss.item(), rel=1e-5)
    assert row["loss"] - row["ce"] > 0.1                           # the z term is visible at this weight
    loads = [st.tokens_per_expert.double() for _, st in out.router]
    assert len(loads) > 1 and len({round(float(l.max() / l.mean()), 9) for l in loads}) > 1
    assert row["load_max"] == pytest.approx(max(float(l.max() / l.mean()) for l in loads), rel=1e-9)
    assert len(t.opt.param_groups) == 2 and all(g["lr"] == 1e-3 for g in t.opt.param_groups)   # decay and no-decay


def test_load_max_pools_every_micro_batch(tmp_path):
    """With grad_accum 2, load_max is the global batch's busiest expert against the mean (tokens per expert summed
    over both micro-batches), not the last micro-batch's."""
    t = T.Trainer(tiny_model(), tiny_train(grad_accum=2), T.SyntheticData(64), tmp_path / "r")
    idx, tgt, doc = T.SyntheticData(64).train_batch(0, 4, 32)
    with torch.no_grad():
        halves = [t.gpt.run(idx[r], tgt[r], doc[r]) for r in (slice(0, 2), slice(2, 4))]
    per_half = [[st.tokens_per_expert.double() for _, st in out.router] for out in halves]
    pooled = [a + b for a, b in zip(*per_half)]
    want = max(float(l.max() / l.mean()) for l in pooled)
    last = max(float(l.max() / l.mean()) for l in per_half[1])
    assert abs(want - last) > 1e-3                                 # the two readings differ on this batch
    assert t.step(0, 0, 1e-3)["load_max"] == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("loop", [dict(), dict(schedule="per_layer"), dict(part="attn"), dict(parallel=True)])
def test_load_is_labelled_by_layer_and_visit_in_plan_order(loop):
    """The objective's and forward_backward's load: {"L{layer}.v{visit}": (E,)} per MoE visit, in the plan's order
    (the looped middle layers twice), so a per-layer reading needs no reconstruction."""
    from loop import plan
    cfg = tiny_model(loop=LoopConfig(start=1, length=2, n_loops=2, **loop))
    gpt = GPT(cfg)
    idx, tgt, doc = T.SyntheticData(64).train_batch(0, 4, 32)
    want = [f"L{v.layer}.v{v.visit}" for v in plan(cfg.n_layer, cfg.loop) if v.mlp]
    if not loop:
        assert want == ["L0.v0", "L1.v0", "L2.v0", "L1.v1", "L2.v1", "L3.v0"]
    with torch.no_grad():
        load = T.Objective(gpt)(idx, tgt, doc)[4]
    assert list(load) == want and all(t.sum() == 4 * 32 * cfg.top_k for t in load.values())
    summed = T.forward_backward(T.Objective(gpt), cfg, idx, tgt, doc, T.step_scale(tgt), accum=2)[1]
    assert list(summed) == want and all(torch.equal(summed[k], load[k].float()) for k in want)
    assert T.Objective(GPT(tiny_model(n_experts=0)))(idx, tgt, doc)[4] == {}   # dense: no load


def test_a_looped_model_without_the_baselines_control_is_said(tmp_path, capsys):
    """S of a looped model is measured at its Baseline's scale (SMELT Eq. 1): without meta["control"] the Trainer
    says, before training, that it falls back to the model's own dense control; with one it says nothing."""
    T.Trainer(tiny_model(), tiny_train(), T.SyntheticData(64), tmp_path / "a")
    assert "its own dense control" in capsys.readouterr().err
    control = tiny_model(loop=LoopConfig(), n_experts=2)
    T.Trainer(tiny_model(), tiny_train(), T.SyntheticData(64), tmp_path / "b", {"control": control})
    assert "own dense control" not in capsys.readouterr().err


def test_flops_ctx_with_the_models_block_size_is_checked_once_it_is_known(tmp_path):
    """block_size 0 means the model's: a flops_ctx is accepted by the config and checked by the Trainer against
    the model's block_size (32 here)."""
    T.TrainConfig(flops_ctx=16.0).validate()
    t = T.Trainer(tiny_model(), tiny_train(block_size=0, flops_ctx=16.0), T.SyntheticData(64), tmp_path / "ok")
    assert t.tc.block_size == 32 and t.flops_ctx == 16.0
    with pytest.raises(ValueError, match=r"flops_ctx must be <= block_size \(32\), got 40.0"):
        T.Trainer(tiny_model(), tiny_train(block_size=0, flops_ctx=40.0), T.SyntheticData(64), tmp_path / "bad")


def test_wsd_schedule_without_warmup_starts_at_the_peak():
    """warmup_steps=0: every stable step at lr, a branch decaying from lr to the floor."""
    tc = T.TrainConfig(lr=0.5, min_lr_frac=0.2, warmup_steps=0, stable_steps=8, branch_steps=[4, 8], decay_steps=2)
    assert [T.lr_at(tc, s) for s in range(8)] == [0.5] * 8
    assert [T.lr_at(tc, 4 + j, branch=4) for j in range(2)] == pytest.approx([0.3, 0.1])


def test_metrics_rows_tokens_and_ce_mean_over_the_steps_since_the_last_row(tmp_path, monkeypatch):
    """log_interval=2: each metrics row's tokens = step x batch x block, ce_mean = mean of the per-step ce since the
    previous row (ce_steps of them), ce = the row's own step."""
    ces, step = [], T.Trainer.step

    def rec(self, *a, **kw):
        row = step(self, *a, **kw)
        ces.append(row["ce"])
        return row
    monkeypatch.setattr(T.Trainer, "step", rec)
    T.train(tiny_model(), tiny_train(log_interval=2, branch_steps=[6], ckpt_interval=0), T.SyntheticData(64),
            str(tmp_path / "r"))
    m = read_jsonl(tmp_path / "r" / "metrics.jsonl")
    assert [r["step"] for r in m] == [2, 4, 6, 8] and len(ces) == 8
    for r in m:
        window = ces[r["step"] - 2:r["step"]]
        assert r["tokens"] == r["step"] * 4 * 32 and r["ce_steps"] == 2 and r["ce"] == window[-1]
        assert r["ce_mean"] == pytest.approx(sum(window) / 2, rel=1e-12)


def test_weight_decay_on_matrices_not_on_norms_embeddings_or_loop_mixing():
    cfg = tiny_model(loop=LoopConfig(start=1, length=2, n_loops=2, adapter="matrix", adapter_rank=2))
    gpt = GPT(cfg)
    decay, keep = T.decay_split(gpt)
    names = [n for n, _ in gpt.named_parameters()]
    assert sorted(decay + keep) == sorted(names)
    for n in ("tok_emb.weight", "norm_f.weight", "blocks.0.attn_norm.weight", "blocks.1.mlp_norm.weight"):
        assert n in keep, n
    for n in ("lm_head.weight", "blocks.0.attn.wq.weight", "blocks.0.mlp.w_in", "blocks.0.mlp.w_out",
              "blocks.0.mlp.router.weight"):
        assert n in decay, n
    adapters = [n for n in names if ".adapters." in n]
    assert adapters and all((n in keep) == n.endswith(".M") for n in adapters)
    # the groups are wired: with zero gradients AdamW only decays, p <- p * (1 - lr * wd)
    opt = T.make_optimizer(gpt, T.TrainConfig(lr=1.0, weight_decay=0.5))
    before = {n: p.detach().clone() for n, p in gpt.named_parameters()}
    for p in gpt.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for n, p in gpt.named_parameters():
        torch.testing.assert_close(p.detach(), before[n] * (0.5 if n in decay else 1.0))


def test_fused_adamw_on_cpu_agrees_with_the_for_loop_reference():
    """make_optimizer uses fused AdamW on CPU (train.adamw_impl); fed the same gradients, its parameters stay within
    float rounding of torch's plain for-loop AdamW over the same groups, weight decay and schedule."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, block_size=16, n_layer=4, d_model=32, n_head=2, n_kv_head=1, head_dim=16,
                      d_ff=32, n_experts=4, top_k=2, loop=LoopConfig(start=1, length=2, n_loops=2))
    fast, ref = GPT(cfg), GPT(cfg)
    ref.load_state_dict(fast.state_dict())
    tc = T.TrainConfig(lr=3e-3, weight_decay=0.1)
    assert T.adamw_impl(torch.device("cpu")) == "fused"
    opt = T.make_optimizer(fast, tc)
    assert all(g["fused"] for g in opt.param_groups)
    groups = [{"params": [dict(ref.named_parameters())[n] for n in names], "weight_decay": wd}
              for names, wd in zip(T.decay_split(ref), (tc.weight_decay, 0.0))]
    opt_ref = torch.optim.AdamW(groups, lr=tc.lr, betas=(tc.beta1, tc.beta2), eps=tc.eps, foreach=False)
    idx = torch.randint(0, 64, (2, 16))
    for step in range(5):
        fast.zero_grad(), ref.zero_grad()
        fast.run(idx, idx).loss.backward()
        for p, q in zip(fast.parameters(), ref.parameters()):
            q.grad = p.grad.clone()
        for o in (opt, opt_ref):
            for g in o.param_groups:
                g["lr"] = tc.lr * (step + 1) / 5
            o.step()
        for (n, p), q in zip(fast.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)


def test_effective_doc_length_matches_budget_convention():
    docs = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1], [0] * 8])   # documents of length 4, 4 and 8
    assert data_mod.effective_doc_length(docs[:1]) == pytest.approx(4.0)
    assert data_mod.effective_doc_length(docs[1:]) == pytest.approx(8.0)


def test_train_config_rejects_bad_fields():
    with pytest.raises(ValueError, match="branch_steps"):
        T.TrainConfig(stable_steps=5, branch_steps=[6]).validate()
    with pytest.raises(ValueError, match=r"max\(branch_steps\) must be stable_steps=5, got 3"):
        T.TrainConfig(stable_steps=5, branch_steps=[2, 3])   # steps 4-5 would never train
    with pytest.raises(ValueError, match="batch_size=6 must be divisible"):
        T.TrainConfig(batch_size=6, grad_accum=4).validate()


# ----------------------------------------------------------------------------------------
# End to end

def test_stable_run_and_branches_write_results_metrics_and_checkpoints(straight):
    rows, run_dir, steps = straight
    cfg, tc = tiny_model(), tiny_train()
    assert [r["branch_step"] for r in rows] == [3, 6]
    assert read_jsonl(run_dir / "results.jsonl") == json.loads(json.dumps(rows))
    F = budget.flops_per_token(cfg, 16.0)
    N = budget.count_params(cfg)["blocks"]
    ctl = budget.dense_control(cfg)
    for r in rows:
        assert r["arch"] == "smelt" and r["scale"] == "toy" and r["sparsity_label"] == "test"
        assert r["D"] == (r["branch_step"] + 2) * 4 * 32
        assert r["F"] == F and r["F_ctx"] == 16.0 and r["C"] == F * r["D"] and r["N"] == N
        assert r["S"] == pytest.approx(budget.sparsity(F, N, budget.flops_per_token(ctl, 16.0),
                                                       budget.count_params(ctl)["blocks"]))
        assert set(r["val_loss_by_source"]) == {"synthetic0", "synthetic1"}
        assert set(r["val_loss_by_domain"]) == {"code", "prose"}
        lo, hi = sorted(r["val_loss_by_source"].values())
        assert lo < r["val_loss"] < hi < math.log(64) + 1.0        # token-weighted mean of the sources
        assert r["config"] == cfg.to_dict() and r["wall_s"] > 0
    # decay data is fresh: batches after the whole stable run, the same for every branch; each branch
    # runs when the stable run reaches its fork, then the stable run resumes from the fork checkpoint
    assert steps == [0, 1, 2, 6, 7, 3, 4, 5, 6, 7]
    m = read_jsonl(run_dir / "metrics.jsonl")
    stable = [r for r in m if r["branch"] is None]
    assert [r["step"] for r in stable] == [1, 2, 3, 4, 5, 6]
    need = {"step", "tokens", "lr", "loss", "ce", "aux", "z", "grad_norm", "tokens_per_s", "eta_s", "load_max"}
    assert all(need <= set(r) and math.isfinite(r["loss"]) for r in m)
    assert stable[-1]["loss"] < stable[0]["loss"]                  # it learns
    for b in (3, 6):
        dec = [r for r in m if r["branch"] == b]
        assert [r["step"] for r in dec] == [b + 1, b + 2] and dec[-1]["lr"] == 0.0
    assert [r["lr"] for r in stable] == [T.lr_at(tc, s) for s in range(6)]
    # a finished run keeps no resume checkpoint, one weights-only endpoint per branch, and ckpt.pt
    assert not (run_dir / "ckpt").exists()
    assert sorted(os.listdir(run_dir)) == [".lock", "ckpt.pt", "config.json", "endpoints", "metrics.jsonl",
                                           "results.jsonl"]
    assert sorted(os.listdir(run_dir / "endpoints")) == ["branch_0000003.pt", "branch_0000006.pt"]
    for r in rows:
        ep = checkpoint.load_checkpoint(run_dir / r["endpoint"], cfg, tc)
        assert r["endpoint"] == f"endpoints/branch_{r['branch_step']:07d}.pt" and set(ep) == {"model", "meta"}
        assert ep["meta"]["kind"] == "endpoint" and ep["meta"]["model"] == cfg.to_dict()
        assert ep["meta"]["branch"] == r["branch_step"] and ep["meta"]["step"] == r["branch_step"] + 2
        assert ep["meta"]["tokens"] == r["D"] and ep["meta"]["train"]["lr"] == tc.lr
        assert ep["model"].keys() == GPT(cfg).state_dict().keys()
    cj = json.loads((run_dir / "config.json").read_text())
    assert cj["model"] == cfg.to_dict() and cj["train"]["branch_steps"] == [3, 6]
    # RUN_DIR/ckpt.pt is a byte copy of the longest branch's endpoint, loadable by eval.load_model
    assert (run_dir / "ckpt.pt").read_bytes() == (run_dir / "endpoints" / "branch_0000006.pt").read_bytes()
    import eval as ev
    final, _ = ev.load_model(run_dir)
    end, meta = checkpoint.load_weights(run_dir)
    assert meta["branch"] == 6 and all(torch.equal(final.state_dict()[k], v) for k, v in end.items())


def test_a_run_directory_refuses_a_rebuilt_dataset(tmp_path):
    """config.json records the sha256 of the data's shards: resuming (or re-running) a run directory on data whose
    shards differ (a source skipped before is now present, say) is refused before any step, naming it."""
    import checkpoint
    from checks import CheckpointError
    run_dir = tmp_path / "r"
    T.Trainer(tiny_model(), tiny_train(stable_steps=2, branch_steps=[2], decay_steps=1), T.SyntheticData(64),
              run_dir).run()
    stored = json.loads((run_dir / "config.json").read_text())["data_sha256"]
    assert stored == checkpoint.data_fingerprint(T.SyntheticData(64)) != checkpoint.data_fingerprint(T.SyntheticData(32))
    other = T.Trainer(tiny_model(), tiny_train(stable_steps=2, branch_steps=[2], decay_steps=1), T.SyntheticData(32),
                      run_dir)
    with pytest.raises(CheckpointError, match=r"describes another run: data_sha256: stored .* shards differ"):
        other.run()


def test_rerun_of_finished_run_skips_training(straight):
    rows, run_dir, _ = straight
    before = (run_dir / "metrics.jsonl").read_text()
    data = RecordingData(64)
    again = T.train(tiny_model(), tiny_train(), data, str(run_dir), {"scale": "toy", "sparsity_label": "test"})
    assert again == json.loads(json.dumps(rows)) and data.steps == []
    assert (run_dir / "metrics.jsonl").read_text() == before
    assert len(read_jsonl(run_dir / "results.jsonl")) == 2


def test_resume_after_crash_is_bit_for_bit(straight, tmp_path):
    rows, run_dir, _ = straight
    meta = {"scale": "toy", "sparsity_label": "test"}
    with pytest.raises(RuntimeError, match="simulated crash"):   # dies in the stable run after branch 3
        T.train(tiny_model(), tiny_train(), CrashingData(4, 64), str(tmp_path), meta)
    # kept: only the fork point branch 6 resumes from (branch 3 is finished: row + endpoint)
    assert os.listdir(tmp_path / "ckpt") == ["stable_0000003.pt"]
    assert [r["branch_step"] for r in read_jsonl(tmp_path / "results.jsonl")] == [3]
    resumed = T.train(tiny_model(), tiny_train(), T.SyntheticData(64), str(tmp_path), meta)
    drop = lambda rs: [{k: v for k, v in r.items() if k != "wall_s"} for r in rs]
    assert drop(resumed) == drop(rows)                             # val losses equal exactly
    assert strip_timing(read_jsonl(tmp_path / "metrics.jsonl")) == strip_timing(read_jsonl(run_dir / "metrics.jsonl"))
    for name in ("branch_0000003.pt", "branch_0000006.pt"):
        a, _ = checkpoint.load_weights(run_dir / "endpoints" / name)
        b, _ = checkpoint.load_weights(tmp_path / "endpoints" / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------------------------------
# Checkpoint safety and divergence

def test_corrupt_and_mismatched_checkpoints_are_named(straight, tmp_path):
    _, run_dir, _ = straight
    src = run_dir / "endpoints" / "branch_0000003.pt"
    with pytest.raises(checks.CheckpointError, match=r"model\.d_model: stored 32, this run 48") as e:
        checkpoint.load_checkpoint(src, tiny_model(d_model=48), tiny_train())
    assert str(src) in str(e.value)
    with pytest.raises(checks.CheckpointError, match=r"train\.lr: stored 0\.01, this run 0\.02"):
        checkpoint.load_checkpoint(src, tiny_model(), tiny_train(lr=0.02))
    # a run interrupted after branch 3, its one checkpoint (the fork branch 6 needs) then truncated:
    # resuming names that file
    run = tmp_path / "run"
    with pytest.raises(RuntimeError, match="simulated crash"):
        T.train(tiny_model(), tiny_train(), CrashingData(3, 64), str(run))
    bad = run / "ckpt" / "stable_0000003.pt"
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])
    with pytest.raises(checks.CheckpointError, match="truncated or corrupt") as e:
        T.train(tiny_model(), tiny_train(), T.SyntheticData(64), str(run))
    assert str(bad) in str(e.value)
    with pytest.raises(checks.CheckpointError, match=r"config\.json.*model\.n_layer: stored 4, this run 3"):
        T.train(tiny_model(n_layer=3, loop=LoopConfig(start=1, length=1, n_loops=2)), tiny_train(),
                T.SyntheticData(64), str(run))


@dataclass
class UpgradedConfig(ModelConfig):
    """ModelConfig after a `git pull`: one more field, whose default is the old behaviour."""
    router: str = "softmax"


def test_a_run_resumes_after_a_defaulted_field_is_added(straight, tmp_path):
    """A run directory written before a config field existed resumes bit-exactly once it does; another value of
    that field is refused by name (the stored run lacks it: it ran with the default)."""
    rows, run_dir, _ = straight
    meta = {"scale": "toy", "sparsity_label": "test"}
    with pytest.raises(RuntimeError, match="simulated crash"):
        T.train(tiny_model(), tiny_train(), CrashingData(4, 64), str(tmp_path), meta)
    assert "router" not in checks.read_json(tmp_path / "config.json")["model"]
    with pytest.raises(checks.CheckpointError, match=r"model\.router: stored 'softmax', this run 'sigmoid'"):
        T.train(UpgradedConfig(**tiny_model().to_dict(), router="sigmoid"), tiny_train(), T.SyntheticData(64),
                str(tmp_path), meta)
    resumed = T.train(UpgradedConfig(**tiny_model().to_dict()), tiny_train(), T.SyntheticData(64), str(tmp_path), meta)
    drop = lambda rs: [{k: v for k, v in r.items() if k not in ("wall_s", "config", "control")} for r in rs]
    assert drop(resumed) == drop(rows)                             # val losses equal exactly
    assert resumed[1]["config"] == {**rows[1]["config"], "router": "softmax"}
    for name in ("branch_0000003.pt", "branch_0000006.pt"):
        a, _ = checkpoint.load_weights(run_dir / "endpoints" / name)
        b, _ = checkpoint.load_weights(tmp_path / "endpoints" / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    old = checkpoint.load_checkpoint(run_dir / "endpoints" / "branch_0000003.pt", UpgradedConfig(**tiny_model().to_dict()),
                                     tiny_train())
    assert "router" not in old["meta"]["model"]                    # an endpoint from before the field still loads


def test_needed_checkpoints_by_hand():
    """Retention keeps, per pending branch, its own latest checkpoint, else the latest stable one at or before
    its fork (the fork step itself included); a finished run keeps none."""
    need = checkpoint.needed_checkpoints
    stable = {(None, 4), (None, 8)}
    assert need(stable, [8]) == {(None, 8)}                        # the fork checkpoint at exactly b
    assert need(stable, [6]) == {(None, 4)}                        # the latest before the fork
    assert need(stable, [2]) == set()                              # nothing before it: start over
    assert need(stable | {(8, 9)}, [8]) == {(8, 9)}                # a branch's own checkpoint wins
    assert need(stable | {(8, 9), (8, 10)}, [4, 8]) == {(None, 4), (8, 10)}
    assert need(stable | {(8, 9)}, []) == set()


# a valid other value of every trajectory field of tiny_train()
OTHER_TRAJECTORY = {"lr": 0.02, "min_lr_frac": 0.1, "warmup_steps": 1, "stable_steps": 8, "decay_steps": 3,
                    "batch_size": 2, "block_size": 16, "weight_decay": 0.0, "beta1": 0.8, "beta2": 0.99, "eps": 1e-6,
                    "grad_clip": 2.0, "seed": 1}


@pytest.mark.parametrize("field", checkpoint.TRAJECTORY)
def test_every_trajectory_field_is_checked_on_resume(straight, field):
    """A checkpoint made with another value of any checkpoint.TRAJECTORY field (the seed too) is refused, naming it."""
    assert set(OTHER_TRAJECTORY) == set(checkpoint.TRAJECTORY)
    _, run_dir, _ = straight
    src = run_dir / "endpoints" / "branch_0000003.pt"
    stored = getattr(tiny_train(), field)
    with pytest.raises(checks.CheckpointError, match=rf"train\.{field}: stored {stored!r}, this run"):
        checkpoint.load_checkpoint(src, tiny_model(), tiny_train(**{field: OTHER_TRAJECTORY[field]},
                                                                 **({"branch_steps": [3, 8]} if field == "stable_steps" else {})))


def test_atomic_save_keeps_the_old_file_when_writing_fails(tmp_path, monkeypatch):
    path = tmp_path / "c.pt"
    checks.atomic_save({"x": torch.ones(3)}, path)

    def dying_save(obj, f):
        f.write(b"PK\x03\x04 half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(OSError, match="disk full"):
        checks.atomic_save({"x": torch.zeros(3)}, path)
    monkeypatch.undo()
    assert torch.equal(torch.load(path, weights_only=True)["x"], torch.ones(3))
    assert os.listdir(tmp_path) == ["c.pt"]


def test_divergence_stops_and_keeps_last_good_checkpoint(tmp_path, monkeypatch):
    calls = {"n": 0}
    forward = T.Objective.forward

    def poisoned(self, idx, targets, doc_ids):   # the 3rd training forward returns NaN
        out = forward(self, idx, targets, doc_ids)
        if torch.is_grad_enabled():
            calls["n"] += 1
            if calls["n"] == 3:
                return (out[0] * float("nan"),) + out[1:]
        return out

    monkeypatch.setattr(T.Objective, "forward", poisoned)
    tc = tiny_train(stable_steps=4, branch_steps=[4], ckpt_interval=1)
    with pytest.raises(checkpoint.DivergenceError, match=r"non-finite loss nan .* optimizer step 3 .*stable_0000002\.pt"):
        T.train(tiny_model(), tc, T.SyntheticData(64), str(tmp_path))
    ck = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert ck == ["stable_0000002.pt"]                              # superseded step 1 removed, no step 3
    good = checkpoint.load_checkpoint(tmp_path / "ckpt" / "stable_0000002.pt", tiny_model(), tc)
    assert all(torch.isfinite(v).all() for v in good["model"].values())
    monkeypatch.undo()                                              # the same run dir then resumes and finishes
    rows = T.train(tiny_model(), tc, T.SyntheticData(64), str(tmp_path))
    assert [r["branch_step"] for r in rows] == [4] and math.isfinite(rows[0]["val_loss"])


# ----------------------------------------------------------------------------------------
# Multi-process on CPU: torchrun with gloo

CLI = ["--data", "synthetic", "--vocab-size", "64", "--stable-steps", "3", "--branch-steps", "3",
       "--decay-steps", "1", "--warmup-steps", "1", "--batch-size", "4", "--block-size", "32",
       "--log-interval", "1", "--eval-tokens", "128", "--lr", "1e-2", "--device", "cpu"]


# Under torchrun, before the FSDP CLI run: a run that dies at training batch 2 after a full checkpoint at
# step 2 (finished runs keep none), so the test can resume a 2-rank FSDP checkpoint in one process.
CRASH_THEN_CLI = """
import gc
import sys
sys.path.insert(0, {root!r})
import torch
import train as T
from checks import read_json
from model import ModelConfig

class Crash(T.SyntheticData):
    def train_batch(self, step, *a, **kw):
        if step == 2:
            raise RuntimeError("simulated crash")
        return super().train_batch(step, *a, **kw)

torch.distributed.init_process_group("gloo")   # joined here, so train() leaves it for T.main
cfg = ModelConfig.from_dict(read_json({model!r}))
tc = T.TrainConfig(lr=1e-2, warmup_steps=1, stable_steps=3, branch_steps=[3], decay_steps=1, batch_size=4,
                   block_size=32, log_interval=1, eval_tokens=128, ckpt_interval=2, flops_ctx=16.0, device="cpu",
                   fsdp=True)
try:
    T.train(cfg, tc, Crash(64), {crashed!r})
except RuntimeError as e:
    assert "simulated crash" in str(e), e
gc.collect()   # free the crashed run's FSDP modules (cyclic garbage) now, not in interpreter teardown
T.main(sys.argv[1:])
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """torchrun with 2 ranks, launched side by side: DDP with 2 micro-batches of 1 row per rank (no_sync
    path) and FSDP2 with 1 micro-batch of 2 rows (after a crashed FSDP run, CRASH_THEN_CLI); and the
    single-process reference (1 x 4 rows, through the CLI entry point, run meanwhile in this process)."""
    d = tmp_path_factory.mktemp("cli")
    # aux_loss_coef = 0: the load-balancing loss is a per-batch statistic, so it alone would differ
    # between 1 x 4 rows and 2 x 2 rows; everything else must agree
    (d / "model.json").write_text(tiny_model(aux_loss_coef=0.0).to_json())
    (d / "crash_then_cli.py").write_text(CRASH_THEN_CLI.format(root=ROOT, model=str(d / "model.json"),
                                                               crashed=str(d / "fsdp-crashed")))
    args = ["--model-json", str(d / "model.json"), *CLI]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    script = {"ddp": "train.py", "fsdp": str(d / "crash_then_cli.py")}
    procs = {mode: subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", script[mode], *args,
         "--out-dir", str(d / mode), *(["--fsdp"] if mode == "fsdp" else ["--grad-accum", "2"])],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for mode in ("ddp", "fsdp")}
    try:
        ref_rows = T.main([*args, "--out-dir", str(d / "one")])
        logs = {mode: p.communicate(timeout=300)[0] for mode, p in procs.items()}
    finally:
        for p in procs.values():
            p.kill() if p.poll() is None else None
    return d, ref_rows, {mode: (p.returncode, logs[mode]) for mode, p in procs.items()}


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_torchrun_two_ranks_match_one_process(runs, mode):
    d, ref_rows, status = runs
    rc, log = status[mode]
    assert rc == 0, log[-5000:]
    out = d / mode
    ref, got = read_jsonl(d / "one" / "metrics.jsonl"), read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in got] == [r["step"] for r in ref] == [1, 2, 3, 4]
    for a, b in zip(ref, got):
        for k in ("loss", "ce", "z", "grad_norm", "lr", "load_max"):
            assert abs(a[k] - b[k]) < 1e-5, (k, a, b)
    rows = read_jsonl(out / "results.jsonl")
    assert len(rows) == 1 and abs(rows[0]["val_loss"] - ref_rows[0]["val_loss"]) < 1e-5
    assert 1.0 < rows[0]["F_ctx"] <= 32                              # measured document length
    # the 2-rank endpoint is a full state dict with the same weights
    name = "endpoints/branch_0000003.pt"
    ref_ck, _ = checkpoint.load_weights(d / "one" / name)
    ck, meta = checkpoint.load_weights(out / name)
    assert ck.keys() == ref_ck.keys() == GPT(tiny_model()).state_dict().keys() and meta["step"] == 4
    for k, v in ck.items():
        torch.testing.assert_close(v, ref_ck[k], rtol=0, atol=1e-5)
    assert not (out / "ckpt").exists()                              # no resume checkpoint survives the run
    if mode == "fsdp":   # a 2-rank FSDP resume checkpoint (gathered full state) resumes in one process
        path = d / "fsdp-crashed" / "ckpt" / "stable_0000002.pt"
        tc = T.TrainConfig.from_dict({**json.loads(checks.load_file(path)["meta"])["train"], "fsdp": False})
        trainer = T.Trainer(tiny_model(aux_loss_coef=0.0), tc, T.SyntheticData(64), d / f"{mode}-resume")
        assert trainer.load(path) == 2
        assert trainer.opt.state_dict()["state"][0]["exp_avg"].abs().sum() > 0


@pytest.mark.parametrize("error,caught", [(RuntimeError, RuntimeError), (checkpoint.DivergenceError, SystemExit)])
def test_a_crashing_cli_run_frees_its_trainer_before_the_process_group_goes(tmp_path, monkeypatch, error, caught):
    """Under a process group, train.main drops the crash's frames (they hold the Trainer and its DDP / FSDP model)
    so the model is freed while the group lives, not in interpreter teardown (where it aborted a torchrun rank);
    a divergence too, which train.main turns into a one-line exit (the DivergenceError stays its context)."""
    import gc
    import traceback
    import torch.distributed as dist
    alive = []

    def crash(self):
        raise error("simulated crash")

    def destroy(real=dist.destroy_process_group):
        alive.append(sum(type(o) is T.Trainer for o in gc.get_objects()))
        real()
    monkeypatch.setattr(T.Trainer, "run", crash)
    monkeypatch.setattr(dist, "destroy_process_group", destroy)
    (tmp_path / "model.json").write_text(tiny_model().to_json())
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        with pytest.raises(caught, match="simulated crash") as err:
            T.main(["--model-json", str(tmp_path / "model.json"), *CLI, "--out-dir", str(tmp_path / "run")])
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert alive == [0] and not dist.is_initialized()
    told = err.value if caught is error else err.value.__context__
    assert any(f.name == "crash" for f in traceback.extract_tb(told.__traceback__))   # the traceback still says where
