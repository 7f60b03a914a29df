"""Fault injection and bad inputs (issue 16), as tables of (input or fault, expected outcome).

Library level, CPU, under a minute. Each row is one case the issue's fault-injection pass found
accepted silently, ending in a deep torch / numpy error, or corrupting a run:
  * bad config values (NaN, infinity, bool-vs-int, float sizes, negative values, unknown keys, devices)
    -> ValueError naming the field / key;
  * bad forward / generate inputs -> ValueError naming the argument;
  * unparseable or edited JSON files -> an error naming the file and line;
  * flipped bytes anywhere in a checkpoint -> CheckpointError naming the file;
  * a corrupt ckpt.pt -> rebuilt from the endpoint it copies; a torn last row -> cut and recomputed;
    stale temp files -> removed at the next write;
  * non-finite model / optimizer state -> never saved (DivergenceError);
  * a second writer on a run directory -> RunLockedError; the lock dies with its holder;
  * a killed reproduce.py -> its pool_run workers die too;
  * crashes at several points -> the resumed run equals the uninterrupted one bit for bit;
  * the disk estimate -> within 20 % of what a run really keeps (peak and final).
  * probes (issue 26): unmatched pairs, bad values, a damaged probes.json.
"""
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import checkpoint
import checks
import data as data_mod
from checks import JSONFileError
import train as T
from lab import costs
from toys import tiny_model, tiny_train
from model import GPT, ModelConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAN, INF = float("nan"), float("inf")



pytestmark = pytest.mark.usefixtures("one_thread")




# ----------------------------------------------------------------------------------------
# Bad config values: ValueError naming the field

MODEL_BAD = [
    (dict(rope_theta=0.0), "rope_theta"), (dict(rope_theta=-1.0), "rope_theta"), (dict(rope_theta=NAN), "rope_theta"),
    (dict(norm_eps=-1.0), "norm_eps"), (dict(aux_loss_coef=NAN), "aux_loss_coef"), (dict(z_loss_coef=-1.0), "z_loss_coef"),
    (dict(tie_embeddings="no"), "tie_embeddings"), (dict(router_renormalize=1), "router_renormalize"),
    (dict(init_std=-0.02), "init_std"), (dict(init_std=INF), "init_std"),
    (dict(n_experts=2.5), "n_experts"), (dict(n_experts=True), "n_experts"), (dict(d_model=64.0), "d_model"),
    (dict(vocab_size=-1), "vocab_size"), (dict(block_size=INF), "block_size"), (dict(head_dim=7.5), "head_dim"),
    (dict(top_k=NAN), "top_k"), (dict(moe_impl=3), "moe_impl"), (dict(attn_backend="tpu"), "attn_backend"),
    (dict(d_model=None), "d_model"), (dict(rope_theta=True), "rope_theta"),
    (dict(loop=dict(start=1, length=2, n_loops=NAN)), "n_loops"),
    (dict(loop=dict(start=1, length=2, n_loops=2.0)), "n_loops"),
    (dict(loop=dict(start=1, length=2, n_loops=2, residual_scale="false")), "residual_scale"),
    (dict(loop=dict(start=1, length=2, n_loops=2, kv_window=-1)), "kv_window"),
    (dict(loop=dict(start=1, length=2, n_loops=2, adapter_rank=0, adapter="lora")), "adapter_rank"),
    (dict(loop=dict(start=1, length=2, n_loop=2)), r"unknown key\(s\) \['n_loop'\]"),
    (dict(loop="middle"), "loop must be a LoopConfig"),
]

TRAIN_BAD = [
    (dict(lr=INF), "lr"), (dict(lr=NAN), "lr"), (dict(lr=0.0), "lr"), (dict(beta1=1.5), "beta1"),
    (dict(beta2=-0.1), "beta2"), (dict(beta2=1.0), "beta2"), (dict(eps=0.0), "eps"), (dict(eps=-1e-8), "eps"),
    (dict(eps=NAN), "eps"), (dict(eps=0.0, beta2=0.0), "eps"), (dict(weight_decay=NAN), "weight_decay"),
    (dict(weight_decay=INF), "weight_decay"), (dict(grad_clip=NAN), "grad_clip"), (dict(grad_clip=-1.0), "grad_clip"),
    (dict(flops_ctx=NAN), "flops_ctx"), (dict(warmup_steps=NAN), "warmup_steps"), (dict(stable_steps=2.5), "stable_steps"),
    (dict(min_lr_frac=NAN), "min_lr_frac"), (dict(batch_size=True), "batch_size"), (dict(seed=-1), "seed"),
    (dict(branch_steps=[2.5]), r"branch_steps\[0\]"), (dict(branch_steps=3), "branch_steps"),
    (dict(device="tpu"), "device"), (dict(device="cuda:x"), "device"), (dict(compile="yes"), "compile"),
    (dict(fsdp=1), "fsdp"), (dict(dtype="fp16"), "dtype"), (dict(dist_backend="tcp"), "dist_backend"),
    (dict(out_dir=""), "out_dir"), (dict(out_dir=5), "out_dir"), (dict(log_interval=0), "log_interval"),
    (dict(lr=True), "lr"), (dict(stable_steps=None), "stable_steps"),
]


