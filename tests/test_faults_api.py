"""Fault-campaign cases (issue 26, class api): values the campaign found accepted, now refused by name."""
import math

import pytest

import budget
import moe
import train as T
from loop import MAX_LOOPS, LoopConfig
from model import ModelConfig


@pytest.mark.fault("api")
@pytest.mark.parametrize("kw, field", [
    (dict(d_model=0), "d_model"), (dict(d_ff=2.5), "d_ff"), (dict(n_experts=True), "n_experts"),
    (dict(top_k=0), "top_k"), (dict(renormalize="yes"), "renormalize")])
def test_moe_refuses_bad_arguments_by_name(kw, field):
    args = dict(d_model=8, d_ff=8, n_experts=4, top_k=2, renormalize=True) | kw
    with pytest.raises(ValueError, match=f"MoE: {field}"):
        moe.MoE(**args)


@pytest.mark.fault("api")
def test_loop_count_is_bounded():
    LoopConfig(start=0, length=1, n_loops=MAX_LOOPS).validate()
    with pytest.raises(ValueError, match=r"n_loops must lie in \[1, 64\], got 1000000"):
        LoopConfig(start=0, length=1, n_loops=10 ** 6)


@pytest.mark.fault("api")
@pytest.mark.parametrize("opt", [dict(ff_band=math.nan), dict(q_band=math.inf)])
def test_match_refuses_non_finite_search_bands(opt):
    base = ModelConfig(vocab_size=64, block_size=32, n_layer=4, d_model=32, n_head=2, n_kv_head=1, d_ff=32)
    with pytest.raises(ValueError, match="match: ff_band and q_band must be >= 0 and finite"):
        budget.match(base, LoopConfig(start=1, length=2, n_loops=2), 32.0, **opt)


@pytest.mark.fault("cli")
def test_flops_ctx_beyond_the_context_is_refused_not_clamped():
    with pytest.raises(ValueError, match=r"flops_ctx must be <= block_size \(64\), got 1000000000000.0"):
        T.TrainConfig(block_size=64, flops_ctx=1e12).validate()
