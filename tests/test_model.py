"""model.py: decoding equals the full forward, document masking isolates documents, Llama peer, bad input."""
import pytest
import torch

from loop import LoopConfig
from model import GPT, ModelConfig


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=64, block_size=32, n_layer=4, d_model=32, n_head=4, n_kv_head=2, d_ff=48)
    base.update(kw)
    return ModelConfig(**base)


def live(model: GPT) -> GPT:
    """Give zero-initialised parameters (adapter B, PLT gates) random values so they matter, and move the
    Loop Matrix adapters' M off the identity (an asymmetric M: mixing along the wrong axis shows)."""
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if p.abs().sum() == 0:
            torch.nn.init.normal_(p, std=0.05)
        elif ".adapters." in name and name.endswith(".M"):   # matrix M = I (softmax M = 0 is drawn above)
            with torch.no_grad():
                p.add_(torch.randn_like(p) * 0.5)
    return model.eval()


def decode_in_pieces(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    """Prefill 7 tokens, five single-token steps, then a chunk of the rest."""
    cache = model.new_cache(idx.shape[0], idx.shape[1] + 2)
    outs = [model.forward_step(idx[:, :7], cache)]
    outs += [model.forward_step(idx[:, t:t + 1], cache) for t in range(7, 12)]
    outs.append(model.forward_step(idx[:, 12:], cache))
    assert cache.length == idx.shape[1]
    return torch.cat(outs, 1)


@pytest.mark.parametrize("kw", [dict(), dict(n_kv_head=4), dict(n_kv_head=1, head_dim=16),
                                dict(n_experts=6, top_k=2), dict(tie_embeddings=True)])
def test_decode_equals_full_forward(kw):
    torch.manual_seed(0)
    m = GPT(tiny(**kw)).eval()
    idx = torch.randint(0, 64, (2, 20))
    torch.testing.assert_close(decode_in_pieces(m, idx), m(idx)[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kw", [dict(), dict(loop=LoopConfig(start=1, length=2, n_loops=3, parallel=True)),
                                dict(loop=LoopConfig(start=1, length=2, n_loops=2, parallel=True, kv_window=3))])
def test_cache_repeat_forks_every_row(kw):
    """Prefill 2 rows, repeat the cache 3x, decode on: equals the full forward of the 6 sequences."""
    torch.manual_seed(0)
    m = live(GPT(tiny(**kw)))
    ctx, cont = torch.randint(0, 64, (2, 9)), torch.randint(0, 64, (6, 5))
    cache = m.new_cache(2, 14)
    m.forward_step(ctx, cache)
    forked = cache.repeat(3)
    assert forked.batch_size == 6 and forked.length == 9
    got = torch.cat([m.forward_step(cont[:, :2], forked), m.forward_step(cont[:, 2:], forked)], 1)
    full = m(torch.cat([ctx.repeat_interleave(3, 0), cont], 1))[0][:, 9:]
    torch.testing.assert_close(got, full, rtol=1e-4, atol=1e-4)


def test_generate_greedy_matches_argmax_of_full_forward():
    torch.manual_seed(0)
    m = GPT(tiny(n_experts=4, top_k=2)).eval()
    prompt = torch.randint(0, 64, (2, 5))
    out = m.generate(prompt, 6, temperature=0)
    assert out.shape == (2, 11) and torch.equal(out[:, :5], prompt)
    logits = m(out[:, :-1])[0]
    assert torch.equal(logits[:, 4:].argmax(-1), out[:, 5:])


@pytest.mark.parametrize("kw", [dict(), dict(n_experts=4, top_k=2),
                                dict(loop=LoopConfig(start=1, length=2, n_loops=2, parallel=True)),
                                dict(loop=LoopConfig(start=1, length=2, n_loops=2, parallel=True, kv_window=4))])
def test_document_masking_isolates_documents(kw):
    """Packed documents: rewriting one changes no other, and a packed document equals it run alone (PLT windows too)."""
    torch.manual_seed(0)
    m = live(GPT(tiny(**kw)))
    idx = torch.randint(0, 64, (1, 24))
    doc = torch.tensor([[0] * 10 + [1] * 8 + [2] * 6])
    base = m(idx, doc_ids=doc)[0]
    changed = idx.clone()
    changed[0, 10:18] = torch.randint(0, 64, (8,))     # rewrite document 1 only
    out = m(changed, doc_ids=doc)[0]
    torch.testing.assert_close(out[:, :10], base[:, :10])
    torch.testing.assert_close(out[:, 18:], base[:, 18:], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out[:, 10:18], base[:, 10:18])
    # a packed document equals the same document run alone (RoPE is relative)
    alone = m(idx[:, 18:])[0]
    torch.testing.assert_close(base[:, 18:], alone, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_paths_match_cpu_reference():
    torch.manual_seed(0)
    cfg = tiny(n_experts=8, top_k=2, d_model=64, d_ff=64, n_head=4, head_dim=16)
    m = GPT(cfg).eval()
    idx = torch.randint(0, 64, (2, 32))
    doc = torch.cat([torch.zeros(2, 13, dtype=torch.long), torch.ones(2, 19, dtype=torch.long)], 1)
    ref = m(idx, doc_ids=doc)[0]
    mc = m.cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = mc(idx.cuda(), doc_ids=doc.cuda())[0].float().cpu()
    assert (out - ref).abs().max() < 0.05 * ref.abs().max()


def test_matches_transformers_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = tiny(n_kv_head=2, head_dim=16)
    m = GPT(cfg).eval()
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_kv_head,
        head_dim=cfg.hd, max_position_embeddings=cfg.block_size, rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta, tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    sd = {"model.embed_tokens.weight": m.tok_emb.weight, "model.norm.weight": m.norm_f.weight,
          "lm_head.weight": m.lm_head.weight}
    for i, b in enumerate(m.blocks):
        p = f"model.layers.{i}."
        sd.update({p + "self_attn.q_proj.weight": b.attn.wq.weight, p + "self_attn.k_proj.weight": b.attn.wk.weight,
                   p + "self_attn.v_proj.weight": b.attn.wv.weight, p + "self_attn.o_proj.weight": b.attn.wo.weight,
                   p + "mlp.gate_proj.weight": b.mlp.gate.weight, p + "mlp.up_proj.weight": b.mlp.up.weight,
                   p + "mlp.down_proj.weight": b.mlp.down.weight, p + "input_layernorm.weight": b.attn_norm.weight,
                   p + "post_attention_layernorm.weight": b.mlp_norm.weight})
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected and all("rotary" in k for k in missing)
    idx = torch.randint(0, 64, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(m(idx)[0], hf(idx).logits, rtol=1e-4, atol=1e-4)


def test_loss_is_cross_entropy_plus_weighted_router_losses():
    torch.manual_seed(0)
    m = GPT(tiny(n_experts=4, top_k=2, aux_loss_coef=0.1, z_loss_coef=0.01))
    idx = torch.randint(0, 64, (2, 16))
    out = m.run(idx, idx)
    assert len(out.router) == 4
    torch.testing.assert_close(out.loss, out.ce + 0.1 * out.aux_loss + 0.01 * out.z_loss)
    dense = GPT(tiny()).run(idx, idx)
    assert torch.equal(dense.loss, dense.ce)


def test_init_is_small_and_depth_scaled():
    m = GPT(tiny(loop=LoopConfig(start=1, length=2, n_loops=2)))
    assert abs(m.tok_emb.weight.std().item() - 0.02) < 0.003
    layers = m.cfg.n_layer   # 4 stored layers (6 executed visits: not counted, 1/r scales the loop)
    assert abs(m.blocks[0].attn.wo.weight.std().item() - 0.02 / (2 * layers) ** 0.5) < 0.002


def test_init_rule_is_the_same_for_looped_and_unlooped():
    """issue 23.2: one init rule for Baseline and SMELT: same depth -> bit-identical weights, loop or not."""
    torch.manual_seed(5)
    base = GPT(tiny(n_experts=4, top_k=2)).state_dict()
    torch.manual_seed(5)
    looped = GPT(tiny(n_experts=4, top_k=2, loop=LoopConfig(start=1, length=2, n_loops=3))).state_dict()
    assert base.keys() == looped.keys() and all(torch.equal(base[k], looped[k]) for k in base)
    wo = GPT(tiny(n_layer=8)).blocks[0].attn.wo.weight   # the rule does follow depth
    assert abs(wo.std().item() - 0.02 / 16 ** 0.5) < 0.0015


def _name_rule_init(self):
    """Frozen copy of GPT.init_weights before issue 22 (residual outputs chosen by name suffix); its depth
    term follows issue 23.2's rule (n_layer, not executed visits): the test pins which parameters get it. A PLT
    gate's down projection is an ordinary matrix (N(0, std)); only its zero up projection is skipped."""
    import math
    nn = torch.nn
    std = self.cfg.init_std
    out_std = std / math.sqrt(2 * self.cfg.n_layer)
    for name, p in self.named_parameters():
        plt_down = name.startswith("plt.") and name.endswith(".down.weight")
        if "adapters" in name or (name.startswith("plt.") and not plt_down) or "kv_gate" in name:
            continue
        if plt_down:
            nn.init.normal_(p, 0.0, std)
        elif p.dim() == 1:
            nn.init.ones_(p)
        elif name.endswith(("wo.weight", "down.weight", "w_out")):
            nn.init.normal_(p, 0.0, out_std)
        else:
            nn.init.normal_(p, 0.0, std)
    for blk in self.blocks:
        if blk.attn.window:
            nn.init.zeros_(blk.attn.kv_gate.weight)


@pytest.mark.parametrize("kw", [
    dict(), dict(n_experts=6, top_k=2), dict(tie_embeddings=True),
    dict(loop=LoopConfig(start=1, length=2, n_loops=3)),
    dict(loop=LoopConfig(start=1, length=2, n_loops=2, schedule="per_layer", part="attn")),
    dict(loop=LoopConfig(start=1, length=2, n_loops=2, adapter="lora")),
    dict(n_experts=4, top_k=2, loop=LoopConfig(start=1, length=2, n_loops=2, adapter="softmax")),
    dict(loop=LoopConfig(start=1, length=2, n_loops=3, parallel=True)),
    dict(n_experts=4, top_k=2, loop=LoopConfig(start=1, length=2, n_loops=2, parallel=True, kv_window=3,
                                              adapter="matrix")),
])
def test_init_by_declared_roles_equals_the_old_name_rule(kw, monkeypatch):
    """Each module's RESIDUAL_OUT / OWN_INIT give bit-identical weights (and RNG state) to the suffix rule."""
    with monkeypatch.context() as mp:
        mp.setattr(GPT, "init_weights", _name_rule_init)
        torch.manual_seed(3)
        ref = GPT(tiny(**kw)).state_dict()
        ref_next = torch.rand(4)
    torch.manual_seed(3)
    new = GPT(tiny(**kw)).state_dict()
    assert new.keys() == ref.keys()
    assert all(torch.equal(new[k], ref[k]) for k in ref), [k for k in ref if not torch.equal(new[k], ref[k])]
    assert torch.equal(torch.rand(4), ref_next)


def test_init_refuses_a_vector_it_has_no_rule_for():
    """A bias (or any 1-D parameter that is not an RMSNorm gain) of a module added to the model gets no silent
    init rule: init_weights names it, unless its module declares OWN_INIT."""
    m = GPT(tiny())
    m.blocks[0].extra = torch.nn.Linear(4, 4, bias=True)
    with pytest.raises(ValueError, match=r"blocks\.0\.extra\.bias is not an RMSNorm gain nor a matrix"):
        m.init_weights()
    m.blocks[0].extra.OWN_INIT = ("bias",)
    m.init_weights()


def test_residual_out_is_read_per_module_not_by_name():
    """A module declaring an unusually named parameter in RESIDUAL_OUT gets the depth-scaled std;
    an OWN_INIT module is left as it initialised itself."""
    import model as model_lib

    class Odd(torch.nn.Module):
        RESIDUAL_OUT = ("back.to_stream",)

        def __init__(self):
            super().__init__()
            self.w_in = torch.nn.Parameter(torch.empty(256, 256))
            self.back = torch.nn.Module()
            self.back.to_stream = torch.nn.Parameter(torch.empty(256, 256))

    class Mine(torch.nn.Module):
        OWN_INIT = True

        def __init__(self):
            super().__init__()
            self.down = torch.nn.Parameter(torch.full((8, 8), 3.0))

    torch.manual_seed(0)
    m = GPT(tiny())
    m.blocks[1].mlp, m.blocks[2].mlp = Odd(), Mine()
    residual, own = model_lib.init_roles(m)
    assert "blocks.1.mlp.back.to_stream" in residual and "blocks.1.mlp.w_in" not in residual
    assert own == {"blocks.2.mlp.down"}
    assert {"blocks.0.attn.wo.weight", "blocks.0.mlp.down.weight"} <= residual
    m.init_weights()
    out_std = 0.02 / (2 * len(m.plan)) ** 0.5
    assert abs(m.blocks[1].mlp.back.to_stream.std().item() - out_std) < 0.1 * out_std
    assert abs(m.blocks[1].mlp.w_in.std().item() - 0.02) < 0.002
    assert torch.equal(m.blocks[2].mlp.down, torch.full((8, 8), 3.0))


@pytest.mark.parametrize("kw,msg", [   # loops as dicts: LoopConfig(...) itself raises at construction
    (dict(n_head=4, n_kv_head=3), "n_head % n_kv_head"),
    (dict(n_experts=2, top_k=3), "top_k"),
    (dict(d_model=0), "d_model must be > 0"),
    (dict(head_dim=7), "head_dim"),
    (dict(loop=dict(start=3, length=2, n_loops=2)), "outside the stack"),
    (dict(loop=dict(n_loops=2)), "needs a span"),
    (dict(loop=dict(start=1, length=2, n_loops=2, parallel=True, schedule="per_layer")), "parallel"),
    (dict(loop=dict(start=1, length=2, n_loops=2, adapter="lorax")), "adapter"),
])
def test_bad_configs_raise_naming_the_rule(kw, msg):
    with pytest.raises(ValueError, match=msg):
        tiny(**kw)


def test_bad_inputs_raise_clear_errors():
    m = GPT(tiny())
    with pytest.raises(ValueError, match="vocab_size"):
        m(torch.tensor([[1, 2, 64]]))
    with pytest.raises(ValueError, match="vocab_size"):
        m(torch.tensor([[-1, 2]]))
    with pytest.raises(ValueError, match="block_size"):
        m(torch.zeros(1, 33, dtype=torch.long))
    with pytest.raises(ValueError, match="doc_ids shape"):
        m(torch.zeros(1, 4, dtype=torch.long), doc_ids=torch.zeros(1, 3, dtype=torch.long))
    cache = m.new_cache(1, 4)
    m.forward_step(torch.zeros(1, 3, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="max_len"):
        m.forward_step(torch.zeros(1, 2, dtype=torch.long), cache)


def test_config_round_trips_through_json():
    cfg = tiny(n_experts=4, top_k=2, loop=LoopConfig(start=1, length=2, n_loops=2, adapter="lora"))
    import json
    assert ModelConfig.from_dict(json.loads(cfg.to_json())) == cfg


# ---------------------------------------------------------------- head-dim rule, flex on CUDA

def test_head_dim_rule_picks_sdpa_for_narrow_heads_on_cuda_and_names_the_field():
    from attention import FLEX_MIN_HEAD_DIM, attention_kernel
    assert FLEX_MIN_HEAD_DIM == 16
    assert attention_kernel("auto", "cuda", 16, True, True) == "flex"
    assert attention_kernel("auto", "cuda", 8, True, True) == "sdpa"       # falls back, exact (tested below)
    assert attention_kernel("auto", "cuda", 64, True, False) == "sdpa"     # nothing to mask but causality
    assert attention_kernel("auto", "cpu", 64, True, True) == "sdpa"       # CPU flex has no backward
    assert attention_kernel("flex", "cpu", 8, True, True) == "flex"        # CPU flex accepts narrow heads
    assert attention_kernel("auto", "cuda", 8, True, True) == attention_kernel("sdpa", "cuda", 8, True, True)
    with pytest.raises(ValueError, match="head_dim=12"):
        attention_kernel("flex", "cuda", 12, True, True)
    with pytest.raises(ValueError, match="full-sequence"):
        attention_kernel("flex", "cpu", 64, False, True)


@pytest.mark.parametrize("preset", ["smoke", "tiny", "small", "medium", "paper"])
def test_preset_ladders_keep_head_dim_at_least_16(preset):
    import budget
    import configs
    from attention import FLEX_MIN_HEAD_DIM
    ctx = 0.9 * configs.LADDERS[preset]["block"]   # a document length (the data's is measured; none here)
    dims = {(r["scale"], r["arch"]): r["head_dim"] for r in budget.ladder(preset, ctx)}
    assert min(dims.values()) >= FLEX_MIN_HEAD_DIM, dims


def test_narrow_heads_keep_the_document_mask_on_the_sdpa_path():
    """head_dim 8 with document ids: the path CUDA's "auto" takes for narrow heads (SDPA, boolean
    block-diagonal causal mask) equals explicit flex (CPU flex accepts 8) and the math reference."""
    torch.manual_seed(0)
    sd = GPT(tiny()).state_dict()
    idx = torch.randint(0, 64, (2, 32))
    doc = torch.cat([torch.zeros(2, 13, dtype=torch.long), torch.ones(2, 19, dtype=torch.long)], 1)
    outs = []
    for backend in ("sdpa", "flex", "math"):
        m = GPT(tiny(attn_backend=backend))
        m.load_state_dict(sd)
        assert m.cfg.hd == 8
        with torch.no_grad():
            outs.append(m(idx, doc_ids=doc)[0])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(outs[0], outs[2], rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (CPU flex attention has no backward)")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-3), (torch.bfloat16, 3e-2)])
def test_cuda_flex_forward_and_backward_match_sdpa_on_the_document_mask(dtype, tol):
    """Flex attention (compiled kernel, compiled block mask) against SDPA with the boolean
    block-diagonal causal mask: output and dq, dk, dv, with GQA, through attention.attend.
    The same comparison is the first figure of scripts/gpu_check.sh (bench.py flex)."""
    from lab import bench
    r = bench.flex_vs_sdpa(torch.device("cuda"), B=2, H=4, Hkv=2, T=512, hd=64, dtype=dtype, mean_doc=100,
                           time_it=False)
    assert r["shape"]["documents"] > 4
    for name in ("out", "dq", "dk", "dv"):
        assert r[f"rel_diff_{name}"] < tol, (name, r)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_eager_flex_does_not_materialise_the_scores():
    """Validation runs the uncompiled model: its flex call must still be the compiled kernel with a
    compiled block mask. Eager flex would hold B x H x T x T fp32 scores (268 MB here)."""
    import attention
    from lab import bench
    dev = torch.device("cuda")
    B, H, T, hd = 8, 8, 1024, 64
    q, k, v = (torch.randn(B, H, T, hd, device=dev, dtype=torch.bfloat16) for _ in range(3))
    doc = bench.packed_doc_ids(B, T, 200).to(dev)
    pos = torch.arange(T, device=dev)
    with torch.no_grad():
        attention.attend(q, k, v, pos, pos, doc, doc, 0, "flex", masks={})   # compiles
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        attention.attend(q, k, v, pos, pos, doc, doc, 0, "flex", masks={})
        torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base < B * H * T * T    # well under one byte per score


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_compiled_moe_step_is_one_graph_without_syncs():
    """bf16 autocast training step of a SMELT config on CUDA: one graph (fullgraph), the fused
    grouped matmul where the GPU has it, and no synchronising call in a steady-state step."""
    from lab import bench
    from torch._dynamo.utils import counters
    from model import compile_model
    from train import Objective
    dev = torch.device("cuda")
    cfg = ModelConfig(vocab_size=512, block_size=256, n_layer=4, d_model=128, n_head=4, n_kv_head=2, d_ff=64,
                      n_experts=8, top_k=2, loop=LoopConfig(start=1, length=2, n_loops=2))
    gpt = GPT(cfg).to(dev)
    obj = Objective(gpt)
    idx = torch.randint(0, 512, (4, 256), device=dev)
    doc = bench.packed_doc_ids(4, 256, 64).to(dev)
    counters.clear()
    compiled = compile_model(obj, fullgraph=True)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ce, n, aux, z, _ = compiled(idx, idx, doc)
        (ce / n + aux + z).backward()
    step()
    step()
    assert counters["stats"]["unique_graphs"] == 1
    assert bench.count_syncs(step, dev) == 0
    cap = torch.cuda.get_device_capability()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        kinds = gpt.blocks[0].mlp.kernels(idx[..., None].float())
    assert kinds == (("torch", "torch") if cap in ((9, 0), (10, 0)) else ("padded", "padded"))
