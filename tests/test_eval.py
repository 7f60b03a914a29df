"""eval.py, tasks.py, calibration.py, downstream_claims.py, eval_plots.py: option scoring, exact match = greedy decoding, truncation,
statistics, length buckets, calibration, the grid."""
import copy
import json
import math
import random
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn as nn

from lab import calibration
import eval as ev
from lab import evaluate
from lab import eval_plots
import checks
from lab import tasks
import eval as validation
from lab import downstream_claims
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
    return tasks.Task("toy", "mc", items, rho=0.5, chance=0.5, category="toy", origin="generated", norm=norm)


# ---------------------------------------------------------------------------- scoring

def test_mc_picks_the_option_the_rigged_model_prefers():
    tok = CharTok()
    # "abc" -> the model prefers "d" then "e": option "de" wins over "xq" whichever is gold
    items = [tasks.Item("abc", "de", ["de", "xq"]), tasks.Item("abc", "xq", ["de", "xq"]),
             tasks.Item("klm", "no", ["zz", "no"]), tasks.Item("klm", "zz", ["zz", "no"])]
    r = tasks.evaluate_task(Successor(bos=0), tok, mc_task(items), k=0, block_size=64)
    assert r["acc"] == 0.5 and r["seeds"] == 1
    assert [r["per_item"][r["items"].index(i)] for i in range(4)] == [1, 0, 1, 0]
    assert r["centred"] == pytest.approx(0.0)   # rho = 0.5


def test_length_normalisation_changes_the_pick():
    # successor tokens cost a = log(e^2 + V - 1) - 2 each, a wrong token b = log(e^2 + V - 1):
    # "defg" (4a ~ 10.5) loses to "x" (b ~ 4.6) on the sum, wins per token (2.6 < 4.6)
    items = [tasks.Item("abc", "defg", ["defg", "x"])]
    assert tasks.evaluate_task(Successor(), CharTok(), mc_task(items, "token"), 0, block_size=64)["acc"] == 1
    assert tasks.evaluate_task(Successor(), CharTok(), mc_task(items, "char"), 0, block_size=64)["acc"] == 1
    assert tasks.evaluate_task(Successor(), CharTok(), mc_task(items, "none"), 0, block_size=64)["acc"] == 0


def test_gold_loss_and_exact_match_on_the_rigged_model():
    m = 3.0
    items = [tasks.Item("abc", "de"), tasks.Item("pq", "rz")]          # "de" all successors, "rz" not
    t = tasks.Task("toy", "gen", items, 0.0, None, "toy", "generated")
    r = tasks.evaluate_task(Successor(m), CharTok(), t, 0, block_size=64)
    a, b = math.log(math.exp(m) + V - 1) - m, math.log(math.exp(m) + V - 1)
    assert r["acc"] == 0.5 and r["gold_tokens"] == 4
    assert r["gold_loss"] == pytest.approx((3 * a + b) / 4, rel=1e-5)   # token-weighted micro average


def test_summary_completion_pools_tokens_over_tasks():
    """summarise's "completion" is sum(gold nll) / sum(gold tokens) over the generation tasks (micro), not the
    mean of per-task gold losses; "core" is the mean centred accuracy over every task."""
    def t(kind, nll, toks, centred, origin="bigbench"):
        r = {"acc": centred, "centred": centred}
        if kind == "gen":
            r.update(gold_nll_sum=nll, gold_tokens=toks, gold_loss=nll / toks if toks else math.nan)
        return {"origin": origin, "kind": kind, "headline_k": 2, "by_k": {"0": dict(r), "2": r}}
    # losses 2.0 over 10 tokens and 4.0 over 2: pooled 28 / 12 = 2.333, the macro mean would be 3.0
    s = evaluate.summarise({"a": t("gen", 20.0, 10, 0.1), "b": t("gen", 8.0, 2, 0.3), "c": t("mc", None, None, 0.5),
                      "g": t("gen", 3.0, 1, 0.0, origin="generated")})
    assert s["real"]["completion"] == pytest.approx(28 / 12)
    assert s["real"]["by_k"]["2"]["completion"] == pytest.approx(28 / 12)
    assert s["real"]["core"] == pytest.approx(0.3) and s["real"]["n_tasks"] == 3
    assert s["generated"]["completion"] == pytest.approx(3.0)


def test_demonstrations_vary_with_seed_and_are_batched(monkeypatch):
    items = [tasks.Item(f"q{i} =", f" {i % 7}") for i in range(12)]
    t = tasks.Task("toy", "gen", items, 0.0, None, "toy", "generated")
    model = Successor()
    with monkeypatch.context() as mp:       # the demonstrations evaluate_task itself put in each prompt
        seen = _recording_demos(mp, t)
        r = tasks.evaluate_task(model, CharTok(), t, k=3, seeds=4, max_items=5, block_size=128)
    assert r["seeds"] == 4 and r["n_items"] == 5 and len(r["acc_by_seed"]) == 4
    assert len(model.calls) == 1          # 20 prompts scored in one forward
    assert [i for i, _ in seen] == [i for i in r["items"] for _ in range(4)]   # each scored item, once per seed
    for item in r["items"]:               # seeds change the choice / order of a fixed item's demonstrations
        demos = [tuple(d) for i, d in seen if i == item]
        assert len(demos) == 4 and all(len(d) == 3 and item not in d for d in demos)
        assert len(set(demos)) > 1, (item, demos)


def _recording_demos(mp, task) -> list:
    """Patches tasks.fit_prompt (on the monkeypatch context `mp`) to record each call as (query item index,
    demonstration indices) into the returned list, then build the prompt as before."""
    index, seen, fit = {id(it): j for j, it in enumerate(task.items)}, [], tasks.fit_prompt

    def spy(item, demos, *a, **kw):
        seen.append((index[id(item)], [index[id(d)] for d in demos]))
        return fit(item, demos, *a, **kw)
    mp.setattr(tasks, "fit_prompt", spy)
    return seen


def _demos_of_every_request(monkeypatch, task, k, seeds, max_items, block_size):
    """task_requests on `task`, recording each fit_prompt call as (query item index, demonstration indices)."""
    with monkeypatch.context() as mp:
        seen = _recording_demos(mp, task)
        out = tasks.task_requests(CharTok(), task, k, seeds, max_items, block_size, bos=0)
    assert len(seen) == len(out["requests"]) == len(out["used"]) * (1 if k == 0 else seeds)
    return seen


def test_scored_item_is_never_its_own_demonstration(monkeypatch):
    """task_requests draws each item's demonstrations from the *other* items of its group (no answer leak)."""
    items = [tasks.Item(f"q{i} =", f" a{i}", group="g") for i in range(3)]
    toy = tasks.Task("toy3", "gen", items, 0.0, None, "toy", "generated")
    seen = _demos_of_every_request(monkeypatch, toy, k=2, seeds=6, max_items=None, block_size=128)
    assert len(seen) == 18
    for i, demos in seen:                 # 3 items, k = 2: the demonstrations are exactly the other two
        assert sorted(demos) == sorted({0, 1, 2} - {i}), f"item {i} drew demonstrations {demos}"
    real = tasks.load_bigbench("cs_algorithms")           # two groups (lcs, valid_parentheses)
    for k in (1, 3):
        seen = _demos_of_every_request(monkeypatch, real, k=k, seeds=4, max_items=40, block_size=4096)
        assert len(seen) == 160
        for i, demos in seen:
            assert i not in demos and len(demos) == k, f"k={k}: item {i} drew demonstrations {demos}"
            assert {real.items[j].group for j in demos} == {real.items[i].group}


def test_a_duplicate_of_the_scored_item_is_never_its_demonstration(monkeypatch):
    """Items that repeat (gen_modadd has 49 possible sums for 200 items) are excluded from each other's
    demonstrations, so no prompt shows its own query with its answer; demos_available counts what is left."""
    items = [tasks.Item(f"q{i % 3} =", f" a{i % 3}", group="g") for i in range(6)]   # each item twice
    toy = tasks.Task("dup6", "gen", items, 0.0, None, "toy", "generated")
    assert tasks.demos_available(toy) == 4
    seen = _demos_of_every_request(monkeypatch, toy, k=4, seeds=3, max_items=None, block_size=128)
    for i, demos in seen:
        assert sorted(demos) == [j for j in range(6) if j % 3 != i % 3], f"item {i} drew {demos}"
    modadd = tasks.get_task("gen_modadd")
    for k in (8, 32):
        for i, demos in _demos_of_every_request(monkeypatch, modadd, k=k, seeds=3, max_items=60, block_size=4096):
            it = modadd.items[i]
            assert all((modadd.items[j].query, modadd.items[j].answer) != (it.query, it.answer) for j in demos)


def test_prompt_moves_trailing_space_into_the_continuation():
    demo, item = tasks.Item("\nQ: 1+1\nA: ", "2"), tasks.Item("\nQ: 2+2\nA: ", "4", prefix="add:", sep="\n")
    ctx, conts = tasks.build_prompt(item, [demo])
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
            items.append((tasks.Item(q, greedy), True))                     # the greedy answer itself
        else:
            wrong = greedy[:2] + ("a" if greedy[2] != "a" else "b")      # differs in the last token
            items.append((tasks.Item(q, wrong), False))
    assert len(items) >= 4 and any(want for _, want in items)
    t = tasks.Task("toy", "gen", [it for it, _ in items], 0.0, None, "toy", "generated")
    r = tasks.evaluate_task(model, tok, t, 0, block_size=48)
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
    shared = tasks.score_options(m, head, tails, block_size=32)
    each = tasks.score_continuations(m, [(head + t, len(t)) for t in tails], block_size=32)
    for (a, na, ga), (b, nb, gb) in zip(shared, each):
        assert na == nb and ga == gb and a == pytest.approx(b, rel=1e-5, abs=1e-5)
    long_head = head * 4                                   # 52 tokens: cut once, to fit the longest option
    cut = tasks.score_options(m, long_head, tails, block_size=32)
    ref = tasks.score_continuations(m, [(tasks.truncate_left(long_head, 27) + t, len(t)) for t in tails], block_size=32)
    assert [c[0] for c in cut] == pytest.approx([r[0] for r in ref], rel=1e-5, abs=1e-5)
    with pytest.raises(ValueError, match="no room"):
        tasks.score_options(m, head, [[1] * 31], block_size=32)


@pytest.mark.parametrize("kw", [dict(), dict(n_experts=4, top_k=2),
                                dict(loop=LoopConfig(start=1, length=2, n_loops=3, parallel=True))])
def test_head_at_answer_positions_equals_full_logits(kw):
    """score_continuations runs the head only at answer positions: equal to full logits, one sequence at a time
    (rows of different lengths and answer lengths in one batch, including a row shorter than the longest answer)."""
    m = _live_gpt(**kw)
    torch.manual_seed(2)
    reqs = [([0] + torch.randint(1, V, (L - 1,)).tolist(), n) for L, n in ((20, 5), (3, 1), (11, 2), (32, 7), (6, 5))]
    fast = tasks.score_continuations(m, reqs, block_size=32)
    assert len(m.norm_f._forward_hooks) == 0                   # the hook is gone afterwards
    for (toks, n), (nll, nn_, ok) in zip(reqs, fast):
        with torch.no_grad():
            logits = m(torch.tensor([toks]))[0][0]              # (L, V): the head at every position
        L = len(toks)
        lg, tgt = logits[L - n - 1:L - 1], torch.tensor(toks[L - n:])
        assert nn_ == n and ok == bool((lg.argmax(-1) == tgt).all())
        assert nll == pytest.approx(float(nn.functional.cross_entropy(lg, tgt, reduction="sum")), rel=1e-5, abs=1e-5)


