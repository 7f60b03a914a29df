"""moe.py: grouped matmul against its reference, the MoE layer against its loop and Mixtral's block."""
import pytest
import torch
import torch.nn.functional as F

from moe import MoE, _combine_reference, combine, grouped_mm, grouped_mm_reference


def _rand_case(sizes, d_in=16, d_out=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    sizes = torch.tensor(sizes)
    x = torch.randn(int(sizes.sum()), d_in, generator=g, requires_grad=True)
    w = torch.randn(len(sizes), d_in, d_out, generator=g, requires_grad=True)
    return x, w, sizes


def _cpu_grouped_mm_or_skip():
    """torch._grouped_mm has a CPU kernel in torch 2.13 (fp32 and bf16); skip, saying so, where it does not."""
    try:
        torch._grouped_mm(torch.zeros(4, 8), torch.zeros(2, 8, 8), offs=torch.tensor([2, 4], dtype=torch.int32))
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"torch._grouped_mm has no CPU kernel in torch {torch.__version__}: {e}")


@pytest.mark.parametrize("impl", ["loop", "torch"])   # torch: the fused CUDA path, run by torch on CPU too
@pytest.mark.parametrize("sizes", [[3, 5, 2, 7], [0, 6, 0, 4], [9, 0, 0, 0], [0, 0, 0, 11]])
def test_grouped_mm_matches_reference_values_and_grads(sizes, impl):
    if impl == "torch":
        _cpu_grouped_mm_or_skip()
    x, w, s = _rand_case(sizes)
    dy = torch.randn(x.shape[0], w.shape[2])
    y = grouped_mm(x, w, s, impl=impl)
    (y * dy).sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    y_ref = grouped_mm_reference(x, w, s)
    (y_ref * dy).sum().backward()
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(gw, w.grad)   # empty groups get exactly zero weight gradient
    for g, n in enumerate(sizes):
        if n == 0:
            assert gw[g].abs().max() == 0


@pytest.mark.parametrize("impl", ["loop", "torch", "padded"])
def test_grouped_mm_stride0_grad_and_shape_errors(impl):
    if impl == "torch":
        _cpu_grouped_mm_or_skip()
    x, w, s = _rand_case([2, 0, 3])
    grouped_mm(x, w, s, impl=impl).sum().backward()   # .sum() hands back an expanded, stride-0 gradient
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    grouped_mm_reference(x, w, s).sum().backward()
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(gw, w.grad)
    with pytest.raises(ValueError, match="do not fit"):
        grouped_mm(x, w[:, :3], s, impl=impl)