@pytest.mark.fault("api")
@pytest.mark.parametrize("kw,field", MODEL_BAD, ids=[f"model-{i}" for i in range(len(MODEL_BAD))])
def test_model_config_refuses(kw, field):
    with pytest.raises(ValueError, match=field):
        tiny_model(**kw)


@pytest.mark.fault("api")
@pytest.mark.parametrize("kw,field", TRAIN_BAD, ids=[f"train-{i}" for i in range(len(TRAIN_BAD))])
def test_train_config_refuses(kw, field):
    with pytest.raises(ValueError, match=rf"TrainConfig: .*{field}"):
        tiny_train(**kw)


@pytest.mark.fault("api")
def test_config_dicts_name_unknown_keys_and_accept_numpy_scalars():
    import numpy as np
    d = tiny_model().to_dict()
    with pytest.raises(ValueError, match=r"ModelConfig: unknown key\(s\) \['n_expert'\]"):
        ModelConfig.from_dict({**d, "n_expert": 4})
    with pytest.raises(ValueError, match="expected a JSON object"):
        ModelConfig.from_dict([1, 2])
    with pytest.raises(ValueError, match=r"TrainConfig: unknown key\(s\) \['learning_rate'\]"):
        T.TrainConfig.from_dict({"learning_rate": 1e-3})
    cfg = ModelConfig.from_dict({**d, "d_model": np.int64(32), "init_std": np.float32(0.02)})
    assert type(cfg.d_model) is int and type(cfg.init_std) is float and json.loads(cfg.to_json())["d_model"] == 32
    assert ModelConfig.from_dict(json.loads(tiny_model().to_json())) == tiny_model()
    tc = tiny_train()
    assert T.TrainConfig.from_dict(json.loads(json.dumps(vars(tc)))) == tc


@pytest.mark.fault("api")
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_without_gpu_is_refused_before_training(tmp_path):
    with pytest.raises(ValueError, match=r"TrainConfig.device cuda: torch sees no CUDA device"):
        T.train(tiny_model(), tiny_train(device="cuda"), T.SyntheticData(64), str(tmp_path))
    assert not any(tmp_path.iterdir())


# ----------------------------------------------------------------------------------------
# Bad forward / generate inputs

def _gpt():
    torch.manual_seed(0)
    return GPT(tiny_model()).eval()


IDX = torch.zeros(1, 4, dtype=torch.long)
FORWARD_BAD = [
    (dict(idx=IDX, targets=torch.tensor([[1, 2, 3, 64]])), r"targets must lie in \[0, vocab_size=64\) or be -1"),
    (dict(idx=IDX, targets=torch.tensor([[1, 2, -2, 3]])), "targets must lie in"),
    (dict(idx=IDX, targets=torch.zeros(1, 4)), "targets must be an integer tensor"),
    (dict(idx=IDX, doc_ids=torch.zeros(1, 4)), "doc_ids must be an integer tensor"),
    (dict(idx=torch.zeros(0, 4, dtype=torch.long)), "at least one sequence"),
    (dict(idx=torch.zeros(2, 0, dtype=torch.long)), "at least one sequence"),
    (dict(idx=torch.zeros(1, 4)), "idx must be an integer tensor"),
]
GENERATE_BAD = [
    (dict(max_new_tokens=-1), "max_new_tokens"), (dict(max_new_tokens=2.0), "max_new_tokens"),
    (dict(max_new_tokens=2, temperature=-1.0), "temperature"), (dict(max_new_tokens=2, temperature=NAN), "temperature"),
    (dict(max_new_tokens=2, top_k=0), "top_k"), (dict(max_new_tokens=2, top_k=True), "top_k"),
]


@pytest.mark.fault("api")
@pytest.mark.parametrize("kw,msg", FORWARD_BAD, ids=[f"forward-{i}" for i in range(len(FORWARD_BAD))])
def test_forward_refuses(kw, msg):
    with pytest.raises(ValueError, match=msg):
        _gpt()(**kw)


@pytest.mark.fault("api")
@pytest.mark.parametrize("kw,msg", GENERATE_BAD, ids=[f"generate-{i}" for i in range(len(GENERATE_BAD))])
def test_generate_refuses(kw, msg):
    with pytest.raises(ValueError, match=msg):
        _gpt().generate(IDX, **kw)
    with pytest.raises(ValueError, match="prompt"):
        _gpt().generate(torch.zeros(1, 0, dtype=torch.long), 2)


@pytest.mark.fault("api")
def test_valid_edge_inputs_still_work():
    m = _gpt()
    _, loss = m(IDX, targets=torch.tensor([[-1, -1, 3, 63]]), doc_ids=torch.zeros(1, 4, dtype=torch.int32))
    assert math.isfinite(loss.item())
    assert m.generate(IDX, 0).shape == (1, 4) and m.generate(IDX, 3, temperature=0, top_k=1).shape == (1, 7)


# ----------------------------------------------------------------------------------------
# JSON files: errors name the file and line

