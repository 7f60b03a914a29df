"""eval.py: option scoring, exact match = greedy decoding, truncation, statistics, length buckets, calibration."""
import json
import math
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn as nn

import eval as ev
from loop import LoopConfig
from model import GPT, ModelConfig


class CharTok:
    """A character tokenizer: printable ASCII -> 1..95 (and a few more), id 0 = EOT/BOS."""
    eot_token = 0

    def encode(self, s: str) -> list[int]:
        return [min(ord(c), 126) - 31 if ord(c) >= 32 else 96 + (ord(c) % 8) for c in s]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(t + 31) if t < 96 else chr(t - 96) for t in ids)


V = 104


class Successor(nn.Module):
    """Rigged LM: after token t it prefers t + 1 by `margin` logits over every other token."""

    def __init__(self, margin: float = 2.0, bos: int | None = None):
        super().__init__()
        self.margin, self.bos, self.calls = margin, bos, []
        self.cfg = SimpleNamespace(vocab_size=V)

    def forward(self, idx, targets=None, doc_ids=None):
        if self.bos is not None:
            assert (idx[:, 0] == self.bos).all(), "BOS must open every scored sequence"
        self.calls.append(tuple(idx.shape))
        return self.margin * nn.functional.one_hot((idx + 1) % V, V).float(), None


def mc_task(items, norm="token"):
    return ev.Task("toy", "mc", items, rho=0.5, chance=0.5, category="toy", origin="generated", norm=norm)


# ---------------------------------------------------------------------------- scoring

def test_mc_picks_the_option_the_rigged_model_prefers():
    tok = CharTok()
    # "abc" -> the model prefers "d" then "e": option "de" wins over "xq" whichever is gold
    items = [ev.Item("abc", "de", ["de", "xq"]), ev.Item("abc", "xq", ["de", "xq"]),
             ev.Item("klm", "no", ["zz", "no"]), ev.Item("klm", "zz", ["zz", "no"])]
    r = ev.evaluate_task(Successor(bos=0), tok, mc_task(items), k=0, block_size=64)
    assert r["acc"] == 0.5 and r["seeds"] == 1
    assert [r["per_item"][r["items"].index(i)] for i in range(4)] == [1, 0, 1, 0]
    assert r["centred"] == pytest.approx(0.0)   # rho = 0.5


def test_length_normalisation_changes_the_pick():
    # successor tokens cost a = log(e^2 + V - 1) - 2 each, a wrong token b = log(e^2 + V - 1):
    # "defg" (4a ~ 10.5) loses to "x" (b ~ 4.6) on the sum, wins per token (2.6 < 4.6)
    items = [ev.Item("abc", "defg", ["defg", "x"])]
    assert ev.evaluate_task(Successor(), CharTok(), mc_task(items, "token"), 0, block_size=64)["acc"] == 1
    assert ev.evaluate_task(Successor(), CharTok(), mc_task(items, "char"), 0, block_size=64)["acc"] == 1
    assert ev.evaluate_task(Successor(), CharTok(), mc_task(items, "none"), 0, block_size=64)["acc"] == 0


def test_gold_loss_and_exact_match_on_the_rigged_model():
    m = 3.0
    items = [ev.Item("abc", "de"), ev.Item("pq", "rz")]          # "de" all successors, "rz" not
    t = ev.Task("toy", "gen", items, 0.0, None, "toy", "generated")
    r = ev.evaluate_task(Successor(m), CharTok(), t, 0, block_size=64)
    a, b = math.log(math.exp(m) + V - 1) - m, math.log(math.exp(m) + V - 1)
    assert r["acc"] == 0.5 and r["gold_tokens"] == 4
    assert r["gold_loss"] == pytest.approx((3 * a + b) / 4, rel=1e-5)   # token-weighted micro average


