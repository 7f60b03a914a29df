"""loop.py: placement, schedules, 1/r scale, adapters, PLT (decode == forward, one batched call per token)."""
import pytest
import torch

import loop as L
from loop import LoopConfig
from model import GPT, Block, ModelConfig
from test_model import decode_in_pieces, live, tiny


def test_smelt_placement_table():
    # SMELT Appendix A, 1-based looped layers 3-7, 4-9, 6-15, 8-22
    for n, (first, last) in {10: (3, 7), 12: (4, 9), 20: (6, 15), 30: (8, 22)}.items():
        s, m = L.middle_span(n)
        assert (s + 1, s + m) == (first, last)
    assert L.middle_third(12) == (4, 4) and L.middle_third(10) == (3, 4)   # M = B - 2 floor(B/3)


def test_schedule_orders():
    blk = LoopConfig(start=1, length=2, n_loops=2)
    assert L.schedule(4, blk) == [(0, 0), (1, 0), (2, 0), (1, 1), (2, 1), (3, 0)]
    per = LoopConfig(start=1, length=2, n_loops=2, schedule="per_layer")
    assert L.schedule(4, per) == [(0, 0), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0)]
    assert sorted(L.schedule(4, blk)) == sorted(L.schedule(4, per))   # same evaluations, other order
    full = LoopConfig(start=0, length=3, n_loops=3)
    assert [l for l, _ in L.schedule(3, full)] == [0, 1, 2] * 3
    assert L.schedule(4, LoopConfig()) == [(i, 0) for i in range(4)]


def test_plan_scales_and_parts():
    p = L.plan(4, LoopConfig(start=1, length=2, n_loops=2))
    assert [(v.attn_scale, v.mlp_scale) for v in p] == [(1, 1), (.5, .5), (.5, .5), (.5, .5), (.5, .5), (1, 1)]
    attn = L.plan(4, LoopConfig(start=1, length=2, n_loops=2, part="attn"))
    assert [(v.layer, v.attn, v.mlp, v.mlp_scale) for v in attn[1:5]] == [
        (1, True, False, 1.0), (2, True, False, 1.0), (1, True, True, 1.0), (2, True, True, 1.0)]
    mlp = L.plan(4, LoopConfig(start=1, length=2, n_loops=3, part="mlp"))
    assert sum(v.attn for v in mlp) == 4 and sum(v.mlp for v in mlp) == 8
    assert {v.mlp_scale for v in mlp if v.layer in (1, 2)} == {1 / 3}
    off = L.plan(4, LoopConfig(start=1, length=2, n_loops=2, residual_scale=False))
    assert {v.attn_scale for v in off} == {1.0}


def test_plan_visits_for_part_attn_and_mlp_in_full():
    """Every Visit field for part="attn" / "mlp": the repeated sub-layer runs each visit at 1/r, the other once unscaled."""
    V, t = L.Visit, 1 / 3
    attn = L.plan(4, LoopConfig(start=1, length=2, n_loops=3, part="attn"))
    assert attn == [V(0, 0, True, True, 1.0, 1.0),
                    V(1, 0, True, False, t, 1.0), V(2, 0, True, False, t, 1.0),
                    V(1, 1, True, False, t, 1.0), V(2, 1, True, False, t, 1.0),
                    V(1, 2, True, True, t, 1.0), V(2, 2, True, True, t, 1.0),     # MLP once: the last visit
                    V(3, 0, True, True, 1.0, 1.0)]
    mlp = L.plan(4, LoopConfig(start=1, length=2, n_loops=3, part="mlp"))
    assert mlp == [V(0, 0, True, True, 1.0, 1.0),
                   V(1, 0, True, True, 1.0, t), V(2, 0, True, True, 1.0, t),      # attention once: the first visit
                   V(1, 1, False, True, 1.0, t), V(2, 1, False, True, 1.0, t),
                   V(1, 2, False, True, 1.0, t), V(2, 2, False, True, 1.0, t),
                   V(3, 0, True, True, 1.0, 1.0)]
    per = L.plan(3, LoopConfig(start=0, length=2, n_loops=2, part="mlp", schedule="per_layer"))
    assert per == [V(0, 0, True, True, 1.0, .5), V(0, 1, False, True, 1.0, .5),
                   V(1, 0, True, True, 1.0, .5), V(1, 1, False, True, 1.0, .5), V(2, 0, True, True, 1.0, 1.0)]
    off = L.plan(3, LoopConfig(start=0, length=2, n_loops=2, part="attn", residual_scale=False))
    assert [(v.attn, v.mlp, v.attn_scale, v.mlp_scale) for v in off] == [
        (True, False, 1.0, 1.0), (True, False, 1.0, 1.0), (True, True, 1.0, 1.0), (True, True, 1.0, 1.0),
        (True, True, 1.0, 1.0)]


