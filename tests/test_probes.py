"""Probes (SMELT Section 6): metric identities, shapes and ranges, bounded memory, Baseline, CLI."""
import json
import math
import os
import sys
import types

import pytest
import torch

import probes
import train as T
from loop import LoopConfig
from model import GPT, ModelConfig


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: one intra-op thread avoids spin-wait contention on a shared 2-core CPU."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=64, block_size=32, n_layer=4, d_model=32, n_head=4, n_kv_head=2, d_ff=16,
                n_experts=8, top_k=2, loop=LoopConfig(start=1, length=2, n_loops=2),
                moe_impl="reference")   # the slow reference MoE: no custom-op warm-up, same routing
    base.update(kw)
    return ModelConfig(**base)


def tiny_model(seed=0, **kw) -> GPT:
    torch.manual_seed(seed)
    return GPT(tiny_cfg(**kw)).eval()


def batches(n, B=2, T=32, seed=1, docs=True):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        idx = torch.randint(0, 64, (B, T), generator=g)
        doc = (torch.arange(T)[None].expand(B, T) >= 11).long() if docs else None   # two documents
        out.append((idx, idx.roll(-1, 1), doc))
    return out


def capture_of(model, idx, doc=None):
    cap = {}
    with torch.no_grad():
        model.run(idx, doc_ids=doc, capture=cap)
    return cap


# ----------------------------------------------------------------------------------------
# Pure functions

def test_doc_positions():
    doc = torch.tensor([[0, 0, 0, 1, 1, 2]])
    start, pos = probes.doc_positions(doc, 1, 6)
    assert start.tolist() == [[0, 0, 0, 3, 3, 5]]
    assert pos.tolist() == [[0, 1, 2, 0, 1, 0]]
    start, pos = probes.doc_positions(None, 2, 3)
    assert start.tolist() == [[0, 0, 0]] * 2 and pos.tolist() == [[0, 1, 2]] * 2


def test_expert_overlap_and_random_expectation():
    a = torch.tensor([[0, 1, 2], [0, 1, 2], [5, 6, 7]])
    b = torch.tensor([[2, 1, 0], [3, 1, 4], [0, 1, 2]])
    assert probes.expert_overlap(a, b).tolist() == [3, 1, 0]
    exp, pmf = probes.random_overlap(8, 64)
    assert exp == pytest.approx(1.0) and sum(pmf) == pytest.approx(1.0)
    assert sum(j * p for j, p in enumerate(pmf)) == pytest.approx(exp)        # hypergeometric mean = k^2/n


def test_attention_overlaps():
    p = torch.softmax(torch.randn(2, 3, 5, 7), -1)
    assert torch.allclose(probes.topk_overlap(p, p, 3), torch.ones(2, 3, 5))
    assert torch.allclose(probes.mass_overlap(p, p), torch.ones(2, 3, 5))
    e0, e1 = torch.zeros(7), torch.zeros(7)
    e0[0], e1[1] = 1, 1
    assert probes.topk_overlap(e0, e1, 1).item() == 0 and probes.mass_overlap(e0, e1).item() == 0
    q = torch.softmax(torch.randn(2, 3, 5, 7), -1)
    for v in (probes.topk_overlap(p, q, 2), probes.mass_overlap(p, q)):
        assert v.shape == (2, 3, 5) and (v >= 0).all() and (v <= 1 + 1e-6).all()


def test_sink_mass_reads_document_start():
    p = torch.zeros(1, 1, 4, 4)
    p[0, 0, :, 0] = 1.0                                   # everything on token 0
    start, _ = probes.doc_positions(torch.tensor([[0, 0, 1, 1]]), 1, 4)
    assert probes.sink_mass(p, start)[0, 0].tolist() == [1, 1, 0, 0]


def test_update_cosine_sums():
    u = torch.randn(10, 6)
    M = probes.update_cosine_sums([u, 2 * u, -u], chunk=3) / 10
    assert torch.allclose(M, torch.tensor([[1., 1, -1], [1, 1, -1], [-1, -1, 1]], dtype=torch.float64), atol=1e-6)


def test_cross_visit_pairs():
    for schedule in ("block", "per_layer"):
        m = tiny_model(loop=LoopConfig(start=1, length=2, n_loops=3, schedule=schedule))
        assert probes.cross_visit_pairs(m.plan) == [((1, 0), (1, 1)), ((1, 1), (1, 2)), ((2, 0), (2, 1)), ((2, 1), (2, 2))]
    assert probes.cross_visit_pairs(tiny_model(loop=LoopConfig()).plan) == []


# ----------------------------------------------------------------------------------------
# Identities: a layer visited twice with identical input