def test_demonstrations_vary_with_seed_and_are_batched():
    items = [ev.Item(f"q{i} =", f" {i % 7}") for i in range(12)]
    t = ev.Task("toy", "gen", items, 0.0, None, "toy", "generated")
    model = Successor()
    r = ev.evaluate_task(model, CharTok(), t, k=3, seeds=4, max_items=5, block_size=128)
    assert r["seeds"] == 4 and r["n_items"] == 5 and len(r["acc_by_seed"]) == 4
    assert len(model.calls) == 1          # 20 prompts scored in one forward
    prompts = {ev.build_prompt(items[0], [items[j] for j in random.Random(f"toy/{s}/0").sample(range(1, 12), 3)])[0]
               for s in range(4)}
    assert len(prompts) > 1               # seeds change the choice / order of demonstrations


def test_prompt_moves_trailing_space_into_the_continuation():
    demo, item = ev.Item("\nQ: 1+1\nA: ", "2"), ev.Item("\nQ: 2+2\nA: ", "4", prefix="add:", sep="\n")
    ctx, conts = ev.build_prompt(item, [demo])
    assert ctx == "add:\nQ: 1+1\nA: 2\n\nQ: 2+2\nA:" and conts == [" 4"]


def test_exact_match_equals_greedy_generation():
    """Teacher-forced argmax match == GPT.generate(temperature=0) reproduces the answer."""
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=V, block_size=48, n_layer=2, d_model=32, n_head=4, n_kv_head=2, d_ff=64)).eval()
    tok = CharTok()
    items = []
    for i, q in enumerate(["ab =", "xyz =", "hello =", "q =", "1 2 3 =", "zz ="]):
        ids = torch.tensor([[0] + tok.encode(q)])
        out = model.generate(ids, 3, temperature=0)[0, ids.shape[1]:].tolist()
        if 0 in out:                                                     # EOT cannot be written as text
            continue
        greedy = tok.decode(out)
        if i % 2 == 0:
            items.append((ev.Item(q, greedy), True))                     # the greedy answer itself
        else:
            wrong = greedy[:2] + ("a" if greedy[2] != "a" else "b")      # differs in the last token
            items.append((ev.Item(q, wrong), False))
    assert len(items) >= 4 and any(want for _, want in items)
    t = ev.Task("toy", "gen", [it for it, _ in items], 0.0, None, "toy", "generated")
    r = ev.evaluate_task(model, tok, t, 0, block_size=48)
    got = {i: c for i, c in zip(r["items"], r["per_item"])}
    assert [bool(got[i]) for i in range(len(items))] == [want for _, want in items]


def _live_gpt(block_size: int = 32, **kw) -> GPT:
    torch.manual_seed(0)
    m = GPT(ModelConfig(vocab_size=V, block_size=block_size, n_layer=4, d_model=32, n_head=4, n_kv_head=2, d_ff=48, **kw))
    for p in m.parameters():          # zero-initialised adapters / PLT gates get values so they matter
        if p.abs().sum() == 0:
            nn.init.normal_(p, std=0.05)
    return m.eval()


@pytest.mark.parametrize("kw", [dict(), dict(n_experts=4, top_k=2),
                                dict(loop=LoopConfig(start=1, length=2, n_loops=2)),
                                dict(loop=LoopConfig(start=1, length=2, n_loops=3, parallel=True)),
                                dict(loop=LoopConfig(start=1, length=2, n_loops=2, parallel=True, kv_window=3))])
def test_shared_context_scoring_equals_scoring_each_sequence(kw):
    """score_options (prefill once, Cache.repeat, one batch of options) == score_continuations."""
    m = _live_gpt(**kw)
    torch.manual_seed(1)
    head = [0] + torch.randint(1, V, (12,)).tolist()
    tails = [torch.randint(1, V, (n,)).tolist() for n in (1, 3, 2, 5)]
    shared = ev.score_options(m, head, tails, block_size=32)
    each = ev.score_continuations(m, [(head + t, len(t)) for t in tails], block_size=32)
    for (a, na, ga), (b, nb, gb) in zip(shared, each):
        assert na == nb and ga == gb and a == pytest.approx(b, rel=1e-5, abs=1e-5)
    long_head = head * 4                                   # 52 tokens: cut once, to fit the longest option
    cut = ev.score_options(m, long_head, tails, block_size=32)
    ref = ev.score_continuations(m, [(ev.truncate_left(long_head, 27) + t, len(t)) for t in tails], block_size=32)
    assert [c[0] for c in cut] == pytest.approx([r[0] for r in ref], rel=1e-5, abs=1e-5)
    with pytest.raises(ValueError, match="no room"):
        ev.score_options(m, head, [[1] * 31], block_size=32)


