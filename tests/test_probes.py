"""Probes (SMELT Section 6): metric identities, the control head, units and intervals, the held-out sample,
the Dyck case study mechanics, claims, figures, CLI."""
import json
import math
import os
import shutil

import numpy as np
import pytest
import torch

import data
from lab import dyck_probe
from lab import probe_pairs
from lab import probe_claims
from lab import probe_plots
import probes
import checks
from lab import stats
from loop import LoopConfig
from model import GPT, ModelConfig



pytestmark = pytest.mark.usefixtures("one_thread")


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


def test_labels_number_visits_from_one_and_name_unlooped_layers():
    m = tiny_model()
    lab = probes.visit_labels(m.plan)
    assert lab == {(0, 0): "L0", (1, 0): "L1.v1", (2, 0): "L2.v1", (1, 1): "L1.v2", (2, 1): "L2.v2", (3, 0): "L3"}
    assert probes.pair_label((1, 0), (1, 1)) == "L1.v1-v2"


def test_control_heads_is_half_offset_permutation():
    assert probes.control_heads(4) == [2, 3, 0, 1]
    for H in (2, 3, 5, 8):
        c = probes.control_heads(H)
        assert sorted(c) == list(range(H)) and all(c[h] != h for h in range(H))   # every head once, never itself
    assert probes.control_heads(1) is None


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
    assert list(res["cross_visit"]) == ["L1.v1-v2", "L2.v1-v2"]
    for d in res["cross_visit"].values():
        assert d["visits"] == [1, 2]
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


def _one_capture():
    """(model, idx, capture, result) of one tiny-model batch through a ProbeAccumulator (4 heads, 8 experts, top-2)."""
    m = tiny_model()
    idx, _, doc = batches(1)[0]
    cap = capture_of(m, idx, doc)
    acc = probes.ProbeAccumulator(m.plan, 4, 8, 2)
    acc.update(cap, doc)
    return m, idx, cap, acc.result()


def test_per_visit_measures_match_a_direct_reference_on_the_capture():
    """x_rms, update_rms (attn + mlp write), relative_update ||dx||/||x||, sink mass (queries past their document's
    first token) and the overlap fraction / k, recomputed by hand from one real capture."""
    m, idx, cap, res = _one_capture()
    T, D = idx.shape[1], cap[(0, 0)]["x"].shape[-1]
    start = [0 if t < 11 else 11 for t in range(T)]                  # batches(): documents [0, 11) and [11, T)
    for (layer, visit), name in probes.visit_labels(m.plan).items():
        c, d = cap[(layer, visit)], res["per_visit"][name]
        x = c["x"].double()
        upd = c["attn_write"].double() + c["mlp_write"].double()
        assert d["x_rms"] == pytest.approx((x.norm(dim=-1) / math.sqrt(D)).mean().item(), rel=1e-5)
        assert d["update_rms"] == pytest.approx((upd.norm(dim=-1) / math.sqrt(D)).mean().item(), rel=1e-5)
        assert d["relative_update"] == pytest.approx((upd.norm(dim=-1) / x.norm(dim=-1)).mean().item(), rel=1e-5)
        p = c["attn_probs"].double()
        sink = [p[b, h, t, start[t]].item() for b in range(p.shape[0]) for h in range(4) for t in range(T)
                if t != start[t]]
        assert d["sink_mass"] == pytest.approx(sum(sink) / len(sink), rel=1e-5)
    s = res["summary"]
    assert s["expert_overlap_frac"] == pytest.approx(s["expert_overlap"] / 2)
    assert s["expert_overlap_random"] == pytest.approx(2 * 2 / 8)


def test_cross_visit_cosines_per_head_for_pv_and_the_unit_block_matches_the_result():
    """PV's cross-visit cosine is per token and head (Q, K, V: per token over the full vector); the units block's
    ucos_same / ucos_other pool to the result's same-layer and non-matching update-cosine means."""
    m, idx, cap, res = _one_capture()
    cos = lambda a, b: torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1).mean().item()
    heads = lambda x: x.view(*x.shape[:2], 4, -1)
    for layer in (1, 2):
        a, b = cap[(layer, 0)], cap[(layer, 1)]
        d = res["cross_visit"][f"L{layer}.v1-v2"]["cosine"]
        assert d["PV"] == pytest.approx(cos(heads(a["pv"]), heads(b["pv"])), rel=1e-5)
        assert abs(cos(heads(a["pv"]), heads(b["pv"])) - cos(a["pv"], b["pv"])) > 1e-4   # the two differ here
        assert d["Q"] == pytest.approx(cos(a["q"], b["q"]), rel=1e-5)
    q = res["units"]["quantities"]
    pooled = lambda n: np.asarray(q[n]["sum"]).sum(0) / np.sum(q[n]["count"])
    assert pooled("ucos_same") == pytest.approx(res["update_cosine"]["cross_visit_diagonal"], rel=1e-6)
    assert pooled("ucos_other") == pytest.approx([res["update_cosine"]["other_cross_visit_mean"]] * 2, rel=1e-6)


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


