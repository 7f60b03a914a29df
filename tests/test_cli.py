"""One command-line convention across every entry point (checks.py), and bad values refused up front.

Each entry point (reproduce.py, train.py, eval.py, scaling.py, budget.py, bench.py, probes.py,
data.py and every scripts/*.py but common.py) exposes `build_parser()`; the tests build each parser
in-process (no main, nothing runs, a few seconds for all of them) and check its --help against
checks.py's rules: --out-dir for the output directory (old spellings hidden), --device defaulting to
auto and checked when parsed, every default shown exactly once, the same preset names. A table of
bad values must each be refused by argparse (exit status 2) with a message naming the option.
"""
from __future__ import annotations

import argparse
import importlib
from pathlib import Path

import pytest

import checks

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("scripts_importable")   # scripts/ on sys.path for this module only
MODULES = ["reproduce", "train", "lab.evaluate", "lab.scaling_analysis", "budget", "lab.bench", "lab.probe_pairs", "lab.corpus", "lab.hub"]
SCRIPTS = sorted(p.stem for p in (ROOT / "scripts").glob("*.py") if p.stem != "common")
ENTRY_POINTS = MODULES + SCRIPTS
RUN_PRESETS = {"smoke", "tiny", "fits", "small", "medium", "paper"}
# options without a default that need none: inputs that are given or not (no computed default to explain)
NO_DEFAULT_INPUTS = {"--run", "--pair", "--config", "--ladder", "--results", "--compare", "--baselines", "--model-json",
                     "--preset", "--data-dir", "--arch", "--scale", "--sparsity-label", "--source"}


def parser_of(name: str) -> argparse.ArgumentParser:
    return importlib.import_module(name).build_parser()