def test_mc_task_on_a_gpt_uses_shared_context_with_the_same_result():
    options = [" 0", " 11", " 222"]                     # options of different lengths: a padded batch
    items = [ev.Item(f"q{i} =", options[i % 3], options=options, group="g") for i in range(9)]
    task = mc_task(items)
    m = _live_gpt(block_size=64)

    class NoCache(nn.Module):          # the same model without new_cache: the per-sequence path
        def __init__(self):
            super().__init__()
            self.m, self.cfg = m, m.cfg

        def forward(self, idx):
            return self.m(idx)

    for block in (64, 20):             # 64: every prompt fits; 20: contexts are cut (once, to fit the longest option)
        a = ev.evaluate_task(m, CharTok(), task, k=2, seeds=3, block_size=block)
        b = ev.evaluate_task(NoCache(), CharTok(), task, k=2, seeds=3, block_size=block)
        assert a["per_item_by_seed"] == b["per_item_by_seed"] and a["n_items"] == b["n_items"] == 9


def test_truncation_keeps_bos():
    toks = [7] + list(range(100, 140))
    cut = ev.truncate_left(toks, 16)
    assert len(cut) == 16 and cut[0] == 7 and cut[1:] == toks[-15:]
    assert ev.truncate_left(toks[:10], 16) == toks[:10]
    # scoring a too-long prompt: every forwarded row opens with BOS (Successor asserts it) and the
    # result equals scoring the manually truncated sequence
    long = [0] + CharTok().encode("abcdefghij" * 10)
    r1 = ev.score_continuations(Successor(bos=0), [(long, 5)], block_size=32)
    r2 = ev.score_continuations(Successor(bos=0), [(ev.truncate_left(long, 32), 5)], block_size=32)
    assert r1 == r2


def test_long_answers_are_skipped_not_truncated():
    items = [ev.Item("a", "b" * 40), ev.Item("a", "b")]
    t = ev.Task("toy", "gen", items, 0.0, None, "toy", "generated")
    r = ev.evaluate_task(Successor(), CharTok(), t, 0, block_size=16)
    assert r["skipped"] == 1 and r["n_items"] == 1


# ---------------------------------------------------------------------------- statistics

def test_centred_accuracy():
    assert ev.centred_accuracy(0.25, 0.25) == 0 and ev.centred_accuracy(1.0, 0.25) == 1
    assert ev.centred_accuracy(0.625, 0.25) == pytest.approx(0.5)
    assert ev.centred_accuracy(0.1, 0.0) == pytest.approx(0.1)
    with pytest.raises(ValueError):
        ev.centred_accuracy(0.5, 1.0)


def test_permutation_test():
    rng = np.random.default_rng(0)
    a = rng.random(60)
    assert ev.permutation_test(a, a, n=2000, seed=1) == 1.0
    b = a + 0.3 + 0.05 * rng.standard_normal(60)
    assert ev.permutation_test(b, a, n=2000, seed=1) < 0.01
    noise = a + 0.05 * rng.standard_normal(60)
    assert ev.permutation_test(noise, a, n=2000, seed=1) > 0.05
    with pytest.raises(ValueError):
        ev.permutation_test([1, 2], [1, 2, 3])


# ---------------------------------------------------------------------------- validation loss

def test_length_buckets_from_doc_ids():
    doc = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2],
                        [0] * 16])
    lengths = ev.segment_lengths(doc)
    assert lengths[0].tolist() == [3] * 3 + [2] * 2 + [11] * 11 and lengths[1].tolist() == [16] * 16
    assert ev.length_bounds(4096) == [32, 64, 128, 256, 512, 1024, 2048, 4096]
    assert ev.length_bounds(16) == [1, 2, 4, 8, 16] and ev.length_bounds(100)[-1] == 128
    assert ev.length_bucket(lengths, 16)[0].tolist() == [4] * 3 + [2] * 2 + [16] * 11
    assert ev.length_bucket(torch.tensor([40, 9000]), 4096).tolist() == [64, 4096]   # longer: top bucket


