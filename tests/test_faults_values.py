"""Issue 55, classes 5 and 4: a refusal names the value at fault, and library functions refuse values that make no
sense at their definition (one line naming the argument and its rule), not deep inside numpy/torch or as nan."""
import math

import numpy as np
import pytest
import torch

import budget
import data
import moe
import scaling
from lab import scaling_analysis, stats, tasks
from model import ModelConfig
from toys import tiny_model

NAN = math.nan


# ---------------------------------------------------------------- class 5: the refusal names the right argument

@pytest.mark.fault("cli")
@pytest.mark.parametrize("main,argv,msg", [
    (scaling_analysis.main, ["--results", "r.jsonl", "--budgets", "-1e20"], "--budgets: must be a positive number"),
    (scaling_analysis.main, ["--results", "r.jsonl", "--budgets", "1e20", "-5"], "got -5"),
    (scaling_analysis.main, ["--results", "r.jsonl", "--budgets", "-.5"], "got -.5"),
    (budget.main, ["--ladder", "tiny", "--ctx-len", "500"], "--ctx-len 500 exceeds preset tiny's block size 128"),
])
def test_cli_refusal_names_the_value(main, argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and msg in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.fault("cli")
def test_budget_config_ctx_len_beyond_its_block_size(tmp_path, capsys):
    path = tmp_path / "model.json"
    path.write_text(tiny_model().to_json())
    with pytest.raises(SystemExit):
        budget.main(["--config", str(path), "--ctx-len", str(10 * tiny_model().block_size)])
    assert "--ctx-len" in capsys.readouterr().err


# ---------------------------------------------------------------- class 4: data.py batch functions

def _token_data():
    """A TokenData with one tiny held-out source: the checks come before any read of the train stream."""
    td = object.__new__(data.TokenData)
    td._val = {"s": np.arange(200, dtype=np.uint16)}
    td._val_starts = {"s": np.array([0])}
    td.sources, td.eot = ["s"], 199
    return td


BATCH_BAD = [
    (dict(step=-1), "step must be an integer >= 0"),
    (dict(batch_size=0), "batch_size must be an integer >= 1"),
    (dict(batch_size=-3), "batch_size must be an integer >= 1"),
    (dict(block_size=0), "block_size must be an integer >= 1"),
    (dict(block_size=2.5), "block_size must be an integer >= 1"),
    (dict(world_size=0), "world_size must be an integer >= 1"),
]


@pytest.mark.fault("api")
@pytest.mark.parametrize("make", [_token_data, lambda: data.SyntheticData(64)], ids=["token", "synthetic"])
@pytest.mark.parametrize("kw,msg", BATCH_BAD)
def test_train_batch_refuses_sizes(make, kw, msg):
    args = {"step": 0, "batch_size": 2, "block_size": 8, **kw}
    with pytest.raises(ValueError, match=msg):
        make().train_batch(**args)


@pytest.mark.fault("api")
@pytest.mark.parametrize("make,source", [(_token_data, "s"), (lambda: data.SyntheticData(64), "synthetic0")],
                         ids=["token", "synthetic"])
@pytest.mark.parametrize("kw,msg", [
    (dict(batch_size=0), "batch_size must be an integer >= 1"),
    (dict(block_size=0), "block_size must be an integer >= 1"),
    (dict(block_size=-8), "block_size must be an integer >= 1"),
    (dict(max_tokens=0), "max_tokens must be an integer >= 1"),
    (dict(max_tokens=-64), "max_tokens must be an integer >= 1"),
])
def test_val_batches_refuse_sizes(make, source, kw, msg):
    args = {"batch_size": 2, "block_size": 8, **kw}
    with pytest.raises(ValueError, match=msg):
        next(iter(make().val_batches(source, **args)))


@pytest.mark.fault("api")
def test_good_sizes_still_batch():
    idx, tgt, doc = next(iter(_token_data().val_batches("s", 2, 8, max_tokens=32)))
    assert idx.shape == (2, 8) and data.SyntheticData(64).train_batch(0, 2, 8)[0].shape == (2, 8)


# ---------------------------------------------------------------- class 4: bootstrap draws, fits, accuracies

@pytest.mark.fault("api")
@pytest.mark.parametrize("call,msg", [
    (lambda n: stats.bootstrap_interval([1.0, 2.0, 3.0], n_draws=n), "n_draws must be an integer >= 1"),
    (lambda n: stats.permutation_test(np.arange(20.0), np.zeros(20), n=n), r"n \(random sign patterns\)"),
    (lambda n: scaling_analysis.cell_bootstrap(None, None, 1e20, 0.5, n_draws=n), "n_draws must be an integer >= 1"),
    (lambda n: scaling_analysis.analyse([], "unused", n_boot=n - 1), "n_boot must be an integer >= 0"),
])
@pytest.mark.parametrize("n", [0, -5, 2.5, NAN])
def test_bootstrap_draws_refused(call, msg, n):
    with pytest.raises(ValueError, match=msg):
        call(n)


def _points():
    F, D = np.repeat(np.geomspace(1e8, 1e10, 3), 3), np.tile(np.geomspace(1e9, 1e11, 3), 3)
    S = np.zeros(9)
    return F, S, D, 2.0 + 50 / F ** 0.3 + 80 / D ** 0.3


@pytest.mark.fault("api")
@pytest.mark.parametrize("fixed", [{"E": -1.0}, {"E": 0.0}, {"E": NAN}, {"E": math.inf}, {"a": NAN}, {"a": -0.5},
                                   {"c": 9.0}, {"b": -3.0}])
def test_fit_refuses_fixed_out_of_domain(fixed):
    with pytest.raises(ValueError, match="`fixed` values out of their domain"):
        scaling.fit_result(*_points(), fixed={"b": 0.0, **fixed})


@pytest.mark.fault("api")
@pytest.mark.parametrize("acc", [NAN, 1.5, -0.1, np.array([0.5, NAN])])
def test_centred_accuracy_refuses(acc):
    with pytest.raises(ValueError, match=r"accuracy must be in \[0, 1\]"):
        tasks.centred_accuracy(acc, 0.25)


# ---------------------------------------------------------------- class 4: MoE shapes and group sizes

@pytest.mark.fault("api")
@pytest.mark.parametrize("shape", [(2, 3, 16), (2, 3, 64), (6, 32)])
def test_moe_refuses_the_wrong_width(shape):
    with pytest.raises(ValueError, match=r"MoE: x must be \(B, T, d_model=32\)"):
        moe.MoE(32, 16, 4, 2)(torch.randn(*shape))


@pytest.mark.fault("api")
@pytest.mark.parametrize("impl", ["loop", "reference"])
@pytest.mark.parametrize("sizes", [[2, 2], [3, 3], [6, -1]])
def test_grouped_mm_refuses_sizes_not_summing_to_the_rows(impl, sizes):
    with pytest.raises(ValueError, match="group_sizes must be >= 0 and sum to x's 5 rows"):
        moe.grouped_mm(torch.randn(5, 4), torch.randn(2, 4, 3), torch.tensor(sizes), impl=impl)


# ---------------------------------------------------------------- class 4: absurd but finite ModelConfig values

@pytest.mark.fault("api")
@pytest.mark.parametrize("kw,msg", [
    (dict(rope_theta=1e-300), "rope_theta=1e-300 makes the rotary angles non-finite"),
    (dict(rope_theta=0.5), "rope_theta"),
    (dict(rope_theta=1e300), "rope_theta"),
    (dict(aux_loss_coef=1e308), "aux_loss_coef=1e[+]?308 overflows"),
    (dict(z_loss_coef=1e300), "z_loss_coef=1e[+]?300 overflows"),
    (dict(init_std=1e308), "init_std=1e[+]?308"),
    (dict(norm_eps=1e300), "norm_eps=1e[+]?300"),
])
def test_model_config_refuses_absurd_values(kw, msg):
    with pytest.raises(ValueError, match=f"ModelConfig: {msg}"):
        tiny_model(**kw)
    ModelConfig(**{**tiny_model().to_dict(), **{k: 1.0 for k in kw if k != "norm_eps"}})   # the bound itself is fine