def test_control_is_other_head_same_layer_and_visit():
    """Heads h and h + H/2 attend identically within each visit, and visit 2 attends elsewhere than visit 1:
    the paper's control (same layer and visit) is 1, the same-head cross-visit overlap 0. The old pairing
    (head h on visit 1 vs head h + H/2 on visit 2) would have given 0."""
    m = tiny_model()
    idx, _, _ = batches(1)[0]
    cap = capture_of(m, idx)
    T = idx.shape[1]
    for layer in (1, 2):
        for visit, key in ((0, 0), (1, 1)):                           # visit 1 on key 0, visit 2 on the query itself
            p = torch.zeros(2, 4, T, T)
            if key == 0:
                p[..., 0] = 1.0
            else:
                p[:, :, torch.arange(T), torch.arange(T)] = 1.0
            cap[(layer, visit)]["attn_probs"] = p
    acc = probes.ProbeAccumulator(m.plan, 4, 8, 2, attn_topk=(1,))
    acc.update(cap)
    for d in acc.result()["cross_visit"].values():
        assert d["attention"]["top1_control"] == pytest.approx(1.0)
        assert d["attention"]["mass_control"] == pytest.approx(1.0)
        assert d["attention"]["top1"] == pytest.approx(0.0) and d["attention"]["mass"] == pytest.approx(0.0)
    # and a control head that attends differently from head h on the same visit gives 0
    for layer in (1, 2):
        for visit in (0, 1):
            p = torch.zeros(2, 4, T, T)
            p[:, :2, :, 0] = 1.0                                      # heads 0, 1 on the first key
            p[:, 2:, torch.arange(T), torch.arange(T)] = 1.0          # heads 2, 3 (their controls) on the query
            cap[(layer, visit)]["attn_probs"] = p
    acc = probes.ProbeAccumulator(m.plan, 4, 8, 2, attn_topk=(1,))
    acc.update(cap, torch.zeros_like(idx) + (torch.arange(T) >= 1))   # query 0 is its own document: left out
    for d in acc.result()["cross_visit"].values():
        assert d["attention"]["top1"] == pytest.approx(1.0) and d["attention"]["top1_control"] == pytest.approx(0.0)


# ----------------------------------------------------------------------------------------
# Shapes and ranges on a random looped model; Baseline; units

def test_shapes_and_ranges():
    m = tiny_model()
    res = probes.probe(m, batches(2))
    json.dumps(res)                                             # JSON-able
    assert res["tokens"] == 2 * 2 * 32
    V = len(m.plan)
    assert res["visits"] == ["L0", "L1.v1", "L2.v1", "L1.v2", "L2.v2", "L3"] and res["looped_layers"] == [1, 2]
    M = torch.tensor(res["update_cosine"]["matrix"])
    assert M.shape == (V, V) and torch.allclose(M, M.T, atol=1e-6)
    assert torch.allclose(M.diagonal(), torch.ones(V, dtype=M.dtype), atol=1e-5)
    assert (M.abs() <= 1 + 1e-6).all()
    assert len(res["update_cosine"]["cross_visit_diagonal"]) == 2
    for name, d in res["per_visit"].items():
        assert len(d["sink_mass_per_head"]) == 4 and 0 <= d["sink_mass"] <= 1
        assert d["x_rms"] > 0 and d["update_rms"] > 0 and d["relative_update"] > 0
        assert d["looped"] == (d["layer"] in (1, 2)) and d["visit"] in (1, 2)
    for d in res["cross_visit"].values():
        dist = d["expert_overlap"]["distribution"]
        assert len(dist) == 3 and sum(dist) == pytest.approx(1.0) and 0 <= d["expert_overlap"]["mean"] <= 2
        assert sum(d["expert_overlap"]["random_distribution"]) == pytest.approx(1.0)
        assert all(-1 - 1e-6 <= c <= 1 + 1e-6 for c in d["cosine"].values())
        assert all(r > 0 for r in d["norm_ratio"].values())
        assert all(0 <= v <= 1 + 1e-6 for v in d["attention"].values())
        assert set(d["attention"]) == {"top1", "top8", "mass", "top1_control", "top8_control", "mass_control"}
    s = res["summary"]
    assert 0 <= s["expert_overlap_frac"] <= 1 and s["ratio_update"] > 0
    # non-matching cross-visit pairs: another looped layer on a later visit (L1.v1 x L2.v2, L2.v1 x L1.v2)
    assert s["update_cosine_other"] == pytest.approx(((M[1, 4] + M[2, 3]) / 2).item(), abs=1e-6)
    pv = res["per_visit"]
    for v in (1, 2):
        assert s[f"sink_mass_span_v{v}"] == pytest.approx((pv[f"L1.v{v}"]["sink_mass"] + pv[f"L2.v{v}"]["sink_mass"]) / 2)