class FakeData:
    """TokenData stand-in: two sources in two domains, packed docs (each starting with EOT = 0)."""
    sources = ["a", "b"]
    domains = {"a": "code", "b": "web"}

    def __init__(self, with_lengths: bool):
        g = torch.Generator().manual_seed(0)
        self.rows = {s: torch.randint(1, V, (3, 17), generator=g) for s in self.sources}
        for r in self.rows.values():
            r[:, [0, 5, 7]] = 0                                     # documents of 5, 2 and 10+ tokens
        self.with_lengths = with_lengths

    def val_batches(self, source, batch_size, block_size, max_tokens=None, **kw):
        if kw and not self.with_lengths:
            raise TypeError("val_batches() got an unexpected keyword argument")
        rows = self.rows[source]
        idx, tgt = rows[:, :-1], rows[:, 1:]
        doc = torch.cumsum(idx == 0, 1)
        lengths = ev.segment_lengths(doc)                                 # the documents end in the row
        batches = [(idx[b:b + batch_size], tgt[b:b + batch_size], doc[b:b + batch_size], lengths[b:b + batch_size])
                   for b in range(0, len(rows), batch_size)]
        return iter([bt if kw.get("doc_lengths") else bt[:3] for bt in batches])


def test_val_loss_report_weights_tokens():
    model = Successor(margin=1.0)
    rep = ev.val_loss_report(model, FakeData(False), block_size=16, batch_size=2)
    data = FakeData(False)
    nll = {s: nn.functional.cross_entropy(model(r[:, :-1])[0].transpose(1, 2), r[:, 1:], reduction="none")
           for s, r in data.rows.items()}
    assert rep["by_source"]["a"] == pytest.approx(float(nll["a"].mean()), rel=1e-5)
    assert rep["by_domain"]["web"] == pytest.approx(float(nll["b"].mean()), rel=1e-5)
    allnll = torch.cat([nll["a"], nll["b"]])
    assert rep["loss"] == pytest.approx(float(allnll.mean()), rel=1e-5) and rep["tokens"] == 96
    # positions 0-4 -> doc of 5 tokens (bucket 8), 5-6 -> 2 (bucket 2), 7-15 -> 9 (bucket 16)
    assert rep["tokens_by_length"] == {2: 12, 8: 30, 16: 54} and rep["length_from"] == "segment"
    assert rep["by_length"][2] == pytest.approx(float(allnll[:, 5:7].mean()), rel=1e-5)


def test_normalised_shape():
    ref = {32: 3.0, 64: 2.8, 128: 2.6, 256: 2.5}
    new = {32: 2.9, 64: 2.7, 128: 2.4, 256: 2.2}                   # gains .1 .1 .2 .3
    shape = ev.normalised_shape(ref, new)
    assert np.mean(list(shape.values())) == pytest.approx(1.0)
    assert shape[256] == pytest.approx(0.3 / 0.175)
    assert ev.long_short_ratio(shape) == pytest.approx(0.25 / 0.1)
    fam = ev.shape_families({"smelt": [(ref, new), ({str(k): v for k, v in ref.items()}, new)]})
    assert fam["smelt"]["shape"][64] == pytest.approx(shape[64]) and fam["smelt"]["n_pairs"] == 2


# ---------------------------------------------------------------------------- calibration