@torch.no_grad()
def score_continuations_reference(model, requests, block_size):
    """The slow obvious score_continuations: one sequence per forward, the logits at every position."""
    model.eval()
    out = []
    for toks, n in requests:
        seq = tasks.truncate_left(toks, block_size)
        assert 0 < n < len(seq)
        logits = ev.forward_logits(model, torch.tensor([seq]))[0]                      # (L, V)
        lg, tgt = logits[len(seq) - n - 1:len(seq) - 1], torch.tensor(seq[len(seq) - n:])
        out.append((float(nn.functional.cross_entropy(lg, tgt, reduction="sum")), n,
                    bool((lg.argmax(-1) == tgt).all())))
    return out


@pytest.mark.parametrize("kw", [dict(), dict(n_experts=4, top_k=2),
                                dict(loop=LoopConfig(start=1, length=2, n_loops=2))])
def test_batched_scoring_equals_the_per_request_reference(kw):
    """score_continuations (batches by padded tokens and answer logits, one host read each) ==
    score_continuations_reference (one sequence per forward, full logits), whatever the batch budget."""
    m = _live_gpt(**kw)
    torch.manual_seed(3)
    reqs = [([0] + torch.randint(1, V, (L - 1,)).tolist(), n)
            for L, n in ((20, 5), (3, 1), (11, 2), (32, 7), (6, 5), (40, 3), (9, 8), (32, 1))]   # 40: truncated
    ref = score_continuations_reference(m, reqs, block_size=32)
    for max_tokens, max_logits, calls in ((1 << 16, 1 << 26, 1), (64, 1 << 26, 3), (1 << 16, 2 * 8 * V, 4)):
        counts = Counter()
        got = tasks.score_continuations(m, reqs, block_size=32, max_tokens=max_tokens, max_logits=max_logits,
                                        counts=counts)
        assert counts["forward_calls"] == counts["host_reads"] == calls and counts["sequences"] == len(reqs)
        for (a, na, ga), (b, nb, gb) in zip(got, ref):
            assert na == nb and ga == gb and a == pytest.approx(b, rel=1e-5, abs=1e-5)
    assert len(m.norm_f._forward_hooks) == 0


def test_plan_batches_keeps_within_budget_and_groups_lengths():
    rng = random.Random(0)
    lengths = [rng.randrange(5, 1025) for _ in range(500)]
    ns = [rng.randrange(1, 5) for _ in lengths]
    batches = tasks.plan_batches(lengths, ns, vocab=16384, max_tokens=1 << 15, max_logits=1 << 26)
    assert sorted(i for b in batches for i in b) == list(range(500))
    for b in batches:
        assert len(b) * lengths[b[0]] <= 1 << 15 or len(b) == 1                 # padded to the batch's first row
        assert len(b) * max(ns[i] for i in b) * 16384 <= 1 << 26 or len(b) == 1
        assert lengths[b[0]] == max(lengths[i] for i in b)
    padded = sum(len(b) * lengths[b[0]] for b in batches)
    assert padded < 1.15 * sum(lengths) and len(batches) < 30                 # sorted: little padding, few calls
    assert len(tasks.plan_batches(lengths, ns, None, 1 << 15, 1 << 26)) == 500   # unknown vocabulary: one row each


def test_fit_prompt_drops_whole_demonstrations_from_the_left():
    demos = [tasks.Item(f"q{i} =", f" {i}") for i in range(6)]
    item, tok = tasks.Item("q9 =", " 9"), CharTok()
    full, conts = tasks.build_prompt(item, demos)
    head, tails, kept, cut = tasks.fit_prompt(item, demos, tok.encode, 0, 200)
    assert (kept, cut) == (6, False) and head == [0] + tok.encode(full) and tails == [tok.encode(c) for c in conts]
    for block in (30, 20, 14):
        head, tails, kept, cut = tasks.fit_prompt(item, demos, tok.encode, 0, block)
        assert 0 < kept < 6 and not cut and len(head) + len(tails[0]) <= block
        assert head == [0] + tok.encode(tasks.build_prompt(item, demos[6 - kept:])[0])      # the last `kept`
        more = [0] + tok.encode(tasks.build_prompt(item, demos[5 - kept:])[0])
        assert len(more) + len(tails[0]) > block                                              # one more would not fit
    assert tasks.fit_prompt(item, demos, tok.encode, 0, 10)[2:] == (0, False)              # the query alone fits
    head, tails, kept, cut = tasks.fit_prompt(item, demos, tok.encode, 0, 5)               # not even the query
    assert (kept, cut) == (0, True) and head[0] == 0 and len(head) + len(tails[0]) == 5


def test_shot_sweep_reports_the_demonstrations_that_fit(tmp_path):
    items = [tasks.Item(f"q{i} =", f" {i % 7}") for i in range(12)]
    t = tasks.Task("toy", "gen", items, 0.0, None, "toy", "generated")
    fits = tasks.evaluate_task(Successor(), CharTok(), t, k=3, seeds=2, max_items=4, block_size=128)
    assert (fits["demos_kept"], fits["share_short"], fits["share_cut"]) == (3.0, 0.0, 0.0)
    short = tasks.evaluate_task(Successor(), CharTok(), t, k=3, seeds=2, max_items=4, block_size=16)
    assert 0 < short["demos_kept"] < 3 and short["share_short"] == 1.0 and short["share_cut"] == 0.0
    assert evaluate.fit_label(3, short["demos_kept"]) == f"k=3 ({short['demos_kept']:.1f} fit)" and evaluate.fit_label(3, 3.0) == "k=3"
    # an endpoint at a 64-token block: gen_copy's 8-shot prompts do not fit and leave the sweep, with their figures
    save_run(tmp_path / "run")
    res = evaluate.evaluate_endpoint(tmp_path / "run", tasks=["gen_copy"], shots=[0, 1, 8], seeds=2, max_items=3,
                               enc=CharTok(), val=False, log=lambda m: None)
    e = res["tasks"]["gen_copy"]
    assert set(e["by_k"]) == {"0", "1"} and set(e["short_k"]) == {"8"} and set(e["fit"]) == {"0", "1", "8"}
    assert e["fit"]["8"]["share_short"] > 0.5 and e["headline_k"] == 1
    assert res["summary"]["not_reported"] == [f"gen_copy k=8 ({e['fit']['8']['demos_kept']:.1f} fit)"]
    assert res["summary"]["fit"]["gen_copy"]["1"]["reported"] and not res["summary"]["fit"]["gen_copy"]["8"]["reported"]
    assert res["forward_calls"] == sum(r["forward_calls"] for r in (*e["by_k"].values(), *e["short_k"].values()))
    assert res["scoring"]["sequences"] == 3 + 3 * 2 + 3 * 2


def test_mc_task_on_a_gpt_uses_shared_context_with_the_same_result():
    options = [" 0", " 11", " 222"]                     # options of different lengths: a padded batch
    items = [tasks.Item(f"q{i} =", options[i % 3], options=options, group="g") for i in range(9)]
    task = mc_task(items)
    m = _live_gpt(block_size=64)

    class NoCache(nn.Module):          # the same model without new_cache: the per-sequence path
        def __init__(self):
            super().__init__()
            self.m, self.cfg = m, m.cfg

        def forward(self, idx):
            return self.m(idx)

    for block in (64, 20):             # 64: every prompt fits; 20: contexts are cut (once, to fit the longest option)
        a = tasks.evaluate_task(m, CharTok(), task, k=2, seeds=3, block_size=block)
        b = tasks.evaluate_task(NoCache(), CharTok(), task, k=2, seeds=3, block_size=block)
        assert a["per_item_by_seed"] == b["per_item_by_seed"] and a["n_items"] == b["n_items"] == 9


def test_truncation_keeps_bos():
    toks = [7] + list(range(100, 140))
    cut = tasks.truncate_left(toks, 16)
    assert len(cut) == 16 and cut[0] == 7 and cut[1:] == toks[-15:]
    assert tasks.truncate_left(toks[:10], 16) == toks[:10]
    # scoring a too-long prompt: every forwarded row opens with BOS (Successor asserts it) and the
    # result equals scoring the manually truncated sequence
    long = [0] + CharTok().encode("abcdefghij" * 10)
    r1 = tasks.score_continuations(Successor(bos=0), [(long, 5)], block_size=32)
    r2 = tasks.score_continuations(Successor(bos=0), [(tasks.truncate_left(long, 32), 5)], block_size=32)
    assert r1 == r2


def test_long_answers_are_skipped_not_truncated():
    items = [tasks.Item("a", "b" * 40), tasks.Item("a", "b")]
    t = tasks.Task("toy", "gen", items, 0.0, None, "toy", "generated")
    r = tasks.evaluate_task(Successor(), CharTok(), t, 0, block_size=16)
    assert r["skipped"] == 1 and r["n_items"] == 1


# ---------------------------------------------------------------------------- statistics

def test_centred_accuracy():
    assert tasks.centred_accuracy(0.25, 0.25) == 0 and tasks.centred_accuracy(1.0, 0.25) == 1
    assert tasks.centred_accuracy(0.625, 0.25) == pytest.approx(0.5)
    assert tasks.centred_accuracy(0.1, 0.0) == pytest.approx(0.1)
    with pytest.raises(ValueError):
        tasks.centred_accuracy(0.5, 1.0)


def test_compare_tests_over_seeds_one_sided():
    """Appendix C: the permutation test pairs per-seed accuracies (not items) and asks SMELT > Baseline."""
    def res(by_seed_k2, acc0):
        r2 = {"acc": float(np.mean(by_seed_k2)), "acc_by_seed": by_seed_k2, "items": [0, 1], "per_item": [1.0, 0.0]}
        r0 = {"acc": acc0, "acc_by_seed": [acc0], "items": [0, 1], "per_item": [1.0, 0.0]}
        return {"tasks": {"t": {"by_k": {"0": r0, "2": r2}}}}
    base, smelt = res([0.4, 0.4, 0.4], 0.5), res([0.5, 0.6, 0.7], 0.5)
    c = evaluate.compare(base, smelt)["tasks"]["t"]
    # differences +0.1 +0.2 +0.3: of the 2^3 sign patterns only the observed one reaches the mean: p = 1/8;
    # the items' results are identical on both sides, so a test over items would find nothing
    assert c["2"]["p"] == pytest.approx(1 / 8) and c["2"]["gain"] == pytest.approx(0.2) and c["2"]["seeds"] == 3
    assert evaluate.compare(smelt, base)["tasks"]["t"]["2"]["p"] == pytest.approx(1.0)      # one-sided: the other way
    assert c["0"]["p"] is None                                                         # one seed at k = 0
    assert not hasattr(ev, "permutation_test")                                         # one implementation: stats


# ---------------------------------------------------------------------------- validation loss