def test_one_loop_is_exactly_the_plain_model():
    torch.manual_seed(0)
    plain = GPT(tiny(n_experts=4, top_k=2)).eval()
    one = GPT(tiny(n_experts=4, top_k=2, loop=LoopConfig(start=1, length=2, n_loops=1))).eval()
    one.load_state_dict(plain.state_dict())
    idx = torch.randint(0, 64, (2, 16))
    assert torch.equal(plain(idx)[0], one(idx)[0])


def test_residual_scale_applies_one_over_r_to_span_updates():
    torch.manual_seed(0)
    cfgs = [tiny(loop=LoopConfig(start=1, length=2, n_loops=2, residual_scale=s)) for s in (True, False)]
    a, b = GPT(cfgs[0]), GPT(cfgs[1])
    b.load_state_dict(a.state_dict())
    idx = torch.randint(0, 64, (1, 8))
    ca, cb = {}, {}
    a.run(idx, capture=ca)
    b.run(idx, capture=cb)
    # layer 0 is outside the span: same input, same write; layer 1 visit 0: same input, half the write
    torch.testing.assert_close(ca[(0, 0)]["attn_write"], cb[(0, 0)]["attn_write"])
    torch.testing.assert_close(ca[(1, 0)]["attn_write"], 0.5 * cb[(1, 0)]["attn_write"])


@pytest.mark.parametrize("part", ["both", "mlp"])
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_residual_scale_applies_one_over_r_to_every_mlp_write(moe, part):
    """Hand-run residual stream: every in-span MLP write is (1/r) * mlp(mlp_norm(x + attn_write)), outside it 1x."""
    torch.manual_seed(0)
    r = 2
    m = GPT(tiny(loop=LoopConfig(start=1, length=2, n_loops=r, part=part),
                 **(dict(n_experts=4, top_k=2) if moe else {}))).eval()
    idx = torch.randint(0, 64, (2, 8))
    cap = {}
    with torch.no_grad():
        logits = m.run(idx, capture=cap).logits
        x = m.tok_emb(idx)
        order = L.schedule(4, m.cfg.loop)
        assert len(order) == 6
        for layer, v in order:
            c, blk = cap[(layer, v)], m.blocks[layer]
            scale = 1 / r if layer in (1, 2) else 1.0           # SMELT Eq. 8-9: 1/r inside the span only
            torch.testing.assert_close(c["x"], x)
            x = x + c.get("attn_write", 0)
            h = blk.mlp_norm(x)
            torch.testing.assert_close(c["mlp_norm"], h)
            f = blk.mlp(h)[0] if moe else blk.mlp(h)
            torch.testing.assert_close(c["mlp_write"], scale * f, rtol=1e-5, atol=1e-6)
            x = x + scale * f
        torch.testing.assert_close(logits, m.lm_head(m.norm_f(x)), rtol=1e-5, atol=1e-5)


def test_state_dict_of_plain_model_loads_into_adapter_and_plt_models():
    plain = GPT(tiny()).state_dict()
    for lk in (dict(adapter="matrix"), dict(parallel=True, inject="norm_gate"), dict(parallel=True, kv_window=4)):
        m = GPT(tiny(loop=LoopConfig(start=1, length=2, n_loops=2, **lk)))
        missing, unexpected = m.load_state_dict(plain, strict=False)
        assert not unexpected and missing
        assert all(("adapters" in k) or k.startswith("plt.") or "kv_gate" in k for k in missing)


@pytest.mark.parametrize("kind", ["lora", "matrix", "softmax"])
def test_adapters_are_noops_at_init_and_train(kind):
    torch.manual_seed(0)
    base = GPT(tiny(loop=LoopConfig(start=1, length=2, n_loops=3)))
    ad = GPT(tiny(loop=LoopConfig(start=1, length=2, n_loops=3, adapter=kind, adapter_rank=4)))
    ad.load_state_dict(base.state_dict(), strict=False)
    idx = torch.randint(0, 64, (2, 16))
    assert torch.equal(base(idx)[0], ad(idx)[0])
    opt = torch.optim.SGD([p for n, p in ad.named_parameters() if "adapters" in n], lr=0.5)
    loss0 = ad(idx, idx)[1]
    for _ in range(5):
        opt.zero_grad()
        ad(idx, idx)[1].backward()
        opt.step()
    assert ad(idx, idx)[1] < loss0
    b = ad.blocks[1].mlp.adapters["down"].B
    assert b[0].abs().sum() > 0 and not torch.allclose(b[0], b[1])   # loops specialise