def test_units_sum_to_the_global_means_and_state_grows_only_with_units():
    m = tiny_model()
    bs = batches(4)
    keys = [("a", 0), ("b", 0)] * 4                              # 8 rows, two units
    res = probes.probe(m, bs, units=keys)
    assert res["units"]["keys"] == [["a", 0], ["b", 0]]
    q = res["units"]["quantities"]
    u = q["ratio_update"]
    S, n = np.array(u["sum"]), np.array(u["count"])               # (units, layers, visits), (units,)
    assert S.shape == (2, 2, 2) and n.tolist() == [4 * 32, 4 * 32]
    pooled = S.sum(0) / n.sum()
    for j, name in enumerate(("L1", "L2")):
        assert pooled[j, 0] == pytest.approx(res["per_visit"][f"{name}.v1"]["update_rms"], rel=1e-6)
        assert pooled[j, 1] == pytest.approx(res["per_visit"][f"{name}.v2"]["update_rms"], rel=1e-6)
    t8 = np.array(q["top8_same"]["sum"]).sum(0) / np.array(q["top8_same"]["count"]).sum()
    assert t8.mean() == pytest.approx(res["summary"]["attn_top8"], rel=1e-6)
    assert set(q) >= {"ratio_update", "ratio_attn_write", "ratio_mlp_write", "ucos_same", "ucos_other", "cos_Q",
                      "cos_V", "top8_same", "top8_control", "expert_overlap", "sink"}
    acc = probes.ProbeAccumulator(m.plan, 4, 8, 2)
    acc.update(capture_of(m, bs[0][0], bs[0][2]), bs[0][2], units=["a", "b"])
    sizes = acc.state_sizes()
    for idx, _, doc in bs[1:]:
        acc.update(capture_of(m, idx, doc), doc, units=["b", "a"])
    assert acc.state_sizes() == sizes and acc.tokens == 4 * 64        # no (T,) or (T, T) state, no growth
    n_visits = len(m.plan)
    assert max(math.prod(s) for s in sizes.values()) <= 2 * max(n_visits * n_visits, 8)
    with pytest.raises(ValueError, match="one key per row"):
        acc.update(capture_of(m, bs[0][0]), None, units=["a"])


def test_streamed_batches_equal_one_big_batch():
    m = tiny_model()
    bs = batches(3)
    a = probes.probe(m, bs)["summary"]
    idx, doc = torch.cat([b[0] for b in bs]), torch.cat([b[2] for b in bs])
    b = probes.probe(m, [(idx, None, doc)])["summary"]
    for k in a:
        assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), k


def test_max_tokens_truncates():
    res = probes.probe(tiny_model(), batches(5), max_tokens=80)      # 80 tokens -> 3 rows of 32
    assert res["tokens"] == 96


def test_baseline_has_sink_but_no_cross_visit():
    m = tiny_model(loop=LoopConfig())
    res = probes.probe(m, batches(2))
    assert res["cross_visit"] == {} and res["looped_layers"] == []
    assert list(res["per_visit"]) == ["L0", "L1", "L2", "L3"]
    assert all(d["sink_mass"] is not None and not d["looped"] for d in res["per_visit"].values())
    assert res["summary"]["update_cosine_cross_visit"] is None and res["summary"]["expert_overlap"] is None
    assert len(res["update_cosine"]["matrix"]) == 4


def test_dense_and_partial_loops_run():
    res = probes.probe(tiny_model(n_experts=0), batches(1))           # dense: no expert overlap
    assert all("expert_overlap" not in d for d in res["cross_visit"].values())
    res = probes.probe(tiny_model(loop=LoopConfig(start=1, length=2, n_loops=2, part="mlp")), batches(1))
    d = next(iter(res["cross_visit"].values()))                        # attention runs once: no attention metrics
    assert d["attention"]["top1"] is None and d["expert_overlap"]["mean"] >= 0


# ----------------------------------------------------------------------------------------
# The held-out sample