def test_calibration_recovers_a_known_sigmoid():
    true = dict(a=0.6, b=0.1, alpha=3.0, tau=3.2, d=-1)
    losses = np.linspace(2.4, 4.2, 12)
    scores = ev.sigmoid4(losses, **true)
    other_l = np.array([2.8, 3.5])
    other_s = ev.sigmoid4(other_l, **true) + np.array([0.05, -0.02])
    c = ev.calibrate(losses, scores, other_l, other_s, higher_is_better=True, other_groups=["big", "small"])
    for k in ("a", "b", "alpha", "tau"):
        assert c["params"][k] == pytest.approx(true[k], rel=1e-3, abs=1e-4)
    assert c["params"]["r2"] == pytest.approx(1.0)
    assert c["residuals"] == pytest.approx([0.05, -0.02], abs=1e-5)
    assert c["by_group"] == pytest.approx({"big": 0.05, "small": -0.02}, abs=1e-5)
    # a loss metric (increasing, lower is better): a lower-than-predicted loss is a positive residual
    comp = ev.sigmoid4(losses, 1.0, 0.5, 2.0, 3.0, +1)
    c2 = ev.calibrate(losses, comp, [3.0], [ev.sigmoid4(3.0, 1.0, 0.5, 2.0, 3.0, +1) - 0.1], higher_is_better=False)
    assert c2["params"]["d"] == 1 and c2["residuals"][0] == pytest.approx(0.1, abs=1e-4)
    with pytest.raises(ValueError):
        ev.calibrate(losses[:3], scores[:3], other_l, other_s)


# ---------------------------------------------------------------------------- tasks

def test_bigbench_tasks_load():
    sizes = {"qa_wikidata": 2000, "language_identification": 1000, "dyck_languages": 1000,
             "cs_algorithms": 1320, "operators": 211, "repeat_copy_logic": 32}
    for name, n in sizes.items():
        t = ev.load_bigbench(name)
        assert len(t.items) == n and t.origin == "bigbench" and t.shots == 10
    li = ev.load_bigbench("language_identification")
    assert li.kind == "mc" and li.rho == 0.25 and li.chance == pytest.approx(1 / 11)
    assert all(it.answer in it.options and "choice: " + it.answer in it.query for it in li.items[:50])
    cs = ev.load_bigbench("cs_algorithms")
    assert {it.group for it in cs.items} == {"lcs", "valid_parentheses"}


def test_generated_tasks_are_exact_and_seeded():
    close = dict(zip("([{<", ")]}>"))
    for it in ev.generate_task("gen_dyck", 50, depth=4).items:
        stack = []
        for c in it.query.split(":")[1].split("=")[0].split():
            if c in close:
                stack.append(close[c])
            else:
                assert stack.pop() == c
        assert it.answer.split() == stack[::-1] and len(stack) == 4
    for it in ev.generate_task("gen_reverse", 20).items:
        assert it.answer.split() == it.query.split(":")[1].split("=")[0].split()[::-1]
    for it in ev.generate_task("gen_modadd", 20, modulus=11).items:
        a, _, b = it.query.split()[:3]
        assert int(it.answer) == (int(a) + int(b)) % 11
    kv = ev.generate_task("gen_kv", 20, n_pairs=5)
    assert kv.chance == 0.2 and all(f"{it.query.split(';')[1].split()[0]}={it.answer.strip()}" in it.query
                                    for it in kv.items)
    assert ev.generate_task("gen_copy", 5).items == ev.generate_task("gen_copy", 5).items
    assert ev.generate_task("gen_copy", 5, seed=1).items != ev.generate_task("gen_copy", 5).items
    assert ev.generate_task("gen_dyck", depth=2, n_types=4).chance == 1 / 16
    assert ev.resolve_tasks(["generated", "gen_dyck"]) == list(ev.GENERATED_TASKS)
    with pytest.raises(KeyError):
        ev.resolve_tasks(["nope"])


# ---------------------------------------------------------------------------- runs and CLI

def save_run(path, vocab_size=V, corrupt=False):
    cfg = ModelConfig(vocab_size=vocab_size, block_size=64, n_layer=2, d_model=32, n_head=4, n_kv_head=2, d_ff=64)
    torch.manual_seed(0)
    model = GPT(cfg)
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model": cfg.to_dict(), "data_dir": str(path / "nodata")}))
    if corrupt:
        (path / "ckpt.pt").write_bytes(b"not a checkpoint")
    else:
        torch.save({"model": model.state_dict(), "step": 7}, path / "ckpt.pt")
    return model


