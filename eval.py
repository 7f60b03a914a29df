"""Evaluation: validation loss by source / domain / document length, few-shot tasks, calibration.

What this file implements (SMELT Sections 3.1 "Evaluation", 5.1, 5.3 and Appendix E)
----------------------------------------------------------------------------------
* `val_loss_report`: token-weighted validation cross-entropy over all held-out sources, per
  source, per domain and per document-length bucket (upper bounds are powers of two ending at
  the context length: 32..4096 at 4096, SMELT 5.3's eight buckets). `normalised_shape` divides a
  pair's per-bucket improvement by its mean so shapes compare across pairs (SMELT vs Baseline,
  more experts, more parameters); `shape_families` averages them and gives the long/short ratio.
* Few-shot scoring as DCLM (llm-foundry) and lm-eval do it: sequences in batched forwards
  (`score_continuations`); on CPU, the options of one multiple-choice prompt after a single
  prefill of their shared context (`score_options`: the cache is repeated per option; 3.3x
  faster for language_identification's 11 options at 256 tokens and 2 shots, 1.4x at 128
  tokens on the tiny preset's model, even for gen_kv's 4 options; tested equal to
  `score_continuations`). A context too long for the block is cut on the left once, to fit
  its longest option, so all options follow the same context. Multiple choice is judged by the
  log-likelihood of each option after k demonstrations
  (DCLM's per-token mean, lm-eval's per-character acc_norm or the raw sum); exact-match
  generation (greedy); gold-completion loss (cross-entropy on the gold answer tokens, a
  token-weighted micro average); centred accuracy (a - rho) / (1 - rho) with DCLM's v2 random
  baselines; left truncation that keeps BOS; demonstrations chosen and ordered by 10 seeds,
  reported as mean and standard error over seeds.
* Tasks, offline: six of DCLM Core's 22 tasks from BIG-bench 1.0.0 (tasks/bigbench/, see its
  README) and procedurally generated tasks that tiny models can learn in context (Dyck closing
  at a set depth, copy, reverse, key-value retrieval, modular addition), each from a seeded
  generator with a known chance rate. Real and generated tasks are summarised separately.
* The shot sweep k in {0, 1, 2, 4, 8, 16, 32} (SMELT Fig. 20b-c) and `permutation_test`, a
  paired sign-flip permutation test on two models' per-item results.
* `calibrate`: SMELT Eq. 6-7, the monotone four-parameter sigmoid from validation loss to a
  metric fitted on Baseline endpoints, and each other model's residual (positive = better than
  its loss predicts), by scale; `calibration_report` also does it per task, averaged by category.
* `load_model`, `evaluate_run` (library entry point for reproduce.py) and a CLI writing
  RUN_DIR/eval.json and plots.

Design choices and why
----------------------
* Exact match is computed teacher-forced: an answer is correct when the argmax at every answer
  position equals the gold token. That is exactly "greedy decoding of len(answer) tokens
  reproduces the answer" (tests check it against `GPT.generate(temperature=0)`), it is what
  llm-foundry's language-modelling accuracy measures, and the same forward gives the
  gold-completion loss, so all items batch together.
* Prompts follow BIG-bench's own JSON formatting (task_prefix, example input/output prefixes,
  few-shot separator, choices appended to the input for multiple choice). Trailing spaces of the
  prompt move to the start of the continuation (lm-eval's target delimiter), so a BPE never sees
  a dangling space token. Prompt and continuation are tokenised separately and BOS (the EOT
  token, as in training) is prepended.
* Too-long prompts lose tokens from the left, right after BOS: the model always starts from
  the document-start token it was trained with (SMELT App. E). An answer that cannot fit with at
  least one context token is skipped and counted.
* Demonstrations come from the other items of the same (sub)task, drawn and ordered by
  random.Random(f"{task}/{seed}/{item}"); evaluated items are a fixed shuffle of the task, the
  same for every model and seed, so per-item results pair across models. k = 0 runs once.
* Real tasks use DCLM's scoring (token-mean log-likelihood for multiple choice, first gold
  target for generation) and DCLM's v2 baselines for centring. BIG-bench's language
  identification lists 11 options per item (chance 1/11, DCLM v1's 9.1) while DCLM v2 centres it
  at 25; `rho` follows DCLM v2 and `chance` reports the true rate beside it.
* Validation tokens are bucketed by their whole document's length when TokenData offers it
  (`val_batches(..., doc_lengths=True)`), else by the length of the document's segment in the
  context (from doc_ids). Documents longer than the context fall into the top bucket.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import data as data_mod

TASK_DIR = Path(__file__).resolve().parent / "tasks" / "bigbench"
SHOTS = (0, 1, 2, 4, 8, 16, 32)
# name -> (kind, DCLM category, DCLM shots, DCLM v2 random baseline as a fraction)
REAL_TASKS = {
    "qa_wikidata": ("gen", "World Knowledge", 10, 0.0),
    "language_identification": ("mc", "Language Understanding", 10, 0.25),
    "dyck_languages": ("gen", "Symbolic Problem Solving", 10, 0.0),
    "cs_algorithms": ("gen", "Symbolic Problem Solving", 10, 0.0),
    "operators": ("gen", "Symbolic Problem Solving", 10, 0.0),
    "repeat_copy_logic": ("gen", "Symbolic Problem Solving", 10, 0.0),
}
GENERATED_TASKS = ("gen_dyck", "gen_copy", "gen_reverse", "gen_kv", "gen_modadd")


# ================================================================ validation loss

def length_bounds(block_size: int, n_buckets: int = 8) -> list[int]:
    """Bucket upper bounds: powers of two ending at the first one >= block_size (32..4096 at 4096)."""
    top = 1 << max(0, math.ceil(math.log2(block_size)))
    return sorted({max(1, top >> i) for i in range(n_buckets)})


def segment_lengths(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) document ids -> (B, T) length of the run of equal ids (the document's segment) at each position."""
    B, T = doc_ids.shape
    start = torch.ones_like(doc_ids, dtype=torch.bool)
    start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    seg = start.long().cumsum(1) + torch.arange(B, device=doc_ids.device)[:, None] * (T + 1)
    return torch.bincount(seg.flatten())[seg]


