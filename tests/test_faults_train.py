"""Fault cases of the training loop (issue 26): finite divergence, metrics.jsonl damage and kills, bad values
refused up front; and the one validation pass per endpoint that eval reuses (issue 25), padded to one shape (24)."""
from __future__ import annotations

import json
import math
import shutil
import sys

import pytest
import torch

import checkpoint
import eval as ev
from lab import evaluate
import checks
import train as T
import eval as validation
from toys import tiny_model, tiny_train

pytestmark = pytest.mark.usefixtures("one_thread")




def strip(rows):
    return [{k: v for k, v in r.items() if k not in ("tokens_per_s", "eta_s", "wall_s", "mfu")} for r in rows]


# ---------------------------------------------------------------------------- validation computed once

def test_stored_report_is_the_one_eval_uses(finished, monkeypatch):
    rows, run = finished
    data = T.SyntheticData(64)
    stored = validation.stored_report(run, 6, data, 32, 128)
    assert stored is not None and stored["loss"] == rows[-1]["val_loss"] == rows[-1]["val"]["loss"]
    assert stored["by_source"] == rows[-1]["val_loss_by_source"] and set(stored["by_length"]) <= {1, 2, 4, 8, 16, 32}
    # recomputed from the endpoint by eval, the same numbers to float rounding
    model, _ = ev.load_model(run / "endpoints" / "branch_0000006.pt")
    fresh = ev.val_loss_report(model, data, 32, 4, 128)
    assert fresh["loss"] == pytest.approx(stored["loss"], rel=1e-5) and fresh["tokens"] == stored["tokens"]
    assert fresh["by_length"].keys() == stored["by_length"].keys()
    for b in fresh["by_length"]:
        assert fresh["by_length"][b] == pytest.approx(stored["by_length"][b], rel=1e-5)
    # evaluate_endpoint takes the stored report and runs no validation of its own
    calls = []
    monkeypatch.setattr(evaluate, "val_loss_report", lambda *a, **k: calls.append(1))
    rec = evaluate.evaluate_endpoint(run / "endpoints" / "branch_0000006.pt", tasks=(), data=data, enc=object(),
                                     val_tokens_per_source=128, log=lambda m: None)
    assert rec["val"]["loss"] == stored["loss"] and not calls
    # other settings (a different token cap) are not reused
    assert validation.stored_report(run, 6, data, 32, 256) is None
    assert validation.stored_report(run, 5, data, 32, 128) is None


def test_padded_batches_give_the_same_numbers():
    torch.manual_seed(0)
    model = T.GPT(tiny_model())
    data = T.SyntheticData(64)
    seen = []
    def nll(i, t, d):
        seen.append(i.shape)
        return validation.token_nll(model(i, doc_ids=d)[0].float(), t)
    padded = validation.val_loss_by(nll, data, 32, 3, 160)     # 5 contexts per source: batches 3 + 2 (padded)
    assert set(seen) == {(3, 32)}
    exact = validation.val_loss_by(nll, data, 32, 1, 160)      # one context per batch: nothing to pad
    assert padded["tokens"] == exact["tokens"] and padded["loss"] == pytest.approx(exact["loss"], rel=1e-6)
    b = validation.pad_batch((torch.ones(2, 4, dtype=torch.long),) * 3, 3)
    assert b[1][2].tolist() == [-1] * 4 and b[0][:2].tolist() == [[1] * 4] * 2
    with pytest.raises(ValueError, match="exceeds batch_size=1"):
        validation.pad_batch((torch.ones(2, 4),), 1)


# ---------------------------------------------------------------------------- finite divergence

@pytest.mark.fault("numerical")
def test_finite_blow_up_stops_with_no_results_row(tmp_path):
    with pytest.raises(checkpoint.DivergenceError, match=r"diverged at optimizer step \d+ .*above ln V \+ 1") as e:
        T.train(tiny_model(), tiny_train(lr=30.0, warmup_steps=0, branch_steps=[6], ckpt_interval=1),
                T.SyntheticData(64), str(tmp_path))
    assert "last good checkpoint" in str(e.value)
    assert not (tmp_path / "results.jsonl").exists() and not (tmp_path / "ckpt.pt").exists()
    for p in (tmp_path / "ckpt").glob("*.pt"):   # what is kept is finite and below the limit when it was written
        assert not checkpoint._nonfinite(checks.load_file(p)["model"])


@pytest.mark.fault("numerical")
def test_cli_divergence_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit, match=r"^train\.py: .*diverged at optimizer step \d+ .*ln V \+ 1"):
        T.main(["--preset", "smoke-dense", "--data", "synthetic", "--vocab-size", "64", "--lr", "30",
                "--warmup-steps", "0", "--stable-steps", "6", "--decay-steps", "2", "--batch-size", "4",
                "--block-size", "32", "--log-interval", "1", "--eval-tokens", "128", "--out-dir", str(tmp_path)])
    assert not (tmp_path / "results.jsonl").exists()