def test_length_buckets_from_doc_ids():
    doc = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2],
                        [0] * 16])
    lengths = validation.segment_lengths(doc)
    assert lengths[0].tolist() == [3] * 3 + [2] * 2 + [11] * 11 and lengths[1].tolist() == [16] * 16
    assert validation.length_bounds(4096) == [32, 64, 128, 256, 512, 1024, 2048, 4096]
    assert validation.length_bounds(16) == [1, 2, 4, 8, 16] and validation.length_bounds(100)[-1] == 128
    b16, b4096 = (torch.tensor(validation.length_bounds(n)) for n in (16, 4096))
    assert b16[validation.length_bucket(lengths, b16)][0].tolist() == [4] * 3 + [2] * 2 + [16] * 11
    assert b4096[validation.length_bucket(torch.tensor([40, 9000]), b4096)].tolist() == [64, 4096]   # longer: top


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
        lengths = validation.segment_lengths(doc)                                 # the documents end in the row
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
    shape = validation.normalised_shape(ref, new)
    assert np.mean(list(shape.values())) == pytest.approx(1.0)
    assert shape[256] == pytest.approx(0.3 / 0.175)
    assert validation.long_short_ratio(shape) == pytest.approx(0.25 / 0.1)
    assert validation.normalised_shape({str(k): v for k, v in ref.items()}, new) == shape     # JSON keys are strings
    assert all(math.isnan(v) for v in validation.normalised_shape(ref, ref).values())          # no gain: no shape


# ---------------------------------------------------------------------------- calibration

def test_calibration_recovers_a_known_sigmoid():
    true = dict(a=0.6, b=0.1, alpha=3.0, tau=3.2, d=-1)
    losses = np.linspace(2.4, 4.2, 12)
    scores = calibration.sigmoid4(losses, **true)
    other_l = np.array([2.8, 3.5])
    other_s = calibration.sigmoid4(other_l, **true) + np.array([0.05, -0.02])
    c = calibration.calibrate(losses, scores, other_l, other_s, higher_is_better=True, other_groups=["big", "small"])
    for k in ("a", "b", "alpha", "tau"):
        assert c["params"][k] == pytest.approx(true[k], rel=1e-3, abs=1e-4)
    assert c["params"]["r2"] == pytest.approx(1.0)
    assert c["residuals"] == pytest.approx([0.05, -0.02], abs=1e-5)
    assert c["by_group"] == pytest.approx({"big": 0.05, "small": -0.02}, abs=1e-5)
    # a loss metric (increasing, lower is better): a lower-than-predicted loss is a positive residual
    comp = calibration.sigmoid4(losses, 1.0, 0.5, 2.0, 3.0, +1)
    c2 = calibration.calibrate(losses, comp, [3.0], [calibration.sigmoid4(3.0, 1.0, 0.5, 2.0, 3.0, +1) - 0.1], higher_is_better=False)
    assert c2["params"]["d"] == 1 and c2["residuals"][0] == pytest.approx(0.1, abs=1e-4)
    assert c["identified"] and c["residual_interval"]["mean"] == pytest.approx(0.015, abs=1e-5)
    assert c["extrapolated"] == 0
    with pytest.raises(ValueError, match="equal-length"):
        calibration.calibrate(losses, scores[:3], other_l, other_s)


def test_calibration_does_not_depend_on_the_baseline_order_and_counts_extrapolated_others():
    """Shuffled Baseline points give the sorted fit (the step check sorts by loss); others outside its loss range count."""
    true = dict(a=0.6, b=0.1, alpha=3.0, tau=3.2, d=-1)
    losses = np.linspace(2.4, 4.2, 12)
    perm = np.random.default_rng(0).permutation(12)
    other_l = np.array([2.0, 3.0, 4.5, 4.2])                       # below, inside, above, on the edge
    other_s = calibration.sigmoid4(other_l, **true)
    ref = calibration.calibrate(losses, calibration.sigmoid4(losses, **true), other_l, other_s)
    shuf = calibration.calibrate(losses[perm], calibration.sigmoid4(losses[perm], **true), other_l, other_s)
    assert ref["identified"] and shuf["identified"], shuf["why"]
    assert shuf["params"] == pytest.approx(ref["params"], rel=1e-6, abs=1e-9)
    assert ref["extrapolated"] == shuf["extrapolated"] == 2 and ref["inside"] == [False, True, False, True]
    off = calibration.calibrate(losses, calibration.sigmoid4(losses, **true), other_l,
                                other_s + np.array([0.3, 0.0, 0.3, 0.0]), other_groups=["a", "b", "a", "b"])
    assert off["residuals"][0] == pytest.approx(0.3, abs=1e-3)          # kept, in order, for the record
    assert off["mean_residual"] == pytest.approx(0.0, abs=1e-3)         # but the summaries read the inside ones
    assert list(off["by_group"]) == ["b"] and off["residual_interval"]["n"] == 2


@pytest.mark.parametrize("lowest, want, absent", [
    (2.0, "+0.0100 over 2 endpoints (1 outside the Baseline losses left out); its interval over runs", "["),
    (2.8, "+0.0100 over 3 endpoints; its interval over runs", "outside")])
def test_calibration_figure_title_gives_no_endpoint_interval(lowest, want, absent, tmp_path, monkeypatch):
    """The figure states the mean residual over the endpoints inside the Baseline losses and says how many were left
    out (nothing when none is); it prints no interval (a run's endpoints share its trajectory: the claim's interval
    is over runs)."""
    true = dict(a=0.6, b=0.1, alpha=3.0, tau=3.2, d=-1)
    losses = np.linspace(2.4, 4.2, 12)
    other_l = np.array([lowest, 3.0, 3.5])
    ep = lambda L, s: {"val": {"loss": float(L)}, "summary": {"real": {"core": float(s)}}}
    base = [ep(L, calibration.sigmoid4(L, **true)) for L in losses]
    others = [ep(L, calibration.sigmoid4(L, **true) + 0.01) for L in other_l]
    c = calibration.calibrate(losses, [e["summary"]["real"]["core"] for e in base], other_l,
                              [e["summary"]["real"]["core"] for e in others])
    import matplotlib.axes
    titles, orig = [], matplotlib.axes.Axes.set
    monkeypatch.setattr(matplotlib.axes.Axes, "set", lambda self, **kw: titles.append(kw.get("title")) or orig(self, **kw))
    eval_plots.plot_calibration(base, others, {"metrics": {"core": {**c, "higher_is_better": True}}}, tmp_path / "c.png")
    [title] = [t for t in titles if t]
    assert want in title and absent not in title and (tmp_path / "c.png").exists()


def test_calibration_counts_both_ends_of_the_baseline_losses_as_inside():
    """An other exactly at the lowest or the highest Baseline loss is inside (no extrapolation): it counts."""
    true = dict(a=0.6, b=0.1, alpha=3.0, tau=3.2, d=-1)
    losses = np.linspace(2.4, 4.2, 12)
    other_l = np.array([losses.min(), losses.max()])
    c = calibration.calibrate(losses, calibration.sigmoid4(losses, **true), other_l,
                              calibration.sigmoid4(other_l, **true) + np.array([0.02, 0.04]))
    assert c["inside"] == [True, True] and c["extrapolated"] == 0
    assert c["mean_residual"] == pytest.approx(0.03, abs=1e-4) and c["residual_interval"]["n"] == 2


def test_calibration_report_categories_leave_out_others_outside_the_baseline_losses():
    """by_category averages a task's residuals over the SMELT endpoints inside the Baseline loss range only: the
    "small" endpoint at loss 4.0 (Baselines 2.5-3.6) reads the sigmoid's extrapolation and is in no group."""
    sig = lambda l: float(calibration.sigmoid4(l, 0.8, 0.0, 3.0, 3.1, -1))
    ep = lambda loss, bump=0.0, scale="s": {"run": f"r{loss}", "scale": scale, "val": {"loss": loss}, "summary": {},
                                            "tasks": {"t": {"category": "Symbolic", "headline_k": 10,
                                                            "by_k": {"10": {"centred": sig(loss) + bump}}}}}
    rep = calibration.calibration_report([ep(x) for x in (2.5, 2.8, 3.0, 3.2, 3.6)],
                                         [ep(2.9, 0.03, "big"), ep(4.0, 0.2, "small")])
    assert rep["metrics"]["task/t"]["inside"] == [True, False]
    assert rep["by_category"] == {"Symbolic": pytest.approx({"big": 0.03, "all": 0.03}, abs=1e-3)}


def test_calibration_chance_floor_refuses_only_when_every_score_is_at_chance():
    """chance: refused when all Baseline scores are <= chance; a curve that reaches the floor at high loss is fitted."""
    losses = np.linspace(2.4, 4.2, 12)
    scores = calibration.sigmoid4(losses, 0.6, 0.0, 3.0, 3.2, -1)
    scores[-3:] = 0.0                                              # the worst Baselines sit at chance
    assert calibration.calibration_problem(losses, scores, chance=0.0) is None
    assert "at or below chance" in calibration.calibration_problem(losses, scores - 0.6, chance=0.0)
    c = calibration.calibrate(losses, scores, [3.0], [0.3], chance=0.0)
    assert c["identified"] and c["params"]["r2"] > 0.99


def test_calibration_report_reads_each_metric_its_origin_headline_k_and_chance():
    """calibration_report: "generated core" reads the generated summary, a task its headline k, a task's chance floor
    is its centred exact chance (all Baselines below it: refused), a NaN metric is named missing, not fitted."""
    sig = lambda l, a, b, al, tau, d: float(calibration.sigmoid4(l, a, b, al, tau, d))

    def ep(loss, bump=0.0, scale="s"):
        by_k = {"0": {"centred": sig(loss, 0.2, 0.4, 3.0, 3.0, -1)}, "10": {"centred": sig(loss, 0.8, 0.0, 3.0, 3.1, -1) + bump}}
        floor = {"10": {"centred": sig(loss, 0.2, 0.05, 4.0, 3.0, -1)}}   # centred 0.05-0.25, below chance 1/3
        return {"run": f"r{loss}", "scale": scale, "val": {"loss": loss},
                "summary": {"real": {"core": sig(loss, 0.5, 0.0, 4.0, 3.0, -1), "completion": float("nan")},
                            "generated": {"core": sig(loss, 0.3, 0.1, 4.0, 3.0, -1) + 2 * bump}},
                "tasks": {"t": {"category": "Symbolic", "headline_k": 10, "by_k": by_k},
                          "floor": {"category": "World", "headline_k": 10, "rho": 0.25, "chance": 0.5, "by_k": floor}}}
    base = [ep(x) for x in (2.5, 2.8, 3.0, 3.2, 3.6)]
    rep = calibration.calibration_report(base, [ep(2.9, 0.03, "big")])
    assert rep["metrics"]["generated core"]["residuals"] == pytest.approx([0.06], abs=1e-3)
    assert rep["metrics"]["core"]["residuals"] == pytest.approx([0.0], abs=1e-3)
    assert rep["metrics"]["task/t"]["residuals"] == pytest.approx([0.03], abs=1e-3)
    assert "missing" in rep["metrics"]["completion"]["why"] and not rep["metrics"]["completion"]["identified"]
    assert "at or below chance" in rep["not_identified"]["task/floor"]
    assert rep["by_category"] == {"Symbolic": pytest.approx({"big": 0.03, "all": 0.03}, abs=1e-3)}


@pytest.mark.parametrize("scores, why", [
    (np.zeros(12), "same"),                                           # all-zero accuracies: the old R^2 = nan plot
    (-np.linspace(0.0, 0.1, 12), "at or below chance"),               # centred accuracy never above chance
    (np.random.default_rng(0).random(12) * 0.1, "R^2"),               # noise: the sigmoid explains nothing
    (np.r_[[0.5] * 6, [0.1] * 6], "step"),                            # two clusters: the transition is anywhere
])
def test_calibration_refuses_what_it_cannot_identify(scores, why, tmp_path):
    losses = np.r_[np.linspace(2.0, 2.2, 6), np.linspace(3.0, 3.2, 6)] if why == "step" else np.linspace(2.4, 4.2, 12)
    c = calibration.calibrate(losses, scores, [3.0], [0.2], chance=0.0)
    assert not c["identified"] and why in c["why"] and "params" not in c and "residuals" not in c
    assert "4 Baseline endpoints" in calibration.calibrate(losses[:4], scores[:4], [3.0], [0.2])["why"]
    # a report of refused fits draws nothing and says why
    rep = {"metrics": {"core": {**c, "higher_is_better": True}}}
    note = eval_plots.plot_calibration([], [], rep, tmp_path / "cal.png")
    assert not (tmp_path / "cal.png").exists() and why in note and "No calibration figure" in note