def length_bucket(lengths: torch.Tensor, block_size: int, n_buckets: int = 8) -> torch.Tensor:
    """Each length -> the smallest bucket bound >= it (longer than every bound -> the top bucket)."""
    bounds = torch.tensor(length_bounds(block_size, n_buckets), device=lengths.device)
    return bounds[torch.bucketize(lengths, bounds).clamp(max=len(bounds) - 1)]


def _logits(model: nn.Module, idx: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    with torch.autocast("cuda", torch.bfloat16, enabled=idx.is_cuda):
        out = model(idx) if doc_ids is None else model(idx, doc_ids=doc_ids)
    return (out[0] if isinstance(out, tuple) else out).float()


def _device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


@torch.no_grad()
def val_loss_report(model: nn.Module, data, block_size: int, batch_size: int,
                    max_tokens_per_source: int | None = None, n_buckets: int = 8) -> dict:
    """Token-weighted validation loss: overall, by source, by domain, by document-length bucket.

    data: a data.TokenData (sources, domains, val_batches). Targets of -1 are ignored.
    Returns {"loss", "loss_macro" (mean over sources), "tokens", "by_source", "by_domain",
    "by_length": {bucket: loss}, "tokens_by_length", "length_from": "document" | "segment"}.
    """
    model.eval()
    dev = _device(model)
    bounds = length_bounds(block_size, n_buckets)
    src_sum, src_n = defaultdict(float), defaultdict(int)
    len_sum, len_n = np.zeros(len(bounds)), np.zeros(len(bounds), dtype=np.int64)
    length_from = "document"
    for src in data.sources:
        try:
            batches = data.val_batches(src, batch_size, block_size, max_tokens_per_source, doc_lengths=True)
        except TypeError:  # a TokenData without whole-document lengths: use segments from doc_ids
            batches, length_from = data.val_batches(src, batch_size, block_size, max_tokens_per_source), "segment"
        for batch in batches:
            idx, targets, doc_ids = (t.to(dev) for t in batch[:3])
            lengths = batch[3].to(dev) if len(batch) > 3 else segment_lengths(doc_ids)
            logits = _logits(model, idx, doc_ids)
            nll = F.cross_entropy(logits.transpose(1, 2), targets.clamp(min=0), reduction="none")
            valid = targets >= 0
            src_sum[src] += float(nll[valid].sum())
            src_n[src] += int(valid.sum())
            which = torch.bucketize(lengths, torch.tensor(bounds, device=dev)).clamp(max=len(bounds) - 1)
            len_sum += torch.bincount(which[valid], nll[valid].double(), len(bounds)).cpu().numpy()
            len_n += torch.bincount(which[valid], minlength=len(bounds)).cpu().numpy()
    agg = data_mod.token_weighted({s: (src_sum[s], src_n[s]) for s in src_n}, data.domains)
    if not agg["tokens"]:
        raise ValueError("no validation tokens: every source is empty or shorter than one context")
    return {"loss": agg["loss"],
            "loss_macro": float(np.mean(list(agg["by_source"].values()))),
            "tokens": agg["tokens"],
            "by_source": agg["by_source"],
            "by_domain": agg["by_domain"],
            "by_length": {b: float(len_sum[i] / len_n[i]) for i, b in enumerate(bounds) if len_n[i]},
            "tokens_by_length": {b: int(len_n[i]) for i, b in enumerate(bounds) if len_n[i]},
            "length_from": length_from}


def normalised_shape(ref_by_length: dict, new_by_length: dict) -> dict[int, float]:
    """SMELT 5.3: improvement per bucket (ref loss - new loss) divided by its mean over buckets."""
    ref, new = {int(k): v for k, v in ref_by_length.items()}, {int(k): v for k, v in new_by_length.items()}
    buckets = sorted(set(ref) & set(new))
    gain = np.array([ref[b] - new[b] for b in buckets])
    mean = gain.mean() if len(gain) else 0.0
    if abs(mean) < 1e-12:
        return {b: float("nan") for b in buckets}
    return {b: float(g / mean) for b, g in zip(buckets, gain)}


def long_short_ratio(shape: dict) -> float:
    """Mean normalised gain over the longer half of the buckets / over the shorter half (SMELT: 1.52)."""
    vals = [shape[b] for b in sorted(shape, key=int)]
    h = len(vals) // 2
    return float(np.mean(vals[len(vals) - h:]) / np.mean(vals[:h])) if h else float("nan")


def shape_families(pairs: dict[str, list[tuple[dict, dict]]]) -> dict:
    """{family: [(ref_by_length, new_by_length), ...]} -> {family: {"shape": {bucket: mean}, "long_short"}}."""
    out = {}
    for family, items in pairs.items():
        shapes = [normalised_shape(r, n) for r, n in items]
        buckets = sorted(set.intersection(*(set(s) for s in shapes))) if shapes else []
        mean = {b: float(np.nanmean([s[b] for s in shapes])) for b in buckets}
        out[family] = {"shape": mean, "long_short": long_short_ratio(mean), "n_pairs": len(items)}
    return out


# ================================================================ tasks

@dataclass
class Item:
    query: str                      # the formatted input; the answer follows it directly
    answer: str                     # gold continuation (generation) or the gold option (multiple choice)
    options: list[str] | None = None
    prefix: str = ""                # the (sub)task prefix, once at the top of the prompt
    sep: str = "\n"                 # between demonstrations
    group: str = ""                 # demonstrations come from items of the same group (subtask)


@dataclass
class Task:
    name: str
    kind: str                       # "mc" | "gen"
    items: list[Item]
    rho: float                      # random baseline for centred accuracy
    chance: float | None            # exact chance rate of a blind guesser where one is defined
    category: str
    origin: str                     # "bigbench" | "generated"
    shots: int = 10                 # the task's standard k (DCLM)
    norm: str = "token"             # multiple choice: "token" (DCLM), "char" (lm-eval acc_norm), "none"


def load_bigbench(name: str, root: Path | str = TASK_DIR) -> Task:
    """A task from tasks/bigbench/NAME.json (BIG-bench task.json; cs_algorithms holds two subtasks)."""
    if name not in REAL_TASKS:
        raise KeyError(f"unknown BIG-bench task {name!r}; available: {sorted(REAL_TASKS)}")
    path = Path(root) / f"{name}.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing (see tasks/bigbench/README.md for how it was extracted)")
    kind, category, shots, rho = REAL_TASKS[name]
    d = json.loads(path.read_text())
    items = []
    for part in d.get("subtasks", [d]):
        ip, op = part.get("example_input_prefix", "\nQ: "), part.get("example_output_prefix", "\nA: ")
        cp, append = part.get("choice_prefix", "\n  choice: "), part.get("append_choices_to_input", True)
        prefix, sep = part.get("task_prefix", ""), part.get("few_shot_example_separator", "\n")
        for j, ex in enumerate(part["examples"]):
            scores = ex.get("target_scores")
            gold = max(scores, key=scores.get) if scores else ex["target"]
            gold = gold[0] if isinstance(gold, list) else gold
            if kind == "mc":
                shown = list(scores)
                random.Random(f"{name}/{part['name']}/{j}").shuffle(shown)
                text = ip + ex["input"] + (cp + cp.join(shown) if append else "") + op
                items.append(Item(text, gold, list(scores), prefix, sep, part["name"]))
            else:
                items.append(Item(ip + ex["input"] + op, str(gold), None, prefix, sep, part["name"]))
    chance = float(np.mean([1 / len(it.options) for it in items])) if kind == "mc" else None
    return Task(name, kind, items, rho, chance, category, "bigbench", shots)