class FakeData:
    """Stands in for data.TokenData: sources in domains, a validation stream per source with known documents."""

    def __init__(self, docs: dict[str, tuple[str, list[int]]], vocab: int = 512, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.sources = list(docs)
        self.domains = {s: d for s, (d, _) in docs.items()}
        self.lengths = {s: np.array(L) for s, (_, L) in docs.items()}
        self.stream = {s: torch.randint(0, vocab - 1, (int(sum(L)),), generator=g) for s, (_, L) in docs.items()}
        self.eot = vocab - 1
        for s, L in self.lengths.items():                         # every document starts with EOT
            self.stream[s][np.concatenate([[0], np.cumsum(L)[:-1]])] = self.eot
        self.vocab = vocab

    def tokenizer(self):
        return data.get_tokenizer(self.vocab)

    def val_doc_lengths(self, source):
        return self.lengths[source]

    val_slots = data.TokenData.val_slots   # the real choice of contexts: spread over the stream

    @property
    def _val(self):
        return self.stream

    def val_batches(self, source, batch_size, block_size, max_tokens=None):
        st, T = self.stream[source], block_size
        slots = self.val_slots(source, T, max_tokens)
        for b in range(0, len(slots), batch_size):
            rows = torch.stack([st[k * T:k * T + T + 1] for k in slots[b:b + batch_size]])
            idx = rows[:, :-1]
            doc = torch.cumsum(idx == self.eot, 1)
            yield idx, rows[:, 1:], doc - doc[:, :1]


def fake_data():
    return FakeData({"c1": ("code", [100, 300]), "c2": ("code", [64, 64, 200]), "m1": ("math", [500]),
                     "p1": ("prose", [20] * 20), "p2": ("prose", [90]), "x1": ("prose", [10])})


def test_held_out_sample_spans_domains_equally():
    d = fake_data()
    s = probes.held_out_sample(d, tokens=3 * 4 * 32, block_size=32)   # 4 contexts per domain
    desc = s.describe()
    assert desc["domains"] == ["code", "math", "prose"]
    assert desc["tokens_by_domain"] == {"code": 128, "math": 128, "prose": 128}
    assert desc["tokens_by_source"] == {"c1": 64, "c2": 64, "m1": 128, "p1": 64, "p2": 64}   # round-robin; x1 too short
    assert s.idx.shape == (12, 32) and len(s.units) == 12
    # Two of a source's contexts are taken spread over its stream (data.val_slots): c1 reads tokens 0-31 and
    # 352-383, in its documents [0, 100) and [100, 400): two units; c2 (documents at 0, 64, 128) 0-31 and
    # 288-319: two; p1 (20-token documents) 0-31 and 352-383: two; p2 (one 90-token document) 0-31 and 32-63:
    # one; m1's four contexts (slots 0, 5, 9, 14) all lie in its one 500-token document: one unit.
    assert s.units == [("c1", 0), ("c1", 1), ("c2", 0), ("c2", 1), ("m1", 0), ("m1", 0), ("m1", 0), ("m1", 0),
                       ("p1", 0), ("p1", 1), ("p2", 0), ("p2", 0)]
    assert torch.equal(s.idx[1], d.stream["c1"][352:384])
    d2 = FakeData({"a": ("code", [32, 32, 40])})                      # a document starts exactly at 32
    s2 = probes.held_out_sample(d2, tokens=64, block_size=32)
    assert s2.units == [("a", 0), ("a", 1)]
    with pytest.raises(ValueError, match="block_size"):
        probes.held_out_sample(d, tokens=16, block_size=32)


# ----------------------------------------------------------------------------------------
# Dyck case study (Sec. 6.4)

ENC = None


def enc512():
    global ENC
    ENC = ENC or data.get_tokenizer(512)
    return ENC


def test_dyck_prompts_honour_k_and_mark_demonstration_answers():
    enc = enc512()
    P = dyck_probe.dyck_prompts(enc, 192, ks=(1, 2, 4, 8), n_items=3)
    assert P["ks"] == [1, 2, 4] and P["skipped_k"] == [8]              # k = 8 cannot fit 192 tokens
    by_item = {}
    for p in P["prompts"]:
        assert len(p["tokens"]) <= 192 and p["tokens"][0] == enc.eot_token
        text = enc.decode(p["tokens"])
        assert text.count("Output:") == p["k"] + 1                    # k demonstrations + the query
        demo_text = "".join(enc.decode([p["tokens"][i]]) for i in p["demo"])
        assert set(demo_text) <= set(" )]}>") and demo_text.strip()    # only demonstration-answer brackets
        answer = [enc.decode([t]) for t in p["answer"]]
        assert len(p["targets"]) == 3 and all(a in dyck_probe.CLOSERS for a in answer)
        assert [p["tokens"][t + 1] for t in p["targets"]] == p["answer"]   # each target predicts its bracket
        by_item.setdefault(p["item"], []).append(p)
    assert len(by_item) == 3
    for ps in by_item.values():
        assert [p["k"] for p in ps] == [1, 2, 4]
        k1 = enc.decode(ps[0]["tokens"])
        # nested: the k = 1 demonstration opens every larger prompt; its answer holds every target bracket
        first_demo = k1[:k1.rindex("Input:")]
        assert all(enc.decode(p["tokens"]).startswith(first_demo) for p in ps)
        demo1 = "".join(enc.decode([ps[0]["tokens"][i]]) for i in ps[0]["demo"])
        assert {enc.decode([t]) for t in ps[0]["answer"]} <= set(demo1)
    assert dyck_probe.dyck_prompts(enc, 48)["prompts"] == []


def test_dyck_case_study_mechanics():
    enc = enc512()
    m = tiny_model(vocab_size=512, block_size=192).train()
    out = dyck_probe.dyck_case_study(m, enc, ks=(1, 2, 4), n_items=2)
    assert out["ks"] == [1, 2, 4] and set(out["by_k"]) == {"1", "2", "4"} and out["n_prompts"] == 6
    assert m.training                                                  # run in eval mode, its mode then restored
    assert out["visits"] == [1, 2] and out["layers"] == [1, 2]
    E = torch.tensor(out["ablation_effect"])                            # (span layers, heads)
    li, hi = divmod(int(E.argmax()), 4)
    assert (out["head"]["layer"], out["head"]["head"]) == (out["layers"][li], hi)
    assert out["head"]["effect"] == pytest.approx(float(E.max()))
    for b, d, o in zip(out["mass"]["bos"], out["mass"]["demo"], out["mass"]["other"]):
        for v in range(2):                                             # BOS + demonstrations + rest = 1
            assert b[v] + d[v] + o[v] == pytest.approx(1.0, abs=1e-5) and min(b[v], d[v], o[v]) >= 0
    for k, row in out["by_k"].items():
        assert row["n"] == 2 and len(row["bos_mass"]) == 2
    # the ablation is "zero the head's slice of W_O's input": zeroing W_O's columns gives the same effect
    L, h = out["head"]["layer"], out["head"]["head"]
    P = dyck_probe.dyck_prompts(enc, 192, ks=(1, 2, 4), n_items=2)
    m2 = tiny_model(vocab_size=512, block_size=192)
    with torch.no_grad():
        m2.blocks[L].attn.wo.weight[:, h * 8:(h + 1) * 8] = 0
    again = dyck_probe.dyck_case_study(m2, enc, prompts=P)
    assert out["selection_k"] == 4                                     # the head is chosen on the k = 4 prompts
    assert out["by_k"]["4"]["target_loss"] == pytest.approx(out["selection_loss"], rel=1e-6)
    assert sum(r["n"] * r["target_loss"] for r in out["by_k"].values()) / 6 == pytest.approx(out["clean_loss"], rel=1e-6)
    for bad in (-1, 4):                                                # 4 heads: 0 to 3
        with pytest.raises(ValueError, match="head must be in"):
            with dyck_probe.ablate_head(m, L, bad):
                pass
    assert again["selection_loss"] - out["selection_loss"] == pytest.approx(out["head"]["effect"], abs=1e-5)
    every = dyck_probe.dyck_case_study(m, enc, prompts=P, select_k=None)   # or on every prompt
    assert every["selection_k"] is None and every["selection_loss"] == pytest.approx(out["clean_loss"])
    ex = out["example"]
    assert ex["k"] == 4 and len(ex["attention"]) == 2 and len(ex["attention"][0]) == 3
    json.dumps(out)


# ----------------------------------------------------------------------------------------
# probe_pairs, claims, figures

def models_pair(seed):
    """(Baseline, looped) random models with the 512-token tokenizer's vocabulary."""
    return (tiny_model(seed, vocab_size=512, block_size=192, loop=LoopConfig()),
            tiny_model(seed + 1, vocab_size=512, block_size=192))


@pytest.fixture(scope="module")
def pairs_result():
    pairs = [(f"p{i}", *models_pair(2 * i)) for i in range(2)]
    # 768 tokens make 13 held-out units: a percentile bootstrap over fewer than 10 decides nothing (stats)
    return probe_pairs.probe_pairs(pairs, fake_data(), tokens=6 * 4 * 32, block_size=32, batch_size=4,
                              dyck_items=2, dyck_ks=(1, 2), dyck_block_size=192, n_draws=200, log=None)


def test_probe_pairs_result(pairs_result):
    r = pairs_result
    json.dumps(r)
    assert r["order"] == ["p0", "p1"] and r["sample"]["tokens"] == 768 and r["sample"]["units"] >= stats.MIN_BOOTSTRAP_UNITS
    for e in r["pairs"].values():
        assert e["baseline"]["tokens"] == e["smelt"]["tokens"] == 768
        assert e["smelt"]["units"]["keys"] == e["baseline"]["units"]["keys"]   # the same held-out units
        assert e["dyck"]["ks"] == [1, 2]
    a = r["aggregate"]["smelt/ratio_update"]
    assert a == pytest.approx((r["pairs"]["p0"]["smelt"]["summary"]["ratio_update"]
                               + r["pairs"]["p1"]["smelt"]["summary"]["ratio_update"]) / 2)


def test_claims(pairs_result):
    cs = probe_claims.claims(pairs_result, n_draws=200)
    ids = [c["id"] for c in cs]
    assert ids == ["update_ratio", "attn_write_ratio", "moe_write_ratio", "norm_ratio", "update_cosine",
                   "q_stabler_than_v", "k_stabler_than_v", "q_keeps_input", "k_keeps_input", "v_below_input",
                   "top8_overlap", "expert_overlap", "sink_shrinks",
                   "dyck_bos_falls", "dyck_demo_rises"]
    for c in cs:
        iv = c["interval"]
        assert isinstance(iv, stats.Interval) and iv.resolved and iv.lo <= iv.hi, c["id"]
        held_out = stats.verdict(iv, c["direction"], c["value"])   # needs the across-pairs verdict to agree
        agree = held_out == stats.verdict(c["across_pairs"], c["direction"], c["value"])
        assert c["verdict"] == (held_out if agree else "not resolved"), c["id"]
        assert set(c["per_pair"]) == {"p0", "p1"}
        assert iv.mean == pytest.approx(np.mean([x.mean for x in c["per_pair"].values()]), abs=1e-9), c["id"]
        pick = min if c["direction"] == ">" else max
        assert c["weakest"].mean == pytest.approx(pick(x.mean for x in c["per_pair"].values()), abs=1e-9)
        json.dumps(probe_claims.claim_json(c))
    by = {c["id"]: c for c in cs}
    s0 = pairs_result["pairs"]["p0"]["smelt"]["summary"]
    assert by["update_ratio"]["per_pair"]["p0"].mean == pytest.approx(s0["ratio_update"], rel=1e-6)
    assert by["top8_overlap"]["per_pair"]["p0"].mean == pytest.approx(s0["attn_top8"] - s0["attn_top8_control"],
                                                                      rel=1e-6)
    assert by["sink_shrinks"]["per_pair"]["p0"].mean == pytest.approx(
        s0["sink_mass_span_v2"] - s0["sink_mass_span_v1"], rel=1e-6)
    assert by["expert_overlap"]["per_pair"]["p0"].mean == pytest.approx(s0["expert_overlap"] - 2 * 2 / 8, rel=1e-6)


def test_claim_intervals_on_a_known_effect(pairs_result):
    """Hand-set unit sums: visit 2 writes exactly 2x (pair p0) and 2.1x (p1) visit 1 in every unit -> held-out
    interval [2.05, 2.05], across pairs a t-interval above 1: reproduced; a pair with one visit-2 sink below and
    one above visit 1 -> an interval that straddles 0 (not resolved)."""
    r = json.loads(json.dumps(pairs_result))
    for i, e in enumerate(r["pairs"].values()):
        q = e["smelt"]["units"]["quantities"]
        S = np.array(q["ratio_update"]["sum"])
        S[..., 1] = (2 + 0.1 * i) * S[..., 0]
        q["ratio_update"]["sum"] = S.tolist()
        K = np.array(q["sink"]["sum"])
        K[:, :, 1] = K[:, :, 0] + np.where(np.arange(len(K)) % 2 == 0, 0.5, -0.5)[:, None] * np.array(q["sink"]["count"])[:, None]
        q["sink"]["sum"] = K.tolist()
    by = {c["id"]: c for c in probe_claims.claims(r, n_draws=300)}
    iv = by["update_ratio"]["interval"]
    assert (iv.mean, iv.lo, iv.hi) == pytest.approx((2.05, 2.05, 2.05)) and by["update_ratio"]["verdict"] == "reproduced"
    assert 1 < by["update_ratio"]["across_pairs"].lo < 2 < 2.1 < by["update_ratio"]["across_pairs"].hi
    assert by["sink_shrinks"]["interval"].lo < 0 < by["sink_shrinks"]["interval"].hi
    assert by["sink_shrinks"]["verdict"] == "not resolved"


def test_an_every_cell_claim_needs_its_weakest_pair(pairs_result):
    """"In all 16 cells, all four norm ratios exceed 1": pair p1's units alternate 0.65x / 1.75x (its interval
    straddles 1), p0 sits just above p1's mean in every unit; the mean over pairs is above 1 on both intervals,
    but the weakest pair is not, so the claim is not resolved. A claim not made of every cell is not marked."""
    r = json.loads(json.dumps(pairs_result))

    def set_ratio(name, per_unit):
        q = r["pairs"][name]["smelt"]["units"]["quantities"]
        S = np.array(q["ratio_update"]["sum"])
        S[..., 1] = np.asarray(per_unit(S.shape[0])).reshape(-1, *[1] * (S.ndim - 2)) * S[..., 0]
        q["ratio_update"]["sum"] = S.tolist()

    set_ratio("p1", lambda U: np.where(np.arange(U) % 2 == 0, 0.65, 1.75))
    p1 = probe_claims.claims(r, n_draws=300)[0]["per_pair"]["p1"].mean
    set_ratio("p0", lambda U: np.full(U, p1 + 0.01))
    c = {c["id"]: c for c in probe_claims.claims(r, n_draws=300)}["update_ratio"]
    assert stats.verdict(c["interval"], ">", 1.0) == "reproduced" == stats.verdict(c["across_pairs"], ">", 1.0)
    assert c["weakest"].lo < 1.0 < c["weakest"].hi and c["verdict"] == "not resolved"
    assert dict(probe_claims.claimed())["ratio_update"].every_cell
    assert not dict(probe_claims.claimed())["ucos_gap"].every_cell


def test_claims_refuse_pairs_on_different_units(pairs_result):
    r = json.loads(json.dumps(pairs_result))
    r["pairs"]["p1"]["smelt"]["units"]["keys"][0] = ["elsewhere", 0]
    with pytest.raises(ValueError, match="same held-out units"):
        probe_claims.claims(r, n_draws=10)


def test_figures(pairs_result, tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    paths = probe_plots.plot_pairs(pairs_result, str(tmp_path), detail=["p1"])
    names = {os.path.relpath(p, tmp_path) for p in paths}
    assert {"fig23_grid.png", "fig56_sink_profiles.png"} <= names
    for n in ("p1",):
        for fig in ("fig21_expert_overlap", "fig22_residual_flow", "fig24_update_cosine", "fig25_cross_visit_cosines",
                    "fig26_attended_token_overlap", "fig28_sink_heads", "fig30_attention_sink", "fig27_dyck"):
            assert os.path.join(n, fig + ".png") in names
    assert all(os.path.getsize(p) > 0 for p in paths)
    # heat maps are scaled to their data, not to a fixed 0-1
    fig, ax = plt.subplots()
    im = probe_plots._heat(ax, [[0.031, 0.034], [0.029, 0.036]], "magma")
    assert im.get_clim() == pytest.approx((0.029, 0.036))
    im = probe_plots._heat(ax, [[0.01, -0.02]], "RdBu_r", symmetric=True)
    assert im.get_clim() == pytest.approx((-0.02, 0.02))
    # sink profile: visits 1 and 2 in the span, unlooped layers named as such, never a "visit 0"
    e = pairs_result["pairs"]["p0"]
    probe_plots._sink_profile(ax, e["smelt"], e["baseline"])
    labels = ax.get_legend_handles_labels()[1]
    assert labels == ["Baseline", "SMELT, unlooped layers", "SMELT visit 1 (looped span)", "SMELT visit 2 (looped span)"]
    plt.close(fig)


def test_cli(tmp_path, monkeypatch):
    runs = {}
    for name, m in (("base", tiny_model(1, vocab_size=512, block_size=192, loop=LoopConfig())),
                    ("smelt", tiny_model(0, vocab_size=512, block_size=192))):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"model": m.cfg.to_dict(), "data_dir": str(tmp_path / "data"),
                                                   "train": {"block_size": 32}}))
        checks.atomic_save({"model": m.state_dict()}, d / "ckpt.pt")
        runs[name] = str(d)
    fake = fake_data()
    fake.tokenizer()                                                  # built before data is swapped out
    monkeypatch.setattr(data, "TokenData", lambda data_dir: fake)
    out = tmp_path / "out"
    report = probe_pairs.main(["--pair", "cell", runs["base"], runs["smelt"], "--tokens", "192", "--batch-size", "4",
                          "--dyck-items", "1", "--draws", "50", "--out-dir", str(out)])
    saved = json.loads((out / "probes.json").read_text())
    assert saved["sample"]["tokens"] == 3 * 2 * 32 and list(saved["pairs"]) == ["cell"]
    assert saved["pairs"]["cell"]["baseline"]["cross_visit"] == {}
    assert {c["id"] for c in saved["claims"]} >= {"update_ratio", "sink_shrinks", "dyck_demo_rises"}
    dyck = saved["pairs"]["cell"]["dyck"]          # Dyck prompts must fit the 32-token training context: none do
    assert dyck["skipped_k"] == [1, 2, 4, 8] and dyck["n_prompts"] == 0 and "error" in dyck
    assert {c["id"]: c["verdict"] for c in saved["claims"]}["dyck_demo_rises"] == "not resolved"
    assert all(os.path.exists(p) for p in report["figures"])
    assert checks.read_hashed_json(out / "probes.json")["figures"] == [os.path.relpath(p, out) for p in report["figures"]]
    moved = tmp_path / "moved"                                        # a copied out dir reads back from the copy
    shutil.copytree(out, moved)
    shutil.rmtree(out)
    again = probe_pairs.load_result(moved / "probes.json")
    assert again["figures"] == [str(moved / os.path.relpath(p, out)) for p in report["figures"]]
    assert all(os.path.exists(p) for p in again["figures"]) and again["claims"] == saved["claims"]