@pytest.mark.fault("numerical")
def test_guard_needs_a_sustained_window(finished):
    _, run = finished
    t = T.Trainer(tiny_model(), tiny_train(), T.SyntheticData(64), run)
    limit = checkpoint.divergence_limit(64)
    t.trail = [(None, 1, limit + 5), (None, 2, limit - 1)]
    t._guard(3, None, limit + 5, None)                       # two high rows, one low between: no stop
    t._guard(4, 3, limit + 5, None)                          # the branch's history: stable rows <= 3, then its own
    with pytest.raises(checkpoint.DivergenceError, match="step 5 of the branch 3"):
        t._guard(5, 3, limit + 2, None)
    with pytest.raises(checkpoint.DivergenceError, match="validation loss nan"):
        t._guard(5, None, None, math.nan)
    # the stable run blew up after step 3; branch 3 forked before it and reads only stable rows <= 3
    t.trail = [(None, s, limit - 1) for s in (1, 2, 3)] + [(None, s, limit + 5) for s in (4, 5)]
    t._guard(6, 3, limit + 5, None)                          # branch 3: low, low, high: no stop


# ---------------------------------------------------------------------------- metrics.jsonl

@pytest.mark.fault("kills")
def test_row_is_written_before_its_checkpoint(tmp_path, monkeypatch):
    """A kill right after a checkpoint lands cannot lose that step's row: the row is on disk first."""
    seen = []
    real = T.Trainer.save
    def save(self, branch, step):
        rows = checks.read_jsonl(self.run_dir / "metrics.jsonl")
        seen.append(any(r["step"] == step and r["branch"] == branch for r in rows))
        return real(self, branch, step)
    monkeypatch.setattr(T.Trainer, "save", save)
    T.train(tiny_model(), tiny_train(), T.SyntheticData(64), str(tmp_path))
    assert seen and all(seen)


@pytest.mark.fault("corruption")
@pytest.mark.parametrize("damage", ["flip", "zeros_tail", "zero_filled"])
def test_damaged_metrics_rows_are_quarantined_not_lost(finished, tmp_path, damage, capsys):
    rows, run = finished
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    path = copy / "metrics.jsonl"
    raw = path.read_bytes()
    lines = raw.split(b"\n")
    if damage == "flip":            # one byte of an old row
        lines[1] = lines[1].replace(b'"ce"', b'"cf"', 1)
        path.write_bytes(b"\n".join(lines))
    elif damage == "zeros_tail":    # a crash that left a zero-filled block after the last row
        path.write_bytes(raw + b"\x00" * 4096)
    else:                           # the whole file zero-filled
        path.write_bytes(b"\x00" * len(raw))
    again = T.train(tiny_model(), tiny_train(), T.SyntheticData(64), str(copy))   # resumes, no advice to follow
    assert [r["val_loss"] for r in again] == [r["val_loss"] for r in rows]
    out = capsys.readouterr().out
    kept = checks.read_jsonl(path)
    assert (copy / "metrics.jsonl.damaged").exists() and "moved to metrics.jsonl.damaged" in out
    if damage == "flip":
        assert "line(s) [2]" in out and len(kept) == len(lines) - 2      # only the damaged row is set aside
    elif damage == "zeros_tail":
        assert strip(kept) == strip(checks.read_jsonl(run / "metrics.jsonl"))
    else:
        assert (copy / "metrics.jsonl.damaged").read_bytes() == b"\x00" * len(raw) + b"\n"   # kept aside, not cut


@pytest.mark.fault("corruption")
def test_intact_last_row_without_newline_is_kept(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(checks.jsonl_line({"a": 1}) + checks.jsonl_line({"a": 2}).rstrip("\n"))
    assert checkpoint.quarantine_damaged_rows(path) == []
    assert [r["a"] for r in checks.read_jsonl(path)] == [1, 2] and path.read_text().endswith("\n")


# ---------------------------------------------------------------------------- values refused up front

@pytest.mark.fault("cli")
@pytest.mark.parametrize("args,msg", [
    (["--seed", str(2**32)], "seed must lie in [0, 2**32 - 1]"),
    (["--seed", "-1"], "seed must be >= 0"),
    (["--batch-size", "200000000"], "batch_size=200000000: one training step needs at least"),
    (["--fsdp"], "fsdp=True needs torchrun"),
    (["--dist-backend", "nccl"], "dist_backend='nccl' needs torchrun"),
])
def test_cli_values_refused_by_name_before_training(args, msg, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit):
        T.main(["--preset", "smoke-dense", "--data", "synthetic", "--out-dir", str(tmp_path / "r"), *args])
    assert msg in capsys.readouterr().err
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


@pytest.mark.fault("api")
@pytest.mark.parametrize("model_kw,msg", [
    (dict(rope_theta=1e-300), "rope_theta=1e-300 makes the rotary angles non-finite"),
    (dict(aux_loss_coef=1e308), "aux_loss_coef=1e[+]?308 overflows"),
    (dict(z_loss_coef=1e300), "z_loss_coef=1e[+]?300 overflows"),
])
def test_api_values_refused_before_training(model_kw, msg, tmp_path):
    with pytest.raises(ValueError, match=msg):
        T.train(tiny_model(**model_kw), tiny_train(), T.SyntheticData(64), str(tmp_path))
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.fault("api")
def test_api_seed_and_block_size_refused():
    with pytest.raises(ValueError, match="seed must lie in"):
        tiny_train(seed=2**32)
    with pytest.raises(ValueError, match="block_size must be an integer >= 1"):
        T.SyntheticData(64).train_batch(0, 4, 0)


def test_machine_settings_name_what_a_run_uses():
    import train
    ms = train.machine_settings()
    assert ms["torch_threads"] == torch.get_num_threads() and ms["cpus"] >= 1 and ms["cpu_dtype"] == "fp32"
    assert json.loads(json.dumps(ms)) == ms   # printable in a summary, and read back as it was