def _dyck(rng: random.Random, depth: int, n_types: int) -> tuple[str, str]:
    """A prefix with exactly `depth` unclosed brackets (closed pairs mixed in) and its closing sequence."""
    opens, closes = "([{<"[:n_types], ")]}>"[:n_types]

    def closed(n: int) -> list[str]:
        out = []
        for _ in range(n):
            t = rng.randrange(n_types)
            out += [opens[t]] + (closed(1) if rng.random() < 0.3 else []) + [closes[t]]
        return out

    toks, stack = [], []
    for _ in range(depth):
        toks += closed(rng.randrange(3))
        t = rng.randrange(n_types)
        toks.append(opens[t])
        stack.append(t)
    return " ".join(toks), " ".join(closes[t] for t in reversed(stack))


def generate_task(name: str, n_items: int = 200, seed: int = 0, depth: int = 3, n_types: int = 3,
                  length: int = 4, alphabet: int = 8, n_pairs: int = 4, modulus: int = 7) -> Task:
    """A procedurally generated task, the same for the same arguments.

    gen_dyck     close `depth` open brackets of `n_types` kinds        chance (1/n_types)^depth
    gen_copy     repeat `length` letters from `alphabet`                chance (1/alphabet)^length
    gen_reverse  reverse them                                           chance (1/alphabet)^length
    gen_kv       n_pairs "key=value" pairs, pick the asked key's value (multiple choice)   1/n_pairs
    gen_modadd   a + b mod `modulus`                                    chance 1/modulus
    (chance: a guesser who knows the answer format and length, but not the input)
    """
    rng = random.Random(f"{name}/{seed}")
    letters = "abcdefghijklmnopqrstuvwxyz"[:alphabet]
    items = []
    for _ in range(n_items):
        if name == "gen_dyck":
            q, a = _dyck(rng, depth, n_types)
            items.append(Item(f"dyck: {q} =", " " + a))
        elif name in ("gen_copy", "gen_reverse"):
            s = [rng.choice(letters) for _ in range(length)]
            out = s if name == "gen_copy" else s[::-1]
            items.append(Item(f"{name[4:]}: {' '.join(s)} =", " " + " ".join(out)))
        elif name == "gen_kv":
            keys = rng.sample(letters, n_pairs)
            vals = rng.sample(range(10), n_pairs)
            ask = rng.randrange(n_pairs)
            ctx = " ".join(f"{k}={v}" for k, v in zip(keys, vals))
            items.append(Item(f"{ctx} ; {keys[ask]} =", f" {vals[ask]}", [f" {v}" for v in vals]))
        elif name == "gen_modadd":
            a, b = rng.randrange(modulus), rng.randrange(modulus)
            items.append(Item(f"{a} + {b} mod {modulus} =", f" {(a + b) % modulus}"))
        else:
            raise KeyError(f"unknown generated task {name!r}; available: {GENERATED_TASKS}")
    for it in items:
        it.group = name
    chance = {"gen_dyck": (1 / n_types) ** depth, "gen_copy": (1 / alphabet) ** length,
              "gen_reverse": (1 / alphabet) ** length, "gen_kv": 1 / n_pairs, "gen_modadd": 1 / modulus}[name]
    return Task(name, "mc" if name == "gen_kv" else "gen", items, chance, chance, "Synthetic ICL", "generated")