def test_probes_json_refuses_a_figure_outside_its_folder(tmp_path):
    (tmp_path / "elsewhere.png").write_bytes(b"png")
    res = {"sample": {}, "pairs": {}, "claims": [], "figures": [str(tmp_path / "elsewhere.png")]}
    with pytest.raises(ValueError, match=r"figure .*elsewhere\.png lies outside .*out"):
        probe_pairs.save_result(tmp_path / "out" / "probes.json", res)


def test_model_object_pairs_are_checked_too():
    base, smelt = models_pair(0)
    with pytest.raises(ValueError, match=r"pair 'p': <GPT object> \(Baseline\) and <GPT object> \(SMELT\) are "
                                         r"not a matched pair: swapped"):
        probe_pairs.probe_pairs([("p", smelt, base)], fake_data(), tokens=64, block_size=32)
    with pytest.raises(ValueError, match="one run twice"):
        probe_pairs.probe_pairs([("p", smelt, smelt)], fake_data(), tokens=64, block_size=32)
    other = tiny_model(0, vocab_size=256, block_size=192)
    with pytest.raises(ValueError, match="vocab_size 512 vs 256"):
        probe_pairs.probe_pairs([("p", base, other)], fake_data(), tokens=64, block_size=32)


# ----------------------------------------------------------------------------------------
# The quantity registry: one place per quantity