def test_identical_visits_hand_built_capture():
    """Copy visit 1's tensors into visit 2: overlap k, every cosine 1, ratios 1, attention overlap 1."""
    m = tiny_model()
    idx, _, doc = batches(1)[0]
    cap = capture_of(m, idx, doc)
    for layer in (1, 2):
        cap[(layer, 1)] = {k: v.clone() for k, v in cap[(layer, 0)].items()}
    acc = probes.ProbeAccumulator(m.plan, 4, 8, 2)
    acc.update(cap, doc)
    res = acc.result()
    assert len(res["cross_visit"]) == 2
    for d in res["cross_visit"].values():
        assert d["expert_overlap"]["distribution"][-1] == pytest.approx(1.0)
        assert d["expert_overlap"]["mean"] == pytest.approx(2.0)
        assert d["expert_overlap"]["random_mean"] == pytest.approx(2 * 2 / 8)
        for stage, c in d["cosine"].items():
            assert c == pytest.approx(1.0, abs=1e-5), stage
        for r, v in d["norm_ratio"].items():
            assert v == pytest.approx(1.0, abs=1e-6), r
        for key in ("top1", "top8", "mass"):
            assert d["attention"][key] == pytest.approx(1.0, abs=1e-6), key
    assert res["summary"]["update_cosine_cross_visit"] == pytest.approx(1.0, abs=1e-5)


def test_identity_looped_layers_give_identical_visits():
    """Looped layers that write nothing: both visits see the same input through the real model."""
    m = tiny_model()
    with torch.no_grad():
        for layer in (1, 2):
            m.blocks[layer].attn.wo.weight.zero_()
            m.blocks[layer].mlp.w_out.zero_()
    res = probes.probe(m, batches(2))
    for d in res["cross_visit"].values():
        assert d["expert_overlap"]["mean"] == pytest.approx(2.0)
        for stage in ("resid", "X", "Q", "K", "V", "PV"):
            assert d["cosine"][stage] == pytest.approx(1.0, abs=1e-5), stage
        for key in ("top1", "top8", "mass"):
            assert d["attention"][key] == pytest.approx(1.0, abs=1e-5), key
        assert d["norm_ratio"]["attn_norm"] == pytest.approx(1.0, abs=1e-5)


# ----------------------------------------------------------------------------------------
# Shapes and ranges on a random looped model; Baseline; memory

def test_shapes_and_ranges():
    m = tiny_model()
    res = probes.probe(m, batches(2))
    json.dumps(res)                                             # JSON-able
    assert res["tokens"] == 2 * 2 * 32
    V = len(m.plan)
    assert res["visits"] == [probes.label(v.layer, v.visit) for v in m.plan] and res["looped_layers"] == [1, 2]
    M = torch.tensor(res["update_cosine"]["matrix"])
    assert M.shape == (V, V) and torch.allclose(M, M.T, atol=1e-6)
    assert torch.allclose(M.diagonal(), torch.ones(V, dtype=M.dtype), atol=1e-5)
    assert (M.abs() <= 1 + 1e-6).all()
    assert len(res["update_cosine"]["cross_visit_diagonal"]) == 2
    for d in res["per_visit"].values():
        assert len(d["sink_mass_per_head"]) == 4 and 0 <= d["sink_mass"] <= 1
        assert d["x_rms"] > 0 and d["update_rms"] > 0 and d["relative_update"] > 0
    for d in res["cross_visit"].values():
        dist = d["expert_overlap"]["distribution"]
        assert len(dist) == 3 and sum(dist) == pytest.approx(1.0) and 0 <= d["expert_overlap"]["mean"] <= 2
        assert sum(d["expert_overlap"]["random_distribution"]) == pytest.approx(1.0)
        assert all(-1 - 1e-6 <= c <= 1 + 1e-6 for c in d["cosine"].values())
        assert all(r > 0 for r in d["norm_ratio"].values())
        assert all(0 <= v <= 1 + 1e-6 for v in d["attention"].values())
        assert set(d["attention"]) == {"top1", "top8", "mass", "top1_control", "top8_control", "mass_control"}
    s = res["summary"]
    assert 0 <= s["expert_overlap_frac"] <= 1 and s["ratio_update"] > 0 and s["update_cosine_other"] is not None


def test_memory_does_not_grow_with_batches():
    m = tiny_model()
    bs = batches(5)
    acc = probes.ProbeAccumulator(m.plan, 4, 8, 2)
    acc.update(capture_of(m, bs[0][0], bs[0][2]), bs[0][2])
    sizes1 = acc.state_sizes()
    for idx, _, doc in bs[1:]:
        acc.update(capture_of(m, idx, doc), doc)
    assert acc.state_sizes() == sizes1 and acc.tokens == 5 * 64
    n_visits = len(m.plan)
    assert max(math.prod(s) for s in sizes1.values()) <= max(n_visits * n_visits, 8)   # no (T,) or (T,T) state
    # streamed sums equal one big batch
    big = probes.ProbeAccumulator(m.plan, 4, 8, 2)
    idx, doc = torch.cat([b[0] for b in bs]), torch.cat([b[2] for b in bs])
    big.update(capture_of(m, idx, doc), doc)
    a, b = acc.result()["summary"], big.result()["summary"]
    for k in a:
        assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), k