def test_load_model_round_trip_and_errors(tmp_path):
    ref = save_run(tmp_path / "ok")
    model, meta = ev.load_model(tmp_path / "ok")
    idx = torch.randint(0, V, (1, 10))
    torch.testing.assert_close(model(idx)[0], ref.eval()(idx)[0])
    assert meta["checkpoint"] == {"step": 7}
    with pytest.raises(FileNotFoundError, match="config.json"):
        ev.load_model(tmp_path / "missing")
    save_run(tmp_path / "bad", corrupt=True)
    with pytest.raises(ValueError, match="ckpt.pt"):
        ev.load_model(tmp_path / "bad")
    (tmp_path / "ok" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ev.load_model(tmp_path / "ok")


def test_evaluate_run_compare_and_calibration(tmp_path):
    save_run(tmp_path / "run")
    logs = []
    res = ev.evaluate_run(tmp_path / "run", tasks=["gen_kv", "operators", "repeat_copy_logic"],
                          shots=[0, 2, 32], seeds=2, max_items=4, enc=CharTok(), data=FakeData(True), batch_size=2,
                          log=logs.append)
    assert res["val"]["tokens"] == 96 and res["val"]["length_from"] == "document"
    assert any("repeat_copy_logic" in m and "k=32" in m and "skipped" in m for m in logs)   # 31 other items
    assert "32" not in res["tasks"]["repeat_copy_logic"]["by_k"] and "32" in res["tasks"]["gen_kv"]["by_k"]
    assert set(res["summary"]) == {"real", "generated"}
    assert res["tasks"]["operators"]["headline_k"] == 32 and res["tasks"]["repeat_copy_logic"]["headline_k"] == 2
    assert res["tasks"]["gen_kv"]["by_k"]["2"]["seeds"] == 2
    json.dumps(res)                                                # eval.json-serialisable
    cmp = ev.compare(res, res)
    assert cmp["tasks"]["gen_kv"]["2"]["p"] == 1.0 and cmp["tasks"]["gen_kv"]["2"]["gain"] == 0
    # calibration over eval.json-like summaries: 5 Baselines on a known curve, one model above it
    def fake(loss, bump=0.0, scale="s"):
        task = lambda cat, c: {"category": cat, "headline_k": 10, "by_k": {"10": {"centred": c}}}
        return {"run": f"r{loss}", "scale": scale, "val": {"loss": loss},
                "summary": {"real": {"core": float(ev.sigmoid4(loss, 0.5, 0.0, 4.0, 3.0, -1)) + bump,
                                     "completion": float(ev.sigmoid4(loss, 2.0, 1.0, 2.0, 3.0, 1)) - bump}},
                "tasks": {"t1": task("Symbolic", float(ev.sigmoid4(loss, 0.8, 0.0, 3.0, 3.1, -1)) + 2 * bump),
                          "t2": task("World", float(ev.sigmoid4(loss, 0.3, 0.1, 5.0, 2.9, -1)) - bump)}}
    rep = ev.calibration_report([fake(x) for x in (2.5, 2.8, 3.0, 3.2, 3.6)], [fake(2.9, 0.03, "big"),
                                                                               fake(3.3, 0.01, "small")])
    assert rep["metrics"]["core"]["by_group"] == pytest.approx({"big": 0.03, "small": 0.01}, abs=1e-3)
    assert rep["metrics"]["completion"]["mean_residual"] == pytest.approx(0.02, abs=1e-3)
    assert rep["by_category"]["Symbolic"] == pytest.approx({"big": 0.06, "small": 0.02, "all": 0.04}, abs=1e-3)
    assert rep["by_category"]["World"]["all"] == pytest.approx(-0.02, abs=1e-3)


def test_cli_writes_eval_json_and_plots(tmp_path):
    pytest.importorskip("data")
    save_run(tmp_path / "run", vocab_size=512)   # data.get_tokenizer(512) needs no download
    ev.main(["--run", str(tmp_path / "run"), "--tasks", "gen_copy", "dyck_languages", "--shots", "0", "1",
             "--seeds", "2", "--max-items", "3", "--val-tokens", "0"])
    out = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert out["tasks"]["dyck_languages"]["by_k"]["1"]["n_items"] == 3 and out["val"] is None
    assert (tmp_path / "run" / "eval_shots.png").stat().st_size > 0