def test_registry_reads_exactly_what_the_accumulator_writes(pairs_result):
    written = set(pairs_result["pairs"]["p0"]["smelt"]["units"]["quantities"])
    read = {d for q in probe_claims.QUANTITIES.values() for d in q.reads}
    assert read == written
    assert probe_claims.COS_STAGES == ("update", *probes.STAGES)
    assert set(pairs_result["pair_intervals"]) == {n for n, _ in probe_claims.panels()}


def test_one_registry_row_reaches_intervals_claims_and_figure(pairs_result, tmp_path, monkeypatch):
    """A quantity registered in one place (a row of probe_claims.QUANTITIES) gets its per-pair intervals
    (what probe_pairs stores as "pair_intervals"), its claim in claims() and its own panel in Fig. 23."""
    row = probe_claims.Quantity(
        ("cos_V",), lambda m, _: 1 - float(m.sum()) / m.size,
        claim=probe_claims.Claim("v_moves", ">", 0.0, "Fig. 25", "1 - cross-visit cosine of V, visit {b} vs {a}",
                                 "new", ("cos_V",)),
        panel=probe_claims.Panel("i", "1 - V cosine, {vb} vs {va}", hline=0.0))
    monkeypatch.setitem(probe_claims.QUANTITIES, "v_distance", row)
    s0 = pairs_result["pairs"]["p0"]["smelt"]["summary"]
    ivs = probe_claims.panel_intervals(pairs_result, n_draws=50)
    assert set(ivs["v_distance"]) == {"p0", "p1"}
    assert ivs["v_distance"]["p0"]["mean"] == pytest.approx(1 - s0["cos_V"], rel=1e-6)
    cs = probe_claims.claims(pairs_result, n_draws=50)
    ids = [c["id"] for c in cs]
    assert ids.index("v_moves") == ids.index("sink_shrinks") + 1          # after the held-out claims, before Dyck
    c = cs[ids.index("v_moves")]
    assert c["what"] == "1 - cross-visit cosine of V, visit 2 vs 1" and set(c["per_pair"]) == {"p0", "p1"}
    assert c["verdict"] == stats.verdict(c["interval"], ">", 0.0) and set(c["parts"]) == {"cos_V"}
    figs = []
    monkeypatch.setattr(probe_plots, "_save", lambda fig, path, paths=None, tight=True: figs.append(fig) or path)
    probe_plots.plot_grid(pairs_result, str(tmp_path / "grid.png"), n_draws=50)
    titles = [ax.get_title() for ax in figs[0].axes if ax.get_title()]
    assert len(titles) == 9 and titles[-1] == "(i) 1 - V cosine, v2 vs v1" and len(figs[0].axes) == 12
    probe_plots.plots.pyplot().close(figs[0])


def test_labels_say_visit_v_plus_1_beyond_two_visits(pairs_result):
    assert probe_claims.visit_words(2) == {"a": "1", "b": "2", "va": "v1", "vb": "v2"}
    assert probe_claims.visit_words(3)["b"] == "v+1"
    r = json.loads(json.dumps(pairs_result))
    by = {c["id"]: c["what"] for c in probe_claims.claims(r, n_draws=10)}
    assert by["update_ratio"] == "visit-2 / visit-1 norm of the full update Δx"      # r = 2: as before
    assert by["sink_shrinks"] == "attention-sink mass in the looped span, visit 2 minus visit 1"
    r["pairs"]["p0"]["smelt"]["per_visit"]["L1.v3"] = {**r["pairs"]["p0"]["smelt"]["per_visit"]["L1.v2"], "visit": 3}
    by = {c["id"]: c["what"] for c in probe_claims.claims(r, n_draws=10)}
    assert by["update_ratio"] == "visit-v+1 / visit-v norm of the full update Δx"
    assert by["sink_shrinks"] == "attention-sink mass in the looped span, visit v+1 minus visit v"
