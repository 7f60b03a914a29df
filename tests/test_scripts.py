"""The experiment scripts run end to end on the smoke preset and write the JSON they promise.

A representative subset runs in-process through main(argv) with --steps 4 (span sweep, adapters,
PLT with the RMS ratio, decode latency with a 4-token prompt); every script answers --help; one
script runs as `python scripts/NAME.py` from the repo root to check the sys.path plumbing.
The rest (depth / loop-count sweeps, ladder, downstream, probes, schedules) share common.py
with these and are run by hand: `python scripts/NAME.py --preset smoke --steps 4`.
"""
from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ["span_sweep", "depth_sweep", "loop_count_sweep", "scaling_ladder", "downstream", "probe_runs",
           "howto_schedules", "howto_adapters", "howto_plt", "decode_latency"]
sys.path.insert(0, str(ROOT / "scripts"))


@pytest.fixture(autouse=True)
def _keep_threads():
    """The smoke preset pins torch to one thread; give the rest of the session its own setting back."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def run(name: str, tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / name
    result = importlib.import_module(name).main(["--preset", "smoke", "--out", str(out), *extra])
    on_disk = json.loads((out / "results.json").read_text())
    assert on_disk["script"] == name and on_disk["preset"] == "smoke"
    assert (out / "table.md").read_text().startswith("|")
    assert on_disk["rows"] == json.loads(json.dumps(result["rows"], default=float))
    return on_disk


def finite(*xs) -> bool:
    return all(isinstance(x, (int, float)) and math.isfinite(x) for x in xs)


@pytest.mark.parametrize("name", SCRIPTS)
def test_help(name, capsys):
    with pytest.raises(SystemExit) as e:
        importlib.import_module(name).main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "--preset" in text and "--steps" in text and "--out" in text


def test_runs_from_repo_root():
    p = subprocess.run([sys.executable, "scripts/span_sweep.py", "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "Table 3.3" in p.stdout


def test_span_sweep(tmp_path):
    r = run("span_sweep", tmp_path, "--steps", "4")
    spans = [row["span"] for row in r["rows"]]
    L = r["rows"][0]["n_layer"]
    assert spans == list(range(0, L + 1, 2)) and spans[-1] == L      # 0 (Baseline) .. full stack
    assert r["steps"] == 4 and r["train"]["stable_steps"] == 4
    for row in r["rows"]:
        assert finite(row["val_loss"], row["flops_ratio"], row["params_ratio"], row["kv_ratio"])
        assert row["effective_layers"] == L + row["span"]              # two passes over the span
        if row["span"]:                                               # matched to the Baseline (SMELT 3.2)
            assert abs(row["flops_ratio"] - 1) < 0.1 and abs(row["params_ratio"] - 1) < 0.05
    assert all(Path(f).is_file() for f in r["figures"])


def test_howto_adapters(tmp_path):
    r = run("howto_adapters", tmp_path, "--steps", "4", "--loops", "2")
    rows = {(row["loops"], row["adapter"]): row for row in r["rows"]}
    assert set(rows) == {(1, "-"), (2, "none"), (2, "lora"), (2, "matrix"), (2, "softmax")}
    assert rows[(2, "none")]["adapter_params"] == 0
    assert 0 < rows[(2, "lora")]["adapter_params"] < rows[(2, "matrix")]["adapter_params"]   # + the L x L mixing
    for row in r["rows"]:
        assert finite(row["val_loss"], row["overhead_pct"])


def test_howto_plt(tmp_path):
    variants = ["no_loop", "sequential", "unshifted", "plt_add", "plt_add_kv", "plt_norm_gate"]
    r = run("howto_plt", tmp_path, "--steps", "4", "--variants", *variants, "--ratio-tokens", "128")
    rows = {row["variant"]: row for row in r["rows"]}
    assert list(rows) == variants
    assert rows["plt_add_kv"]["kv_ratio"] < rows["plt_add"]["kv_ratio"] == rows["sequential"]["kv_ratio"]
    for v, row in rows.items():
        assert finite(row["val_loss"], *row["rms_ratio"])
        assert len(row["rms_ratio"]) == row["loops"] and all(x > 0 for x in row["rms_ratio"])


def test_decode_latency(tmp_path):
    r = run("decode_latency", tmp_path, "--steps", "2", "--prompt", "4")
    rows = {row["model"]: row for row in r["rows"]}
    assert {"unlooped", "sequential_2loop", "plt_2loop", "plt_2loop_kv_shared"} <= set(rows)
    for name in ("unlooped", "sequential_2loop", "plt_2loop"):
        assert finite(rows[name]["ms_per_token"]) and rows[name]["ms_per_token"] > 0
    assert rows["sequential_2loop"]["kv_bytes_per_token"] > rows["unlooped"]["kv_bytes_per_token"]
    assert rows["plt_2loop_kv_shared"]["kv_bytes_per_token"] < rows["plt_2loop"]["kv_bytes_per_token"]
    assert finite(r["plt_ratio"], r["sequential_ratio"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit; on a GPU the script runs for minutes")
def test_gpu_check_script_refuses_clearly_without_a_gpu(tmp_path):
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True,
                       env={**os.environ, "OUT": str(tmp_path),
                            "PATH": str(Path(sys.executable).parent) + ":" + os.environ.get("PATH", "")},
                       timeout=120)
    assert r.returncode == 2 and "no CUDA device" in r.stderr