def get_task(name: str) -> Task:
    return generate_task(name) if name in GENERATED_TASKS else load_bigbench(name)


def resolve_tasks(names: Iterable[str]) -> list[str]:
    """Expand the groups "real", "generated" and "all"; check every name."""
    out = []
    for n in names:
        group = {"real": list(REAL_TASKS), "generated": list(GENERATED_TASKS),
                 "all": list(REAL_TASKS) + list(GENERATED_TASKS)}.get(n, [n])
        for g in group:
            if g not in REAL_TASKS and g not in GENERATED_TASKS:
                raise KeyError(f"unknown task {g!r}; known: {list(REAL_TASKS) + list(GENERATED_TASKS)}")
            out += [g] if g not in out else []
    return out


# ================================================================ prompts and batched scoring

def build_prompt(item: Item, demos: Sequence[Item]) -> tuple[str, list[str]]:
    """(context, continuations): BIG-bench layout; the context's trailing spaces open each continuation."""
    ctx = item.prefix + "".join(d.query + d.answer + item.sep for d in demos) + item.query
    body = ctx.rstrip(" ")
    lead = ctx[len(body):]
    return body, [lead + o for o in (item.options or [item.answer])]


def truncate_left(tokens: list[int], block_size: int) -> list[int]:
    """Keep BOS (tokens[0]) and the last block_size - 1 tokens."""
    return tokens if len(tokens) <= block_size else tokens[:1] + tokens[len(tokens) - block_size + 1:]