# ---------------------------------------------------------------------------- tasks

def test_bigbench_tasks_load():
    sizes = {"qa_wikidata": 2000, "language_identification": 1000, "dyck_languages": 1000,
             "cs_algorithms": 1320, "operators": 211, "repeat_copy_logic": 32}
    for name, n in sizes.items():
        t = tasks.load_bigbench(name)
        assert len(t.items) == n and t.origin == "bigbench" and t.shots == 10
    li = tasks.load_bigbench("language_identification")
    assert li.kind == "mc" and li.rho == 0.25 and li.chance == pytest.approx(1 / 11)
    assert all(it.answer in it.options and "choice: " + it.answer in it.query for it in li.items[:50])
    cs = tasks.load_bigbench("cs_algorithms")
    assert {it.group for it in cs.items} == {"lcs", "valid_parentheses"}


def test_generated_tasks_are_exact_and_seeded():
    close = dict(zip("([{<", ")]}>"))
    for it in tasks.generate_task("gen_dyck", 50, depth=4).items:
        stack = []
        for c in it.query.split(":")[1].split("=")[0].split():
            if c in close:
                stack.append(close[c])
            else:
                assert stack.pop() == c
        assert it.answer.split() == stack[::-1] and len(stack) == 4
    for it in tasks.generate_task("gen_reverse", 20).items:
        assert it.answer.split() == it.query.split(":")[1].split("=")[0].split()[::-1]
    for it in tasks.generate_task("gen_modadd", 20, modulus=11).items:
        a, _, b = it.query.split()[:3]
        assert int(it.answer) == (int(a) + int(b)) % 11
    kv = tasks.generate_task("gen_kv", 20, n_pairs=5)
    assert kv.chance == 0.2 and all(f"{it.query.split(';')[1].split()[0]}={it.answer.strip()}" in it.query
                                    for it in kv.items)
    assert tasks.generate_task("gen_copy", 5).items == tasks.generate_task("gen_copy", 5).items
    assert tasks.generate_task("gen_copy", 5, seed=1).items != tasks.generate_task("gen_copy", 5).items
    assert tasks.generate_task("gen_dyck", depth=2, n_types=4).chance == 1 / 16
    assert tasks.resolve_tasks(["generated", "gen_dyck"]) == list(tasks.GENERATED_TASKS)
    with pytest.raises(KeyError):
        tasks.resolve_tasks(["nope"])


# ---------------------------------------------------------------------------- runs and CLI

