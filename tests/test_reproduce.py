"""reproduce.py: the smoke preset runs every stage end to end and a re-run skips finished work."""
import json
import time

import reproduce


def test_smoke_reproduction_end_to_end(tmp_path):
    out = tmp_path / "smoke"
    report = reproduce.main(["--preset", "smoke", "--out", str(out)])
    text = report.read_text()
    for section in ("Budget-matched ladder", "Final validation loss", "Scaling", "Downstream",
                    "Probes of the second visit", "Claims: reproduced or not"):
        assert section in text, section
    ladder = json.loads((out / "ladder.json").read_text())
    assert len(ladder) == 4 and all(c["match"]["within_tolerance"] for c in ladder)
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    plan = reproduce.PLANS["smoke"]
    assert len(rows) == 2 * len(ladder) * len(plan.branch_steps)
    assert {r["arch"] for r in rows} == {"baseline", "smelt"}
    assert all(r["val_loss"] < 6.3 for r in rows)          # below the uniform 512-token loss: it learned
    assert (out / "scaling" / "coeffs.json").exists() and (out / "probes.json").exists()
    assert (out / "figures" / "curves.png").stat().st_size > 0
    # finished runs are skipped: the second pass trains nothing and reads the stored JSON
    t0 = time.time()
    reproduce.main(["--preset", "smoke", "--out", str(out), "--skip", "scaling"])
    assert time.time() - t0 < 60
    assert [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()] == rows
