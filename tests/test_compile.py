"""torch.compile of the training objective: one graph per config, no host syncs, no recompiles.

Every config kind (dense, MoE, SMELT = MoE looped over the middle half twice, PLT) is traced
with fullgraph=True through AOTAutograd, forward and backward (a graph break is an error), and
the traced forward and backward graphs are searched for operators that read device data back
to the host. One config (SMELT, which holds both the MoE and the loop) also goes through
inductor forward and backward: on a CPU inductor's first compile builds its C++ headers (about
a minute cold on 2 busy cores, seconds once cached), so the other three are traced only.
`pytest -m "not compile"` leaves this file out.
"""
import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.testing import CompileCounter

import attention
from loop import LoopConfig
from model import GPT, ModelConfig, compile_model
from train import Objective, forward_backward, step_scale

pytestmark = pytest.mark.compile

# Operators whose result needs device data on the host (a sync on a GPU, a graph break or a
# data-dependent shape under compile), and the "loop" grouped matmul, which reads group sizes inside.
HOST_READ_OPS = ("_local_scalar_dense", "nonzero", "bincount", "unique", "masked_select", "repeat_interleave",
                 "looped_moe.grouped_mm", "_grouped_mm")


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=64, block_size=32, n_layer=4, d_model=32, n_head=2, n_kv_head=1, d_ff=32)
    base.update(kw)
    return ModelConfig(**base)


CONFIGS = {
    "dense": dict(),
    "moe": dict(n_experts=4, top_k=2),
    "smelt": dict(n_experts=4, top_k=2, loop=LoopConfig(start=1, length=2, n_loops=2)),
    "plt": dict(loop=LoopConfig(start=1, length=2, n_loops=2, parallel=True)),
}


def batch(B=2, T=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 64, (B, T), generator=g)
    doc = torch.zeros(B, T, dtype=torch.long)
    doc[:, 13:] = 1
    doc[1, 25:] = 2
    return idx, torch.roll(idx, -1, 1), doc


def step(fn, gpt, idx, tgt, doc):
    gpt.zero_grad(set_to_none=True)
    loss = forward_backward(fn, gpt.cfg, idx, tgt, doc, step_scale(tgt))[2]   # train.py's forward and backward
    return loss, {k: p.grad.clone() for k, p in gpt.named_parameters() if p.grad is not None}


class GraphRecorder:
    """A torch.compile backend: AOTAutograd with pass-through compilers that keep every traced graph."""

    def __init__(self):
        self.frames, self.graphs = 0, []

        def keep(gm, example_inputs):
            self.graphs.append(gm)
            return make_boxed_func(gm.forward)
        self._aot = aot_autograd(fw_compiler=keep, bw_compiler=keep)

    def __call__(self, gm, example_inputs):
        self.frames += 1
        return self._aot(gm, example_inputs)

    def ops(self) -> set[str]:
        return {str(n.target) for g in self.graphs for n in g.graph.nodes if n.op == "call_function"}

    def host_reads(self) -> set[str]:
        return {op for op in self.ops() if any(bad in op for bad in HOST_READ_OPS)}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_objective_is_one_graph_forward_and_backward_without_host_reads(name):
    torch.manual_seed(0)
    gpt = GPT(tiny(**CONFIGS[name]))
    obj = Objective(gpt)
    rec = GraphRecorder()
    compiled = torch.compile(obj, backend=rec, fullgraph=True, dynamic=False)
    idx, tgt, doc = batch()
    loss_e, grads_e = step(obj, gpt, idx, tgt, doc)
    for _ in range(2):                        # the second step must reuse the graph
        loss_c, grads_c = step(compiled, gpt, idx, tgt, doc)
    assert rec.frames == 1, f"{rec.frames} graphs: a recompile or a break"
    assert len(rec.graphs) == 2               # one forward and one backward graph
    assert not rec.host_reads(), rec.host_reads()
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-5)
    assert grads_c.keys() == grads_e.keys()
    for k in grads_e:
        torch.testing.assert_close(grads_c[k], grads_e[k], rtol=1e-4, atol=1e-6, msg=k)