@pytest.mark.fault("corruption")
def test_unparseable_json_names_file_and_line(tmp_path, finished):
    rows, run = finished
    bad = tmp_path / "model.json"
    bad.write_text(tiny_model().to_json()[:-30])
    with pytest.raises(checks.JSONFileError, match=rf"{bad}:\d+:\d+: not valid JSON.*truncated"):
        checks.read_json(bad)
    with pytest.raises(ValueError, match=str(bad)):                  # --model-json
        T.main(["--model-json", str(bad), "--data", "synthetic", "--out-dir", str(tmp_path / "x")])
    with pytest.raises(ValueError, match=r"model\.json: ModelConfig: unknown key\(s\) \['n_expert'\]"):
        bad.write_text(json.dumps({**tiny_model().to_dict(), "n_expert": 2}))
        T.main(["--model-json", str(bad), "--data", "synthetic", "--out-dir", str(tmp_path / "x")])
    cfg = tmp_path / "run" / "config.json"                          # a run's config.json
    cfg.parent.mkdir()
    cfg.write_text((run / "config.json").read_text()[:200])
    with pytest.raises(ValueError, match=rf"{cfg}:\d+:\d+: not valid JSON"):
        T.train(tiny_model(), tiny_train(), T.SyntheticData(64), str(cfg.parent))
    man = tmp_path / "data" / "manifest.json"                       # a data manifest
    man.parent.mkdir()
    man.write_text('{"files": {\n  "train.bin": {"bytes": 1,\n')
    with pytest.raises(ValueError, match=rf"{man}:3:\d+: not valid JSON"):
        data_mod.TokenData(man.parent)


@pytest.mark.fault("corruption")
def test_json_errors_say_truncated_only_when_the_input_ended_early(tmp_path):
    """The "truncated" hint is given when the parser ran out of input (an interrupted write), not for a
    malformed file that is complete; read_json with keys names the missing ones."""
    for text in ('{"a": 1, "b":', "[1, 2", '{"a": "unterminated'):
        with pytest.raises(JSONFileError, match=r"^x\.json:1:\d+: not valid JSON: .* \(truncated"):
            checks.parse_json(text, "x.json")
    with pytest.raises(JSONFileError, match=r"^x\.json:1:\d+: not valid JSON: [^(]*$"):
        checks.parse_json('{"a": 1,, "b": 2}', "x.json")
    p = tmp_path / "plain.json"
    p.write_text(json.dumps({"a": 1}))
    assert checks.read_json(p, ("a",)) == {"a": 1}
    with pytest.raises(JSONFileError, match=r"plain\.json: missing key\(s\) \['b', 'c'\]"):
        checks.read_json(p, ("a", "b", "c"))


@pytest.mark.parametrize("fault,msg", [
    ("truncate_middle", r"results\.jsonl:1:\d+: not valid JSON"),
    ("truncate_second", r"results\.jsonl:2:\d+: not valid JSON"),
    ("edit_value", r"results\.jsonl:2: row content differs from its sha256"),
    ("drop_hash", r"results\.jsonl:1: missing key\(s\) \['sha256'\]"),
    ("missing_keys", r"results\.jsonl:1: missing key\(s\) \['config', 'train'\]"),
])
@pytest.mark.fault("corruption")
def test_damaged_results_rows_are_named(finished, tmp_path, fault, msg):
    rows, run = finished
    lines = (run / "results.jsonl").read_text().splitlines(keepends=True)
    if fault == "truncate_middle":
        lines[0] = lines[0][:100] + "\n"
    elif fault == "truncate_second":
        lines[1] = lines[1][:100] + "\n"
    elif fault == "edit_value":
        lines[1] = lines[1].replace(f'"val_loss": {rows[1]["val_loss"]}', '"val_loss": 1.0')
    elif fault == "drop_hash":
        r = json.loads(lines[0])
        del r["sha256"]
        lines[0] = json.dumps(r) + "\n"
    else:
        lines[0] = checks.jsonl_line({k: v for k, v in rows[0].items() if k not in ("config", "train")})
    (tmp_path / "results.jsonl").write_text("".join(lines))
    with pytest.raises(checks.CheckpointError, match=msg):
        checks.read_jsonl(tmp_path / "results.jsonl", keys=("branch_step", "config", "train"))


@pytest.mark.fault("kills")
def test_torn_last_rows_are_cut_and_recomputed(finished, tmp_path):
    """A crash during an append leaves a partial last line: the next run cuts it and carries on."""
    import shutil
    rows, run = finished
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    res = (copy / "results.jsonl").read_text()
    (copy / "results.jsonl").write_text(res[:len(res) - 50])        # branch 6's row torn
    met = (copy / "metrics.jsonl").read_text()
    (copy / "metrics.jsonl").write_text(met + '{"phase": "decay", "bra')
    again = T.train(tiny_model(), tiny_train(), T.SyntheticData(64), str(copy))
    drop = lambda rs: [{k: v for k, v in r.items() if k != "wall_s"} for r in rs]
    assert drop(again) == drop(rows)
    assert len(checks.read_jsonl(copy / "metrics.jsonl")) == len(checks.read_jsonl(run / "metrics.jsonl"))


# ----------------------------------------------------------------------------------------
# Checkpoints: every flipped byte is caught; ckpt.pt rebuilt; stale temp files removed