@pytest.mark.parametrize("part", ["both", "attn", "mlp"])
def test_adapters_sit_only_on_repeated_sublayers_and_every_row_trains(part):
    """part="attn": only attention repeats, so only it gets per-loop adapters (a once-run MLP would train one row
    of r); part="mlp" the reverse. Every adapter row then gets a gradient, and budget counts what is stored."""
    import budget
    cfg = tiny(loop=LoopConfig(start=1, length=2, n_loops=2, part=part, adapter="lora", adapter_rank=2))
    m = live(GPT(cfg)).train()
    for i, blk in enumerate(m.blocks):
        assert (blk.attn.adapters is not None) == (i in (1, 2) and part != "mlp")
        assert (blk.mlp.adapters is not None) == (i in (1, 2) and part != "attn")
    m(torch.randint(0, 64, (2, 12)), torch.randint(0, 64, (2, 12)))[1].backward()
    rows = [(n, p.grad[l]) for n, p in m.named_parameters() if ".adapters." in n for l in range(2)]
    assert rows and all(g is not None and g.abs().sum() > 0 for _, g in rows)
    assert budget.count_params(cfg)["blocks"] == sum(p.numel() for n, p in m.named_parameters()
                                                     if n.startswith("blocks.") or n.startswith("norm"))


def test_moe_adapters_sit_on_attention_only_and_mlp_alone_is_refused():
    """MoE blocks take adapters on attention only (docs/loop.md): part="both" adapts attention and budget
    counts just those; part="mlp" would add none at all, so ModelConfig refuses it naming the rule."""
    import budget
    loop = dict(start=1, length=2, n_loops=2, adapter="lora", adapter_rank=2)
    m = GPT(tiny(n_experts=4, top_k=2, loop=LoopConfig(**loop, part="both")))
    assert [blk.attn.adapters is not None for blk in m.blocks] == [False, True, True, False]
    assert not any(".mlp." in n and ".adapters." in n for n, _ in m.named_parameters())
    plan = budget.plan_of(m.cfg)
    assert (plan.adapter_attn_layers, plan.adapter_mlp_layers) == (2, 0)
    with pytest.raises(ValueError, match="part='mlp' with n_experts=4 adds no adapter"):
        tiny(n_experts=4, top_k=2, loop=LoopConfig(**loop, part="mlp"))
    tiny(n_experts=4, top_k=2, loop=LoopConfig(**loop, part="attn"))   # attention only: allowed