def options(ap: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Visible options by their long flag (hidden aliases and -h left out)."""
    return {a.option_strings[-1] if a.option_strings[-1].startswith("--") else a.option_strings[0]: a
            for a in ap._actions if a.option_strings and a.help is not argparse.SUPPRESS
            and not isinstance(a, argparse._HelpAction)}


def help_block(ap: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The --help lines of one option, as printed."""
    return ap._get_formatter()._format_action(action)


def test_every_script_has_a_parser():
    assert len(SCRIPTS) >= 10, SCRIPTS
    for name in ENTRY_POINTS:
        assert callable(getattr(importlib.import_module(name), "build_parser", None)), f"{name}: no build_parser()"


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_help_follows_the_convention(name):
    ap = parser_of(name)
    assert issubclass(ap.formatter_class, checks.HelpFormatter), f"{name}: not checks.HelpFormatter"
    text = ap.format_help()
    opts = options(ap)
    # the output directory is --out-dir everywhere; old spellings are hidden
    assert "--out-dir" in opts, f"{name}: no --out-dir"
    assert opts["--out-dir"].dest == "out_dir"
    for old in ("--out ", "--out\n", "--json", "--n-jobs"):
        assert old not in text, f"{name}: {old.strip()!r} shown in --help"
    # --device: one default, checked when parsed
    if "--device" in opts:
        assert opts["--device"].default == "auto" and opts["--device"].type is checks.device, name
    # every default shown, never twice
    for flag, a in opts.items():
        block = help_block(ap, a).lower()
        assert block.count("(default") <= 1 and block.count("default:") <= 1, f"{name} {flag}: two defaults\n{block}"
        flag_like = isinstance(a, (argparse._StoreTrueAction, argparse._StoreFalseAction))
        if a.required or flag_like or flag in NO_DEFAULT_INPUTS:
            continue
        assert "default" in block, f"{name} {flag}: --help does not say its default\n{block}"
    # counts are typed: no bare int options (checks.positive_int / nonneg_int / int_range instead)
    for flag, a in opts.items():
        if name != "train":   # train.py's TrainConfig ints are checked by TrainConfig.validate in main
            assert a.type is not int, f"{name} {flag}: a bare int (use checks.positive_int or checks.nonneg_int)"


def test_presets_are_one_set():
    """reproduce.py and budget.py --ladder take every run size; the scripts take the same three (grid_power every one);
    the corpus presets (data.py --preset, train.py --data) are the sizes with their own corpus."""
    import configs
    runs = set(options(parser_of("reproduce"))["--preset"].choices)
    assert runs == RUN_PRESETS
    assert set(options(parser_of("budget"))["--ladder"].choices) == RUN_PRESETS
    sized = [n for n in SCRIPTS if "--preset" in options(parser_of(n))]
    assert set(SCRIPTS) - set(sized) == {"render_notebooks"}   # the tool that has no run size
    for name in sized:   # grid_power trains nothing: it takes every plan (fits, medium, paper too)
        want = RUN_PRESETS if name == "grid_power" else {"smoke", "tiny", "small"}
        assert set(options(parser_of(name))["--preset"].choices) == want, name
    assert set(options(parser_of("lab.corpus"))["--preset"].choices) == set(configs.DATA_PRESETS) == {"smoke", "tiny", "small"}
    assert set(options(parser_of("train"))["--data"].choices) == set(configs.DATA_PRESETS) | {"synthetic"}


@pytest.mark.parametrize("name,old", [("budget", "--json"), ("lab.bench", "--json"), ("lab.scaling_analysis", "--n-jobs")])
def test_old_spellings_are_gone(name, old, capsys):
    with pytest.raises(SystemExit) as e:
        parser_of(name).parse_args([old, "2"])
    assert e.value.code == 2 and f"unrecognized arguments: {old}" in capsys.readouterr().err


def test_device_values():
    for ok in ("auto", "cpu", "cuda", "cuda:1"):
        assert checks.device(ok) == ok
    for bad in ("mps", "gpu", "cuda:x"):          # mps: untested here, and train.py's TrainConfig refuses it
        with pytest.raises(argparse.ArgumentTypeError, match="expected auto, cpu, cuda or cuda:N"):
            checks.device(bad)
    assert checks.resolve_device("cpu") == "cpu" and checks.resolve_device("auto") in ("cpu", "cuda")


def test_help_formatter_shows_lists_and_percent():
    ap = checks.parser("x")
    ap.add_argument("--a", type=int, nargs="+", default=[1, 8], help="sizes")
    ap.add_argument("--b", default="50%", help="a share")
    ap.add_argument("--c", nargs="*", default=[], help="stages")
    ap.add_argument("--d", type=int, default=3, help="three (default: three)")
    text = " ".join(ap.format_help().split())
    assert "sizes (default: 1 8)" in text and "a share (default: 50%)" in text
    assert "stages (default: none)" in text and "three (default: three)" in text and "(default: 3)" not in text


BAD = [  # (entry point, argv, the option the message must name, a fragment of the reason)
    ("lab.evaluate", ["--run", "r", "--max-items", "-1"], "--max-items", "non-negative"),
    ("lab.evaluate", ["--run", "r", "--shots", "2", "-1"], "--shots", "non-negative"),
    ("lab.evaluate", ["--run", "r", "--seeds", "0"], "--seeds", "positive"),
    ("lab.evaluate", ["--run", "r", "--batch-size", "0"], "--batch-size", "positive"),
    ("lab.evaluate", ["--run", "r", "--val-tokens", "-5"], "--val-tokens", "non-negative"),
    ("lab.evaluate", ["--run", "r", "--seeds", "two"], "--seeds", "integer"),
    ("lab.evaluate", ["--run", "r", "--tasks", "no_such_task"], "--tasks", "invalid choice"),
    ("lab.evaluate", ["--run", "r", "--device", "gpu"], "--device", "expected auto"),
    ("lab.probe_pairs", ["--pair", "p", "b", "s", "--batch-size", "0"], "--batch-size", "positive"),
    ("lab.probe_pairs", ["--pair", "p", "b", "s", "--tokens", "0"], "--tokens", "positive"),
    ("lab.probe_pairs", ["--pair", "p", "b", "s", "--dyck-items", "-1"], "--dyck-items", "positive"),
    ("lab.probe_pairs", ["--pair", "p", "b", "s", "--draws", "0"], "--draws", "positive"),
    ("lab.probe_pairs", ["--pair", "p", "b", "s", "--block-size", "-1"], "--block-size", "non-negative"),
    ("lab.probe_pairs", ["--pair", "p", "b", "s", "--device", "gpu"], "--device", "expected auto"),
    ("lab.probe_pairs", ["--tokens", "64"], "--pair", "required"),
    ("reproduce", ["--jobs", "0"], "--jobs", "positive"),
    ("reproduce", ["--preset", "huge"], "--preset", "invalid choice"),
    ("reproduce", ["--skip", "train"], "--skip", "invalid choice"),
    ("reproduce", ["--loops", "0"], "--loops", "positive"),
    ("lab.scaling_analysis", ["--bootstrap", "-1"], "--bootstrap", "non-negative"),
    ("lab.scaling_analysis", ["--jobs", "0"], "--jobs", "positive"),
    ("lab.scaling_analysis", ["--budgets", "1e21", "-1"], "--budgets", "positive"),
    ("lab.scaling_analysis", ["--budgets", "0"], "--budgets", "positive"),
    ("lab.scaling_analysis", ["--budgets", "nan"], "--budgets", "finite"),
    ("budget", ["--ladder", "huge"], "--ladder", "invalid choice"),
    ("budget", ["--ctx-len", "0"], "--ctx-len", "positive"),
    ("lab.bench", ["--train-batch", "0"], "--train-batch", "positive"),
    ("lab.bench", ["--train-preset", "huge"], "--train-preset", "invalid choice"),
    ("lab.bench", ["--device", "tpu"], "--device", "expected auto"),
    ("lab.corpus", ["--vocab-size", "100"], "--vocab-size", "[257, 50257]"),
    ("lab.corpus", ["--measure", "4096,x"], "--measure", "integer"),
    ("lab.corpus", ["--preset", "medium"], "--preset", "invalid choice"),
    ("train", ["--preset", "smoke-dense", "--branch-steps", "0"], "--branch-steps", "positive"),
    ("train", ["--preset", "smoke-dense", "--dtype", "fp16"], "--dtype", "invalid choice"),
    ("train", ["--preset", "smoke-dense", "--device", "gpu"], "--device", "expected auto"),
    ("train", ["--preset", "smoke-dense", "--data", "huge"], "--data", "invalid choice"),
    ("span_sweep", ["--steps", "0"], "--steps", "positive"),
    ("span_sweep", ["--jobs", "0"], "--jobs", "positive"),
    ("span_sweep", ["--threads", "0"], "--threads", "positive"),
    ("span_sweep", ["--seed", "-1"], "--seed", "non-negative"),
    ("span_sweep", ["--preset", "paper"], "--preset", "invalid choice"),
    ("span_sweep", ["--loops", "0"], "--loops", "positive"),
    ("depth_sweep", ["--depths", "4", "0"], "--depths", "positive"),
    ("downstream", ["--seeds", "0"], "--seeds", "positive"),
    ("downstream", ["--shots", "-1"], "--shots", "non-negative"),
    ("downstream", ["--max-items", "0"], "--max-items", "positive"),
    ("probe_runs", ["--tokens", "0"], "--tokens", "positive"),
    ("probe_runs", ["--draws", "0"], "--draws", "positive"),
    ("probe_runs", ["--batch-size", "0"], "--batch-size", "positive"),
    ("howto_plt", ["--kv-window", "0"], "--kv-window", "positive"),
    ("howto_adapters", ["--rank", "0"], "--rank", "positive"),
    ("scaling_ladder", ["--bootstrap", "-1"], "--bootstrap", "non-negative"),
    ("decode_latency", ["--prompt", "0"], "--prompt", "positive"),
    ("decode_latency", ["--new-tokens", "-3"], "--new-tokens", "positive"),
    ("decode_latency", ["--steps", "4"], "--steps", "unrecognized"),
    ("decode_latency", ["--jobs", "2"], "--jobs", "unrecognized"),
]


@pytest.mark.parametrize("name,argv,flag,why", BAD, ids=[f"{n}:{' '.join(a[-2:])}" for n, a, _, _ in BAD])
def test_bad_values_are_refused(name, argv, flag, why, capsys):
    with pytest.raises(SystemExit) as e:
        parser_of(name).parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and why in err, err


@pytest.mark.parametrize("argv,why", [(["--batch-size", "0"], "batch_size must be > 0"),
                                      (["--stable-steps", "-5"], "stable_steps must be > 0"),
                                      (["--min-lr-frac", "2"], "min_lr_frac must lie in [0, 1]"),
                                      (["--batch-size", "6", "--grad-accum", "4"], "divisible")])
def test_train_config_rules_refused_before_anything_runs(argv, why, capsys, tmp_path):
    """train.py's numeric flags are checked by TrainConfig's own rules right after parsing (one
    place for the rules), with the parser's usage and exit status 2, before data or models."""
    import train
    with pytest.raises(SystemExit) as e:
        train.main(["--preset", "smoke-dense", "--data", "synthetic", "--out-dir", str(tmp_path / "r"), *argv])
    assert e.value.code == 2
    assert why in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_good_values_parse():
    a = parser_of("lab.evaluate").parse_args(["--run", "r", "--max-items", "0", "--shots", "0", "2", "--device", "cpu"])
    assert a.max_items == 0 and a.shots == [0, 2] and a.device == "cpu"
    a = parser_of("lab.scaling_analysis").parse_args(["--budgets", "1e21", "--bootstrap", "0"])
    assert a.budgets == [1e21] and a.bootstrap == 0 and a.out_dir == "scaling_out"
    a = parser_of("decode_latency").parse_args(["--new-tokens", "4"])
    assert a.new_tokens == 4 and a.steps is None and a.device == "auto"


def test_render_notebooks_refuses_an_unknown_notebook(capsys):
    import render_notebooks
    with pytest.raises(SystemExit) as e:
        render_notebooks.main(["no_such_notebook", "--check"])
    assert e.value.code == 2 and "no notebook ['no_such_notebook']" in capsys.readouterr().err