def save_run(path, vocab_size=V, corrupt=False, block_size=64):
    cfg = ModelConfig(vocab_size=vocab_size, block_size=block_size, n_layer=2, d_model=32, n_head=4, n_kv_head=2, d_ff=64)
    torch.manual_seed(0)
    model = GPT(cfg)
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model": cfg.to_dict(), "data_dir": str(path / "nodata")}))
    if corrupt:
        (path / "ckpt.pt").write_bytes(b"not a checkpoint")
    else:
        checks.atomic_save({"model": model.state_dict(), "step": 7}, path / "ckpt.pt")
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
    with pytest.raises(checks.CheckpointError, match="ckpt.pt has no valid content hash"):   # hash checked on load
        ev.load_model(tmp_path / "bad")
    (tmp_path / "ok" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ev.load_model(tmp_path / "ok")


def test_evaluate_run_compare_and_calibration(tmp_path):
    save_run(tmp_path / "run", block_size=512)   # 2-shot prompts fit, 32-shot ones do not
    logs = []
    res = evaluate.evaluate_endpoint(tmp_path / "run", tasks=["gen_kv", "operators", "repeat_copy_logic"],
                          shots=[0, 2, 32], seeds=2, max_items=4, enc=CharTok(), data=FakeData(True), batch_size=2,
                          log=logs.append)
    assert res["val"]["tokens"] == 96 and res["val"]["length_from"] == "document"
    assert any("repeat_copy_logic" in m and "k=32" in m and "skipped" in m for m in logs)   # 31 other items
    assert "32" not in res["tasks"]["repeat_copy_logic"]["by_k"] and "32" not in res["tasks"]["repeat_copy_logic"]["fit"]
    # k=32 is evaluated for gen_kv and operators, but 32 demonstrations do not fit a 512-token block: out of the sweep
    for name in ("gen_kv", "operators"):
        assert "32" in res["tasks"][name]["short_k"] and "32" not in res["tasks"][name]["by_k"]
        assert res["tasks"][name]["fit"]["32"]["share_short"] == 1.0 and res["tasks"][name]["fit"]["2"]["share_short"] == 0
        assert any(s.startswith(f"{name} k=32 (") for s in res["summary"]["not_reported"])
    assert set(res["summary"]) == {"real", "generated", "fit", "not_reported"}
    assert res["tasks"]["operators"]["headline_k"] == 2 and res["tasks"]["repeat_copy_logic"]["headline_k"] == 2
    assert res["tasks"]["gen_kv"]["by_k"]["2"]["seeds"] == 2
    json.dumps(res)                                                # eval.json-serialisable
    cmp = evaluate.compare(res, res)
    assert cmp["tasks"]["gen_kv"]["2"]["p"] == 1.0 and cmp["tasks"]["gen_kv"]["2"]["gain"] == 0
    # calibration over eval.json-like summaries: 5 Baselines on a known curve, one model above it
    def fake(loss, bump=0.0, scale="s"):
        task = lambda cat, c: {"category": cat, "headline_k": 10, "by_k": {"10": {"centred": c}}}
        return {"run": f"r{loss}", "scale": scale, "val": {"loss": loss},
                "summary": {"real": {"core": float(calibration.sigmoid4(loss, 0.5, 0.0, 4.0, 3.0, -1)) + bump,
                                     "completion": float(calibration.sigmoid4(loss, 2.0, 1.0, 2.0, 3.0, 1)) - bump}},
                "tasks": {"t1": task("Symbolic", float(calibration.sigmoid4(loss, 0.8, 0.0, 3.0, 3.1, -1)) + 2 * bump),
                          "t2": task("World", float(calibration.sigmoid4(loss, 0.3, 0.1, 5.0, 2.9, -1)) - bump)}}
    rep = calibration.calibration_report([fake(x) for x in (2.5, 2.8, 3.0, 3.2, 3.6)], [fake(2.9, 0.03, "big"),
                                                                               fake(3.3, 0.01, "small")])
    assert rep["metrics"]["core"]["by_group"] == pytest.approx({"big": 0.03, "small": 0.01}, abs=1e-3)
    assert rep["metrics"]["completion"]["mean_residual"] == pytest.approx(0.02, abs=1e-3)
    assert rep["by_category"]["Symbolic"] == pytest.approx({"big": 0.06, "small": 0.02, "all": 0.04}, abs=1e-3)
    assert rep["by_category"]["World"]["all"] == pytest.approx(-0.02, abs=1e-3)


def test_cli_writes_eval_json_and_says_why_no_plot(tmp_path, capsys):
    pytest.importorskip("data")
    save_run(tmp_path / "run", vocab_size=512, block_size=512)   # tokenizer.get_tokenizer(512) needs no download
    evaluate.main(["--run", str(tmp_path / "run"), "--tasks", "gen_copy", "dyck_languages", "--shots", "0", "1",
             "--seeds", "2", "--max-items", "3", "--val-tokens", "0"])
    out = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert out["tasks"]["dyck_languages"]["by_k"]["1"]["n_items"] == 3 and out["val"] is None
    # an untrained model is at chance on both tasks: no all-zero figure, a sentence instead
    assert not (tmp_path / "run" / "eval_shots.png").exists()
    assert "not drawn): dyck_languages, gen_copy" in capsys.readouterr().out


# ---------------------------------------------------------------------------- endpoints

@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A real train.py run (SMELT-shaped toy, branches at 3 and 6): weights-only endpoints and ckpt.pt."""
    import train as T
    run = tmp_path_factory.mktemp("run") / "toy_smelt"
    cfg = ModelConfig(vocab_size=V, block_size=32, n_layer=4, d_model=32, n_head=2, n_kv_head=1, d_ff=32,
                      n_experts=4, top_k=2, loop=LoopConfig(start=1, length=2, n_loops=2))
    tc = T.TrainConfig(lr=1e-2, warmup_steps=2, stable_steps=6, branch_steps=[3, 6], decay_steps=2, batch_size=4,
                       block_size=32, log_interval=100, eval_tokens=64, flops_ctx=16.0, device="cpu", seed=5)
    T.train(cfg, tc, T.SyntheticData(V), run, {"arch": "smelt", "scale": "toy", "sparsity_label": "S~50%"})
    return run


def test_load_model_accepts_run_dir_endpoint_and_checkpoint(trained_run, tmp_path):
    end3 = trained_run / "endpoints" / "branch_0000003.pt"          # written by train.py
    model, meta = ev.load_model(end3)
    assert meta["branch_step"] == 3 and meta["step"] == 5 and meta["endpoint"] == "endpoints/branch_0000003.pt"
    assert meta["meta"]["arch"] == "smelt" and meta["run_dir"] == str(trained_run)      # config.json was read
    # a full training checkpoint (weights + optimizer + meta) loads the same weights
    ck = torch.load(end3, weights_only=True)
    full = trained_run / "ckpt" / "branch0000003_0000005.pt"
    full.parent.mkdir(exist_ok=True)
    checks.atomic_save({"model": ck["model"], "optimizer": {}, "step": 5, "meta": ck["meta"]}, full)
    m2, meta2 = ev.load_model(full)
    idx = torch.randint(0, V, (1, 12))
    torch.testing.assert_close(m2(idx)[0], model(idx)[0])
    assert meta2["endpoint"] == "ckpt/branch0000003_0000005.pt" and meta2["branch_step"] == 3
    full.unlink()
    # the run directory: ckpt.pt, the longest branch
    _, meta3 = ev.load_model(trained_run)
    assert meta3["branch_step"] == 6 and meta3["endpoint"] is None
    # an endpoint file whose meta lacks the branch: its name gives it
    other = tmp_path / "other_run"
    (other / "endpoints").mkdir(parents=True)
    (other / "config.json").write_text((trained_run / "config.json").read_text())
    checks.atomic_save({"model": ck["model"], "meta": json.dumps({"model": meta["model"]})},
                  other / "endpoints" / "branch_0000006.pt")
    assert ev.load_model(other / "endpoints" / "branch_0000006.pt")[1]["branch_step"] == 6
    # a lone file with no meta and no config.json beside it names what is missing
    checks.atomic_save({"model": ck["model"]}, tmp_path / "lone.pt")
    with pytest.raises(ValueError, match="no model config"):
        ev.load_model(tmp_path / "lone.pt")
    with pytest.raises(FileNotFoundError, match="endpoint file"):
        ev.load_model(tmp_path / "nothing.pt")


def test_run_endpoints_finds_every_branch(trained_run, tmp_path):
    eps = ev.run_endpoints(trained_run)
    assert [(e["branch_step"], e["endpoint"]) for e in eps] == [(3, "endpoints/branch_0000003.pt"),
                                                               (6, "endpoints/branch_0000006.pt")]
    # a row's "endpoint" field wins; a missing file is named
    rows = [json.loads(x) for x in (trained_run / "results.jsonl").read_text().splitlines()]
    run2 = tmp_path / "copy"
    run2.mkdir()
    rows[0]["endpoint"] = "endpoints/branch_0000003.pt"
    rows[1].pop("endpoint")
    (run2 / "results.jsonl").write_text("".join(checks.jsonl_line(r) for r in rows))
    with pytest.raises(FileNotFoundError, match="branch 3 finished"):
        ev.run_endpoints(run2)
    (run2 / "endpoints").mkdir()
    (run2 / "endpoints" / "branch_0000003.pt").write_bytes(b"x")
    (run2 / "ckpt").mkdir()
    (run2 / "ckpt" / "branch0000006_0000008.pt").write_bytes(b"x")
    assert [e["endpoint"] for e in ev.run_endpoints(run2)] == ["endpoints/branch_0000003.pt",
                                                              "ckpt/branch0000006_0000008.pt"]


def test_evaluate_every_branch_with_progress(trained_run):
    import train as T
    logs = []
    recs = [evaluate.evaluate_endpoint(e["path"], tasks=["gen_kv", "gen_copy"], shots=[0, 2], seeds=2, max_items=3,
                                       enc=CharTok(), data=T.SyntheticData(V), batch_size=2, val_tokens_per_source=64,
                                       log=logs.append) for e in ev.run_endpoints(trained_run)]
    assert [(r["branch_step"], r["endpoint"]) for r in recs] == [(3, "endpoints/branch_0000003.pt"),
                                                                (6, "endpoints/branch_0000006.pt")]
    r = recs[0]
    assert (r["arch"], r["scale"], r["sparsity_label"], r["seed"]) == ("smelt", "toy", "S~50%", 5)
    assert r["name"] == "toy_smelt"
    # 2-shot prompts do not fit this run's 32-token block: evaluated, kept under short_k, out of the sweep
    assert r["val"]["tokens"] > 0 and r["tasks"]["gen_kv"]["short_k"]["2"]["acc_by_seed"] and r["seconds"] > 0
    assert len(r["tasks"]["gen_copy"]["short_k"]["2"]["gold_loss_by_seed"]) == 2
    for bk in (*r["tasks"]["gen_copy"]["by_k"].values(), *r["tasks"]["gen_copy"]["short_k"].values()):
        # per-item gold losses (wins' item bootstrap), summed over seeds, add up to the task's
        assert sum(bk["gold_nll_by_item"]) == pytest.approx(bk["gold_nll_sum"], rel=1e-9)
        assert sum(bk["gold_tokens_by_item"]) == bk["gold_tokens"] and len(bk["gold_nll_by_item"]) == bk["n_items"]
    assert set(r["tasks"]["gen_copy"]["by_k"]) == {"0"} and r["forward_calls"] > 0
    assert checks.endpoint_id(r) == "toy_smelt@3"
    # every progress line names its endpoint; one line per task
    assert all(m.startswith(("toy_smelt@3:", "toy_smelt@6:")) for m in logs)
    assert sum("task 2/2 gen_copy" in m for m in logs) == 2
    # a validation report made elsewhere is used as given (no second validation pass)
    again = evaluate.evaluate_endpoint(recs[1]["run"] + "/" + recs[1]["endpoint"], tasks=["gen_copy"], shots=[0],
                                 enc=CharTok(), val=recs[1]["val"], log=logs.append)
    assert again["val"] == recs[1]["val"] and again["branch_step"] == 6
    with pytest.raises(ValueError, match="val must be"):
        evaluate.evaluate_endpoint(trained_run, tasks=["gen_copy"], shots=[0], enc=CharTok(), val={"loss": 1.0})


# ---------------------------------------------------------------------------- the grid (hand-made endpoints)

def rec(arch, scale, label, branch, seed=0, loss=3.0, by_length=None, tasks=None, summary=None):
    return {"name": f"{scale}_{label}_{arch}", "run": f"runs/{scale}_{label}_{arch}", "arch": arch, "scale": scale,
            "sparsity_label": label, "seed": seed, "branch_step": branch,
            "val": {"loss": loss, "by_length": by_length or {}}, "tasks": tasks or {}, "summary": summary or {}}


def task(by_k, chance=0.1, origin="generated"):
    """A task entry: by_k {k: per-seed accuracies}."""
    return {"origin": origin, "kind": "gen", "category": "c", "rho": 0.0, "chance": chance, "headline_k": max(by_k),
            "by_k": {str(k): {"acc": float(np.mean(a)), "acc_se": 0.0, "acc_by_seed": list(a),
                              "centred": float(np.mean(a))} for k, a in by_k.items()}}


def test_matched_pairs_and_win_counts():
    s = lambda core, comp: {"real": {"core": core, "completion": comp}}
    c64, c128 = ("t64", "S~50%"), ("t128", "S~50%")
    recs = [rec("baseline", *c64, 10, summary=s(0.10, 2.0)), rec("smelt", *c64, 10, summary=s(0.12, 1.9)),
            rec("baseline", *c64, 20, summary=s(0.20, 1.8)), rec("smelt", *c64, 20, summary=s(0.20, 1.7)),
            rec("baseline", *c128, 10, summary=s(0.30, 1.5)), rec("smelt", *c128, 10, summary=s(0.25, 1.6)),
            rec("baseline", "t128", "S~50%", 10, seed=1, summary=s(0.3, 1.5)),        # no SMELT twin: unpaired
            rec("smelt", "t128", "S~50%", 20, summary=s(0.3, 1.5))]                   # no Baseline twin
    pairs = downstream_claims.matched_pairs(recs)
    assert [(p["cell"], p["branch_step"]) for p in pairs] == [("t128 S~50%", 10), ("t64 S~50%", 10), ("t64 S~50%", 20)]
    w = downstream_claims.win_counts(recs)
    assert w["n_pairs"] == 3
    core, comp = w["metrics"]["real core"], w["metrics"]["real completion"]
    assert (core["wins"], core["ties"], core["n"]) == (1, 1, 3)                       # 0.12 > 0.10; a tie; a loss
    assert (comp["wins"], comp["n"]) == (2, 3) and comp["paper"].startswith("96 / 96")
    assert comp["by_cell"] == {"t64 S~50%": {"wins": 2, "ties": 0, "n": 2},
                               "t128 S~50%": {"wins": 0, "ties": 0, "n": 1}}
    assert comp["by_endpoint"][0]["delta"] == pytest.approx(0.1)
    with pytest.raises(ValueError, match="two endpoints"):
        downstream_claims.matched_pairs(recs + [rec("smelt", "t64", "S~50%", 10)])
    with pytest.raises(ValueError, match="sparsity_label"):
        downstream_claims.matched_pairs([{**recs[0], "sparsity_label": None}])


def test_icl_sweep_averages_above_chance_cells_and_tests_over_seeds():
    """Appendix C by hand: cell A above chance, cell B's Baseline at chance; the test pairs seeds at max k."""
    A, B = ("t64", "S~50%"), ("t128", "S~50%")
    recs = [
        rec("baseline", *A, 10, tasks={"t": task({0: [0.05], 2: [0.2, 0.3, 0.4]}), "z": task({2: [0, 0, 0]})}),
        rec("baseline", *A, 20, tasks={"t": task({0: [0.05], 2: [0.4, 0.3, 0.2]}), "z": task({2: [0, 0, 0]})}),
        rec("smelt", *A, 10, tasks={"t": task({0: [0.3], 2: [0.5, 0.4, 0.6]}), "z": task({2: [0, 0, 0]})}),
        rec("smelt", *A, 20, tasks={"t": task({0: [0.3], 2: [0.3, 0.4, 0.2]}), "z": task({2: [0, 0, 0]})}),
        rec("baseline", *B, 10, tasks={"t": task({0: [0.0], 2: [0.0, 0.1, 0.0]}), "z": task({2: [0, 0, 0]})}),
        rec("smelt", *B, 10, tasks={"t": task({0: [0.0], 2: [0.9, 0.9, 0.9]}), "z": task({2: [0, 0, 0]})}),
    ]
    sw = downstream_claims.icl_sweep(recs)
    t = sw["t"]
    k2 = t["by_k"]["2"]
    # cell A per seed: Baseline (0.3, 0.3, 0.3), SMELT (0.4, 0.4, 0.4); cell B left out (Baseline 0.033 < 0.1)
    assert (k2["cells_above"], k2["cells"]) == (1, 2)
    assert k2["baseline"] == pytest.approx(0.3) and k2["smelt"] == pytest.approx(0.4)
    assert k2["smelt_by_seed"] == pytest.approx([0.4] * 3)
    # seed differences +0.1 x 3: exact one-sided p = 1/8, the smallest 3 seeds allow
    assert t["max_k"] == 2 and t["test"]["p"] == pytest.approx(1 / 8) and t["test"]["p_min"] == pytest.approx(1 / 8)
    assert t["by_cell"]["t128 S~50%"]["above"] is False and t["by_cell"]["t64 S~50%"]["p"] == pytest.approx(1 / 8)
    # k = 0: Baseline at 0.05 < chance in A, 0 in B: no cell, no average (not an all-zero point)
    assert t["by_k"]["0"]["cells_above"] == 0 and t["by_k"]["0"]["baseline"] is None
    assert "note" not in t
    z = sw["z"]
    assert z["test"]["p"] is None and "no cell" in z["test"]["why"] and "nothing to average" in z["note"]


def test_dyck_gain_is_paired_over_items():
    """The dyck_languages claim is a benchmark difference: icl_sweep averages each item's accuracy over seeds, the
    cell's pairs, then the cells above chance, and the claim is the paired t-interval over items (n = items), not
    over the 2 demonstration seeds; endpoints that scored different items give no interval and say so."""
    from lab import stats

    def dyck(per_item_by_seed, items=(0, 1, 2, 3)):
        t = task({2: np.mean(per_item_by_seed, axis=1)}, chance=0.0, origin="bigbench")
        t["by_k"]["2"].update(items=list(items), per_item=np.mean(per_item_by_seed, axis=0).tolist())
        return {"dyck_languages": t}
    base = [[1, 0, 0, 1], [1, 1, 0, 0]]                             # per seed x item: item means 1, .5, 0, .5
    smelt = [[1, 1, 0, 1], [1, 1, 1, 0]]                            # 1, 1, .5, .5
    A = ("t64", "S~50%")
    recs = [rec("baseline", *A, 10, tasks=dyck(base)), rec("smelt", *A, 10, tasks=dyck(smelt))]
    r = downstream_claims.icl_sweep(recs)["dyck_languages"]["by_k"]["2"]
    assert r["baseline_by_item"] == pytest.approx([1, .5, 0, .5]) and r["smelt_by_item"] == pytest.approx([1, 1, .5, .5])
    [c] = [c for c in downstream_claims.downstream_claims(recs, icl=downstream_claims.icl_sweep(recs))
           if c["id"] == "dyck gain"]
    assert c["interval"] == pytest.approx(stats.paired_difference([1, .5, 0, .5], [1, 1, .5, .5]).to_dict())
    assert c["n"] == 4 and c["unit"] == "paired item" and "averaged over demonstration seeds" in c["claim"]
    recs[1] = rec("smelt", *A, 10, tasks=dyck(smelt, items=(0, 1, 2, 5)))
    [c] = [c for c in downstream_claims.downstream_claims(recs, icl=downstream_claims.icl_sweep(recs))
           if c["id"] == "dyck gain"]
    assert c["interval"] is None and "different dyck_languages items" in c["why"]


def test_icl_sweep_by_item_and_gain_by_cell_read_the_cells_above_chance():
    """Per-item accuracy is averaged over each cell's pairs, then over the cells above chance (t64 with two
    branches weighs as much as t128 with one); a cell at chance (t32, which scored other items) is in neither
    the per-item means nor gain_by_cell (SMELT - Baseline per cell: t64 .875 - .5, t128 .75 - .5)."""
    def t(seeds, per_item, items=(0, 1, 2, 3)):
        x = task({2: seeds}, chance=0.25, origin="bigbench")
        x["by_k"]["2"].update(items=list(items), per_item=per_item)
        return {"dyck_languages": x}
    recs = []
    for (scale, branch), (b, s) in {
            ("t64", 10): (([.5, .5], [1, 0, 0, 1]), ([.75, .75], [1, 1, 0, 1])),
            ("t64", 20): (([.5, .5], [1, 1, 0, 0]), ([1, 1], [1, 1, 1, 1])),
            ("t128", 10): (([.5, .5], [0, 0, 1, 1]), ([.75, .75], [0, 1, 1, 1]))}.items():
        recs += [rec("baseline", scale, "S~50%", branch, tasks=t(*b)),
                 rec("smelt", scale, "S~50%", branch, tasks=t(*s))]
    recs += [rec("baseline", "t32", "S~50%", 10, tasks=t([0, 0], [0, 0, 0, 0], (0, 1, 2, 5))),
             rec("smelt", "t32", "S~50%", 10, tasks=t([.25, .25], [0, 0, 0, 1], (0, 1, 2, 5)))]
    r = downstream_claims.icl_sweep(recs)["dyck_languages"]["by_k"]["2"]
    assert r["cells_above"] == 2 and r["cells"] == 3
    assert r["baseline_by_item"] == pytest.approx([.5, .25, .5, .75])
    assert r["smelt_by_item"] == pytest.approx([.5, 1, .75, 1])
    assert r["gain_by_cell"] == pytest.approx({"t64 S~50%": .375, "t128 S~50%": .25})


def test_dyck_gain_reads_the_largest_k_that_prompts_fit():
    """With k = 2 and k = 4 both kept by most prompts, the dyck_languages claim is at k = 4, over its items."""
    from lab import stats

    def dyck(per_item):
        t = task({k: [float(np.mean(v))] * 2 for k, v in per_item.items()}, chance=0.0, origin="bigbench")
        for k, v in per_item.items():
            t["by_k"][str(k)].update(items=[0, 1, 2, 3], per_item=v)
        return {"dyck_languages": t}
    base, smelt = {2: [1, .5, 0, .5], 4: [.5, .5, .5, 0]}, {2: [1, 1, .5, .5], 4: [.5, .5, .5, .5]}
    A = ("t64", "S~50%")
    recs = [rec("baseline", *A, 10, tasks=dyck(base)), rec("smelt", *A, 10, tasks=dyck(smelt))]
    [c] = [c for c in downstream_claims.downstream_claims(recs, icl=downstream_claims.icl_sweep(recs))
           if c["id"] == "dyck gain"]
    assert "at k = 4" in c["claim"]
    assert c["interval"] == pytest.approx(stats.paired_difference(base[4], smelt[4]).to_dict())


def test_length_families_by_hand(tmp_path):
    """Gains by bucket (8, 16, 32, 64): SMELT adds (.1 .1 .3 .3) -> long/short 3; more experts (.2 .2 .1 .1) -> 0.5;
    more parameters (.1 .1 .1 .1) -> 1. S~90% at t64 equals S~50% there: a zero gain, no shape."""
    g = {("t64", "S=0%"): [0, 0, 0, 0], ("t64", "S~50%"): [.2, .2, .1, .1], ("t64", "S~90%"): [.2, .2, .1, .1],
         ("t128", "S=0%"): [.1, .1, .1, .1], ("t128", "S~50%"): [.3, .3, .2, .2]}
    smelt_extra = [.1, .1, .3, .3]
    bl = lambda gain: {b: 4.0 - x for b, x in zip((8, 16, 32, 64), gain)}
    recs = []
    for (scale, label), gain in g.items():
        for branch in (10, 20):
            recs.append(rec("baseline", scale, label, branch, by_length=bl(gain)))
            recs.append(rec("smelt", scale, label, branch, by_length=bl(np.add(gain, smelt_extra))))
    f = downstream_claims.length_families(recs, n_boot=200)
    sv, ex, pa = f["SMELT vs Baseline"], f["more experts"], f["more parameters"]
    assert sv["n_contrasts"] == 5 and sv["n_endpoint_pairs"] == 10 and sv["paper"] == 1.52
    assert sv["long_short"]["mean"] == pytest.approx(3.0) and sv["long_short"]["lo"] == pytest.approx(3.0)
    assert sv["shape"] == pytest.approx({8: 0.5, 16: 0.5, 32: 1.5, 64: 1.5})
    # more experts: t64 S=0% -> S~50% and t128 S=0% -> S~50% (0.5 each); t64 S~50% -> S~90% has no shape
    assert ex["n_contrasts"] == 2 and ex["n_degenerate"] == 2 and ex["long_short"]["mean"] == pytest.approx(0.5)
    assert {(c["ref"], c["new"]) for c in ex["contrasts"]} == {
        ("baseline t64 S=0% seed 0", "baseline t64 S~50% seed 0"),
        ("baseline t128 S=0% seed 0", "baseline t128 S~50% seed 0")}
    # more parameters: t64 -> t128 at S=0% and at S~50% (t64 before t128: not string order); none at S~90%
    assert pa["n_contrasts"] == 2 and pa["long_short"]["mean"] == pytest.approx(1.0)
    assert all(c["ref"].startswith("baseline t64") and c["new"].startswith("baseline t128") for c in pa["contrasts"])
    assert eval_plots.plot_length_families(f, tmp_path / "fam.png") == "" and (tmp_path / "fam.png").stat().st_size > 0
    # a bucket with too few validation tokens is left out of every shape (and named)
    for r in recs:
        r["val"]["tokens_by_length"] = {"8": 11, "16": 4000, "32": 4000, "64": 4000}
    f2 = downstream_claims.length_families(recs, n_boot=50)["SMELT vs Baseline"]
    assert set(f2["shape"]) == {16, 32, 64} and f2["buckets_dropped"] == {8: 11}
    assert f2["long_short"]["mean"] == pytest.approx(0.3 / 0.1)       # long half {64} over short half {16}
    assert f2["n_negative"] == 0


def test_downstream_claims_and_report(tmp_path):
    """Claims are paired differences decided by stats.verdict; a refused calibration is 'not resolved' with why."""
    from lab import stats
    rng = np.random.default_rng(0)
    recs = []
    for i, (scale, label) in enumerate([(f"t{s}", lab) for s in (32, 64, 96) for lab in ("S~50%", "S~85%")]):
        for branch in (10, 20):
            loss = 4.0 - 0.2 * i - 0.1 * (branch == 20)
            comp_b = 2.0 + loss + 0.01 * rng.standard_normal()
            tasks_b = {"t": task({0: [0.2], 2: [0.3, 0.35]})}
            tasks_s = {"t": task({0: [0.2], 2: [0.4, 0.45]})}
            recs.append(rec("baseline", scale, label, branch, loss=loss, tasks=tasks_b,
                            summary={"real": {"core": 0.0, "completion": comp_b}}))
            recs.append(rec("smelt", scale, label, branch, loss=loss - 0.05, tasks=tasks_s,
                            summary={"real": {"core": 0.0, "completion": comp_b - 0.1 - 0.02 * (i % 2)}}))
    rep = downstream_claims.downstream_report(recs, n_boot=50, unit="endpoint")
    assert rep["n_endpoints"] == 24 and rep["n_pairs"] == 12
    claims = {c["id"]: c for c in rep["claims"]}
    comp = claims["real completion difference"]
    pairs = downstream_claims.matched_pairs(recs)
    want = stats.paired_difference([p["baseline"]["summary"]["real"]["completion"] for p in pairs],
                                   [p["smelt"]["summary"]["real"]["completion"] for p in pairs])
    assert comp["interval"] == pytest.approx(want.to_dict()) and comp["n"] == 12
    assert comp["verdict"] == "reproduced" and comp["direction"] == "<"
    # every core accuracy is 0 (at chance): the difference is exactly 0 -> not resolved, and no calibration
    assert claims["real core difference"]["verdict"] == "not resolved"
    assert "at or below chance" in claims["real core difference"]["why"]
    core_cal = claims["core residual"]
    assert core_cal["verdict"] == "not resolved" and core_cal["interval"] is None
    assert "not identified" in core_cal["why"]
    assert "core" in rep["calibration"]["not_identified"]
    # per run pair instead of per endpoint: 6 units
    by_run = {c["id"]: c for c in downstream_claims.downstream_claims(recs, unit="run")}
    assert by_run["real completion difference"]["n"] == 6
    assert rep["wins"]["metrics"]["real completion"]["wins"] == 12
    assert rep["icl"]["t"]["by_k"]["2"]["gain"] == pytest.approx(0.1)
    figs = eval_plots.plot_downstream(rep, recs, tmp_path)
    assert figs["figures"]["shot_sweep"] and Path(figs["figures"]["shot_sweep"]).stat().st_size > 0
    assert figs["figures"]["length_families"] is None       # the records carry no by_length
    assert any("core not identified" in n for n in figs["notes"])


def test_core_difference_below_chance_gets_no_verdict():
    """Both models below chance (centred accuracy < 0) in every pair: a difference with an interval clear of 0
    still ranks nothing, so the claim is "not resolved" with why, its interval kept for the record."""
    recs = []
    for i, scale in enumerate(("t32", "t64", "t96")):
        for branch in (10, 20):
            b = -0.3 + 0.01 * i + 0.003 * (branch == 20)
            recs.append(rec("baseline", scale, "S~50%", branch, summary={"real": {"core": b}}))
            recs.append(rec("smelt", scale, "S~50%", branch, summary={"real": {"core": b + 0.1 + 0.001 * i}}))
    [c] = [c for c in downstream_claims.downstream_claims(recs) if c["id"] == "real core difference"]
    assert c["interval"]["lo"] > 0 and c["verdict"] == "not resolved" and "at or below chance" in c["why"]


def test_run_unit_pairs_each_training_seed_of_a_cell():
    """unit="run" averages a run pair's branches and keeps each (cell, seed) apart: n = cells x seeds, and the
    interval is paired_difference over those run means."""
    from lab import stats
    rng = np.random.default_rng(1)
    recs, runs = [], {}
    for c, scale in enumerate(("t32", "t64", "t96")):
        for seed in (0, 1):
            delta = 0.05 + 0.1 * seed + 0.02 * c                # the seeds of one cell differ: not one unit
            for branch in (10, 20):
                b = 3.0 - 0.1 * c + 0.05 * seed + 0.01 * rng.standard_normal()
                sm = b - delta + 0.01 * rng.standard_normal()
                runs.setdefault((scale, seed), []).append((b, sm))
                recs.append(rec("baseline", scale, "S~50%", branch, seed=seed, summary={"real": {"completion": b}}))
                recs.append(rec("smelt", scale, "S~50%", branch, seed=seed, summary={"real": {"completion": sm}}))
    want = stats.paired_difference([np.mean([v[0] for v in vs]) for vs in runs.values()],
                                   [np.mean([v[1] for v in vs]) for vs in runs.values()])
    [c] = [c for c in downstream_claims.downstream_claims(recs) if c["id"] == "real completion difference"]   # run: the default
    assert c["n"] == 6 and c["unit"] == "matched run pair"
    assert c["interval"] == pytest.approx(want.to_dict()) and c["verdict"] == "reproduced"
    [e] = [c for c in downstream_claims.downstream_claims(recs, unit="endpoint") if c["id"] == "real completion difference"]
    assert e["n"] == 12


def _item_rec(arch, scale, seed, tasks_):
    """An endpoint whose summary is evaluate.summarise's of `tasks_` {name: (origin, kind, rho, per_item, nll | None)},
    each at k = 0 over the same items, gold nll over 1 + (item % 3) tokens per item."""
    ts = {}
    for name, (origin, kind, rho, acc, nll) in tasks_.items():
        n = len(acc)
        bk = {"items": list(range(n)), "per_item": list(acc), "acc": float(np.mean(acc)),
              "centred": (float(np.mean(acc)) - rho) / (1 - rho)}
        if kind == "gen":
            toks = [1 + i % 3 for i in range(n)]
            bk.update(gold_nll_by_item=list(nll), gold_tokens_by_item=toks, gold_nll_sum=float(np.sum(nll)),
                      gold_tokens=sum(toks))
        ts[name] = {"origin": origin, "kind": kind, "rho": rho, "headline_k": 0, "by_k": {"0": bk}}
    r = rec(arch, scale, "S~50%", 10, seed=seed, tasks=ts)
    r["summary"] = evaluate.summarise(ts)
    return r


def _slow_item_noise(units, origin, key, n_boot, seed):
    """downstream_claims._item_noise's draws one at a time: the same generator calls, each endpoint's summary by evaluate.summarise."""
    rng, names = np.random.default_rng(seed), sorted(n for n, t in units[0][0][0]["tasks"].items()
                                                     if t["origin"] == ("bigbench" if origin == "real" else "generated"))
    names = [n for n in names if key == "core" or units[0][0][0]["tasks"][n]["kind"] == "gen"]
    idx = {n: rng.integers(0, len(units[0][0][0]["tasks"][n]["by_k"]["0"]["items"]),
                           (n_boot, len(units[0][0][0]["tasks"][n]["by_k"]["0"]["items"]))) for n in names}

    def redrawn(r, d):
        ts = {}
        for n, t in r["tasks"].items():
            bk, sel = t["by_k"]["0"], idx[n][d] if n in idx else slice(None)
            acc = np.array(bk["per_item"])[sel]
            nb = {"acc": float(acc.mean()), "centred": (float(acc.mean()) - t["rho"]) / (1 - t["rho"])}
            if t["kind"] == "gen":
                nb.update(gold_nll_sum=float(np.array(bk["gold_nll_by_item"])[sel].sum()),
                          gold_tokens=int(np.array(bk["gold_tokens_by_item"])[sel].sum()))
            ts[n] = {**t, "by_k": {"0": nb}}
        return evaluate.summarise(ts)[origin][key]
    return [np.mean([np.mean([redrawn(s, d) - redrawn(b, d) for b, s in u]) for u in units]) for d in range(n_boot)]


def test_item_noise_holds_a_gain_carried_by_two_items_unresolved():
    """Every pair scores the same 10 items, so the t-interval over run pairs holds training noise only. SMELT's
    gain sits on items 0 and 1 of one task in every pair: the run pairs agree (t-interval clear of 0), but a
    resample drops both items with probability 0.8^10 = 0.11, so the interval over items reaches 0, and so does
    the interval of both noises that decides. A gain spread over most items is resolved."""
    from lab import stats
    flat = [0.0] * 10
    recs = []
    for i in range(6):
        two = [1.0, 1.0 if i % 2 else 0.0] + [0.0] * 8
        recs += [_item_rec("baseline", f"t{i}", 0, {"a": ("bigbench", "mc", 0.25, flat, None)}),
                 _item_rec("smelt", f"t{i}", 0, {"a": ("bigbench", "mc", 0.25, two, None)})]
    [c] = [c for c in downstream_claims.downstream_claims(recs, n_boot=400) if c["id"] == "real core difference"]
    t_iv, items, both = (stats.Interval(**c[k]) for k in ("interval", "items_interval", "both_interval"))
    assert stats.verdict(t_iv, ">", 0.0) == "reproduced" and items.lo == 0.0 and both.lo < 0 < both.hi
    assert c["verdict"] == "not resolved" and items.mean == t_iv.mean == both.mean and items.n == 10
    broad = []
    for i in range(6):
        broad += [_item_rec("baseline", f"t{i}", 0, {"a": ("bigbench", "mc", 0.25, [1.0] * 2 + [0.0] * 8, None)}),
                  _item_rec("smelt", f"t{i}", 0, {"a": ("bigbench", "mc", 0.25, [1.0] * (7 + i % 2) + [0.0] * (3 - i % 2),
                                                        None)})]
    [c] = [c for c in downstream_claims.downstream_claims(broad, n_boot=400) if c["id"] == "real core difference"]
    assert c["both_interval"]["lo"] > 0 and c["verdict"] == "reproduced"


@pytest.mark.parametrize("origin,key", [("real", "core"), ("generated", "completion")])
def test_item_noise_equals_a_per_draw_loop_over_eval_summarise(origin, key):
    """Two tasks of each origin (different rho; generation tasks with unequal token counts), two seeds per cell
    (a unit of two endpoint pairs): the vectorised draws give the percentile interval of a per-draw loop that
    re-runs evaluate.summarise, and "both" adds the draws' variance to the t-interval's."""
    from lab import stats
    rng, recs = np.random.default_rng(2), []
    for c in range(4):
        for seed in range(2):
            pair = []
            for arch, lift in (("baseline", 0.0), ("smelt", 0.1)):
                ts = {}
                for o, n_items in (("bigbench", 11), ("generated", 13)):
                    for j, (kind, rho) in enumerate((("mc", 0.25), ("gen", 0.0))):
                        acc = (rng.random(n_items) < 0.4 + lift).astype(float)
                        ts[f"{o}{j}"] = (o, kind, rho, acc, 2.0 - lift + 0.5 * rng.random(n_items))
                pair.append(_item_rec(arch, f"t{c}", seed, ts))
            recs += pair
    units = {}
    for p in downstream_claims.matched_pairs(recs):
        units.setdefault((p["cell"], p["seed"]), []).append((p["baseline"], p["smelt"]))
    units = list(units.values())
    diffs = [np.mean([s["summary"][origin][key] - b["summary"][origin][key] for b, s in u]) for u in units]
    iv = stats.mean_interval(diffs)
    got = downstream_claims._item_noise(units, origin, key, iv, n_boot=60, seed=5)
    ref = _slow_item_noise(units, origin, key, 60, 5)
    assert (got["items"].lo, got["items"].hi) == pytest.approx(tuple(np.percentile(ref, [2.5, 97.5])), abs=1e-12)
    q = stats.t_quantile(0.975, len(units) - 1)
    half = q * math.sqrt(((iv.hi - iv.lo) / (2 * q)) ** 2 + np.std(ref, ddof=1) ** 2)
    assert (got["both"].lo, got["both"].hi) == pytest.approx((iv.mean - half, iv.mean + half), abs=1e-12)


def test_item_noise_refusals():
    """Records without per-item results keep the t-verdict and say so; records whose per-item results do not give
    their summary get none (not resolved); a task no record scored at its headline k is left out, as summarise."""
    rng, recs = np.random.default_rng(0), []
    item = 2.0 + 0.5 * rng.standard_normal(12)
    for i in range(5):
        for arch, nll in (("baseline", item + 0.01 * i), ("smelt", item - 0.3 + 0.1 * rng.standard_normal(12))):
            recs.append(_item_rec(arch, f"t{i}", 0, {"g": ("bigbench", "gen", 0.0, [0.5] * 12, nll)}))
    [c] = [c for c in downstream_claims.downstream_claims(recs, n_boot=200) if c["id"] == "real completion difference"]
    assert c["both_interval"]["hi"] < 0 and c["verdict"] == "reproduced" and c["why"] is None
    [ref] = [c for c in downstream_claims.downstream_claims(recs, n_boot=20) if c["id"] == "real completion difference"]
    for r in recs:                                  # a task without its headline k anywhere: left out
        # g's results again, at k = 0 only: included at any k, they would keep the pooled completion (so the
        # summaries still add up) but add their own item draws, and the intervals would move
        r["tasks"]["h"] = {**copy.deepcopy(r["tasks"]["g"]), "headline_k": 5}
    [c] = [c for c in downstream_claims.downstream_claims(recs, n_boot=20) if c["id"] == "real completion difference"]
    assert c["items_interval"] is not None and c["items_interval"] == ref["items_interval"]
    assert c["both_interval"] == ref["both_interval"] and c["verdict"] == ref["verdict"]
    del recs[0]["tasks"]["g"]["by_k"]["0"]["gold_tokens_by_item"]
    [c] = [c for c in downstream_claims.downstream_claims(recs, n_boot=20) if c["id"] == "real completion difference"]
    assert c["items_interval"] is None and "lack per-item results (gold_nll_by_item)" in c["why"]
    assert c["verdict"] == "reproduced" and "training noise only" in c["why"]
    few = [_item_rec(a, f"t{i}", 0, {"g": ("bigbench", "gen", 0.0, [0.5] * 6, nll)})
           for i in range(5) for a, nll in (("baseline", item[:6] + 0.01 * i), ("smelt", item[:6] - 0.3 - 0.01 * i))]
    [c] = [c for c in downstream_claims.downstream_claims(few, n_boot=50) if c["id"] == "real completion difference"]
    assert c["both_interval"]["hi"] < 0 and c["verdict"] == "not resolved" and "a task of 6 items" in c["why"]
    recs[2]["summary"]["real"]["core"] += 0.1       # the per-item results no longer give the summary
    [c] = [c for c in downstream_claims.downstream_claims(recs, n_boot=20) if c["id"] == "real core difference"]
    assert c["items_interval"] is None and "do not add up" in c["why"] and c["verdict"] == "not resolved"


def test_residual_claim_is_a_t_interval_over_run_means():
    """The Eq. 7 residual claim's unit is the SMELT run: 3 seeds x 2 branches give n = 3 and the t-interval of the
    three run means, not of the six endpoints (which share trajectories in pairs)."""
    from lab import stats
    recs, res, means = [], [], [0.02, 0.05, 0.03]
    for seed, m in enumerate(means):
        for branch, half in ((10, -0.01), (20, 0.01)):
            recs += [rec("baseline", "t32", "S~50%", branch, seed=seed), rec("smelt", "t32", "S~50%", branch, seed=seed)]
            res.append(m + half)
    cal = {"metrics": {"completion": {"identified": True, "residuals": res}}}
    [c] = [c for c in downstream_claims.downstream_claims(recs, calibration=cal) if c["id"] == "completion residual"]
    assert c["n"] == 3 and c["interval"] == pytest.approx(stats.mean_interval(means).to_dict())
    assert c["unit"].startswith("SMELT run")


def test_residual_claims_leave_out_endpoints_outside_the_baseline_loss_range():
    """An endpoint whose loss lies outside the Baseline's (calibrate's "inside" False) reads the sigmoid's
    extrapolation, not a calibration: it is left out of the residual claims, and their why counts it. Here the
    third seed's endpoints are outside: n = 2 runs; every t128 endpoint outside: no growth interval."""
    from lab import stats
    recs, res, inside, means = [], [], [], [0.02, 0.05, 0.9]
    for seed, m in enumerate(means):
        for scale in ("t32", "t128"):
            recs += [rec("baseline", scale, "S~50%", 10, seed=seed), rec("smelt", scale, "S~50%", 10, seed=seed)]
            res.append(m)
            inside.append(seed < 2 and scale == "t32")
    cal = {"metrics": {"completion": {"identified": True, "residuals": res, "inside": inside}}}
    got = {c["id"]: c for c in downstream_claims.downstream_claims(recs, calibration=cal)}
    c = got["completion residual"]
    assert c["n"] == 2 and c["interval"] == pytest.approx(stats.mean_interval(means[:2]).to_dict())
    assert "4 of 6 SMELT endpoints lie outside the Baseline loss range" in c["why"]
    g = got["completion residual growth"]
    assert g["interval"] is None and g["verdict"] == "not resolved" and g["n"] == 2
    assert g["why"].startswith("too few SMELT runs per scale") and "4 of 6" in g["why"]


def test_residual_claims_why_when_all_inside_too_few_runs_or_none_inside():
    """The why of the residual claims: None when every endpoint is inside and the interval resolves; "too few SMELT
    runs" together with the count left out when one run remains (a t-interval of one run is no interval) or one run
    per scale (Welch of 1 vs 1); no interval, n = 0 and no error when every endpoint is outside."""
    def claims(scales, seeds, inside):
        recs, res, keep = [], [], []
        for seed in seeds:
            for scale in scales:
                recs += [rec("baseline", scale, "S~50%", 10, seed=seed), rec("smelt", scale, "S~50%", 10, seed=seed)]
                res.append(0.01 * (seed + 1))
                keep.append(inside(scale, seed))
        cal = {"metrics": {"completion": {"identified": True, "residuals": res, "inside": keep}}}
        return {c["id"]: c for c in downstream_claims.downstream_claims(recs, calibration=cal)}
    c = claims(["t32"], [0, 1, 2], lambda sc, s: True)["completion residual"]
    assert c["n"] == 3 and c["interval"]["lo"] < c["interval"]["hi"] and c["why"] is None
    c = claims(["t32"], [0, 1, 2], lambda sc, s: s == 0)["completion residual"]
    assert c["n"] == 1 and c["verdict"] == "not resolved"
    assert c["why"] == ("too few SMELT runs for an interval; 2 of 3 SMELT endpoints lie outside the Baseline loss "
                        "range and are left out (their residual would measure the sigmoid's extrapolation)")
    g = claims(["t32", "t128"], [0, 1], lambda sc, s: s == 0)["completion residual growth"]
    assert g["n"] == 2 and g["interval"] is not None and g["verdict"] == "not resolved"
    assert g["why"].startswith("too few SMELT runs per scale for an interval; 2 of 4 SMELT endpoints lie outside")
    c = claims(["t32"], [0, 1], lambda sc, s: False)["completion residual"]
    assert c["interval"] is None and c["n"] == 0 and c["verdict"] == "not resolved"
    assert c["why"].startswith("too few SMELT runs for an interval; 2 of 2 SMELT endpoints lie outside")


@pytest.mark.parametrize("grows", [True, False])
def test_residual_growth_is_largest_scale_minus_smallest(grows):
    """_residual_growth's interval is Welch(largest scale's SMELT run means - smallest's), scales in natural
    order (t32 < t128): larger residuals at t128 -> above 0, reproduced; the reverse -> contradicted. The unit
    is the run: its two branches' residuals are averaged first."""
    from scipy.stats import ttest_ind
    small, large = [0.010, 0.020, 0.015], [0.050, 0.062, 0.055]   # per seed (run)
    if not grows:
        small, large = large, small
    recs, res = [], []
    for seed, (rs, rl) in enumerate(zip(small, large)):
        for branch, half in ((10, -0.004), (20, 0.004)):        # a run's branches straddle its mean
            for scale, r in (("t128", rl), ("t32", rs)):       # records interleave the scales; residuals follow them
                recs += [rec("baseline", scale, "S~50%", branch, seed=seed),
                         rec("smelt", scale, "S~50%", branch, seed=seed)]
                res.append(r + half)
    cal = {"metrics": {"completion": {"identified": True, "residuals": res}}}
    [c] = [c for c in downstream_claims.downstream_claims(recs, calibration=cal) if c["id"] == "completion residual growth"]
    ref = ttest_ind(large, small, equal_var=False).confidence_interval()
    assert (c["interval"]["lo"], c["interval"]["hi"]) == pytest.approx((ref.low, ref.high))
    assert c["interval"]["mean"] == pytest.approx(np.mean(large) - np.mean(small)) and c["n"] == 6
    assert "(t128 vs t32)" in c["claim"]
    assert c["verdict"] == ("reproduced" if grows else "contradicted")


def test_shot_sweep_plot_leaves_out_at_chance_tasks(tmp_path):
    res = {"tasks": {"up": task({0: [0.2], 2: [0.3, 0.5]}), "flat": task({0: [0.0], 2: [0.0, 0.0]}),
                     "real0": task({0: [0.0], 2: [0.0, 0.0]}, chance=None, origin="bigbench")}}
    note = eval_plots.plot_shot_sweep(res, tmp_path / "s.png")
    assert (tmp_path / "s.png").stat().st_size > 0
    assert note == "At or below chance at every k (not drawn): flat, real0."


def test_length_tilt_claim_needs_a_gain_not_a_loss():
    """When SMELT is worse on average, each shape normalises a loss: a ratio below 1 then means the deficit is
    smaller on long documents (the claim's direction, inverted), so the claim gets no verdict."""
    from lab import stats
    fam = {"paper": 1.52, "n_contrasts": 12, "n_negative": 12, "why": None,
           "long_short": stats.Interval(0.67, 0.39, 0.99, 12, 0.95, "bootstrap").to_dict()}
    [c] = [c for c in downstream_claims.downstream_claims([], families={"SMELT vs Baseline": fam}) if c["id"] == "length tilt"]
    assert c["verdict"] == "not resolved" and c["interval"] is None and "negative" in c["why"]
    fam["n_negative"] = 0        # SMELT gains everywhere: the same interval is decided as usual
    [c] = [c for c in downstream_claims.downstream_claims([], families={"SMELT vs Baseline": fam}) if c["id"] == "length tilt"]
    assert c["verdict"] == "contradicted"


def test_segment_lengths_match_a_per_row_loop():
    """validation.segment_lengths against the obvious loop: each position gets the length of its run of equal
    document ids within its own row (rows never share a segment, whatever their ids)."""
    g = torch.Generator().manual_seed(0)
    doc = torch.randint(0, 3, (4, 9), generator=g).cumsum(1) % 3        # many short runs, ids reused across rows
    want = torch.zeros_like(doc)
    for b in range(doc.shape[0]):
        t = 0
        while t < doc.shape[1]:
            e = t
            while e < doc.shape[1] and doc[b, e] == doc[b, t]:
                e += 1
            want[b, t:e] = e - t
            t = e
    assert torch.equal(validation.segment_lengths(doc), want)


def test_length_tilt_keeps_its_verdict_when_half_the_contrasts_are_negative():
    """The tilt claim is withheld only when SMELT's gain is negative in *most* contrasts (n_negative * 2 > n):
    6 of 12 negative is a tie, and the interval is decided as usual."""
    from lab import stats
    fam = {"paper": 1.52, "n_contrasts": 12, "n_negative": 6, "why": None,
           "long_short": stats.Interval(1.5, 1.2, 1.8, 12, 0.95, "bootstrap").to_dict()}
    [c] = [c for c in downstream_claims.downstream_claims([], families={"SMELT vs Baseline": fam}) if c["id"] == "length tilt"]
    assert c["verdict"] == "reproduced" and c["interval"] == pytest.approx(fam["long_short"]) and c["why"] is None
    fam["n_negative"] = 7
    [c] = [c for c in downstream_claims.downstream_claims([], families={"SMELT vs Baseline": fam}) if c["id"] == "length tilt"]
    assert c["verdict"] == "not resolved" and c["interval"] is None


def test_length_tilt_over_few_contrasts_decides_nothing():
    """Below stats.MIN_BOOTSTRAP_UNITS (10) contrasts a percentile bootstrap under-covers: an interval wholly above 1
    is kept for the record but the claim is not resolved, and says why; at 10 it is decided."""
    from lab import stats
    fam = {"paper": 1.52, "n_contrasts": 5, "n_negative": 0, "why": None,
           "long_short": stats.Interval(1.5, 1.2, 1.8, 5, 0.95, "bootstrap").to_dict()}
    [c] = [c for c in downstream_claims.downstream_claims([], families={"SMELT vs Baseline": fam}) if c["id"] == "length tilt"]
    assert c["verdict"] == "not resolved" and c["interval"] == pytest.approx(fam["long_short"])
    assert "5 contrasts" in c["why"] and "fewer than 10" in c["why"]
    fam["n_contrasts"] = stats.MIN_BOOTSTRAP_UNITS
    fam["long_short"] = stats.Interval(1.5, 1.2, 1.8, stats.MIN_BOOTSTRAP_UNITS, 0.95, "bootstrap").to_dict()
    [c] = [c for c in downstream_claims.downstream_claims([], families={"SMELT vs Baseline": fam}) if c["id"] == "length tilt"]
    assert c["verdict"] == "reproduced"


def test_prompt_keeps_newlines_in_the_context_and_lists_every_option():
    """Only trailing spaces move into the continuations: a query ending in a newline keeps it in the context.
    A multiple-choice item has one continuation per option, in order; demonstrations read in the order given."""
    demos = [tasks.Item("Q: 1+1\nA:\n", "2"), tasks.Item("Q: 1+2\nA:\n", "3")]
    ctx, conts = tasks.build_prompt(tasks.Item("Q: 2+2\nA:\n", "4"), demos)
    assert ctx == "Q: 1+1\nA:\n2\nQ: 1+2\nA:\n3\nQ: 2+2\nA:\n" and conts == ["4"]
    ctx, conts = tasks.build_prompt(tasks.Item("Q: 2+2\nA: ", "4", options=["3", "4", "5"]), [])
    assert ctx == "Q: 2+2\nA:" and conts == [" 3", " 4", " 5"]


def test_scoring_batches_truncate_check_and_budget_the_answer_logits():
    """scoring_batches cuts each sequence to the block on the left (BOS kept), refuses a continuation that does
    not leave at least one context token, and budgets logits by the answer positions when the head is hooked
    (every position otherwise; one row per batch when the vocabulary is unknown)."""
    reqs = [([0] + list(range(1, 40)), 3), ([0] + list(range(1, 10)), 2), ([0] + [1] * 20, 5)]
    plan = lambda **kw: tasks.scoring_batches(reqs, **{**dict(block_size=32, vocab=100, head_hooked=True,
                                                                max_tokens=1 << 16, max_logits=1000), **kw})
    seqs, ns, batches = plan()
    assert seqs[0] == [0] + list(range(9, 40)) and seqs[1:] == [r[0] for r in reqs[1:]] and ns == [3, 2, 5]
    assert batches == [[0, 2], [1]]                       # 2 rows x 5 answer positions x 100 = the 1000 budget
    assert plan(head_hooked=False)[2] == [[0], [2], [1]]  # 32 logit rows each: one sequence per batch
    assert plan(vocab=None)[2] == [[0], [2], [1]]
    assert plan(max_logits=1 << 26)[2] == [[0, 2, 1]]
    for bad in [([0, 1, 2], 3), ([0, 1, 2], 0), ([0] + [1] * 40, 32)]:   # the last: 32 of the 32 kept tokens
        with pytest.raises(ValueError, match="does not fit"):
            tasks.scoring_batches([bad], 32, 100, True, 1 << 16, 1 << 26)