@pytest.mark.parametrize("kind", ["lora", "matrix", "softmax"])
def test_adapter_matches_explicit_delta_w_with_random_mixing(kind):
    """LoopAdapter with random A, B, M: loop l gives x @ (sum_j mix[l, j] B_j A_j)^T (softmax rows), stacked == per-loop."""
    torch.manual_seed(0)
    n, d_in, d_out, rank = 3, 5, 4, 2
    ad = L.LoopAdapter(d_in, d_out, n, rank, kind)
    with torch.no_grad():
        ad.B.normal_()
        if kind != "lora":
            ad.M.copy_(torch.randn(n, n) * 2)             # not symmetric, rows and columns unnormalised
    A, B = ad.A.detach().double(), ad.B.detach().double()
    if kind == "lora":
        mix = torch.eye(n, dtype=torch.double)
    else:
        M = ad.M.detach().double()
        mix = M if kind == "matrix" else M.exp() / M.exp().sum(1, keepdim=True)   # softmax over j, per row l
        assert not torch.allclose(M, M.t())
    if kind == "softmax":
        torch.testing.assert_close(ad.mixing().double().sum(1), torch.ones(n, dtype=torch.double))
        torch.testing.assert_close(ad.mixing().double(), mix)
    dW = [sum(mix[l, j] * B[j] @ A[j] for j in range(n)) for l in range(n)]   # (d_out, d_in) per loop
    x = torch.randn(n, 2, 3, d_in)
    stacked = ad(x, None)
    assert stacked.shape == (n, 2, 3, d_out)
    for l in range(n):
        ref = (x[l].double() @ dW[l].t()).float()
        torch.testing.assert_close(ad(x[l], l), ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(stacked[l], ref, rtol=1e-5, atol=1e-5)


LOOP_VARIANTS = (
    [dict(start=1, length=2, n_loops=r, schedule=s, part=p) for r in (2, 3)
     for s in ("block", "per_layer") for p in ("both", "attn", "mlp")]
    + [dict(start=1, length=2, n_loops=r, adapter=a) for r in (2, 3) for a in ("lora", "matrix", "softmax")]
    + [dict(start=1, length=2, n_loops=r, parallel=True, inject=i) for r in (2, 3)
       for i in ("add", "norm_half", "norm_gate")]
    + [dict(start=0, length=4, n_loops=2, parallel=True),                      # full-stack PLT
       dict(start=1, length=2, n_loops=2, parallel=True, shift=False),         # unshifted control
       dict(start=1, length=2, n_loops=3, parallel=True, kv_window=3),
       dict(start=1, length=2, n_loops=2, parallel=True, kv_window=2, adapter="matrix"),
       dict(start=1, length=2, n_loops=2, parallel=True, kv_window=1)])         # empty ring: only its own key


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("lk", LOOP_VARIANTS, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_decode_equals_full_forward_for_every_loop_variant(lk, moe):
    torch.manual_seed(0)
    cfg = tiny(loop=LoopConfig(**lk), **(dict(n_experts=4, top_k=2) if moe else {}))
    m = live(GPT(cfg))
    idx = torch.randint(0, 64, (2, 18))
    torch.testing.assert_close(decode_in_pieces(m, idx), m(idx)[0], rtol=1e-4, atol=1e-4)


def test_plt_shift_zeroes_state_at_document_starts():
    """shift_states: h_(n-1) per token; zero at document starts; column 0 takes h_prev when given, else zero."""
    h = torch.arange(1, 7, dtype=torch.float).view(1, 6, 1)
    doc = torch.tensor([[0, 0, 0, 1, 1, 1]])
    assert L.shift_states(h, doc).flatten().tolist() == [0, 1, 2, 0, 4, 5]
    assert L.shift_states(h, None, torch.tensor([[9.0]])).flatten().tolist() == [9, 1, 2, 3, 4, 5]
    # with doc ids and h_prev: column 0 continues the previous chunk (its state from h_prev, never a reset);
    # a document start inside the chunk still resets, per row
    h2 = torch.tensor([[1., 2., 3., 4.], [5., 6., 7., 8.]])[..., None].repeat(1, 1, 2)   # (2, 4, 2)
    doc2 = torch.tensor([[3, 3, 4, 4], [7, 8, 8, 8]])
    prev = torch.tensor([[9., -9.], [10., -10.]])
    got = L.shift_states(h2, doc2, prev)
    assert got.tolist() == [[[9, -9], [1, 1], [0, 0], [3, 3]],
                            [[10, -10], [0, 0], [6, 6], [7, 7]]]
    assert L.shift_states(h2, doc2).tolist() == [[[0, 0], [1, 1], [0, 0], [3, 3]],
                                                 [[0, 0], [0, 0], [6, 6], [7, 7]]]


def test_plt_gate_starts_at_half():
    torch.manual_seed(0)
    inj = L.PLTInject(4096, "norm_gate")
    e, h = torch.randn(3, 4096), 100 * torch.randn(3, 4096)   # state 100x the embedding, as in the paper
    half = L.PLTInject(4096, "norm_half")
    torch.testing.assert_close(inj(e, h), half(e, h))
    raw = L.PLTInject(16, "add")(e, h)
    cos = torch.nn.functional.cosine_similarity
    assert cos(raw, e).abs().max() < 0.05             # ~ 1 / sqrt(1 + 100^2): the raw sum drowns the token
    assert cos(inj(e, h), e).min() > 0.65             # ~ 0.707 after normalising both halves


def test_plt_gate_init_zero_up_and_model_std_down():
    """GPT's init: the gate's up projection and bias stay zero (g = 1/2), its down projection is drawn
    N(0, init_std) like every matrix, and the two norms' gains are 1."""
    torch.manual_seed(0)
    m = GPT(tiny(d_model=64, loop=LoopConfig(start=1, length=2, n_loops=3, parallel=True, inject="norm_gate")))
    for inj in m.plt:
        assert not inj.up.weight.any() and not inj.up.bias.any()
        assert inj.down.weight.std().item() == pytest.approx(m.cfg.init_std, rel=0.1)
        assert torch.equal(inj.norm_e.weight, torch.ones(64)) and inj.norm_e.eps == m.cfg.norm_eps


@pytest.mark.parametrize("lk", [dict(), dict(kv_window=3)])
def test_plt_decodes_with_unlooped_number_of_sequential_block_calls(monkeypatch, lk):
    torch.manual_seed(0)
    m = GPT(tiny(n_experts=4, top_k=2, loop=LoopConfig(start=1, length=2, n_loops=3, parallel=True, **lk))).eval()
    calls = []
    orig = Block.forward
    monkeypatch.setattr(Block, "forward", lambda self, x, *a, **k: (calls.append(x.shape[0]), orig(self, x, *a, **k))[1])
    cache = m.new_cache(2, 8)
    m.forward_step(torch.randint(0, 64, (2, 4)), cache)   # prefill: loops run in order
    calls.clear()
    m.forward_step(torch.randint(0, 64, (2, 1)), cache)
    assert len(calls) == m.cfg.n_layer                     # 4 sequential calls, not 4 + 2 * 2
    assert calls == [2, 6, 6, 2]                            # the span runs as one batch of r * B rows


def test_kv_window_cache_is_smaller():
    full = GPT(tiny(loop=LoopConfig(start=1, length=2, n_loops=3, parallel=True))).new_cache(1, 32)
    win = GPT(tiny(loop=LoopConfig(start=1, length=2, n_loops=3, parallel=True, kv_window=4))).new_cache(1, 32)
    per_layer = 2 * 2 * 8 * 4                              # k+v, n_kv_head 2, head_dim 8, fp32 bytes
    assert full.nbytes() == per_layer * 32 * (2 + 2 * 3)   # 2 unlooped layers + 2 span layers x 3 loops
    assert win.nbytes() == per_layer * (32 * 4 + 2 * 2 * 3)  # loop 1 full, 2 later loops x ring of w - 1 = 3


def test_window_mask_lets_each_query_see_itself_and_the_key_before_it():
    """build_mask with window w=2 over 5 positions: causal band of width 2; empty slots (-1) and other documents hidden."""
    from attention import build_mask
    pos = torch.arange(5)
    got = build_mask(pos, pos, None, None, window=2)
    assert got.shape == (1, 1, 5, 5)
    assert got[0, 0].int().tolist() == [[1, 0, 0, 0, 0],
                                        [1, 1, 0, 0, 0],
                                        [0, 1, 1, 0, 0],
                                        [0, 0, 1, 1, 0],
                                        [0, 0, 0, 1, 1]]
    assert build_mask(pos, pos, None, None)[0, 0].int().tolist() == torch.ones(5, 5).tril().int().tolist()
    ring = torch.tensor([3, -1, 1, 2, 4])             # key positions of a ring, one empty slot
    doc = torch.tensor([[0, 0, 0, 1, 1]])
    got = build_mask(torch.tensor([4]), ring, doc[:, 4:], doc[:, ring.clamp(min=0)], window=3)
    assert got[0, 0].int().tolist() == [[1, 0, 0, 0, 1]]   # 3, 4; not 2 (other document), 1 (outside the window)


def test_kv_window_ring_holds_the_last_w_minus_1_keys_the_budget_counts():
    """PLT KV sharing: each later loop's ring holds exactly the last w - 1 positions' keys (w - 1 slots, as
    budget.kv_bytes_per_token counts them), and the window mask reads every one of them (the w-th key is
    the query's own)."""
    import budget
    from attention import build_mask
    torch.manual_seed(0)
    w, r, T, B = 3, 3, 10, 2
    cfg = tiny(loop=LoopConfig(start=1, length=2, n_loops=r, parallel=True, kv_window=w))
    m = live(GPT(cfg))
    idx = torch.randint(0, 64, (B, T))
    cap = {}
    with torch.no_grad():
        m.run(idx, capture=cap)
    cache = m.new_cache(B, T)
    assert cache.nbytes() == pytest.approx(B * T * budget.kv_bytes_per_token(cfg, 4, ctx_len=T), rel=1e-12)  # fp32
    n = 0
    for chunk in (4,) + (1,) * (T - 4):
        if n:
            ring_pos = cache.kv[("ring", 1)].pos
            assert int(build_mask(torch.tensor([n]), ring_pos, None, None, w).sum()) == w - 1   # no slot unread
        m.forward_step(idx[:, n:n + chunk], cache)
        n += chunk
        for layer in (1, 2):
            ring = cache.kv[("ring", layer)]
            assert ring.k.shape == (B * (r - 1), cfg.n_kv_head, w - 1, cfg.hd)
            assert sorted(ring.pos.tolist()) == list(range(n - w + 1, n))
            for p in range(n - w + 1, n):
                slot = p % (w - 1)
                assert int(ring.pos[slot]) == p
                for l in range(1, r):
                    torch.testing.assert_close(ring.k[(l - 1) * B:l * B, :, slot], cap[(layer, l)]["k"][:, :, p],
                                               rtol=1e-4, atol=1e-4)
                    torch.testing.assert_close(ring.v[(l - 1) * B:l * B, :, slot], cap[(layer, l)]["v"][:, :, p],
                                               rtol=1e-4, atol=1e-4)