def test_grouped_mm_traces_without_graph_break():
    x, w, s = _rand_case([4, 0, 3])
    f = torch.compile(lambda a, b, c: grouped_mm(a, b, c, impl="loop"), backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(f(x, w, s), grouped_mm_reference(x, w, s))


def _moe(E=8, k=2, D=32, Fd=16, renorm=True, seed=0):
    torch.manual_seed(seed)
    m = MoE(D, Fd, E, k, renormalize=renorm)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return m


@pytest.mark.parametrize("renorm", [True, False])
def test_moe_matches_per_token_loop(renorm):
    m = _moe(renorm=renorm)
    x = torch.randn(2, 7, 32)
    y, st = m(x)
    torch.testing.assert_close(y, m.forward_reference(x), rtol=1e-5, atol=1e-5)
    assert st.tokens_per_expert.sum() == 2 * 7 * 2 and st.topk_idx.shape == (2, 7, 2)
    assert st.aux_loss > 0 and st.z_loss > 0


@pytest.mark.parametrize("k", [1, 2])
def test_router_losses_match_mixtral_and_st_moe(k):
    """The load-balancing loss equals transformers' Mixtral load_balancing_loss_func divided by k (it
    sums the top-k token fractions to k; Switch's normalisation is 1 at balance), the z-loss the
    ST-MoE formula mean(logsumexp(logits)^2), both from the same router logits."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    m = _moe(E=6, k=k)
    x = torch.randn(2, 7, 32)
    _, st = m(x)
    logits = F.linear(x.view(-1, 32), m.router.weight).float()
    E = m.router.weight.shape[0]
    torch.testing.assert_close(st.aux_loss, load_balancing_loss_func((logits,), E, k) / k)
    torch.testing.assert_close(st.z_loss, torch.logsumexp(logits, -1).square().mean())


@pytest.mark.parametrize("renorm", [True, False])
def test_router_weights_are_softmax_topk_renormalised_or_raw(renorm):
    """topk_weight: the top-k of softmax(x W_r), divided by their sum when renormalize, else the raw probabilities."""
    m = _moe(E=6, k=2, renorm=renorm)
    x = torch.randn(2, 7, 32)
    _, st = m(x)
    p = F.linear(x.view(-1, 32), m.router.weight).float().softmax(-1)
    top = p.topk(2, dim=-1)
    want = top.values / top.values.sum(-1, keepdim=True) if renorm else top.values
    assert torch.equal(st.topk_idx.view(-1, 2), top.indices)
    torch.testing.assert_close(st.topk_weight.view(-1, 2), want)
    assert (st.topk_weight.sum(-1) < 0.999).all() != renorm        # raw top-2 of 6 experts sum below one


def test_router_loss_gradients_match_mixtral_and_st_moe():
    """d aux / d W_r and d z / d W_r equal autograd through Mixtral's load_balancing_loss_func / k and the ST-MoE formula."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    m = _moe(E=6, k=2)
    x = torch.randn(2, 7, 32)
    _, st = m(x)
    g_aux = torch.autograd.grad(st.aux_loss, m.router.weight, retain_graph=True)
    g_z = torch.autograd.grad(st.z_loss, m.router.weight)
    w = m.router.weight.detach().clone().requires_grad_(True)
    want_aux, = torch.autograd.grad(load_balancing_loss_func((F.linear(x.view(-1, 32), w),), 6, 2) / 2, w)
    want_z, = torch.autograd.grad(torch.logsumexp(F.linear(x.view(-1, 32), w), -1).square().mean(), w)
    assert want_aux.abs().max() > 1e-4 and want_z.abs().max() > 1e-4
    torch.testing.assert_close(g_aux[0], want_aux)
    torch.testing.assert_close(g_z[0], want_z)


def test_router_logits_softmax_and_losses_in_fp32_under_bf16_autocast():
    """Under bf16 autocast the router's logits (not bf16 products upcast), softmax, weights and losses are fp32:
    top-k choices and the z-loss do not see bf16 rounding."""
    m = _moe(E=6, k=2)
    x = torch.randn(2, 7, 32)
    logits = F.linear(x.view(-1, 32), m.router.weight)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, st = m(x)
        assert F.linear(x.view(-1, 32), m.router.weight).dtype == torch.bfloat16   # what autocast would do
    assert st.topk_weight.dtype == st.aux_loss.dtype == st.z_loss.dtype == torch.float32
    top = logits.softmax(-1).topk(2, dim=-1).values
    torch.testing.assert_close(st.topk_weight.view(-1, 2), top / top.sum(-1, keepdim=True), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(st.z_loss, torch.logsumexp(logits, -1).square().mean(), rtol=1e-6, atol=1e-6)


def test_moe_one_expert_takes_all_tokens():
    m = _moe(E=4, k=1)
    with torch.no_grad():
        m.router.weight.zero_()
        m.router.weight[2, 0] = 100.0
    x = torch.randn(1, 6, 32)
    x[..., 0] = 1.0
    y, st = m(x)
    assert st.tokens_per_expert.tolist() == [0, 0, 6, 0]
    torch.testing.assert_close(y, m.forward_reference(x), rtol=1e-5, atol=1e-5)
    y.sum().backward()
    assert m.w_in.grad[[0, 1, 3]].abs().max() == 0 and m.w_in.grad[2].abs().max() > 0


def test_moe_matches_transformers_mixtral_block():
    transformers = pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    m = _moe(E=8, k=2, D=32, Fd=16)
    cfg = transformers.MixtralConfig(hidden_size=32, intermediate_size=16, num_local_experts=8,
                                     num_experts_per_tok=2, router_jitter_noise=0.0)
    hf = MixtralSparseMoeBlock(cfg).eval()
    with torch.no_grad():
        hf.gate.weight.copy_(m.router.weight)
        hf.experts.gate_up_proj.copy_(m.w_in.transpose(1, 2))   # ours (E, D, 2F) = [gate | up]
        hf.experts.down_proj.copy_(m.w_out.transpose(1, 2))     # ours (E, F, D)
    x = torch.randn(3, 5, 32)
    torch.testing.assert_close(m(x)[0], hf(x), rtol=1e-5, atol=1e-5)


def test_moe_rejects_bad_topk():
    with pytest.raises(ValueError, match="top_k"):
        MoE(8, 8, 4, 5)


def _grads_fast_and_reference(m, x, dy):
    """[input grad, every parameter grad] of the fast forward and of the per-token reference."""
    grads = []
    for fn in (lambda t: m(t)[0], m.forward_reference):
        m.zero_grad()
        x.grad = None
        (fn(x) * dy).sum().backward()
        grads.append([x.grad.clone()] + [p.grad.clone() for p in m.parameters()])
    return grads


def test_moe_gradients_match_per_token_loop():
    m = _moe(E=6, k=2)
    x = torch.randn(2, 5, 32, requires_grad=True)
    dy = torch.randn(2, 5, 32)
    grads = _grads_fast_and_reference(m, x, dy)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- combine without atomics (issue 54)

def _routed_rows(N, k, E, D, dtype, seed):
    """Rows sorted by expert as MoE.forward makes them: y_sorted (N*k, D) and each row's token (N*k,)."""
    g = torch.Generator().manual_seed(seed)
    idx_Nk = torch.rand(N, E, generator=g).argsort(-1)[:, :k]                 # k distinct experts per token
    token = torch.argsort(idx_Nk.flatten(), stable=True) // k
    y = torch.randn(N * k, D, generator=g) * torch.logspace(-4, 4, D)         # wide magnitudes: rounding shows
    return y.to(dtype).requires_grad_(), token


def _bits(t):   # the bit pattern: torch.equal alone calls -0.0 and +0.0 equal
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


@pytest.mark.parametrize("rows,out", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                      (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)])
@pytest.mark.parametrize("N,k,E,D", [(1, 1, 1, 8), (37, 1, 4, 16), (64, 2, 8, 78), (33, 8, 8, 32),
                                     (50, 8, 16, 5), (300, 4, 32, 160)])
def test_combine_is_the_index_add_bit_for_bit(N, k, E, D, rows, out):
    """moe.combine against the index_add_ it replaced (_combine_reference): the same bits, values and grads."""
    y, token = _routed_rows(N, k, E, D, rows, seed=N + k)
    dy = torch.randn(N, D).to(out)
    res = []
    for fn in (_combine_reference, combine):
        y.grad = None
        o = fn(y, token, N, out)
        o.backward(dy)
        res.append((o.detach(), y.grad))
    (a, ga), (b, gb) = res
    assert a.dtype == b.dtype == out and a.shape == (N, D)
    assert torch.equal(_bits(a), _bits(b)) and torch.equal(_bits(ga), _bits(gb))


def test_combine_order_is_what_makes_the_bits_agree():
    """The test above has teeth: each token's rows added in reverse order differ from index_add_'s bits."""
    N, k = 300, 8
    y, token = _routed_rows(N, k, 16, 160, torch.float32, seed=1)
    rows_Nk = torch.argsort(token, stable=True).view(N, k)
    reversed_ND = torch.zeros(N, 160)
    for y_j in y[rows_Nk.flip(1)].unbind(1):
        reversed_ND = reversed_ND + y_j
    ref = _combine_reference(y, token, N, torch.float32)
    eps = torch.finfo(torch.float32).eps
    assert 0 < (reversed_ND - ref).abs().max() <= 8 * eps * y.abs().max()   # rounding only, but other bits


@pytest.mark.parametrize("k,E,impl,equal,autocast", [(1, 4, "loop", False, False), (2, 8, "loop", False, False),
                                                     (8, 8, "loop", False, False), (8, 16, "padded", False, False),
                                                     (2, 8, "loop", True, False), (8, 8, "loop", True, False),
                                                     (4, 8, "loop", False, True)])
def test_moe_with_combine_is_the_index_add_layer_bit_for_bit(monkeypatch, k, E, impl, equal, autocast):
    """The whole layer with combine and with index_add_: same output and every gradient, bit for bit.
    equal: a zero router, so every token's k experts weigh 1/k; autocast: bf16 rows, fp32 output."""
    import moe as moe_lib
    fast, ref = moe_lib.combine, moe_lib._combine_reference
    m = _moe(E=E, k=k)
    m.impl = impl
    if equal:
        with torch.no_grad():
            m.router.weight.zero_()
    x = torch.randn(3, 11, 32, requires_grad=True)
    dy = torch.randn(3, 11, 32)
    outs = []
    for fn in (ref, fast):
        monkeypatch.setattr(moe_lib, "combine", fn)
        m.zero_grad()
        x.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y, st = m(x)
        y.backward(dy)
        outs.append([y.detach(), x.grad.clone()] + [p.grad.clone() for p in m.parameters()])
    if equal:
        assert torch.equal(st.topk_weight, torch.full_like(st.topk_weight, 1 / k))
    for a, b in zip(*outs):
        assert torch.equal(_bits(a), _bits(b))


# ---------------------------------------------------------------- static fallback, autocast, host reads

@pytest.mark.parametrize("sizes,tile", [([3, 5, 2, 7], None), ([0, 6, 0, 4], 4), ([9, 0, 0, 0], 2),
                                        ([0, 0, 0, 11], 8), ([5, 5, 5, 5], 4), ([1, 1, 1, 1], 3)])
def test_padded_grouped_mm_matches_reference_values_and_grads(sizes, tile):
    """[5,5,5,5] with tiles of 4 needs 8 tiles of the 20 // 4 + 4 = 9 allotted: the bound is tight enough."""
    from moe import grouped_mm_padded
    x, w, s = _rand_case(sizes)
    dy = torch.randn(x.shape[0], w.shape[2])
    (grouped_mm_padded(x, w, s, tile) * dy).sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    y_ref = grouped_mm_reference(x, w, s)
    (y_ref * dy).sum().backward()
    torch.testing.assert_close(grouped_mm_padded(x, w, s, tile), y_ref)
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(gw, w.grad)
    for g, n in enumerate(sizes):
        if n == 0:
            assert gw[g].abs().max() == 0


def test_padded_tile_rows_is_a_multiple_of_8_near_a_quarter_of_the_mean_group():
    from moe import padded_tile_rows
    assert padded_tile_rows(32768, 64) == 128     # bench.py moe's shape: mean group 512
    assert padded_tile_rows(100, 16) == 8         # small groups: the floor of 8 rows
    assert padded_tile_rows(4096, 4) % 8 == 0


def test_auto_picks_the_cpu_loop_eagerly_and_rejects_unknown_impls():
    from moe import resolve_impl
    cpu = torch.device("cpu")
    assert resolve_impl("auto", cpu, torch.float32, 64, 64) == "loop"
    assert resolve_impl("auto", cpu, torch.bfloat16, 64, 64) == "loop"   # the fused kernel is CUDA-only
    assert resolve_impl("padded", cpu, torch.float32, 64, 64) == "padded"
    with pytest.raises(ValueError, match="impl"):
        MoE(8, 8, 4, 2, impl="fast")


def test_torch_grouped_mm_bf16_values_match_the_reference():
    _cpu_grouped_mm_or_skip()
    x, w, s = _rand_case([5, 0, 9, 6])
    xb, wb = x.detach().bfloat16(), w.detach().bfloat16()
    torch.testing.assert_close(grouped_mm(xb, wb, s, impl="torch").float(), grouped_mm_reference(xb, wb, s).float(),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("impl", ["padded", "reference", "torch"])
def test_moe_impls_agree_with_the_loop(impl):
    if impl == "torch":
        _cpu_grouped_mm_or_skip()
    m = _moe(E=6, k=2)
    x = torch.randn(2, 9, 32, requires_grad=True)
    dy = torch.randn(2, 9, 32)
    outs = []
    for name in ("loop", impl):
        m.impl = name
        m.zero_grad()
        x.grad = None
        y = m(x)[0]
        (y * dy).sum().backward()
        outs.append([y.detach(), x.grad.clone()] + [p.grad.clone() for p in m.parameters()])
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_experts_compute_in_bf16_under_autocast(monkeypatch):
    """The fp32 residual stream under autocast: the experts still multiply in bf16 (before issue 15 they
    got fp32 inputs and torch.mm(out=) bypassed autocast), and the layer returns the input's dtype."""
    import moe as moe_lib
    seen = []
    real = moe_lib.grouped_mm
    monkeypatch.setattr(moe_lib, "grouped_mm", lambda x, w, s, impl="auto": seen.append((x.dtype, w.dtype)) or real(x, w, s, impl))
    m = _moe(E=4, k=2)
    x = torch.randn(2, 5, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, _ = m(x)
        assert m.kernels(x) == ("loop", "loop")
    assert seen == [(torch.bfloat16, torch.bfloat16)] * 2 and y.dtype == torch.float32
    seen.clear()
    y32, _ = m(x)
    assert seen == [(torch.float32, torch.float32)] * 2
    assert 0 < (y - y32).abs().max() < 0.05 * y32.abs().max()   # bf16 rounding, nothing more


def count_host_reads(fn) -> int:
    """Calls of Tensor.tolist / item / __int__ / __float__ / __bool__ made while fn() runs (each a
    device-to-host read: a sync on a GPU)."""
    names = ("tolist", "item", "__int__", "__float__", "__bool__")
    real = {n: getattr(torch.Tensor, n) for n in names}
    count = [0]

    def wrap(f):
        def g(*a, **k):
            count[0] += 1
            return f(*a, **k)
        return g
    try:
        for n in names:
            setattr(torch.Tensor, n, wrap(real[n]))
        fn()
    finally:
        for n in names:
            setattr(torch.Tensor, n, real[n])
    return count[0]


def test_padded_moe_step_reads_nothing_back_where_the_loop_does():
    m = _moe(E=6, k=2)
    x = torch.randn(2, 9, 32, requires_grad=True)

    def step(impl):
        def f():
            m.impl = impl
            m(x)[0].square().sum().backward()
        return f
    assert count_host_reads(step("padded")) == 0   # router counts, sort, pad, bmm, combine: all on the device
    assert count_host_reads(step("loop")) > 0      # the loop reads group sizes (free on CPU, a sync on GPU)


# ---------------------------------------------------------------- shared experts

def _shared_moe(n_shared, E=6, k=2, D=32, Fd=16, seed=0):
    torch.manual_seed(seed)
    m = MoE(D, Fd, E, k, n_shared=n_shared)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return m


@pytest.mark.parametrize("n_shared", [1, 3])
@pytest.mark.parametrize("impl", ["loop", "padded"])
def test_shared_experts_match_per_token_loop_values_and_grads(n_shared, impl):
    m = _shared_moe(n_shared)
    m.impl = impl
    assert m.shared_w_in.shape == (n_shared, 32, 32) and m.shared_w_out.shape == (n_shared, 16, 32)
    x = torch.randn(2, 5, 32, requires_grad=True)
    dy = torch.randn(2, 5, 32)
    grads = _grads_fast_and_reference(m, x, dy)
    torch.testing.assert_close(m(x)[0], m.forward_reference(x), rtol=1e-5, atol=1e-5)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_shared_experts_add_dense_swiglus_to_the_routed_output():
    m = _shared_moe(2)
    routed = MoE(32, 16, 6, 2)
    routed.load_state_dict({k: v for k, v in m.state_dict().items() if not k.startswith("shared_")})
    x = torch.randn(3, 4, 32)
    swiglu = sum(torch.nn.functional.silu(x @ w[:, :16]) * (x @ w[:, 16:]) @ wo
                 for w, wo in zip(m.shared_w_in, m.shared_w_out))
    torch.testing.assert_close(m(x)[0], routed(x)[0] + swiglu, rtol=1e-5, atol=1e-5)


def test_shared_experts_off_by_default_and_declared_for_the_init():
    torch.manual_seed(0)
    plain = MoE(16, 8, 4, 2)
    torch.manual_seed(0)
    off = MoE(16, 8, 4, 2, n_shared=0)
    assert [n for n, _ in off.named_parameters()] == ["w_in", "w_out", "router.weight"]
    for a, b in zip(plain.parameters(), off.parameters()):
        assert torch.equal(a, b)                                # no new parameter, same RNG draws
    assert off.shared_w_in is None and off.shared_w_out is None
    on = MoE(16, 8, 4, 2, n_shared=1)
    assert MoE.RESIDUAL_OUT == ("w_out", "shared_w_out")
    assert all(isinstance(getattr(on, n), torch.nn.Parameter) for n in MoE.RESIDUAL_OUT)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="n_shared"):
            MoE(16, 8, 4, 2, n_shared=bad)


def test_shared_experts_compute_in_bf16_under_autocast():
    m = _shared_moe(1, E=4)
    x = torch.randn(2, 5, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, _ = m(x)
    y32, _ = m(x)
    assert y.dtype == torch.float32
    assert 0 < (y - y32).abs().max() < 0.05 * y32.abs().max()   # bf16 rounding, nothing more


@pytest.mark.parametrize("n_shared", [1, 2])
def test_shared_experts_match_transformers_qwen2_moe_block(n_shared):
    """Qwen2-MoE gates its shared expert with sigmoid(x w_g): a zero w_g gives 1/2 exactly, so its down
    projection doubled gives our ungated sum; n_shared experts of width F are one of width n_shared * F."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    m = _shared_moe(n_shared, E=8, k=2, D=32, Fd=16)
    cfg = transformers.Qwen2MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
                                      norm_topk_prob=True, shared_expert_intermediate_size=16 * n_shared)
    hf = Qwen2MoeSparseMoeBlock(cfg).eval()
    with torch.no_grad():
        hf.gate.weight.copy_(m.router.weight)
        hf.experts.gate_up_proj.copy_(m.w_in.transpose(1, 2))     # ours (E, D, 2F) = [gate | up]
        hf.experts.down_proj.copy_(m.w_out.transpose(1, 2))       # ours (E, F, D)
        hf.shared_expert.gate_proj.weight.copy_(torch.cat([w[:, :16].t() for w in m.shared_w_in]))
        hf.shared_expert.up_proj.weight.copy_(torch.cat([w[:, 16:].t() for w in m.shared_w_in]))
        hf.shared_expert.down_proj.weight.copy_(2 * torch.cat(list(m.shared_w_out)).t())
        hf.shared_expert_gate.weight.zero_()
    x = torch.randn(3, 5, 32)
    torch.testing.assert_close(m(x)[0], hf(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_matches_its_reference_bit_for_bit(dtype):
    """attention.apply_rope (x cos + [x2 | x1] sin, four ops) equals the obvious rotation of half pairs
    exactly, values and gradients, and a rotation keeps each pair's norm."""
    from attention import apply_rope, apply_rope_reference, rope_table
    cos, sin = rope_table(40, 22, 10000.0)
    x0 = torch.randn(2, 3, 40, 22).to(dtype)
    dy = torch.randn(2, 3, 40, 22).to(dtype)
    outs = []
    for fn in (apply_rope, apply_rope_reference):
        x = x0.clone().requires_grad_()
        y = fn(x, cos, sin)
        y.backward(dy)
        outs.append((y.detach(), x.grad))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    y = outs[0][0].float()
    norm = lambda t: t[..., :11].square() + t[..., 11:].square()   # noqa: E731
    torch.testing.assert_close(norm(y), norm(x0.float()), rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-2)