def test_host_read_check_catches_the_loop_kernel():
    """The check can fail: the eager "loop" grouped matmul (a custom op that reads group sizes) is
    one opaque call, so fullgraph alone would not notice it."""
    gpt = GPT(tiny(n_experts=4, top_k=2, moe_impl="loop"))
    rec = GraphRecorder()
    compiled = torch.compile(Objective(gpt), backend=rec, fullgraph=True, dynamic=False)
    step(compiled, gpt, *batch())
    assert rec.frames == 1 and any("looped_moe.grouped_mm" in op for op in rec.host_reads())


def test_smelt_objective_compiles_with_inductor_and_reads_nothing_back():
    from test_moe import count_host_reads
    torch.manual_seed(0)
    gpt = GPT(tiny(n_layer=3, d_model=16, n_head=1, d_ff=16, n_experts=4, top_k=2,
                   loop=LoopConfig(start=1, length=1, n_loops=2)))
    obj = Objective(gpt)
    compiled = compile_model(obj, fullgraph=True)
    idx, tgt, doc = batch()
    loss_c, grads_c = step(compiled, gpt, idx, tgt, doc)          # compiles
    loss_e, grads_e = step(obj, gpt, idx, tgt, doc)
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-4, atol=1e-4)
    for k in grads_e:
        torch.testing.assert_close(grads_c[k], grads_e[k], rtol=1e-3, atol=1e-5, msg=k)
    assert count_host_reads(lambda: step(compiled, gpt, idx, tgt, doc)) == 0
    assert count_host_reads(lambda: step(obj, gpt, idx, tgt, doc)) > 0   # eager: input checks, the CPU loop
    torch._dynamo.reset()


def test_flex_path_traces_into_the_graph_and_builds_one_mask_per_forward(monkeypatch):
    """attn_backend="flex" (CPU inductor runs its forward): the block mask and flex attention trace
    into the caller's graph (no separately compiled flex, no recompile), and eager code builds the
    mask once per forward, not once per attention visit (6 here)."""
    import torch.nn.attention.flex_attention as fa
    torch.manual_seed(0)
    gpt = GPT(tiny(attn_backend="flex", n_experts=4, top_k=2, loop=LoopConfig(start=1, length=2, n_loops=2)))
    obj = Objective(gpt)
    idx, tgt, doc = batch()
    cc = CompileCounter()
    compiled = torch.compile(obj, backend=cc, fullgraph=True, dynamic=False)
    with torch.no_grad():
        ref = obj(idx, tgt, doc)[0]
        for _ in range(3):
            out = compiled(idx, tgt, doc)[0]
    assert cc.frame_count == 1 and attention._flex_compiled is None
    torch.testing.assert_close(out, ref)
    calls = []
    real = fa.create_block_mask
    monkeypatch.setattr(fa, "create_block_mask", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        obj(idx, tgt, doc)
    assert len(calls) == 1


def test_compile_model_compiles_each_run_once_however_many_runs():
    """The main job's pattern: runs of different shapes one after another in one process. With a
    recompile limit of 2 (8 in torch; the small preset trains 12 runs), plain torch.compile gives
    up from the third shape on and trains it eagerly; compile_model (fresh per run) compiles every
    run exactly once."""
    idx, tgt, doc = batch()

    def runs(compile_fn):
        frames = []
        for d_ff in (16, 24, 32, 40):
            gpt = GPT(tiny(d_ff=d_ff, n_layer=2))
            cc = CompileCounter()
            compiled = compile_fn(Objective(gpt), cc)
            for _ in range(2):
                step(compiled, gpt, idx, tgt, doc)
            frames.append(cc.frame_count)
        return frames

    torch._dynamo.reset()
    try:   # config.patch restores the option itself (monkeypatch's undo would delete it: pytest 9)
        with torch._dynamo.config.patch(recompile_limit=2):
            assert runs(lambda m, cc: torch.compile(m, backend=cc, dynamic=False)) == [1, 1, 0, 0]
            assert runs(lambda m, cc: compile_model(m, backend=cc)) == [1, 1, 1, 1]
    finally:
        torch._dynamo.reset()