@pytest.mark.fault("corruption")
def test_flipped_bytes_anywhere_in_a_checkpoint_are_caught(finished, tmp_path):
    _, run = finished
    good = (run / "endpoints" / "branch_0000003.pt").read_bytes()
    size = len(good)
    offsets = sorted({0, 1, size - 1, size - 40, size - 70, *range(0, size, max(1, size // 97))})
    path = tmp_path / "flipped.pt"
    for off in offsets:
        b = bytearray(good)
        b[off] ^= 0xFF
        path.write_bytes(bytes(b))
        with pytest.raises(checks.CheckpointError, match=str(path)):
            checks.load_file(path)
    for cut in (size - 1, size - checks._TRAILER_LEN, size // 2, 10):   # truncated
        path.write_bytes(good[:cut])
        with pytest.raises(checks.CheckpointError, match="truncated or corrupt"):
            checks.load_file(path)
    path.write_bytes(good)
    assert checks.load_file(path)["model"].keys() == GPT(tiny_model()).state_dict().keys()
    assert len(offsets) >= 100
    # a plain torch.save file (no hash) is refused; the trailer does not disturb plain torch.load
    torch.save({"model": {}, "meta": "{}"}, tmp_path / "plain.pt")
    with pytest.raises(checks.CheckpointError, match="no valid content hash"):
        checks.load_file(tmp_path / "plain.pt")
    assert torch.load(run / "ckpt.pt", weights_only=True)["model"].keys() == GPT(tiny_model()).state_dict().keys()


@pytest.mark.fault("corruption")
def test_corrupt_ckpt_pt_is_rebuilt_from_its_endpoint(finished, tmp_path):
    import shutil
    _, run = finished
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    ep = (copy / "endpoints" / "branch_0000006.pt").read_bytes()
    for damage in (lambda b: b[:len(b) // 3], lambda b: b[:1000] + bytes([b[1000] ^ 1]) + b[1001:]):
        (copy / "ckpt.pt").write_bytes(damage(ep))
        sd, meta = checkpoint.load_weights(copy)                               # served and rebuilt on load
        assert meta["branch"] == 6 and (copy / "ckpt.pt").read_bytes() == ep
        (copy / "ckpt.pt").write_bytes(damage(ep))
        T.train(tiny_model(), tiny_train(), T.SyntheticData(64), str(copy))   # and by re-running the run
        assert (copy / "ckpt.pt").read_bytes() == ep
    (copy / "endpoints" / "branch_0000006.pt").write_bytes(ep[:-5])  # the source itself damaged: named
    with pytest.raises(checks.CheckpointError, match="branch_0000006.pt"):
        T.export_final(copy)


@pytest.mark.fault("kills")
def test_stale_temp_files_are_removed_at_the_next_write(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()                                                      # a pid that no longer runs
    stale = [tmp_path / f"x.pt.tmp{dead.pid}", tmp_path / f"ckpt.pt.tmp{dead.pid}"]
    live = tmp_path / "y.pt.tmp1"                                    # pid 1 runs: another writer's, kept
    for p in (*stale, live):
        p.write_bytes(b"half a checkpoint")
    checks.atomic_save({"model": {}, "meta": "{}"}, tmp_path / "x.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.pt", "y.pt.tmp1"]


# ----------------------------------------------------------------------------------------
# Only finite state is saved

@pytest.mark.fault("numerical")
def test_non_finite_optimizer_state_is_never_saved(tmp_path, monkeypatch):
    """Poison AdamW's second moment after step 3 (the fork point's save): the save is refused and the
    message's last good checkpoint is finite."""
    step = T.Trainer.step

    def poisoned(self, i, data_step, lr):
        row = step(self, i, data_step, lr)
        if i == 2:
            st = self.opt.state[next(iter(self.opt.state))]
            st["exp_avg_sq"].view(-1)[0] = NAN
        return row

    monkeypatch.setattr(T.Trainer, "step", poisoned)
    with pytest.raises(checkpoint.DivergenceError, match=r"refusing to write .*stable_0000003\.pt.*NaN or infinity.*"
                                                r"optimizer\.state\..*exp_avg_sq.*last good checkpoint is "
                                                r".*stable_0000002\.pt"):
        T.train(tiny_model(), tiny_train(ckpt_interval=1), T.SyntheticData(64), str(tmp_path))
    assert os.listdir(tmp_path / "ckpt") == ["stable_0000002.pt"]
    ck = checks.load_file(tmp_path / "ckpt" / "stable_0000002.pt")
    assert not checkpoint._nonfinite(ck["model"]) and not checkpoint._nonfinite(ck["optimizer"])


@pytest.mark.fault("numerical")
def test_non_finite_weights_are_never_saved_as_an_endpoint(tmp_path, monkeypatch):
    step = T.Trainer.step

    def poisoned(self, i, data_step, lr):   # branch 3's last step leaves an infinite weight
        row = step(self, i, data_step, lr)
        if i == 4:
            with torch.no_grad():
                self.gpt.tok_emb.weight[0, 0] = INF
        return row

    monkeypatch.setattr(T.Trainer, "step", poisoned)
    with pytest.raises(checkpoint.DivergenceError, match=r"refusing to write .*branch_0000003\.pt.*tok_emb\.weight"):
        T.train(tiny_model(), tiny_train(), T.SyntheticData(64), str(tmp_path))
    assert not (tmp_path / "endpoints" / "branch_0000003.pt").exists()


# ----------------------------------------------------------------------------------------
# One writer per run directory; workers die with their parent

@pytest.mark.fault("concurrency")
def test_second_writer_is_refused_and_the_lock_dies_with_its_holder(tmp_path):
    with checks.run_lock(tmp_path):                                # another writer, same process
        with pytest.raises(checks.RunLockedError, match=rf"{tmp_path} is in use by another trainer \(pid {os.getpid()}"):
            T.train(tiny_model(), tiny_train(), T.SyntheticData(64), str(tmp_path))
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {ROOT!r})
        import checks
        with checks.run_lock({str(tmp_path)!r}):
            print("locked", flush=True)
            time.sleep(120)""")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(checks.RunLockedError, match=f"pid {holder.pid}"):
            T.train(tiny_model(), tiny_train(), T.SyntheticData(64), str(tmp_path))
        os.kill(holder.pid, signal.SIGKILL)                          # killed: the OS drops its lock
        holder.wait()
        rows = T.train(tiny_model(), tiny_train(stable_steps=3, branch_steps=[3]), T.SyntheticData(64),
                       str(tmp_path))
        assert [r["branch_step"] for r in rows] == [3]
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"      # a zombie nobody reaped yet
    except FileNotFoundError:
        return True


POOL_PARENT = """
import os, sys, time
sys.path.insert(0, {root!r})
if os.environ.get("NO_PDEATHSIG"):   # runs in the workers too (spawn re-imports this file): no prctl
    import ctypes
    _cdll = ctypes.CDLL
    def _no_libc(name, *a, **kw):
        if name is None:
            raise OSError("prctl disabled for the test")
        return _cdll(name, *a, **kw)
    ctypes.CDLL = _no_libc

def job(path):
    with open(path, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(120)

if __name__ == "__main__":
    import reproduce
    reproduce.pool_run(job, [os.path.join({d!r}, "w0"), os.path.join({d!r}, "w1")], 2)
"""


@pytest.mark.fault("kills")
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_pool_workers_die_with_a_killed_parent(tmp_path):
    """Two reproduce-like parents side by side, one with prctl(PR_SET_PDEATHSIG) and one without it (the
    portable parent-watch thread): both are killed with SIGKILL once their 2 workers run jobs."""
    parents, pids = {}, {}
    try:
        for mech in ("pdeathsig", "parent_watch"):
            d = tmp_path / mech
            d.mkdir()
            (d / "parent.py").write_text(POOL_PARENT.format(root=ROOT, d=str(d)))
            env = {**os.environ, "OMP_NUM_THREADS": "1", **({"NO_PDEATHSIG": "1"} if mech == "parent_watch" else {})}
            parents[mech] = subprocess.Popen([sys.executable, str(d / "parent.py")], env=env)
        t0 = time.time()
        while sum(map(len, pids.values())) < 4 and time.time() - t0 < 90:
            pids = {m: [int((tmp_path / m / w).read_text()) for w in ("w0", "w1")
                        if (tmp_path / m / w).exists() and (tmp_path / m / w).read_text()] for m in parents}
            time.sleep(0.2)
        assert sum(map(len, pids.values())) == 4, f"the workers did not start: {pids}"
        for p in parents.values():                                   # kill -9 reproduce.py
            p.kill()
            p.wait()
        t0 = time.time()
        while not all(_gone(p) for ps in pids.values() for p in ps) and time.time() - t0 < 10:
            time.sleep(0.1)
        assert {m: [p for p in ps if not _gone(p)] for m, ps in pids.items()} == {m: [] for m in pids}, \
            "workers outlived their parent"
    finally:
        for p in parents.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        for p in (p for ps in pids.values() for p in ps):
            if not _gone(p):
                os.kill(p, signal.SIGKILL)


# ----------------------------------------------------------------------------------------
# Crashes anywhere: the resumed run equals the uninterrupted one

class DiesAtCall(T.SyntheticData):
    """Raises on the n-th training batch request (a machine failure at that point of the run)."""

    def __init__(self, n, *a, **kw):
        super().__init__(*a, **kw)
        self.n, self.calls = n, 0

    def train_batch(self, step, *a, **kw):
        self.calls += 1
        if self.calls == self.n:
            raise RuntimeError("simulated crash")
        return super().train_batch(step, *a, **kw)


@pytest.mark.fault("kills")
@pytest.mark.parametrize("n", [2, 5, 9])   # batch requests: stable before fork 3, branch 3, branch 6
def test_crash_anywhere_resumes_bit_for_bit(finished, tmp_path, n):
    rows, run = finished
    with pytest.raises(RuntimeError, match="simulated crash"):
        T.train(tiny_model(), tiny_train(ckpt_interval=1), DiesAtCall(n, 64), str(tmp_path))
    again = T.train(tiny_model(), tiny_train(ckpt_interval=1), T.SyntheticData(64), str(tmp_path))
    drop = lambda rs: [{k: v for k, v in r.items() if k not in ("wall_s", "train")} for r in rs]
    assert drop(again) == drop(rows)
    for b in (3, 6):
        a, _ = checkpoint.load_weights(run / "endpoints" / f"branch_{b:07d}.pt")
        c, _ = checkpoint.load_weights(tmp_path / "endpoints" / f"branch_{b:07d}.pt")
        assert all(torch.equal(a[k], c[k]) for k in a)
    assert not (tmp_path / "ckpt").exists()


# ----------------------------------------------------------------------------------------
# Disk: the estimate against what a run really keeps

@pytest.mark.fault("disk")
def test_disk_estimate_within_20_percent_of_a_real_run(tmp_path, monkeypatch):
    cfg, tc = tiny_model(), tiny_train(ckpt_interval=2)
    seen = []
    write = checks._atomic_write

    def du():
        return sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file() and f.name != ".lock")

    def measured(path, fn):   # disk in use after every file written (a new checkpoint before the prune)
        write(path, fn)
        seen.append(du())

    monkeypatch.setattr(checks, "_atomic_write", measured)
    T.train(cfg, tc, T.SyntheticData(64), str(tmp_path))
    est = costs.disk_estimate(cfg, tc)
    assert abs(est["final"] / du() - 1) < 0.2, (est, du())
    assert abs(est["peak"] / max(seen) - 1) < 0.2, (est, max(seen))
    assert abs(est["endpoint"] / (tmp_path / "ckpt.pt").stat().st_size - 1) < 0.05
    assert est["peak"] >= 2 * est["full_checkpoint"]       # a fork point + the next one being written
    plan = costs.plan_disk_estimate([cfg, cfg], tc, jobs=1)
    assert plan["final"] == 2 * est["final"] and plan["peak"] == 2 * est["final"] + est["peak"] - est["final"]


@pytest.mark.fault("corruption")
def test_hashed_json_refuses_edits_and_a_damaged_cache_is_recomputed(tmp_path, capsys):
    p = tmp_path / "stage.json"
    checks.write_json(p, {"loss": 3.25, "rows": [1, 2]})
    assert checks.read_hashed_json(p, ("loss",)) == {"loss": 3.25, "rows": [1, 2]}
    p.write_text(p.read_text().replace("3.25", "2.25"))      # still valid JSON, one value lowered
    with pytest.raises(JSONFileError, match="stage.json: content differs from its sha256"):
        checks.read_hashed_json(p)
    assert checks.read_cache(p) is None and "stage.json" in capsys.readouterr().out
    p.write_text(p.read_text()[:20])                          # truncated
    with pytest.raises(JSONFileError, match="stage.json"):
        checks.read_hashed_json(p)
    assert checks.read_cache(tmp_path / "absent.json") is None


@pytest.mark.fault("corruption")
def test_a_json_file_that_is_not_an_object_or_not_text_is_named(tmp_path, capsys):
    """A hashed-JSON reader refuses, naming the file, a file whose JSON is not an object (a number, a list, a
    string) or whose bytes are not text, and read_cache recomputes each instead of crashing."""
    p = tmp_path / "stage.json"
    for text, why in [("5", "expected a JSON object, got int"), ("[1]", "expected a JSON object, got list"),
                      ('"sha256"', "expected a JSON object, got str")]:
        p.write_text(text)
        with pytest.raises(JSONFileError, match=rf"stage\.json: {why}"):
            checks.read_hashed_json(p)
        assert checks.read_cache(p) is None
        with pytest.raises(JSONFileError, match=rf"stage\.json: {why}"):
            checks.read_json(p, ("a",))
    p.write_bytes(b"\xff\xfe{\x00")
    with pytest.raises(JSONFileError, match=r"stage\.json: not a text file"):
        checks.read_json(p)
    assert checks.read_cache(p) is None and "not a text file" in capsys.readouterr().out


@pytest.mark.fault("corruption")
def test_a_hashed_file_without_model_weights_is_refused(tmp_path):
    """load_file checks more than the hash: a torch file this code wrote but that holds no 'model' weights
    or no meta['model'] is not a checkpoint, and is refused naming the file before any caller reads it."""
    for name, obj in [("no_meta_model.pt", {"model": {}, "meta": "{}"}),
                      ("no_weights.pt", {"meta": json.dumps({"model": {}})})]:
        checks.atomic_save(obj, tmp_path / name)
        with pytest.raises(checks.CheckpointError, match=rf"{tmp_path / name} lacks 'model'"):
            checks.load_file(tmp_path / name)
    checks.atomic_save({"model": {"w": torch.ones(2)}, "meta": json.dumps({"model": {}})}, tmp_path / "ok.pt")
    assert torch.equal(checks.load_file(tmp_path / "ok.pt")["model"]["w"], torch.ones(2))


@pytest.mark.fault("corruption")
def test_blank_lines_in_a_jsonl_file_are_skipped_not_an_end(tmp_path):
    """A blank line (an editor's, or a newline doubled) is skipped: every row after it is still read."""
    p = tmp_path / "results.jsonl"
    p.write_text(checks.jsonl_line({"step": 1}) + "\n  \n" + checks.jsonl_line({"step": 2}))
    assert checks.read_jsonl(p) == [{"step": 1}, {"step": 2}]


@pytest.mark.fault("corruption")
def test_hashed_json_missing_a_required_key_is_refused_and_recomputed(tmp_path, capsys):
    """An intact, hashed JSON file that lacks a key the reader needs (written by an older version) is refused
    naming the key, so read_cache recomputes it instead of handing on a record without it."""
    p = tmp_path / "stage.json"
    checks.write_json(p, {"loss": 3.25})
    with pytest.raises(JSONFileError, match=r"stage\.json: missing key\(s\) \['rows'\]"):
        checks.read_hashed_json(p, ("loss", "rows"))
    assert checks.read_cache(p, ("loss", "rows")) is None and "missing key(s) ['rows']" in capsys.readouterr().out
    assert checks.read_cache(p, ("loss",)) == {"loss": 3.25}


@pytest.mark.fault("kills")
def test_a_torn_tail_is_cut_back_to_the_last_whole_row(tmp_path):
    """repair_torn_tail keeps every whole row with its newline, so the next append starts a line of its
    own; a file that ends in a newline is left as it is."""
    p = tmp_path / "results.jsonl"
    whole = checks.jsonl_line({"branch_step": 3}) + checks.jsonl_line({"branch_step": 6})
    p.write_text(whole + '{"branch_step": 9, "va')
    assert checks.repair_torn_tail(p) and p.read_text() == whole
    with open(p, "a") as f:
        f.write(checks.jsonl_line({"branch_step": 9}))
    assert [r["branch_step"] for r in checks.read_jsonl(p)] == [3, 6, 9]
    assert not checks.repair_torn_tail(p) and not checks.repair_torn_tail(tmp_path / "absent.jsonl")


@pytest.mark.fault("concurrency")
def test_the_lock_file_names_only_the_current_holder(tmp_path):
    """The lock file is rewritten by each holder: a longer pid left by an earlier holder does not remain
    behind the current one (the second writer's message names the pid read from it)."""
    (tmp_path / ".lock").write_text("9" * 40 + "\n" + "stale\n")
    with checks.run_lock(tmp_path):
        assert (tmp_path / ".lock").read_text() == f"{os.getpid()}\n"


# ----------------------------------------------------------------------------------------
# Probes: unmatched pairs refused by the runs' configs, bad values by name, a damaged probes.json recomputed

def _probe_run(root, name, looped=True, vocab=64, seed=0, cell=("t64", "S~85%"), data="data", block=32, branch=None):
    """A run directory as train.py leaves it (config.json, ckpt.pt); the pair check reads only config.json.
    branch: the "branch_step" eval.load_model's meta gives an endpoint file (put in config.json here)."""
    import loop
    d = root / name
    d.mkdir()
    cfg = tiny_model(vocab_size=vocab, **({} if looped else {"loop": loop.LoopConfig()}))
    (d / "config.json").write_text(json.dumps({
        "model": cfg.to_dict(), "train": {"seed": seed, "block_size": block}, "data_dir": str(root / data),
        "meta": {"arch": "smelt" if looped else "baseline", "scale": cell[0], "sparsity_label": cell[1]},
        **({} if branch is None else {"branch_step": branch})}))
    (d / "ckpt.pt").write_bytes(b"")
    return str(d)


UNMATCHED = [   # (Baseline run's fields, SMELT run's fields, the reason named)
    (None, None, "one run twice"), (dict(looped=True), dict(looped=False), "swapped"),
    (dict(looped=False), dict(looped=False), "two Baselines"), (dict(looped=True), dict(looped=True), "two SMELT runs"),
    (dict(looped=False), dict(cell=("t32", "S~85%")), "cell"), (dict(looped=False), dict(data="other"), "data_dir"),
    (dict(looped=False), dict(vocab=128), "vocab_size 64 vs 128"), (dict(looped=False), dict(seed=1), "seed 0 vs 1"),
    (dict(looped=False), dict(block=16), "training block_size 32 vs 16"),
    (dict(looped=False, branch=10), dict(branch=30), "branch_step 10 vs 30"),
]


@pytest.mark.fault("api")
@pytest.mark.parametrize("base,smelt,why", UNMATCHED, ids=[u[2].split()[0] for u in UNMATCHED])
def test_probes_refuse_a_pair_that_is_not_matched(tmp_path, base, smelt, why):
    from lab import probe_pairs
    b = _probe_run(tmp_path, "b", **(base or dict(looped=False)))
    s = b if smelt is None else _probe_run(tmp_path, "s", **smelt)
    with pytest.raises(ValueError, match=rf"pair 'cell': {b} \(Baseline\) and {s} \(SMELT\) are not a matched "
                                         rf"pair: .*{why}"):
        probe_pairs.probe_pairs([("cell", b, s)], None, 64, 32)


@pytest.mark.fault("api")
@pytest.mark.parametrize("kw,name", [(dict(tokens=0), "tokens"), (dict(batch_size=2.5), "batch_size"),
                                     (dict(n_draws=True), "n_draws"), (dict(attn_topk=()), "attn_topk"),
                                     (dict(dyck_ks=(1, 0)), "dyck_ks"), (dict(block_size=33), "block_size 33 exceeds"),
                                     (dict(pairs=[("", "a", "b")]), "non-empty name"),
                                     (dict(pairs=[("x", "/nonexistent/run", "b")]), "/nonexistent/run not found")])
def test_probes_refuse_bad_values_by_name(tmp_path, kw, name):
    from lab import probe_pairs
    pairs = [("cell", _probe_run(tmp_path, "b", looped=False), _probe_run(tmp_path, "s"))]
    args = {"pairs": pairs, "data": None, "tokens": 64, "block_size": 32, **kw}
    with pytest.raises(ValueError, match=name):
        probe_pairs.probe_pairs(**args)


@pytest.mark.fault("cli")
@pytest.mark.parametrize("case,msg", [("twice", "one run twice"), ("swapped", "swapped"),
                                      ("missing", "missing_run not found"), ("tokens", "--tokens 16 is less than"),
                                      ("no_data", "no_data_here"), ("block", "block_size 48 exceeds pair 'cell'")])
def test_probes_cli_refuses_before_any_work(tmp_path, capsys, monkeypatch, case, msg):
    from lab import probe_pairs
    b, s = _probe_run(tmp_path, "b", looped=False), _probe_run(tmp_path, "s")
    pair = {"twice": [s, s], "swapped": [s, b], "missing": [b, str(tmp_path / "missing_run")]}.get(case, [b, s])
    extra = {"tokens": ["--tokens", "16"], "no_data": ["--data-dir", str(tmp_path / "no_data_here")],
             "block": ["--block-size", "48", "--data-dir", str(tmp_path / "data")]}.get(case, [])
    if case == "block":                                              # prepared data of the pair's vocabulary
        monkeypatch.setattr(data_mod, "TokenData", lambda d: type("Data", (), {"vocab_size": 64})())
    with pytest.raises(SystemExit) as e:
        probe_pairs.main(["--pair", "cell", *pair, "--out-dir", str(tmp_path / "out"), *extra])
    assert e.value.code == 2 and msg in capsys.readouterr().err
    assert not (tmp_path / "out" / "probes.json").exists()


@pytest.mark.fault("disk")
def test_probes_cli_refuses_a_file_as_out_dir(tmp_path, capsys):
    from lab import probe_pairs
    (tmp_path / "out").write_text("a file")
    with pytest.raises(SystemExit):
        probe_pairs.main(["--pair", "cell", _probe_run(tmp_path, "b", looped=False), _probe_run(tmp_path, "s"),
                     "--out-dir", str(tmp_path / "out")])
    assert f"output directory {tmp_path / 'out'} is a file" in capsys.readouterr().err


@pytest.mark.fault("corruption")
@pytest.mark.parametrize("damage", ["truncated", "edited", "unhashed", "figure_gone", "absolute_figure"])
def test_damaged_probes_json_is_named_and_recomputed(tmp_path, capsys, damage):
    from lab import probe_pairs
    path, fig = tmp_path / "probes.json", tmp_path / "figures" / "fig23.png"
    fig.parent.mkdir()
    fig.write_bytes(b"png")
    res = {"sample": {"tokens": 64}, "pairs": {"cell": {"x": 0.25}}, "claims": [], "figures": [str(fig)]}
    probe_pairs.save_result(path, res)
    assert probe_pairs.load_result(path) == res and json.loads(path.read_text())["figures"] == ["figures/fig23.png"]
    text = path.read_text()
    if damage == "truncated":
        path.write_text(text[:len(text) // 2])
    elif damage == "edited":                                         # still valid JSON, one value lowered
        path.write_text(text.replace("0.25", "0.15"))
    elif damage == "unhashed":                                       # written before probes.json was hashed
        path.write_text(json.dumps(res))
    elif damage == "figure_gone":
        fig.unlink()
    else:
        checks.write_json(path, res)                               # hashed, but an absolute figure path
    capsys.readouterr()
    assert probe_pairs.load_result(path) is None
    assert str(path) in capsys.readouterr().out


def test_fault_cases_are_counted_by_a_known_class():
    """conftest.py's hooks: `pytest -m fault --collect-only -qq` counts each class; an unknown class stops collection."""
    import types
    import conftest

    def item(cls):
        return types.SimpleNamespace(nodeid=f"t.py::test_{cls}", get_closest_marker=lambda _: pytest.mark.fault(cls).mark)
    items = [item("kills"), item("api"), item("api"), types.SimpleNamespace(get_closest_marker=lambda _: None)]
    config = types.SimpleNamespace(option=types.SimpleNamespace(markexpr="fault"))
    conftest.pytest_collection_modifyitems(config, items)
    assert conftest.pytest_report_collectionfinish(config, items) == (
        "fault cases: kills 1, corruption 0, disk 0, cli 0, api 2, numerical 0, concurrency 0, all 3")
    with pytest.raises(pytest.UsageError, match=r"t.py::test_network: fault class \('network',\) is not one of kills"):
        conftest.pytest_collection_modifyitems(config, [item("network")])


@pytest.mark.fault("api")
@pytest.mark.parametrize("kw,name", [(dict(ks=(0, 1)), "ks"), (dict(ks=()), "ks"), (dict(n_items=0), "n_items"),
                                     (dict(block_size=-5), "block_size"), (dict(n_targets=1.5), "n_targets")])
def test_dyck_prompts_refuse_bad_values_by_name(kw, name):
    from lab import dyck_probe
    with pytest.raises(ValueError, match=rf"dyck_prompts: {name} must"):
        dyck_probe.dyck_prompts(None, **{"block_size": 64, **kw})


@pytest.mark.fault("api")
def test_probes_refuse_data_of_another_vocabulary(tmp_path):
    from lab import probe_pairs
    pairs = [("cell", _probe_run(tmp_path, "b", looped=False), _probe_run(tmp_path, "s"))]
    with pytest.raises(ValueError, match=r"the data's vocabulary \(512 tokens\) is not pair 'cell''s \(64\)"):
        probe_pairs.probe_pairs(pairs, type("Data", (), {"vocab_size": 512})(), 64, 32)