@torch.no_grad()
def score_continuations(model: nn.Module, requests: Sequence[tuple[list[int], int]], block_size: int,
                        pad_id: int = 0, max_logits: int = 1 << 25) -> list[tuple[float, int, bool]]:
    """Each (tokens, n_cont) -> (sum of -log p over the last n_cont tokens, n_cont, all of them the argmax).

    Sequences are truncated on the left (BOS kept), sorted by length and right-padded into batches
    of at most max_logits logit entries; only the continuation positions enter the loss.
    """
    model.eval()
    dev = _device(model)
    seqs = [truncate_left(t, block_size) for t, _ in requests]
    vocab = getattr(getattr(model, "cfg", None), "vocab_size", None)   # unknown: the first batch is one row
    out: list[tuple[float, int, bool] | None] = [None] * len(seqs)
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))
    i = 0
    while i < len(order):
        T = len(seqs[order[i]])
        rows = max(1, min(len(order) - i, max_logits // (T * vocab))) if vocab else 1
        chunk = order[i:i + rows]
        x = torch.full((len(chunk), T), pad_id, dtype=torch.long)
        for r, j in enumerate(chunk):
            x[r, :len(seqs[j])] = torch.tensor(seqs[j])
        x = x.to(dev)
        logits = _logits(model, x)
        vocab = logits.shape[-1]
        for r, j in enumerate(chunk):
            L, n = len(seqs[j]), requests[j][1]
            if not 0 < n < L:
                raise ValueError(f"continuation of {n} tokens does not fit a {L}-token sequence")
            lg, tgt = logits[r, L - n - 1:L - 1], x[r, L - n:L]
            nll = F.cross_entropy(lg, tgt, reduction="sum")
            out[j] = (float(nll), n, bool((lg.argmax(-1) == tgt).all()))
        i += len(chunk)
    return out  # type: ignore[return-value]


@torch.no_grad()
def score_options(model: nn.Module, head: list[int], tails: Sequence[list[int]], block_size: int,
                  pad_id: int = 0) -> list[tuple[float, int, bool]]:
    """score_continuations for several continuations of one context, prefilling the context once.

    The context runs once into a KV cache (model.new_cache / forward_step), the cache is repeated
    once per option (Cache.repeat), and all options run together as one right-padded batch:
    the context's positions are computed once instead of once per option (11 times for
    language_identification). The context is cut on the left once, to fit the longest option,
    so every option is scored after the same context. Same return as score_continuations.
    """
    if not tails or min(len(t) for t in tails) < 1:
        raise ValueError("score_options: every option needs at least one token")
    longest = max(len(t) for t in tails)
    if longest > block_size - 2:
        raise ValueError(f"score_options: an option of {longest} tokens leaves no room for context in {block_size}")
    model.eval()
    dev = _device(model)
    head = truncate_left(head, block_size - longest)
    cache = model.new_cache(1, len(head) + longest)
    with torch.autocast("cuda", torch.bfloat16, enabled=dev.type == "cuda"):
        first = model.forward_step(torch.tensor([head], device=dev), cache)[0, -1].float()   # (V,)
        rest = None
        if longest > 1:
            x = torch.full((len(tails), longest - 1), pad_id, dtype=torch.long)
            for r, t in enumerate(tails):
                x[r, :len(t) - 1] = torch.tensor(t[:-1])
            rest = model.forward_step(x.to(dev), cache.repeat(len(tails))).float()          # (n, longest-1, V)
    out = []
    for r, t in enumerate(tails):
        lg = first[None] if len(t) == 1 else torch.cat([first[None], rest[r, :len(t) - 1]])   # (len(t), V)
        tgt = torch.tensor(t, device=dev)
        out.append((float(F.cross_entropy(lg, tgt, reduction="sum")), len(t), bool((lg.argmax(-1) == tgt).all())))
    return out


def evaluate_task(model: nn.Module, enc, task: Task, k: int, seeds: int = 10, max_items: int | None = None,
                  block_size: int | None = None, bos: int | None = None) -> dict:
    """One task at k shots: accuracy per seed, mean, standard error, centred accuracy, per-item results.

    enc: a tokenizer with encode (or encode_ordinary) and eot_token (BOS and padding).
    Generation tasks also give the gold-completion loss (sum nll / answer tokens over all items and seeds).
    """
    block_size = block_size or model.cfg.block_size
    bos = enc.eot_token if bos is None else bos
    encode = getattr(enc, "encode_ordinary", None) or enc.encode
    n = len(task.items)
    order = random.Random(f"{task.name}/items").sample(range(n), n)
    by_group = defaultdict(list)
    for j, it in enumerate(task.items):
        by_group[it.group].append(j)
    run_seeds = [0] if k == 0 else list(range(seeds))
    requests, plan, skipped, used, n_scored = [], [], 0, [], 0
    for i in order:
        if max_items is not None and len(used) >= max_items:
            break
        item, seqs = task.items[i], []
        pool = [j for j in by_group[item.group] if j != i]
        if k > len(pool):
            raise ValueError(f"{task.name}: {k} demonstrations requested, only {len(pool)} other items")
        for s in run_seeds:
            demos = [task.items[j] for j in random.Random(f"{task.name}/{s}/{i}").sample(pool, k)]
            ctx, conts = build_prompt(item, demos)
            seqs.append(([bos] + encode(ctx), [encode(c) for c in conts]))
        longest = max(len(t) for _, tails in seqs for t in tails)
        if longest > block_size - 2:
            skipped += 1
            continue
        # cut each context once, to fit its longest option: every option is scored after the same
        # context, and both scoring paths below see identical sequences
        seqs = [(truncate_left(head, block_size - max(len(t) for t in tails)), tails) for head, tails in seqs]
        used.append(i)
        for s, (head, tails) in enumerate(seqs):
            plan.append((len(used) - 1, s, n_scored, len(tails)))   # its scores: [n_scored, n_scored + len)
            requests.append((head, tails))
            n_scored += len(tails)
    if task.kind == "mc" and hasattr(model, "new_cache") and _device(model).type == "cpu":
        # prefill each context once and fork it per option (measured on CPU only; on CUDA the few
        # large batched forwards of the per-sequence path are kept)
        scores = [sc for head, tails in requests for sc in score_options(model, head, tails, block_size, bos)]
    else:
        scores = score_continuations(model, [(head + t, len(t)) for head, tails in requests for t in tails],
                                     block_size, pad_id=bos)
    correct = np.zeros((len(run_seeds), len(used)))
    nll_sum, n_tok = 0.0, 0
    for u, s, start, m in plan:
        res = scores[start:start + m]
        if task.kind == "mc":
            item = task.items[used[u]]
            if task.norm == "token":
                crit = [nll / nt for nll, nt, _ in res]
            elif task.norm == "char":
                crit = [nll / max(1, len(o)) for (nll, _, _), o in zip(res, item.options)]   # lm-eval: characters
            else:
                crit = [nll for nll, _, _ in res]
            correct[s, u] = float(item.options[int(np.argmin(crit))] == item.answer)
        else:
            correct[s, u] = float(res[0][2])
            nll_sum += res[0][0]
            n_tok += res[0][1]
    acc = correct.mean(1) if used else np.full(len(run_seeds), np.nan)
    mean = float(acc.mean())
    out = {"k": k, "n_items": len(used), "skipped": skipped, "seeds": len(run_seeds),
           "acc": mean, "acc_se": float(acc.std(ddof=1) / math.sqrt(len(acc))) if len(acc) > 1 else 0.0,
           "acc_by_seed": acc.tolist(), "centred": centred_accuracy(mean, task.rho),
           "items": used, "per_item": correct.mean(0).tolist(), "per_item_by_seed": correct.tolist()}
    if task.kind == "gen":
        out.update(gold_loss=nll_sum / n_tok if n_tok else float("nan"), gold_nll_sum=nll_sum, gold_tokens=n_tok)
    return out


# ================================================================ statistics

def centred_accuracy(acc: float, rho: float) -> float:
    """DCLM Core / SMELT Eq. 11: (a - rho) / (1 - rho); 0 at the random baseline, 1 at perfect."""
    if not 0 <= rho < 1:
        raise ValueError(f"random baseline rho must be in [0, 1), got {rho}")
    return (acc - rho) / (1 - rho)


def permutation_test(a: Sequence[float], b: Sequence[float], n: int = 10000, seed: int = 0) -> float:
    """Two-sided paired permutation test of mean(a - b) = 0: random sign flips of the paired differences.

    p = (1 + #{|mean of flipped d| >= |mean d|}) / (n + 1); identical inputs give p = 1.
    """
    d = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
    if d.ndim != 1 or len(d) == 0:
        raise ValueError(f"a and b must be equal-length non-empty 1-D sequences, got shape {d.shape}")
    obs = abs(d.mean())
    rng = np.random.default_rng(seed)
    hits, done = 0, 0
    while done < n:
        m = min(n - done, max(1, (1 << 22) // len(d)))
        signs = rng.integers(0, 2, size=(m, len(d))) * 2 - 1
        hits += int((np.abs((signs * d).mean(1)) >= obs - 1e-12).sum())
        done += m
    return (1 + hits) / (n + 1)


def sigmoid4(loss, a: float, b: float, alpha: float, tau: float, d: int):
    """SMELT Eq. 6: b + a / (1 + exp(-d alpha (loss - tau))), a, alpha > 0; d = +1 increasing, -1 decreasing."""
    z = np.clip(-d * alpha * (np.asarray(loss, dtype=float) - tau), -60, 60)
    return b + a / (1 + np.exp(z))


def fit_sigmoid(losses: Sequence[float], scores: Sequence[float], d: int) -> dict:
    """Least-squares fit of Eq. 6 (a, alpha > 0 via logs) from a grid of starts; returns params and R^2."""
    from scipy.optimize import least_squares
    x, y = np.asarray(losses, dtype=float), np.asarray(scores, dtype=float)
    if len(x) < 4:
        raise ValueError(f"the 4-parameter sigmoid needs >= 4 Baseline points, got {len(x)}")
    span_y, span_x = max(np.ptp(y), 1e-6), max(np.ptp(x), 1e-6)

    def resid(p):
        return sigmoid4(x, math.exp(p[1]), p[0], math.exp(p[2]), p[3], d) - y

    best = None
    for tau in np.quantile(x, [0.2, 0.5, 0.8]):
        for alpha in (2.0, 10.0):   # slope in units of the loss range
            fit = least_squares(resid, [y.min(), math.log(span_y), math.log(alpha / span_x), tau])
            if best is None or fit.cost < best.cost:
                best = fit
    b, la, lal, tau = best.x
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1 - 2 * best.cost / ss_tot if ss_tot > 0 else float("nan")
    return {"a": math.exp(la), "b": float(b), "alpha": math.exp(lal), "tau": float(tau), "d": d, "r2": r2}


def calibrate(base_losses: Sequence[float], base_scores: Sequence[float], other_losses: Sequence[float],
              other_scores: Sequence[float], higher_is_better: bool = True,
              other_groups: Sequence | None = None) -> dict:
    """SMELT Eq. 6-7: fit loss -> metric on the Baseline, residual delta = s (y - y_hat) for the others.

    d = -1 and s = +1 for a score (higher is better), d = +1 and s = -1 for a loss, so a positive
    residual always means better than a Baseline of the same validation loss.
    Returns {"params": {a, b, alpha, tau, d, r2}, "residuals", "mean_residual", "by_group"}.
    """
    s = 1 if higher_is_better else -1
    params = fit_sigmoid(base_losses, base_scores, d=-s)
    pred = sigmoid4(other_losses, params["a"], params["b"], params["alpha"], params["tau"], params["d"])
    res = s * (np.asarray(other_scores, dtype=float) - pred)
    out = {"params": params, "residuals": res.tolist(), "predicted": pred.tolist(),
           "mean_residual": float(res.mean()) if len(res) else float("nan")}
    if other_groups is not None:
        groups = defaultdict(list)
        for g, r in zip(other_groups, res):
            groups[g].append(r)
        out["by_group"] = {g: float(np.mean(v)) for g, v in groups.items()}
    return out


def calibration_report(base: Sequence[dict], others: Sequence[dict]) -> dict:
    """Calibrate eval.json summaries: metrics "core" and "completion", then every task (centred) by category.

    base / others: evaluate_run outputs (need "val" and "summary"); an optional "scale" key labels
    each run (default: its run directory). Residuals are reported per scale; per-task residuals
    (centred-accuracy units) are averaged within each task category, per scale and pooled.
    """
    missing = [e.get("run", "?") for e in [*base, *others] if not e.get("val")]
    if missing:
        raise ValueError(f"calibration needs each run's validation loss; none in {missing} (evaluate with validation)")
    scale = lambda e: str(e.get("scale", e.get("run", "?")))
    loss = lambda es: [e["val"]["loss"] for e in es]
    report: dict = {"metrics": {}, "by_category": {}}
    for metric, higher in (("core", True), ("completion", False)):
        get = lambda e: e["summary"].get("real", {}).get(metric)
        if all(get(e) is not None and np.isfinite(get(e)) for e in [*base, *others]):
            report["metrics"][metric] = calibrate(loss(base), [get(e) for e in base], loss(others),
                                                  [get(e) for e in others], higher, [scale(e) for e in others])
    cat_res: dict = defaultdict(lambda: defaultdict(list))
    for name, t in base[0]["tasks"].items():
        get = lambda e: e["tasks"].get(name, {}).get("by_k", {}).get(str(t["headline_k"]), {}).get("centred")
        if not all(get(e) is not None for e in [*base, *others]):
            continue
        c = calibrate(loss(base), [get(e) for e in base], loss(others), [get(e) for e in others])
        report["metrics"][f"task/{name}"] = c
        for e, r in zip(others, c["residuals"]):
            cat_res[t["category"]][scale(e)].append(r)
            cat_res[t["category"]]["all"].append(r)
    report["by_category"] = {c: {s: float(np.mean(v)) for s, v in d.items()} for c, d in cat_res.items()}
    return report


# ================================================================ runs

def load_model(run_dir: str | Path, device: str | torch.device = "cpu"):
    """(GPT, meta) from RUN_DIR/config.json ("model": ModelConfig dict) and RUN_DIR/ckpt.pt ("model": state dict)."""
    from model import GPT, ModelConfig
    run = Path(run_dir)
    cfg_path, ckpt_path = run / "config.json", run / "ckpt.pt"
    for p in (cfg_path, ckpt_path):
        if not p.is_file():
            raise FileNotFoundError(f"{p} not found: a run directory needs config.json and ckpt.pt (train.py writes both)")
    try:
        meta = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_path} is not valid JSON: {e}") from e
    if not isinstance(meta, dict) or "model" not in meta:
        raise ValueError(f"{cfg_path} has no 'model' key (expected ModelConfig.to_dict())")
    try:
        ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated file, pickle with code, not a torch file
        raise ValueError(f"{ckpt_path} could not be loaded as a weights-only checkpoint: {e}") from e
    if not isinstance(ckpt, dict) or "model" not in ckpt:
        raise ValueError(f"{ckpt_path} has no 'model' entry (expected torch.save({{'model': state_dict, ...}}))")
    model = GPT(ModelConfig.from_dict(meta["model"]))
    state = {k.removeprefix("_orig_mod."): v for k, v in ckpt["model"].items()}
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        raise ValueError(f"{ckpt_path} does not match the model in {cfg_path}: {e}") from e
    meta = {**meta, "checkpoint": {k: v for k, v in ckpt.items() if k != "model" and not torch.is_tensor(v)}}
    return model.to(device).eval(), meta


def summarise(tasks: dict) -> dict:
    """Per origin ("real", "generated"): "core" = mean centred accuracy over the tasks (for real tasks, the
    DCLM Core average over the subset present), "completion" = micro gold-completion loss over the
    generation tasks; per k and at each task's headline k (its DCLM k if evaluated, else the largest)."""
    out = {}
    for origin in ("real", "generated"):
        ts = {n: t for n, t in tasks.items() if t["origin"] == ("bigbench" if origin == "real" else "generated")}
        if not ts:
            continue

        def agg(pick) -> dict:
            rs = [(t, pick(t)) for t in ts.values() if pick(t) is not None]
            gen = [r for t, r in rs if t["kind"] == "gen" and r["gold_tokens"]]
            return {"core": float(np.mean([r["centred"] for _, r in rs])) if rs else None,
                    "acc_mean": float(np.mean([r["acc"] for _, r in rs])) if rs else None,
                    "completion": (sum(r["gold_nll_sum"] for r in gen) / sum(r["gold_tokens"] for r in gen))
                    if gen else None, "n_tasks": len(rs)}
        ks = sorted({int(k) for t in ts.values() for k in t["by_k"]})
        out[origin] = {**agg(lambda t: t["by_k"].get(str(t["headline_k"]))),
                       "by_k": {str(k): agg(lambda t: t["by_k"].get(str(k))) for k in ks}}
    return out


def evaluate_run(run_dir: str | Path, tasks: Sequence[str] = ("all",), shots: Sequence[int] = SHOTS,
                 seeds: int = 10, max_items: int | None = 100, val: bool = True,
                 val_tokens_per_source: int | None = 1 << 16, batch_size: int = 8, device: str | None = None,
                 enc=None, data=None, log=print) -> dict:
    """Evaluate a run: validation report (when its data_dir is readable) and the shot sweep of every task.

    enc / data: a tokenizer and a TokenData to use instead of the ones the run's config names.
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, meta = load_model(run_dir, device)
    block = model.cfg.block_size
    result: dict = {"run": str(run_dir), "model": meta["model"],
                    "settings": {"tasks": list(tasks), "shots": list(shots), "seeds": seeds, "max_items": max_items}}
    if data is None and val and meta.get("data_dir"):
        try:
            data = data_mod.TokenData(meta["data_dir"])
        except Exception as e:  # a moved or unbuilt dataset should not stop the task evaluation
            log(f"validation skipped: cannot open data_dir {meta['data_dir']!r}: {e}")
    result["val"] = val_loss_report(model, data, block, batch_size, val_tokens_per_source) if (val and data) else None
    if result["val"]:
        log(f"val loss {result['val']['loss']:.4f} over {result['val']['tokens']} tokens")
    if enc is None:
        enc = data_mod.get_tokenizer(model.cfg.vocab_size)
    result["tasks"] = {}
    for name in resolve_tasks(tasks):
        task = get_task(name)
        entry = {"origin": task.origin, "kind": task.kind, "category": task.category, "rho": task.rho,
                 "chance": task.chance, "norm": task.norm if task.kind == "mc" else None, "by_k": {}}
        most = min(Counter(it.group for it in task.items).values()) - 1   # demonstrations available
        for k in shots:
            if k > most:
                log(f"{name:24s} k={k:2d}  skipped: only {most} other items to draw demonstrations from")
                continue
            r = evaluate_task(model, enc, task, k, seeds, max_items, block)
            entry["by_k"][str(k)] = r
            log(f"{name:24s} k={k:2d}  acc {r['acc']:.3f} +- {r['acc_se']:.3f}  centred {r['centred']:+.3f}"
                + (f"  gold loss {r['gold_loss']:.3f}" if task.kind == "gen" else ""))
        done = [int(k) for k in entry["by_k"]]
        entry["headline_k"] = task.shots if task.shots in done else max(done, default=None)
        result["tasks"][name] = entry
    result["summary"] = summarise(result["tasks"])
    return result


def compare(a: dict, b: dict, n: int = 10000, seed: int = 0) -> dict:
    """Model b vs model a (two evaluate_run results): per task and k, acc(b) - acc(a) and the paired
    permutation p-value over items (per-item accuracy averaged over seeds); the length shape of b's gain."""
    out: dict = {"tasks": {}}
    for name, ta in a["tasks"].items():
        tb = b["tasks"].get(name)
        for k, ra in ta["by_k"].items():
            rb = tb["by_k"].get(k) if tb else None
            if rb is None or ra["items"] != rb["items"]:
                continue
            out["tasks"].setdefault(name, {})[k] = {
                "gain": rb["acc"] - ra["acc"], "p": permutation_test(rb["per_item"], ra["per_item"], n, seed)}
    if a.get("val") and b.get("val"):
        shape = normalised_shape(a["val"]["by_length"], b["val"]["by_length"])
        out["length_shape"], out["long_short"] = shape, long_short_ratio(shape)
    return out


# ================================================================ plots and CLI

def plot_shot_sweep(result: dict, path: str | Path, other: dict | None = None) -> None:
    """Accuracy vs k per task (mean +- s.e. over seeds), real and generated tasks in separate panels."""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, origin in zip(axes, ("bigbench", "generated")):
        for i, (name, t) in enumerate(n_t for n_t in result["tasks"].items() if n_t[1]["origin"] == origin):
            for res, style in ((result, "-"), (other, "--")):
                if res is None or name not in res["tasks"]:
                    continue
                ks = sorted(res["tasks"][name]["by_k"], key=int)
                rs = [res["tasks"][name]["by_k"][k] for k in ks]
                ax.errorbar(range(len(ks)), [r["acc"] for r in rs], [r["acc_se"] for r in rs], ls=style,
                            marker="o", ms=3, color=f"C{i}", label=name if style == "-" else None)
                ax.set_xticks(range(len(ks)), ks)
        ax.set(title=f"{'BIG-bench (DCLM Core)' if origin == 'bigbench' else 'generated'} tasks"
               + (" (dashed: compared run)" if other else ""), xlabel="demonstrations k", ylabel="accuracy")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_calibration(base: Sequence[dict], others: Sequence[dict], report: dict, path: str | Path) -> None:
    """Metric vs validation loss: Baseline endpoints, the fitted Eq. 6 curve, the other models."""
    import matplotlib.pyplot as plt
    metrics = [m for m in ("core", "completion") if m in report["metrics"]]
    fig, axes = plt.subplots(1, max(1, len(metrics)), figsize=(5 * max(1, len(metrics)), 4), squeeze=False)
    for ax, m in zip(axes[0], metrics):
        p = report["metrics"][m]["params"]
        xs = [e["val"]["loss"] for e in [*base, *others]]
        grid = np.linspace(min(xs), max(xs), 200)
        ax.plot(grid, sigmoid4(grid, p["a"], p["b"], p["alpha"], p["tau"], p["d"]), "k-", lw=1,
                label=f"Eq. 6 fit, R2={p['r2']:.3f}")
        for es, mk, lab in ((base, "o", "Baseline"), (others, "^", "others")):
            ax.scatter([e["val"]["loss"] for e in es], [e["summary"]["real"][m] for e in es], marker=mk, label=lab)
        ax.set(xlabel="validation loss", ylabel={"core": "mean centred accuracy", "completion": "gold-answer loss"}[m],
               title=f"{m}: mean residual {report['metrics'][m]['mean_residual']:+.4f}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _read_eval(run_dir: str) -> dict:
    p = Path(run_dir) / "eval.json"
    if not p.is_file():
        raise FileNotFoundError(f"{p} not found: run `python eval.py --run {run_dir}` first")
    return json.loads(p.read_text())


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Evaluate a run: validation loss by source/domain/length, "
                                 "few-shot shot sweep, optional comparison and loss-to-score calibration.")
    ap.add_argument("--run", required=True, help="run directory with config.json and ckpt.pt")
    ap.add_argument("--tasks", nargs="+", default=["all"],
                    help=f"task names or groups real|generated|all; real: {list(REAL_TASKS)}; generated: {list(GENERATED_TASKS)}")
    ap.add_argument("--shots", nargs="+", type=int, default=list(SHOTS), help="numbers of demonstrations k")
    ap.add_argument("--seeds", type=int, default=10, help="demonstration seeds per k > 0 (k = 0 runs once)")
    ap.add_argument("--max-items", type=int, default=100, help="items per task (a fixed shuffle); 0 = all")
    ap.add_argument("--val-tokens", type=int, default=1 << 16, help="validation tokens per source; 0 = no validation")
    ap.add_argument("--batch-size", type=int, default=8, help="validation batch size (rows of block_size)")
    ap.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    ap.add_argument("--compare", default=None, help="another run dir with eval.json: permutation tests and length shape vs it")
    ap.add_argument("--baselines", nargs="+", default=None,
                    help="Baseline run dirs with eval.json (>= 4): calibrate this run against them (SMELT Eq. 6-7)")
    args = ap.parse_args(argv)
    if args.baselines and args.val_tokens == 0:
        ap.error("--baselines calibrates against validation loss: it needs --val-tokens > 0")
    res = evaluate_run(args.run, args.tasks, args.shots, args.seeds, args.max_items or None,
                       val=args.val_tokens > 0, val_tokens_per_source=args.val_tokens or None,
                       batch_size=args.batch_size, device=args.device)
    run = Path(args.run)
    other = _read_eval(args.compare) if args.compare else None
    if other:
        res["compare"] = {"against": args.compare, **compare(other, res)}
    if args.baselines:
        base = [_read_eval(d) for d in args.baselines]
        try:
            res["calibration"] = calibration_report(base, [res])
            plot_calibration(base, [res], res["calibration"], run / "eval_calibration.png")
        except ValueError as e:   # e.g. this run's data_dir was unreadable: keep the task results
            res["calibration"] = {"error": str(e)}
            print(f"calibration skipped: {e}")
    (run / "eval.json.tmp").write_text(json.dumps(res, indent=1, default=float))
    os.replace(run / "eval.json.tmp", run / "eval.json")
    plot_shot_sweep(res, run / "eval_shots.png", other)
    for origin, s in res["summary"].items():
        print(f"{origin} tasks: mean centred accuracy {s['core']}, gold-completion loss {s['completion']}")
    print(f"wrote {run / 'eval.json'} and plots")


if __name__ == "__main__":
    main()
