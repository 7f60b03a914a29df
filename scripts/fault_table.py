"""The fault campaign's table (issue 26): every @pytest.mark.fault("<class>") case, counted per class.

  python scripts/fault_table.py [--tests DIR] [-- PYTEST_ARGS ...]

Runs `python -m pytest -m fault DIR` with this module as a plugin (`-p fault_table`) that records each
item's fault class and outcome, then prints class | tried | good | bad (bad: failed in any phase, or
xfailed), and the skipped and bad cases by name. The rules: docs/faults.md, "The table".
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

CLASSES = ("kills", "corruption", "disk", "cli", "api", "numerical", "concurrency")
HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:   # the repo root, for checks.py (imported by the script, not the plugin)
    sys.path.insert(0, str(HERE.parent))


def pytest_addoption(parser) -> None:
    parser.addoption("--fault-table-json", default=None, help="write each fault case's class and outcome here")


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "fault(cls): a fault-campaign case (scripts/fault_table.py)")
    if config.getoption("fault_table_json"):
        config.pluginmanager.register(Recorder(config.getoption("fault_table_json")), "fault_table_recorder")


class Recorder:
    """Collects {nodeid: {"class", "outcome"}} over the run's phases and writes it at the session's end."""

    def __init__(self, path: str):
        self.path, self.cases = path, {}

    def pytest_collection_finish(self, session) -> None:
        for item in session.items:
            m = item.get_closest_marker("fault")
            if m is None:
                continue
            cls = m.args[0] if m.args else None
            if cls not in CLASSES:
                raise pytest.UsageError(f"{item.nodeid}: fault class {cls!r} is not one of {', '.join(CLASSES)}")
            self.cases[item.nodeid] = {"class": cls, "outcome": "passed"}

    def pytest_runtest_logreport(self, report) -> None:
        case = self.cases.get(report.nodeid)
        if case is None or case["outcome"] == "failed":              # the first failure of an item stands
            return
        if report.failed:
            case["outcome"] = "failed"
        elif report.skipped:
            case["outcome"] = "xfailed" if hasattr(report, "wasxfail") else "skipped"

    def pytest_sessionfinish(self, session) -> None:
        Path(self.path).write_text(json.dumps(self.cases, indent=1))


def run_campaign(tests: str | Path, pytest_args: list[str] = ()) -> dict[str, dict]:
    """{nodeid: {"class", "outcome"}} of every fault case under `tests` (a pytest run in a subprocess)."""
    tests = Path(tests).resolve()
    if not tests.exists():
        raise SystemExit(f"fault_table: {tests} does not exist")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cases.json"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
        cmd = [sys.executable, "-m", "pytest", "-m", "fault", "-p", "fault_table", "-p", "no:cacheprovider",
               f"--fault-table-json={out}", str(tests), *pytest_args]
        proc = subprocess.run(cmd, env=env, cwd=HERE.parent, capture_output=True, text=True)   # pytest.ini applies
        if proc.returncode not in (0, 1, 5) or not out.exists():     # 1: some cases failed; 5: none selected
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
            raise SystemExit(f"fault_table: pytest exited {proc.returncode} without a result:\n{tail}")
        return json.loads(out.read_text())


def table(cases: dict[str, dict]) -> str:
    """The markdown table, per class and in all, then the skipped and the bad cases by name."""
    tried = {k: [c["outcome"] for c in cases.values() if c["class"] == k and c["outcome"] != "skipped"]
             for k in CLASSES}
    tried["all"] = [o for got in tried.values() for o in got]
    rows = ["| class | tried | good | bad |", "|---|---|---|---|"] + [
        f"| {k} | {len(got)} | {got.count('passed')} | {len(got) - got.count('passed')} |" for k, got in tried.items()]
    skipped = sorted(k for k, c in cases.items() if c["outcome"] == "skipped")
    bad = sorted((k, c["outcome"]) for k, c in cases.items() if c["outcome"] in ("failed", "xfailed"))
    rows += [""] + [f"skipped (not tried): {k}" for k in skipped] + [f"bad ({o}): {k}" for k, o in bad]
    return "\n".join(rows).rstrip() + "\n"


def build_parser() -> argparse.ArgumentParser:
    import checks
    ap = checks.parser(__doc__)
    ap.add_argument("--tests", default=str(HERE.parent / "tests"), help="test directory or file")
    checks.add_out_dir(ap, "also write the table to DIR/faults.md (default: print only)")
    return ap


def main(argv: list[str] | None = None) -> str:
    argv = sys.argv[1:] if argv is None else list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args = build_parser().parse_args(argv[:cut])
    cases = run_campaign(args.tests, argv[cut + 1:])
    if not cases:
        raise SystemExit(f"fault_table: no @pytest.mark.fault cases under {args.tests}")
    text = table(cases)
    print(text, end="")
    if args.out_dir:
        Path(args.out_dir).mkdir(parents=True, exist_ok=True)
        (Path(args.out_dir) / "faults.md").write_text(text)
    return text


if __name__ == "__main__":
    import checks
    checks.run_main(main)