def test_max_tokens_truncates():
    res = probes.probe(tiny_model(), batches(5), max_tokens=80)      # 80 tokens -> 3 rows of 32
    assert res["tokens"] == 96


def test_baseline_has_sink_but_no_cross_visit():
    m = tiny_model(loop=LoopConfig())
    res = probes.probe(m, batches(2))
    assert res["cross_visit"] == {} and res["looped_layers"] == []
    assert all(d["sink_mass"] is not None for d in res["per_visit"].values())
    assert res["summary"]["update_cosine_cross_visit"] is None and res["summary"]["expert_overlap"] is None
    assert len(res["update_cosine"]["matrix"]) == 4


def test_dense_and_partial_loops_run():
    res = probes.probe(tiny_model(n_experts=0), batches(1))           # dense: no expert overlap
    assert all("expert_overlap" not in d for d in res["cross_visit"].values())
    res = probes.probe(tiny_model(loop=LoopConfig(start=1, length=2, n_loops=2, part="mlp")), batches(1))
    d = next(iter(res["cross_visit"].values()))                        # attention runs once: no attention metrics
    assert d["attention"]["top1"] is None and d["expert_overlap"]["mean"] >= 0


# ----------------------------------------------------------------------------------------
# Dyck

def test_dyck_sequences_balanced():
    pairs = [(10, 11), (12, 13)]
    ids, match = probes.dyck_sequences(6, 20, pairs, seed=3)
    ids2, _ = probes.dyck_sequences(6, 20, pairs, seed=3)
    assert torch.equal(ids, ids2)
    opener = {c: o for o, c in pairs}
    for b in range(6):
        stack = []
        for t, tok in enumerate(ids[b].tolist()):
            if tok in opener:
                assert stack and ids[b, stack[-1]].item() == opener[tok] and match[b, t].item() == stack.pop()
            else:
                stack.append(t)
                assert match[b, t].item() == -1
        assert not stack


def test_dyck_case_study():
    m = tiny_model()
    out = probes.dyck_case_study(m, n_seqs=4, seed=0, bos=63)
    assert out["length"] == 30 and out["n_closers"] == 4 * 15
    assert set(out["visits"]) == {probes.label(v.layer, v.visit) for v in m.plan}
    assert 0 <= out["close_accuracy"] <= 1 and 0 < out["uniform"] < 1
    for d in out["visits"].values():
        for key in ("match_mass", "match_mass_predict", "first_token_mass"):
            assert len(d[key]) == 4 and all(0 <= x <= 1 for x in d[key])
    assert probes.dyck_case_study(m, n_seqs=4, seed=0, bos=63) == out


# ----------------------------------------------------------------------------------------
# Figures and CLI

def test_plots_and_cli(tmp_path, monkeypatch):
    loop_m, base_m = tiny_model(), tiny_model(seed=1, loop=LoopConfig())
    runs = {}
    for name, m in (("looped", loop_m), ("base", base_m)):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"model": m.cfg.to_dict(), "data_dir": str(tmp_path / "data")}))
        T.atomic_save({"model": m.state_dict()}, d / "ckpt.pt")
        runs[name] = str(d)

    class FakeTokenData:                                   # stands in for data.TokenData
        def __init__(self, data_dir):
            self.data_dir = data_dir

        def val_batches(self, source, batch_size, block_size, max_tokens):
            return iter(batches(3, B=batch_size, T=block_size))

    monkeypatch.setitem(sys.modules, "data", types.SimpleNamespace(TokenData=FakeTokenData))
    out = tmp_path / "out"
    report = probes.main(["--run", runs["looped"], "--baseline", runs["base"], "--max-tokens", "128",
                          "--batch-size", "2", "--dyck-seqs", "2", "--out", str(out), "--log-every", "0"])
    saved = json.loads((out / "probes.json").read_text())
    assert saved["baseline"]["cross_visit"] == {} and list(saved["runs"]) == ["looped"]
    assert saved["runs"]["looped"]["tokens"] == 128 and set(saved["dyck"]) == {"looped", "baseline"}
    names = {os.path.basename(p) for p in report["figures"]}
    for fig in ("fig21_expert_overlap.png", "fig22_residual_flow.png", "fig24_update_cosine.png",
                "fig25_cross_visit_cosines.png", "fig26_attended_token_overlap.png", "fig28_sink_heads.png",
                "fig30_attention_sink.png", "fig27_dyck.png"):
        assert fig in names, fig
    assert all(os.path.getsize(p) > 0 for p in report["figures"])
    grid = probes.plot_grid({"a": saved["runs"]["looped"], "b": saved["baseline"]}, str(tmp_path / "grid.png"))
    assert os.path.getsize(grid) > 0
