"""Evaluation: validation loss by source / domain / document length, few-shot tasks, calibration.

What this file implements (SMELT Sections 3.1 "Evaluation", 5.1, 5.3 and Appendix E)
----------------------------------------------------------------------------------
* `val_loss_report`: token-weighted validation cross-entropy over all held-out sources, per
  source, per domain and per document-length bucket (upper bounds are powers of two ending at
  the context length: 32..4096 at 4096, SMELT 5.3's eight buckets). `normalised_shape` divides a
  pair's per-bucket improvement by its mean so shapes compare across pairs, `long_short_ratio`
  compares the longer half of the buckets with the shorter half (`length_families` below).
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
* The shot sweep k in {0, 1, 2, 4, 8, 16, 32} (SMELT Fig. 20b-c).
* `calibrate`: SMELT Eq. 6-7, the monotone four-parameter sigmoid from validation loss to a
  metric fitted on Baseline endpoints, and each other model's residual (positive = better than
  its loss predicts) with a t-interval; `calibration_report` does it for the DCLM metrics and per
  task, averaged by category. A fit is *identified* only when the Baseline points can place it
  (`calibration_problem`: >= 5 points, varying losses and scores, not all at chance; then
  R^2 >= 0.5 and no step across a gap in the data); otherwise it returns "not identified (why)"
  and no parameters, residuals or plot.
* Endpoints: `load_model` takes a run directory (its ckpt.pt), an endpoint file
  (RUN_DIR/endpoints/branch_XXXXXXX.pt) or a training checkpoint; `run_endpoints` lists every
  finished decay branch of a run; `evaluate_endpoint` evaluates one (progress lines through a
  `log` callback, each naming "RUN@BRANCH"), `evaluate_endpoints` all of a run's.
* The grid (SMELT 5.1, 5.3, App. C), from a list of endpoint evaluations: `matched_pairs`
  (Baseline / SMELT of one cell, seed and branch), `win_counts` ("Completion 96/96" per metric,
  per cell, per endpoint), `icl_sweep` (per task and k, averaged within cells, then over the
  cells where both models are above chance; the one-sided paired permutation test over
  demonstration seeds at the largest k, `stats.permutation_test`), `length_families` (SMELT vs
  Baseline, more experts, more parameters: normalised gain by document length and the long/short
  ratio with a bootstrap interval over contrasts), `downstream_claims` (intervals decided by
  `stats.verdict`), `downstream_report` (all of these) and `plot_downstream` (their figures;
  nothing drawn for at-chance tasks or unidentified fits, a sentence instead).

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
* Few-shot scoring runs the output head only at the answer positions (`_head_at`: the final
  norm's output is gathered before the vocabulary projection, which is position-wise, so the
  logits are the same). Measured on the tiny preset's models (vocabulary 4096), task scoring is
  1.2x (t128) to 1.5x (t64) faster: the head is 25-50 % of a forward at d_model 128-64; tested
  equal to the full-logit path. Validation needs every position and keeps the plain forward; its
  cross-entropy runs on flattened rows (6x faster than on transposed logits). One endpoint at
  reproduce.PLANS["tiny"]'s settings, random-init models of all 12 tiny runs, one thread: 4.94 ->
  3.82 CPU s on average (t64 1.9-2.6 s, t128 5.4-6.7 s), identical accuracies and losses
  (the previous eval.py against this one, taking turns, best of 2, on a loaded 2-core machine).
* Pairs and units: matched pairs are (scale, sparsity label, training seed, branch step). The
  permutation test pairs demonstration seeds (the same demonstrations on both sides), as
  Appendix C does; with n seeds an exact test cannot go below p = 2^-n. Downstream claims pair
  endpoints by default (as the brief for the main job asks); endpoints of one run share a
  trajectory, so `unit="run"` averages a run pair's endpoints first for independent units.
* Validation tokens are bucketed by their whole document's length when TokenData offers it
  (`val_batches(..., doc_lengths=True)`), else by the length of the document's segment in the
  context (from doc_ids). Documents longer than the context fall into the top bucket.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import re
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import cli
import data as data_mod
import tokenizer

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


@contextlib.contextmanager
def _head_at(model: nn.Module, pos_BM: torch.Tensor | None):
    """Within the block, the model's output head runs only at positions pos_BM (B, M) of each row.

    The head (final norm + vocabulary projection) is position-wise, so selecting the positions of
    the final norm's output before the projection gives exactly the logits at those positions:
    (B, M, V) instead of (B, T, V). Few-shot scoring needs the logits of the answer tokens only; on
    the tiny preset's models the head is 25-50 % of a forward (vocabulary 4096 against d_model
    64-128). Yields True when the model has a `norm_f` module to hook (GPT), else False (the caller
    selects from the full logits). Tested equal to the full-logit path (tests/test_eval.py).
    """
    norm = getattr(model, "norm_f", None)
    if pos_BM is None or not isinstance(norm, nn.Module):
        yield False
        return

    def keep(_mod, _inp, x_BTD):
        return x_BTD.gather(1, pos_BM[..., None].expand(-1, -1, x_BTD.shape[-1]))   # (B, M, D)
    handle = norm.register_forward_hook(keep)
    try:
        yield True
    finally:
        handle.remove()


def _logits_at(model: nn.Module, idx_BT: torch.Tensor, pos_BM: torch.Tensor) -> torch.Tensor:
    """Logits (B, M, V) at positions pos_BM of each row (the head runs there only, when it can)."""
    with _head_at(model, pos_BM) as hooked:
        logits = _logits(model, idx_BT)
    return logits if hooked else logits.gather(1, pos_BM[..., None].expand(-1, -1, logits.shape[-1]))


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
            # flattened rows, not logits.transpose(1, 2): the same numbers, 6x faster on CPU (2 vs 13 ms
            # for 8 x 128 x 4096 logits), a quarter of the tiny preset's validation pass
            nll = F.cross_entropy(logits.flatten(0, 1), targets.clamp(min=0).flatten(),
                                  reduction="none").view(targets.shape)
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
        lens, ns = [len(seqs[j]) for j in chunk], [requests[j][1] for j in chunk]
        for L, n in zip(lens, ns):
            if not 0 < n < L:
                raise ValueError(f"continuation of {n} tokens does not fit a {L}-token sequence")
        # the logits predicting each row's last M tokens (M: the longest continuation in the chunk);
        # a row's continuation is the last n of them (positions before 0 are clamped and unused)
        M = max(ns)
        pos = torch.tensor([[max(0, L - M - 1 + m) for m in range(M)] for L in lens], device=dev)   # (rows, M)
        logits = _logits_at(model, x, pos)                                                          # (rows, M, V)
        vocab = logits.shape[-1]
        for r, j in enumerate(chunk):
            L, n = lens[r], ns[r]
            lg, tgt = logits[r, M - n:], x[r, L - n:L]
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
    with torch.autocast("cuda", torch.bfloat16, enabled=dev.type == "cuda"), \
            _head_at(model, torch.tensor([[len(head) - 1]], device=dev)):   # the head at the last position only
        first = model.forward_step(torch.tensor([head], device=dev), cache)[0, -1].float()   # (V,)
    with torch.autocast("cuda", torch.bfloat16, enabled=dev.type == "cuda"):
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

    Returns {"k", "n_items", "skipped", "seeds", "acc", "acc_se", "acc_by_seed" (one accuracy per
    demonstration seed: what the Appendix C permutation test pairs across models), "centred",
    "items", "per_item", "per_item_by_seed"}; generation tasks add "gold_loss", "gold_nll_sum",
    "gold_tokens" and "gold_loss_by_seed".

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
    nll_s, tok_s = np.zeros(len(run_seeds)), np.zeros(len(run_seeds), dtype=np.int64)   # gold loss per seed
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
            nll_s[s] += res[0][0]
            tok_s[s] += res[0][1]
    acc = correct.mean(1) if used else np.full(len(run_seeds), np.nan)
    mean = float(acc.mean())
    out = {"k": k, "n_items": len(used), "skipped": skipped, "seeds": len(run_seeds),
           "acc": mean, "acc_se": float(acc.std(ddof=1) / math.sqrt(len(acc))) if len(acc) > 1 else 0.0,
           "acc_by_seed": acc.tolist(), "centred": centred_accuracy(mean, task.rho),
           "items": used, "per_item": correct.mean(0).tolist(), "per_item_by_seed": correct.tolist()}
    if task.kind == "gen":
        nll_sum, n_tok = float(nll_s.sum()), int(tok_s.sum())
        out.update(gold_loss=nll_sum / n_tok if n_tok else float("nan"), gold_nll_sum=nll_sum, gold_tokens=n_tok,
                   gold_loss_by_seed=[float(a / b) if b else float("nan") for a, b in zip(nll_s, tok_s)])
    return out


# ================================================================ statistics and calibration

def centred_accuracy(acc: float, rho: float) -> float:
    """DCLM Core / SMELT Eq. 11: (a - rho) / (1 - rho); 0 at the random baseline, 1 at perfect."""
    if not 0 <= rho < 1:
        raise ValueError(f"random baseline rho must be in [0, 1), got {rho}")
    return (acc - rho) / (1 - rho)


def chance_of(task: dict) -> float:
    """A task entry's chance accuracy: its exact chance rate where one is defined, else DCLM's rho."""
    return float(task["rho"] if task.get("chance") is None else task["chance"])


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


CALIBRATION_MIN_POINTS = 5       # four parameters: at least one degree of freedom left
CALIBRATION_MIN_R2 = 0.5         # the curve must explain most of the Baseline's spread (paper: 0.91-0.997)
CALIBRATION_MAX_JUMP = 0.5       # share of the fitted curve's rise between two neighbouring Baseline losses


def calibration_problem(losses: Sequence[float], scores: Sequence[float], chance: float | None = None) -> str | None:
    """Why Eq. 6 cannot be identified from these Baseline points before fitting (None: try the fit).

    Refused: fewer than CALIBRATION_MIN_POINTS points; all losses equal; constant scores; every
    score at or below `chance` (a score metric whose Baseline never leaves the chance floor: the
    old calibration fitted a sigmoid to all-zero accuracies and printed R^2 = nan).
    """
    x, y = np.asarray(losses, dtype=float), np.asarray(scores, dtype=float)
    if len(x) < CALIBRATION_MIN_POINTS:
        return (f"{len(x)} Baseline endpoint{'s' if len(x) != 1 else ''}; the 4-parameter sigmoid needs at least "
                f"{CALIBRATION_MIN_POINTS}")
    if np.ptp(x) <= 1e-9:
        return f"every Baseline endpoint has the same validation loss ({x[0]:.4f})"
    if np.ptp(y) <= 1e-9 * max(1.0, float(np.abs(y).max())):
        return f"every Baseline score is the same ({y[0]:.4g})"
    if chance is not None and (y <= chance + 1e-9).all():
        return f"every Baseline score is at or below chance ({chance:.4g}); max {y.max():.4g}"
    return None


def calibrate(base_losses: Sequence[float], base_scores: Sequence[float], other_losses: Sequence[float],
              other_scores: Sequence[float], higher_is_better: bool = True,
              other_groups: Sequence | None = None, chance: float | None = None,
              min_r2: float = CALIBRATION_MIN_R2) -> dict:
    """SMELT Eq. 6-7: fit loss -> metric on the Baseline, residual delta = s (y - y_hat) for the others.

    d = -1 and s = +1 for a score (higher is better), d = +1 and s = -1 for a loss, so a positive
    residual always means better than a Baseline of the same validation loss.
    The fit is *identified* only when calibration_problem finds nothing, R^2 is finite and at least
    min_r2, and the curve is not a step: between no two neighbouring Baseline losses does it rise
    by more than CALIBRATION_MAX_JUMP of its rise over all of them (a sigmoid that jumps across a gap
    in the data puts its transition anywhere in the gap: two clusters of points fit it perfectly).
    Returns {"identified": False, "why", "n_base"} when it is not (no parameters, no residuals),
    else {"identified": True, "why": None, "n_base", "params": {a, b, alpha, tau, d, r2}, "residuals",
    "predicted", "mean_residual", "residual_interval" (stats.mean_interval over the others, a dict),
    "extrapolated" (others outside the Baseline loss range), "by_group"}.
    """
    import stats
    bl, bs = np.asarray(base_losses, dtype=float), np.asarray(base_scores, dtype=float)
    ol, os_ = np.asarray(other_losses, dtype=float), np.asarray(other_scores, dtype=float)
    for name, a, b in (("Baseline", bl, bs), ("other", ol, os_)):
        if a.shape != b.shape or a.ndim != 1:
            raise ValueError(f"calibrate: {name} losses and scores must be equal-length lists, "
                             f"got {a.shape} and {b.shape}")
        if not (np.isfinite(a).all() and np.isfinite(b).all()):
            raise ValueError(f"calibrate: {name} losses / scores hold non-finite values")
    s = 1 if higher_is_better else -1
    out: dict = {"identified": False, "why": calibration_problem(bl, bs, chance), "n_base": len(bl)}
    if out["why"]:
        return out
    params = fit_sigmoid(bl, bs, d=-s)
    on_base = sigmoid4(np.sort(bl), params["a"], params["b"], params["alpha"], params["tau"], params["d"])
    jump = float(np.abs(np.diff(on_base)).max() / max(np.ptp(on_base), 1e-300))
    if not math.isfinite(params["r2"]) or params["r2"] < min_r2:
        out["why"] = f"the fit explains too little of the Baseline spread (R^2 = {params['r2']:.3f} < {min_r2})"
    elif jump > CALIBRATION_MAX_JUMP:
        out["why"] = (f"the fitted curve is a step: {100 * jump:.0f} % of its rise lies between two neighbouring "
                      f"Baseline losses, so the data do not place its transition")
    if out["why"]:
        return out
    pred = sigmoid4(ol, params["a"], params["b"], params["alpha"], params["tau"], params["d"])
    res = s * (os_ - pred)
    out.update(identified=True, params=params, residuals=res.tolist(), predicted=pred.tolist(),
               mean_residual=float(res.mean()) if len(res) else float("nan"),
               residual_interval=stats.mean_interval(res).to_dict() if len(res) else None,
               extrapolated=int(((ol < bl.min()) | (ol > bl.max())).sum()))
    if other_groups is not None:
        groups = defaultdict(list)
        for g, r in zip(other_groups, res):
            groups[g].append(r)
        out["by_group"] = {g: float(np.mean(v)) for g, v in groups.items()}
    return out


# (metric name, summary origin, summary key, higher is better, chance in the metric's units)
CALIBRATION_METRICS = (("core", "real", "core", True, 0.0), ("completion", "real", "completion", False, None),
                       ("generated core", "generated", "core", True, 0.0),
                       ("generated completion", "generated", "completion", False, None))


def calibration_report(base: Sequence[dict], others: Sequence[dict], min_r2: float = CALIBRATION_MIN_R2) -> dict:
    """Calibrate endpoint evaluations (SMELT 5.1): every metric of CALIBRATION_METRICS, then every task.

    base: the Baseline endpoints (the paper: all 96); others: the SMELT endpoints. Each needs "val"
    and "summary" (evaluate_endpoint output); "scale" labels the residual groups (default: the run).
    "core" / "completion" are the real (BIG-bench) tasks' DCLM metrics, "generated ..." the same over
    the generated tasks. Per-task fits use centred accuracy at the task's headline k; residuals of
    identified task fits are averaged within each task category, per scale and pooled ("all").
    Returns {"metrics": {name: calibrate(...) + "higher_is_better"}, "identified": [names],
    "not_identified": {name: why}, "by_category": {category: {scale: mean residual}}}.
    """
    missing = [e.get("run", "?") for e in [*base, *others] if not e.get("val")]
    if missing:
        raise ValueError(f"calibration needs each endpoint's validation loss; none in {missing} "
                         f"(evaluate with validation)")
    scale = lambda e: str(e.get("scale") or e.get("run", "?"))
    loss = lambda es: [e["val"]["loss"] for e in es]
    report: dict = {"metrics": {}, "by_category": {}}
    for name, origin, key, higher, chance in CALIBRATION_METRICS:
        get = lambda e: e["summary"].get(origin, {}).get(key)
        vals = [get(e) for e in [*base, *others]]
        if all(v is None for v in vals):
            continue
        if any(v is None or not np.isfinite(v) for v in vals):
            report["metrics"][name] = {"identified": False, "why": f"{name} is missing for some endpoints",
                                       "n_base": len(base), "higher_is_better": higher}
            continue
        report["metrics"][name] = {**calibrate(loss(base), [get(e) for e in base], loss(others),
                                               [get(e) for e in others], higher, [scale(e) for e in others],
                                               chance=chance, min_r2=min_r2), "higher_is_better": higher}
    cat_res: dict = defaultdict(lambda: defaultdict(list))
    for name, t in (base[0]["tasks"].items() if base else []):
        k = str(t.get("headline_k"))
        get = lambda e: e["tasks"].get(name, {}).get("by_k", {}).get(k, {}).get("centred")
        if not all(get(e) is not None for e in [*base, *others]):
            continue
        chance = centred_accuracy(chance_of(t), t["rho"]) if "rho" in t else 0.0
        c = calibrate(loss(base), [get(e) for e in base], loss(others), [get(e) for e in others],
                      chance=chance, min_r2=min_r2)
        report["metrics"][f"task/{name}"] = {**c, "higher_is_better": True}
        if c["identified"]:
            for e, r in zip(others, c["residuals"]):
                cat_res[t["category"]][scale(e)].append(r)
                cat_res[t["category"]]["all"].append(r)
    report["by_category"] = {c: {s: float(np.mean(v)) for s, v in d.items()} for c, d in cat_res.items()}
    report["identified"] = [m for m, c in report["metrics"].items() if c["identified"]]
    report["not_identified"] = {m: c["why"] for m, c in report["metrics"].items() if not c["identified"]}
    return report


# ================================================================ endpoints and runs

def _torch_load(path: Path) -> dict:
    """A train.py torch file: its sha256 trailer checked first (runfiles.file_digest: a flipped byte is a
    CheckpointError naming the file), then loaded weights-only."""
    import runfiles
    runfiles.file_digest(path)
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated file, pickle with code, not a torch file
        raise ValueError(f"{path} could not be loaded as a weights-only checkpoint: {e}") from e
    if not isinstance(ckpt, dict) or "model" not in ckpt:
        raise ValueError(f"{path} has no 'model' entry (expected torch.save({{'model': state_dict, ...}}))")
    return ckpt


def _read_json(path: Path) -> dict:
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(d, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(d).__name__}")
    return d


def load_model(path: str | Path, device: str | torch.device = "cpu"):
    """(GPT, meta) from a run directory, an endpoint file or a full training checkpoint.

    run directory  RUN_DIR/ckpt.pt (the longest branch's endpoint) with RUN_DIR/config.json;
    endpoint file  RUN_DIR/endpoints/branch_XXXXXXX.pt (weights and "meta" only);
    checkpoint     RUN_DIR/ckpt/*.pt (train.py's resume points: weights, optimizer, "meta").
    All hold "model" (a state dict) and, written by train.py, "meta" (a JSON string with "model":
    the ModelConfig dict, "train", "branch", "step", "tokens"). The ModelConfig comes from the file's
    own meta, else from config.json. A file inside RUN_DIR/endpoints or RUN_DIR/ckpt also reads
    RUN_DIR/config.json (data_dir, the run's arch / scale / sparsity label).
    meta: config.json's keys (when found) plus "model", "checkpoint" (the file's meta and scalar
    entries), "run_dir", "endpoint" (path relative to the run dir), "branch_step" (the meta's
    "branch", else read from the file name), "step", "tokens".
    """
    from model import GPT, ModelConfig
    p = Path(path)
    if p.is_dir():
        run, file = p, p / "ckpt.pt"
        if not (p / "config.json").is_file():
            raise FileNotFoundError(f"{p / 'config.json'} not found: a run directory needs config.json and ckpt.pt "
                                    f"(train.py writes both)")
        if not file.is_file():
            raise FileNotFoundError(f"{file} not found: train.py writes it when the run's longest branch finishes; "
                                    f"give an endpoint file (RUN_DIR/endpoints/*.pt) to evaluate another branch")
    elif p.is_file():
        file = p
        parent = p.parent.parent
        run = parent if p.parent.name in ("endpoints", "ckpt") and (parent / "config.json").is_file() else None
    else:
        raise FileNotFoundError(f"{p} not found: give a run directory (config.json + ckpt.pt), an endpoint file "
                                f"or a training checkpoint")
    config = _read_json(run / "config.json") if run is not None else {}
    ckpt = _torch_load(file)
    own = ckpt.get("meta")
    if isinstance(own, str):
        try:
            own = json.loads(own)
        except json.JSONDecodeError as e:
            raise ValueError(f"{file}: its 'meta' entry is not valid JSON: {e}") from e
    own = own if isinstance(own, dict) else {}
    cfg = own.get("model") or config.get("model")
    if not isinstance(cfg, dict):
        raise ValueError(f"{file} has no model config: neither its 'meta' nor "
                         f"{run / 'config.json' if run else 'a config.json beside it'} has a 'model' key "
                         f"(expected ModelConfig.to_dict())")
    model = GPT(ModelConfig.from_dict(cfg))
    state = {k.removeprefix("_orig_mod."): v for k, v in ckpt["model"].items()}
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        raise ValueError(f"{file} does not match its model config: {e}") from e
    scalars = {k: v for k, v in ckpt.items() if k not in ("model", "optimizer", "rng", "meta") and
               isinstance(v, (int, float, str, bool))}
    branch = own.get("branch")
    named = re.fullmatch(r"branch_?(\d{7})(?:_\d{7})?\.pt", file.name)   # endpoints/branch_B.pt, ckpt/branchB_E.pt
    if branch is None and named:
        branch = int(named.group(1))
    meta = {**config, "model": cfg, "checkpoint": {**scalars, **({"meta": own} if own else {})},
            "run_dir": str(run) if run is not None else None,
            "endpoint": str(file.relative_to(run)) if run is not None and file.parent != run else None,
            "branch_step": int(branch) if branch is not None else None,
            "step": own.get("step", scalars.get("step")), "tokens": own.get("tokens")}
    return model.to(device).eval(), meta


def run_endpoints(run_dir: str | Path) -> list[dict]:
    """Every finished decay branch of a run, by branch step: [{"run", "branch_step", "endpoint", "path"}].

    Read from RUN_DIR/results.jsonl (one row per finished branch; the last row of a branch wins).
    A row's endpoint file is its "endpoint" field (relative to the run dir), else
    endpoints/branch_XXXXXXX.pt, else the branch's final training checkpoint
    ckpt/branchXXXXXXX_YYYYYYY.pt (YYYYYYY = branch step + decay steps), whichever exists first.
    """
    run = Path(run_dir)
    res = run / "results.jsonl"
    if not res.is_file():
        raise FileNotFoundError(f"{res} not found: train.py writes one row per finished decay branch")
    import runfiles
    try:
        rows = {int(r["branch_step"]): r for r in runfiles.read_jsonl(res, ("branch_step",))}   # hash-checked
    except runfiles.CheckpointError as e:
        raise ValueError(str(e)) from None
    out = []
    for b, r in sorted(rows.items()):
        decay = (r.get("train") or {}).get("decay_steps")
        cands = [r["endpoint"]] if r.get("endpoint") else []
        cands += [f"endpoints/branch_{b:07d}.pt"] + ([f"ckpt/branch{b:07d}_{b + decay:07d}.pt"] if decay else [])
        found = next((c for c in cands if (run / c).is_file()), None)
        if found is None:
            raise FileNotFoundError(f"{run}: branch {b} finished (results.jsonl) but none of its endpoint files "
                                    f"exists: {', '.join(cands)}")
        out.append({"run": str(run), "branch_step": b, "endpoint": found, "path": str(run / found)})
    return out


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


def evaluate_endpoint(path: str | Path, tasks: Sequence[str] = ("all",), shots: Sequence[int] = SHOTS,
                      seeds: int = 10, max_items: int | None = 100, val: bool | dict = True,
                      val_tokens_per_source: int | None = 1 << 16, batch_size: int = 8, device: str | None = None,
                      enc=None, data=None, log=print) -> dict:
    """Evaluate one endpoint: validation report (when data or its run's data_dir is readable), shot sweep.

    path: a run directory (its ckpt.pt: the longest branch), an endpoint file or a training
    checkpoint (see load_model). enc / data: a tokenizer and a TokenData to use instead of the ones
    the run names. val: True (val_loss_report here), False (none), or a val_loss_report dict made
    elsewhere for this endpoint (e.g. at the branch end, on the same tokens: the validation pass is
    about half of an endpoint's evaluation on the tiny preset). log: called with one compact progress line per stage and task, each naming the
    endpoint ("RUN@BRANCH"); the main job passes its own in worker processes (log=lambda m: None: quiet).
    Returns {"run", "name", "endpoint", "branch_step", "step", "tokens", "arch", "scale",
    "sparsity_label", "seed", "model", "settings", "val", "tasks", "summary", "seconds"}.
    """
    t0 = time.perf_counter()
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, meta = load_model(path, device)
    block = model.cfg.block_size
    run_meta = meta.get("meta") or {}
    run = meta["run_dir"] or str(path)
    train_cfg = meta.get("train") or meta["checkpoint"].get("meta", {}).get("train") or {}
    result: dict = {
        "run": run, "name": Path(run).name, "endpoint": meta["endpoint"], "branch_step": meta["branch_step"],
        "step": meta["step"], "tokens": meta["tokens"],
        "arch": run_meta.get("arch", "smelt" if model.cfg.loop.active else "baseline"),
        "scale": run_meta.get("scale"), "sparsity_label": run_meta.get("sparsity_label"),
        "seed": train_cfg.get("seed"), "model": meta["model"],
        "settings": {"tasks": list(tasks), "shots": list(shots), "seeds": seeds, "max_items": max_items}}
    label = endpoint_id(result)
    given = val if isinstance(val, dict) else None
    if given is not None and not {"loss", "by_length"} <= set(given):
        raise ValueError(f"{label}: val must be True, False or a val_loss_report dict (with 'loss' and 'by_length'); "
                         f"got keys {sorted(given)}")
    val = bool(val) and given is None
    if data is None and val and meta.get("data_dir"):
        try:
            data = data_mod.TokenData(meta["data_dir"])
        except Exception as e:  # a moved or unbuilt dataset should not stop the task evaluation
            log(f"{label}: validation skipped: cannot open data_dir {meta['data_dir']!r}: {e}")
    result["val"] = given or (val_loss_report(model, data, block, batch_size, val_tokens_per_source)
                              if (val and data) else None)
    if result["val"] and given is None:
        log(f"{label}: val loss {result['val']['loss']:.4f} over {result['val']['tokens']} tokens "
            f"({time.perf_counter() - t0:.1f} s)")
    if enc is None:
        enc = tokenizer.get_tokenizer(model.cfg.vocab_size)
    result["tasks"] = {}
    names = resolve_tasks(tasks)
    for i, name in enumerate(names, 1):
        t1 = time.perf_counter()
        task = get_task(name)
        entry = {"origin": task.origin, "kind": task.kind, "category": task.category, "rho": task.rho,
                 "chance": task.chance, "norm": task.norm if task.kind == "mc" else None, "by_k": {}}
        most = min(Counter(it.group for it in task.items).values()) - 1   # demonstrations available
        for k in shots:
            if k > most:
                log(f"{label}: {name} k={k} skipped: only {most} other items to draw demonstrations from")
                continue
            entry["by_k"][str(k)] = evaluate_task(model, enc, task, k, seeds, max_items, block)
        done = [int(k) for k in entry["by_k"]]
        entry["headline_k"] = task.shots if task.shots in done else max(done, default=None)
        result["tasks"][name] = entry
        accs = "  ".join(f"k={k} {r['acc']:.3f}" for k, r in entry["by_k"].items())
        log(f"{label}: task {i}/{len(names)} {name}: acc {accs} ({time.perf_counter() - t1:.1f} s)")
    result["summary"] = summarise(result["tasks"])
    result["seconds"] = time.perf_counter() - t0
    log(f"{label}: done in {result['seconds']:.1f} s")
    return result


def evaluate_run(run_dir: str | Path, *args, **kw) -> dict:
    """evaluate_endpoint on a run directory: its longest branch's endpoint (RUN_DIR/ckpt.pt)."""
    return evaluate_endpoint(run_dir, *args, **kw)


def evaluate_endpoints(run_dir: str | Path, branches: Sequence[int] | None = None, **kw) -> list[dict]:
    """evaluate_endpoint on every finished branch of a run (run_endpoints), or on the given branch steps."""
    eps = run_endpoints(run_dir)
    if branches is not None:
        missing = sorted(set(branches) - {e["branch_step"] for e in eps})
        if missing:
            raise ValueError(f"{run_dir}: no finished branch at steps {missing}; finished: "
                             f"{[e['branch_step'] for e in eps]}")
        eps = [e for e in eps if e["branch_step"] in set(branches)]
    return [evaluate_endpoint(e["path"], **kw) for e in eps]


# ================================================================ the grid: pairs, wins, Appendix C, Section 5.3

def endpoint_id(rec: dict) -> str:
    """'RUN_NAME@BRANCH_STEP' (or RUN_NAME alone for an endpoint without a branch): the key of an endpoint."""
    name = rec.get("name") or Path(str(rec.get("run", "?"))).name
    return name if rec.get("branch_step") is None else f"{name}@{rec['branch_step']}"


def _check_grid(records: Sequence[dict]) -> None:
    for r in records:
        missing = [k for k in ("arch", "scale", "sparsity_label") if r.get(k) is None]
        if missing:
            raise ValueError(f"endpoint {endpoint_id(r)} has no {', '.join(missing)}: the grid analysis needs each "
                             f"run's arch, scale and sparsity_label (train.py's meta / config.json 'meta')")


def matched_pairs(records: Sequence[dict]) -> list[dict]:
    """Baseline and SMELT endpoints of the same cell, training seed and branch step (SMELT's matched pairs).

    Returns [{"cell", "scale", "sparsity_label", "seed", "branch_step", "baseline", "smelt"}], sorted.
    Records of other archs are ignored; two endpoints with the same key are an error.
    """
    _check_grid(records)
    by_key: dict = {}
    for r in records:
        if r["arch"] not in ("baseline", "smelt"):
            continue
        key = (r["scale"], r["sparsity_label"], r.get("seed"), r.get("branch_step"), r["arch"])
        if key in by_key:
            raise ValueError(f"two endpoints for {key}: {endpoint_id(by_key[key])} and {endpoint_id(r)}")
        by_key[key] = r
    pairs = []
    for (sc, lab, seed, b, arch), r in by_key.items():
        if arch == "baseline" and (sc, lab, seed, b, "smelt") in by_key:
            pairs.append({"cell": f"{sc} {lab}", "scale": sc, "sparsity_label": lab, "seed": seed, "branch_step": b,
                          "baseline": r, "smelt": by_key[(sc, lab, seed, b, "smelt")]})
    return sorted(pairs, key=lambda p: (p["cell"], str(p["seed"]), p["branch_step"] or 0))


def metric_value(rec: dict, metric: str) -> float | None:
    """'val_loss', or '<origin> core' / '<origin> completion' (origin: real | generated) of one endpoint."""
    if metric == "val_loss":
        return rec["val"]["loss"] if rec.get("val") else None
    origin, key = metric.split(" ")
    v = rec.get("summary", {}).get(origin, {}).get(key)
    return None if v is None or not np.isfinite(v) else float(v)


# (metric, what, lower is better, the paper's count)
WIN_METRICS = (("val_loss", "validation loss", True, "lower in all 16 cells (Sec. 4.1)"),
               ("real completion", "gold-completion loss, BIG-bench tasks (DCLM Completion)", True,
                "96 / 96 (Sec. 5.1)"),
               ("real core", "centred accuracy, BIG-bench tasks (DCLM Core)", False, "83 / 96 (Sec. 5.1)"),
               ("generated completion", "gold-completion loss, generated tasks", True, None),
               ("generated core", "centred accuracy, generated tasks", False, None))


def win_counts(records: Sequence[dict]) -> dict:
    """SMELT 5.1's win counts: of the matched endpoint pairs, how many SMELT is better on, per metric.

    Returns {"n_pairs", "metrics": {metric: {"what", "lower_is_better", "paper", "wins", "ties", "n",
    "by_cell": {cell: {"wins", "ties", "n"}}, "by_endpoint": [{"cell", "seed", "branch_step",
    "baseline", "smelt", "delta" (SMELT - Baseline), "win"}]}}}. Ties are not wins.
    """
    pairs = matched_pairs(records)
    out: dict = {"n_pairs": len(pairs), "metrics": {}}
    for metric, what, lower, paper in WIN_METRICS:
        rows, cells = [], defaultdict(lambda: {"wins": 0, "ties": 0, "n": 0})
        for p in pairs:
            b, s = metric_value(p["baseline"], metric), metric_value(p["smelt"], metric)
            if b is None or s is None:
                continue
            win, tie = (s < b if lower else s > b), s == b
            rows.append({"cell": p["cell"], "seed": p["seed"], "branch_step": p["branch_step"], "baseline": b,
                         "smelt": s, "delta": s - b, "win": win})
            c = cells[p["cell"]]
            c["wins"], c["ties"], c["n"] = c["wins"] + win, c["ties"] + tie, c["n"] + 1
        if rows:
            out["metrics"][metric] = {"what": what, "lower_is_better": lower, "paper": paper,
                                      "wins": sum(r["win"] for r in rows), "ties": sum(r["delta"] == 0 for r in rows),
                                      "n": len(rows), "by_cell": dict(cells), "by_endpoint": rows}
    return out


def icl_sweep(records: Sequence[dict], margin: float = 0.0, n_perm: int = 10000) -> dict:
    """SMELT Appendix C: per task and k, accuracy averaged within each (scale, sparsity) cell, then over
    the cells where both architectures are above chance; the one-sided permutation test at the max k.

    Within a cell the matched endpoint pairs (all branches and seeds of the cell) are averaged, per
    demonstration seed. A cell counts at (task, k) when both architectures' cell means exceed the
    task's chance (chance_of) by more than `margin`. The test (stats.permutation_test,
    alternative="greater": SMELT > Baseline) pairs the per-seed accuracies at the task's largest k
    shared by every endpoint, pooled over the cells above chance, and per cell. With n seeds an exact
    test cannot give p below 2^-n ("p_min"): 2 seeds never reach p < 0.05.
    Returns {task: {"origin", "kind", "chance", "ks", "by_k": {k: {"baseline", "smelt", "gain",
    "cells_above", "cells", "baseline_by_seed", "smelt_by_seed", "baseline_all_cells",
    "smelt_all_cells" (the mean over every cell, at chance or not: for tables, never averaged into
    the curve)}}, "max_k", "test": {"k", "p", "p_min", "seeds", "gain", "cells_above", "why"},
    "by_cell": {cell: {"above", "baseline", "smelt", "gain", "p"}}, "note"}}; means are None where no
    cell is above chance, and "note" says so.
    """
    import stats
    pairs = matched_pairs(records)
    if not pairs:
        return {}
    names = [n for n in pairs[0]["baseline"]["tasks"]
             if all(n in p[a]["tasks"] for p in pairs for a in ("baseline", "smelt"))]
    out = {}
    for name in names:
        t0 = pairs[0]["baseline"]["tasks"][name]
        chance = chance_of(t0)
        ks = sorted(set.intersection(*(set(int(k) for k in p[a]["tasks"][name]["by_k"])
                                       for p in pairs for a in ("baseline", "smelt"))))
        cells = sorted({p["cell"] for p in pairs})

        def cell_seeds(k: int) -> dict:
            """{cell: (baseline per-seed accuracy, SMELT per-seed accuracy)}, averaged over the cell's pairs."""
            got = {}
            for c in cells:
                ps = [p for p in pairs if p["cell"] == c]
                arr = {a: [p[a]["tasks"][name]["by_k"][str(k)]["acc_by_seed"] for p in ps]
                       for a in ("baseline", "smelt")}
                n = min(len(x) for v in arr.values() for x in v)
                got[c] = tuple(np.mean([x[:n] for x in arr[a]], axis=0) for a in ("baseline", "smelt"))
            return got

        entry = {"origin": t0["origin"], "kind": t0["kind"], "chance": chance, "ks": ks, "by_k": {}}
        for k in ks:
            cs = cell_seeds(k)
            above = [c for c, (b, s) in cs.items() if b.mean() > chance + margin and s.mean() > chance + margin]
            row = {"cells_above": len(above), "cells": len(cells), "baseline": None, "smelt": None, "gain": None,
                   "baseline_by_seed": None, "smelt_by_seed": None,
                   "baseline_all_cells": float(np.mean([b.mean() for b, _ in cs.values()])),
                   "smelt_all_cells": float(np.mean([s.mean() for _, s in cs.values()]))}
            if above:
                n = min(len(cs[c][0]) for c in above)
                b = np.mean([cs[c][0][:n] for c in above], axis=0)
                s = np.mean([cs[c][1][:n] for c in above], axis=0)
                row.update(baseline=float(b.mean()), smelt=float(s.mean()), gain=float(s.mean() - b.mean()),
                           baseline_by_seed=b.tolist(), smelt_by_seed=s.tolist())
            entry["by_k"][str(k)] = row
        K = max(ks) if ks else None
        entry["max_k"] = K
        test = {"k": K, "p": None, "p_min": None, "seeds": 0, "gain": None, "cells_above": 0, "why": None}
        entry["by_cell"] = {}
        if K is not None:
            top = entry["by_k"][str(K)]
            cs = cell_seeds(K)
            for c, (b, s) in cs.items():
                ok = b.mean() > chance + margin and s.mean() > chance + margin
                entry["by_cell"][c] = {"above": bool(ok), "baseline": float(b.mean()), "smelt": float(s.mean()),
                                       "gain": float(s.mean() - b.mean()),
                                       "p": stats.permutation_test(s, b, n_perm, alternative="greater")
                                       if len(b) > 1 else None}
            test.update(cells_above=top["cells_above"], gain=top["gain"])
            if top["baseline_by_seed"] is None:
                test["why"] = f"no cell has both models above chance ({chance:.3g}) at k={K}"
            elif len(top["baseline_by_seed"]) < 2:
                test["why"] = f"one seed at k={K}: a paired test over seeds needs at least 2"
            else:
                n = len(top["baseline_by_seed"])
                test.update(seeds=n, p_min=2.0 ** -n if n <= 16 else 1 / (n_perm + 1),
                            p=stats.permutation_test(top["smelt_by_seed"], top["baseline_by_seed"], n_perm,
                                                     alternative="greater"))
        entry["test"] = test
        if not any(r["cells_above"] for r in entry["by_k"].values()):
            entry["note"] = (f"{name}: no cell has both models above chance ({chance:.3g}) at any k "
                             f"({', '.join(map(str, ks))}); nothing to average or draw")
        out[name] = entry
    return out


def _label_percent(label: str) -> float:
    m = re.search(r"(\d+(?:\.\d+)?)\s*%", str(label))
    return float(m.group(1)) if m else float("nan")


def _natural(s: str) -> tuple:
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(s)))


def _scale_rank(records: Sequence[dict]) -> dict[str, float]:
    """Each scale's rank by its Baselines' active parameters (budget.count_params); by name when unknown."""
    import budget
    from model import ModelConfig
    act = defaultdict(list)
    for r in records:
        if r["arch"] == "baseline" and isinstance(r.get("model"), dict):
            act[r["scale"]].append(budget.count_params(ModelConfig.from_dict(r["model"]))["active"])
    scales = {r["scale"] for r in records}
    if all(act.get(s) for s in scales):
        return {s: float(np.median(act[s])) for s in scales}
    return {s: i for i, s in enumerate(sorted(scales, key=_natural))}


def _sparsity_rank(records: Sequence[dict]) -> dict[str, float]:
    """Each sparsity label's rank: the percentage it names ('S=0%' -> 0, 'S~85%' -> 85), else its experts."""
    labels = {r["sparsity_label"] for r in records}
    if all(math.isfinite(_label_percent(lab)) for lab in labels):
        return {lab: _label_percent(lab) for lab in labels}
    experts = defaultdict(list)
    for r in records:
        experts[r["sparsity_label"]].append((r.get("model") or {}).get("n_experts", 0))
    return {lab: float(np.median(experts[lab])) for lab in labels}


# the long/short ratio of each family in SMELT Fig. 20a
PAPER_LONG_SHORT = {"SMELT vs Baseline": 1.52, "more experts": 0.88, "more parameters": 0.98}


def length_families(records: Sequence[dict], n_boot: int = 2000, seed: int = 0, min_tokens: int = 1000) -> dict:
    """SMELT 5.3 / Fig. 20a: the three families of contrasts in loss by document length.

      SMELT vs Baseline  each SMELT run against its matched Baseline (same cell and seed);
      more experts       consecutive sparsity levels within the Baseline at the same scale
                         (S=0% -> S~85% -> ...: the levels the grid has, ordered by the label's %);
      more parameters    consecutive scales within the Baseline at the same sparsity label
                         (ordered by the Baselines' active parameters).
    A contrast (ref run -> new run, same seed) pairs their endpoints branch by branch (by branch
    order when both runs have as many endpoints, else by equal branch step), normalises each
    endpoint pair's per-bucket gain (ref loss - new loss) by its mean (normalised_shape) and averages
    the pairs' shapes. A family averages its contrasts' shapes; its long/short ratio
    (long_short_ratio of the mean shape) gets a percentile bootstrap interval over contrasts
    (stats.bootstrap_interval: contrasts resampled, the ratio recomputed). Endpoint pairs whose mean
    gain is zero have no shape and are left out (counted). Records need "val" with "by_length".
    Buckets holding fewer than `min_tokens` validation tokens ("tokens_by_length") are left out:
    at the tiny preset's 128-token context the 16-token bucket holds 11 tokens, and its one noisy
    value set the whole ratio. A contrast whose mean gain is negative (the "new" model is worse)
    normalises a loss, not a gain; they are counted ("n_negative").
    Returns {family: {"paper", "shape": {bucket: mean}, "long_short": Interval dict | None,
    "n_contrasts", "n_endpoint_pairs", "n_degenerate", "n_negative", "buckets_dropped": {bucket:
    tokens}, "contrasts": [{"ref", "new", "long_short", "mean_gain", "n_pairs"}], "why"}}.
    """
    import stats
    recs = [r for r in records if r.get("val") and r["val"].get("by_length")]
    _check_grid(recs)
    runs: dict = defaultdict(list)
    for r in recs:
        runs[(r["arch"], r["scale"], r["sparsity_label"], r.get("seed"))].append(r)
    for v in runs.values():
        v.sort(key=lambda r: r.get("branch_step") or 0)
    scale_rank, sparse_rank = (_scale_rank(recs), _sparsity_rank(recs)) if recs else ({}, {})
    base = {k: v for k, v in runs.items() if k[0] == "baseline"}
    contrasts: dict = {f: [] for f in PAPER_LONG_SHORT}
    for (arch, sc, lab, sd) in base:
        if ("smelt", sc, lab, sd) in runs:
            contrasts["SMELT vs Baseline"].append((("baseline", sc, lab, sd), ("smelt", sc, lab, sd)))
    for fam, group_of, rank in (("more experts", lambda k: (k[1], k[3]), lambda k: sparse_rank[k[2]]),
                                ("more parameters", lambda k: (k[2], k[3]), lambda k: scale_rank[k[1]])):
        groups = defaultdict(list)
        for k in base:
            groups[group_of(k)].append(k)
        for g, ks in sorted(groups.items(), key=lambda kv: str(kv[0])):
            ks = sorted(ks, key=rank)
            contrasts[fam] += list(zip(ks[:-1], ks[1:]))

    def rid(k):
        return f"{k[0]} {k[1]} {k[2]}" + (f" seed {k[3]}" if k[3] is not None else "")

    dropped: dict = {}

    def kept(r: dict, other: dict) -> dict[int, float]:
        """r's loss by bucket over the buckets with >= min_tokens tokens in both endpoints."""
        tok = lambda e: {int(b): int(n) for b, n in (e["val"].get("tokens_by_length") or {}).items()}
        ta, tb = tok(r), tok(other)
        out = {}
        for b, v in r["val"]["by_length"].items():
            n = min(ta.get(int(b), min_tokens), tb.get(int(b), min_tokens))
            if n >= min_tokens:
                out[int(b)] = float(v)
            else:
                dropped[int(b)] = n
        return out

    out = {}
    for fam, cons in contrasts.items():
        dropped.clear()
        shapes, rows, n_pairs, n_bad, n_neg = [], [], 0, 0, 0
        for ref_k, new_k in cons:
            ref, new = runs[ref_k], runs[new_k]
            if len(ref) == len(new):
                eps = list(zip(ref, new))
            else:
                nb = {r.get("branch_step"): r for r in new}
                eps = [(r, nb[r.get("branch_step")]) for r in ref if r.get("branch_step") in nb]
            losses = [(kept(a, b), kept(b, a)) for a, b in eps]
            sh = [normalised_shape(la, lb) for la, lb in losses]
            good = [x for x in sh if x and all(np.isfinite(v) for v in x.values())]
            n_pairs, n_bad = n_pairs + len(good), n_bad + len(sh) - len(good)
            gain = float(np.mean([np.mean([la[k] - lb[k] for k in set(la) & set(lb)]) for la, lb in losses]))
            if not good:
                continue
            buckets = sorted(set.intersection(*(set(x) for x in good)))
            mean = {b: float(np.mean([x[b] for x in good])) for b in buckets}
            shapes.append(mean)
            n_neg += gain < 0
            rows.append({"ref": rid(ref_k), "new": rid(new_k), "long_short": long_short_ratio(mean),
                         "mean_gain": gain, "n_pairs": len(good)})
        entry = {"paper": PAPER_LONG_SHORT[fam], "shape": {}, "long_short": None, "n_contrasts": len(shapes),
                 "n_endpoint_pairs": n_pairs, "n_degenerate": n_bad, "n_negative": n_neg,
                 "buckets_dropped": dict(sorted(dropped.items())), "contrasts": rows, "why": None}
        if not shapes:
            entry["why"] = ("no contrast in the grid" if not cons else
                            "every contrast's mean gain is zero: no shape")
        else:
            buckets = sorted(set.intersection(*(set(x) for x in shapes)))

            def ratio(ix, shapes=shapes, buckets=buckets) -> float:
                sel = [shapes[int(i)] for i in ix]
                return long_short_ratio({b: float(np.mean([x[b] for x in sel])) for b in buckets})
            entry["shape"] = {b: float(np.mean([x[b] for x in shapes])) for b in buckets}
            if len(buckets) < 2:
                entry["why"] = f"{len(buckets)} document-length bucket in common: no long/short ratio"
            elif not math.isfinite(ratio(range(len(shapes)))):
                entry["why"] = "the shorter buckets' mean gain is zero: no long/short ratio"
            else:
                iv = stats.bootstrap_interval(np.arange(len(shapes)), ratio, n_boot, seed=seed)
                if not (math.isfinite(iv.lo) and math.isfinite(iv.hi)) and len(shapes) > 1:
                    iv = stats.Interval(iv.mean, math.nan, math.nan, iv.n, iv.level, iv.method)
                    entry["why"] = "a resampled long/short ratio is undefined: no interval"
                entry["long_short"] = iv.to_dict()
                if len(shapes) < 2:
                    entry["why"] = "one contrast: no interval"
        out[fam] = entry
    return out


def downstream_claims(records: Sequence[dict], calibration: dict | None = None, families: dict | None = None,
                      unit: str = "endpoint") -> list[dict]:
    """The main job's downstream claims, each an interval decided by stats.verdict (SMELT 5.1, 5.3).

    For each origin (real BIG-bench tasks, generated tasks): SMELT - Baseline gold-completion loss
    (claim < 0) and centred accuracy (claim > 0), as stats.paired_difference over the matched pairs.
    unit="endpoint" pairs every matched endpoint (cell, seed, branch); unit="run" first averages
    each run pair's endpoints (cell, seed), so the units are independent trainings: endpoints of one
    run share a trajectory, and the endpoint interval counts them as if they did not.
    calibration (calibration_report): the mean Eq. 7 residual of every identified metric, with its
    t-interval over SMELT endpoints (claim > 0); a metric whose fit is not identified is listed
    with verdict "not resolved" and why. families (length_families): SMELT's long/short ratio > 1.
    Returns [{"id", "claim", "paper", "direction", "value", "interval" (Interval dict | None),
    "verdict", "n", "unit", "why"}].
    """
    import stats
    if unit not in ("endpoint", "run"):
        raise ValueError(f"unit must be 'endpoint' or 'run', got {unit!r}")
    pairs = matched_pairs(records)
    claims = []

    def claim(cid, text, paper, direction, value, iv, n, unit_, why=None):
        claims.append({"id": cid, "claim": text, "paper": paper, "direction": direction, "value": value,
                       "interval": iv.to_dict() if iv is not None else None,
                       "verdict": stats.verdict(iv, direction, value), "n": n, "unit": unit_, "why": why})

    for origin, src in (("real", "BIG-bench tasks"), ("generated", "generated tasks")):
        for key, direction, what, paper in (
                ("completion", "<", "gold-completion loss", "lower in 96 / 96 matched pairs (Sec. 5.1)"),
                ("core", ">", "centred accuracy", "higher in 83 / 96 matched pairs (Sec. 5.1)")):
            metric = f"{origin} {key}"
            vals = defaultdict(list)
            for p in pairs:
                b, s = metric_value(p["baseline"], metric), metric_value(p["smelt"], metric)
                if b is not None and s is not None:
                    vals[(p["cell"], p["seed"]) if unit == "run" else len(vals)].append((b, s))
            if not vals:
                continue
            b = [float(np.mean([v[0] for v in vs])) for vs in vals.values()]
            s = [float(np.mean([v[1] for v in vs])) for vs in vals.values()]
            iv = stats.paired_difference(b, s)
            why = None if iv.resolved else f"{len(b)} pair: no interval"
            if key == "core" and max(b + s) <= 0:
                why = "both models at or below chance (centred accuracy <= 0) in every pair"
            claim(f"{metric} difference", f"SMELT - Baseline {what}, {src} {direction} 0", paper, direction, 0.0, iv,
                  len(b), "matched endpoint pair" if unit == "endpoint" else "matched run pair", why)
    if calibration is not None and calibration.get("error"):
        claim("calibration residual", "calibration residual (Eq. 7) of SMELT > 0",
              "positive on every benchmark at every scale (Sec. 5.1, Fig. 16)", ">", 0.0, None, 0, "SMELT endpoint",
              f"calibration not available: {calibration['error']}")
    if calibration is not None:
        for name, c in calibration.get("metrics", {}).items():
            if name.startswith("task/"):
                continue
            text = f"calibration residual (Eq. 7) of SMELT on {name} > 0"
            paper = "positive on every benchmark at every scale (Sec. 5.1, Fig. 16)"
            if not c.get("identified"):
                claim(f"{name} residual", text, paper, ">", 0.0, None, 0, "SMELT endpoint",
                      f"calibration not identified: {c.get('why')}")
                continue
            iv = stats.Interval(**c["residual_interval"]) if c.get("residual_interval") else None
            claim(f"{name} residual", text, paper, ">", 0.0, iv, len(c["residuals"]), "SMELT endpoint")
    if families is not None and "SMELT vs Baseline" in families:
        f = families["SMELT vs Baseline"]
        iv = stats.Interval(**f["long_short"]) if f.get("long_short") else None
        why = f.get("why")
        if iv is not None and f.get("n_negative", 0) * 2 > f["n_contrasts"]:
            # SMELT worse on average: each shape normalises a loss by a negative mean, so a ratio below 1
            # says the *deficit* is smaller on long documents (the claim's direction, inverted): no verdict
            why, iv = (f"SMELT's mean gain is negative in {f['n_negative']} of {f['n_contrasts']} contrasts: the "
                       f"normalised shape describes a loss, not a gain (ratio {stats.Interval(**f['long_short']).fmt(2)})"), None
        claim("length tilt", "SMELT's gain tilts to long documents: long/short ratio > 1",
              "1.52 (controls 0.98, 0.88; Sec. 5.3)", ">", 1.0, iv, f["n_contrasts"], "SMELT/Baseline run pair", why)
    return claims


def downstream_report(records: Sequence[dict], margin: float = 0.0, n_boot: int = 2000, n_perm: int = 10000,
                      unit: str = "endpoint") -> dict:
    """Everything SMELT Section 5 reports from a grid's endpoint evaluations (evaluate_endpoint outputs).

    Returns {"n_endpoints", "n_pairs", "wins" (win_counts), "icl" (icl_sweep), "families"
    (length_families), "calibration" (calibration_report on every Baseline endpoint against every
    SMELT endpoint; {"error"} when the endpoints lack validation), "claims" (downstream_claims)}.
    """
    recs = list(records)
    _check_grid(recs)
    base = [r for r in recs if r["arch"] == "baseline"]
    smelt = [r for r in recs if r["arch"] == "smelt"]
    try:
        cal = calibration_report(base, smelt)
    except ValueError as e:
        cal = {"error": str(e), "metrics": {}}
    fams = length_families(recs, n_boot)
    return {"n_endpoints": len(recs), "n_pairs": len(matched_pairs(recs)), "wins": win_counts(recs),
            "icl": icl_sweep(recs, margin, n_perm), "families": fams, "calibration": cal,
            "claims": downstream_claims(recs, cal, fams, unit)}


def compare(a: dict, b: dict, n: int = 10000) -> dict:
    """Model b vs model a (two endpoint evaluations): per task and k, acc(b) - acc(a) and the one-sided
    paired permutation p-value of b > a over demonstration seeds (SMELT App. C; None with one seed);
    the length shape of b's gain and its long/short ratio."""
    import stats
    out: dict = {"tasks": {}}
    for name, ta in a["tasks"].items():
        tb = b["tasks"].get(name)
        for k, ra in ta["by_k"].items():
            rb = tb["by_k"].get(k) if tb else None
            if rb is None or ra["items"] != rb["items"] or len(ra["acc_by_seed"]) != len(rb["acc_by_seed"]):
                continue
            seeds = len(ra["acc_by_seed"])
            out["tasks"].setdefault(name, {})[k] = {
                "gain": rb["acc"] - ra["acc"], "seeds": seeds,
                "p": stats.permutation_test(rb["acc_by_seed"], ra["acc_by_seed"], n, alternative="greater")
                if seeds > 1 else None}
    if a.get("val") and b.get("val"):
        shape = normalised_shape(a["val"]["by_length"], b["val"]["by_length"])
        out["length_shape"], out["long_short"] = shape, long_short_ratio(shape)
    return out


# ================================================================ plots and CLI

def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _above_chance(task: dict) -> bool:
    """Some k of this task entry has accuracy above its chance rate."""
    return any(r["acc"] > chance_of(task) + 1e-12 for r in task["by_k"].values())


def plot_shot_sweep(result: dict, path: str | Path, other: dict | None = None) -> str:
    """Accuracy vs k per task (mean +- s.e. over seeds) of one endpoint (and a compared one, dashed).

    Tasks whose accuracy never exceeds chance (in either endpoint) are not drawn, and a panel with
    no task left is dropped; the returned text names them. Nothing is written when nothing is left.
    """
    results = [result] + ([other] if other else [])
    drawn = {o: [n for n, t in result["tasks"].items() if t["origin"] == o
                 and any(n in r["tasks"] and _above_chance(r["tasks"][n]) for r in results)]
             for o in ("bigbench", "generated")}
    left = sorted(n for n, t in result["tasks"].items() if n not in drawn[t["origin"]])
    note = (f"At or below chance at every k (not drawn): {', '.join(left)}." if left else "")
    panels = [o for o in drawn if drawn[o]]
    if not panels:
        return (note + " No task is above chance: no shot-sweep figure.").strip()
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, origin in zip(axes[0], panels):
        for i, name in enumerate(drawn[origin]):
            for res, style in ((result, "-"), (other, "--")):
                if res is None or name not in res["tasks"]:
                    continue
                ks = sorted(res["tasks"][name]["by_k"], key=int)
                rs = [res["tasks"][name]["by_k"][k] for k in ks]
                ax.errorbar(range(len(ks)), [r["acc"] for r in rs], [r["acc_se"] for r in rs], ls=style,
                            marker="o", ms=3, color=f"C{i}", label=name if style == "-" else None)
                ax.set_xticks(range(len(ks)), ks)
            ax.axhline(chance_of(result["tasks"][name]), color=f"C{i}", lw=0.6, ls=":")
        ax.set(title=f"{'BIG-bench (DCLM Core)' if origin == 'bigbench' else 'generated'} tasks"
               + (" (dashed: compared run)" if other else "") + "; dotted: chance",
               xlabel="demonstrations k", ylabel="accuracy")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return note


def plot_icl_sweep(sweep: dict, path: str | Path) -> str:
    """SMELT Fig. 51 from icl_sweep: per task, Baseline (dashed) and SMELT (solid) accuracy vs k averaged
    over the cells where both are above chance (bars: standard error over demonstration seeds); tasks
    with no such cell at any k are left out (named in the returned text); nothing is written when no
    task is left."""
    drawn = [n for n, t in sweep.items() if any(r["cells_above"] for r in t["by_k"].values())]
    left = [n for n in sweep if n not in drawn]
    note = (f"No cell has both models above chance at any k for: {', '.join(left)} (not drawn)." if left else "")
    if not drawn:
        return (note + " No task is above chance in any cell: no shot-sweep figure.").strip()
    plt = _pyplot()
    cols = min(4, len(drawn))
    rows = math.ceil(len(drawn) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 3.0 * rows), squeeze=False)
    for ax, name in zip(axes.flat, drawn):
        t = sweep[name]
        ks = [k for k in t["ks"] if t["by_k"][str(k)]["cells_above"]]
        for arch, style, color in (("baseline", "--", "tab:blue"), ("smelt", "-", "tab:red")):
            se = [float(np.std(v, ddof=1) / math.sqrt(len(v))) if len(v) > 1 else 0.0
                  for v in (t["by_k"][str(k)][f"{arch}_by_seed"] for k in ks)]
            ax.errorbar(range(len(ks)), [t["by_k"][str(k)][arch] for k in ks], se, ls=style, marker="o", ms=3,
                        color=color, capsize=2, label="Baseline" if arch == "baseline" else "SMELT")
        ax.set_xticks(range(len(ks)), ks)
        ax.axhline(t["chance"], color="grey", lw=0.6, ls=":")
        p = t["test"]["p"]
        cells = ", ".join(str(t["by_k"][str(k)]["cells_above"]) for k in ks)
        ax.set_title(f"{name}: cells above chance {cells} of {t['by_k'][str(ks[0])]['cells']}\n"
                     + (f"SMELT > Baseline at k={t['test']['k']}: p = {p:.3f} (min {t['test']['p_min']:.3f})"
                        if p is not None else f"no test: {t['test']['why']}"), fontsize=8)
        ax.set_xlabel("demonstrations k", fontsize=8)
        ax.set_ylabel("accuracy", fontsize=8)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(drawn):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return note


def plot_calibration(base: Sequence[dict], others: Sequence[dict], report: dict, path: str | Path) -> str:
    """Metric vs validation loss for every identified Eq. 6 fit: Baseline endpoints, the curve, the others.

    Metrics whose fit is not identified are not drawn (the returned text says why); nothing is
    written when none is identified."""
    metrics = [m for m in ("core", "completion", "generated core", "generated completion")
               if report.get("metrics", {}).get(m, {}).get("identified")]
    skipped = {m: c["why"] for m, c in report.get("metrics", {}).items()
               if not m.startswith("task/") and not c.get("identified")}
    note = " ".join(f"Calibration of {m} not identified: {why}." for m, why in skipped.items())
    if not metrics:
        return (note + " No calibration figure.").strip()
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 4), squeeze=False)
    for ax, m in zip(axes[0], metrics):
        c = report["metrics"][m]
        p = c["params"]
        origin, key = ("real", m) if " " not in m else m.split(" ")
        xs = [e["val"]["loss"] for e in [*base, *others]]
        grid = np.linspace(min(xs), max(xs), 200)
        ax.plot(grid, sigmoid4(grid, p["a"], p["b"], p["alpha"], p["tau"], p["d"]), "k-", lw=1,
                label=f"Eq. 6 fit on Baseline, R2={p['r2']:.3f}")
        for es, mk, lab in ((base, "o", "Baseline"), (others, "^", "SMELT")):
            ax.scatter([e["val"]["loss"] for e in es], [e["summary"][origin][key] for e in es], marker=mk, s=14,
                       label=lab)
        iv = c.get("residual_interval")
        ax.set(xlabel="validation loss", ylabel={"core": "mean centred accuracy",
                                                 "completion": "gold-answer loss (nats/token)"}[key],
               title=f"{m}: SMELT's mean residual (Eq. 7)\n{c['mean_residual']:+.4f}"
               + (f" [{iv['lo']:+.4f}, {iv['hi']:+.4f}]" if iv and math.isfinite(iv["lo"]) else " (no interval)"))
        ax.title.set_fontsize(10)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return note


def plot_length_families(families: dict, path: str | Path) -> str:
    """SMELT Fig. 20a: each family's mean normalised gain by document-length bucket (log2 axis)."""
    fams = {f: v for f, v in families.items() if len(v.get("shape") or {}) >= 2}
    note = " ".join(f"{f}: {v['why']}." for f, v in families.items() if f not in fams and v.get("why"))
    if not fams:
        return (note + " No length-shape figure.").strip()
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 5))
    for (f, v), style in zip(fams.items(), ("o-", "s--", "^:")):   # distinct styles: overlapping lines stay visible
        b = sorted(v["shape"], key=int)
        iv = v["long_short"]
        ratio = ("no long/short ratio" if iv is None else f"long/short {iv['mean']:.2f}"
                 + (f" [{iv['lo']:.2f}, {iv['hi']:.2f}]" if math.isfinite(iv["lo"]) else " (no interval)"))
        ax.plot([int(x) for x in b], [v["shape"][x] for x in b], style, ms=4,
                label=f"{f}: {ratio} (paper {v['paper']}), {v['n_contrasts']} contrasts"
                + (f", {v['n_negative']} with a mean loss, not gain" if v.get("n_negative") else ""))
    ax.axhline(1.0, color="grey", lw=0.6, ls=":")
    ax.set_xscale("log", base=2)
    ticks = sorted({int(b) for v in fams.values() for b in v["shape"]})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    drop = {b: n for v in fams.values() for b, n in v.get("buckets_dropped", {}).items()}
    ax.set(xlabel="document length bucket (tokens, upper bound)"
           + ("\nleft out, too few tokens: " + ", ".join(f"<= {b} ({n} tokens)" for b, n in drop.items())
              if drop else ""),
           ylabel="gain / mean gain", title="Loss gain by document length (SMELT 5.3, Fig. 20a)")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22 if drop else -0.16))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return note


def plot_downstream(report: dict, records: Sequence[dict], out_dir: str | Path) -> dict:
    """The Section 5 figures of downstream_report into out_dir: shot_sweep.png (Appendix C average),
    calibration.png (identified fits only), length_families.png. Returns {"figures": {name: path or
    None}, "notes": [text for what was not drawn]}."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    base = [r for r in records if r["arch"] == "baseline"]
    smelt = [r for r in records if r["arch"] == "smelt"]
    figures, notes = {}, []
    for name, draw in (("shot_sweep", lambda p: plot_icl_sweep(report["icl"], p)),
                       ("calibration", lambda p: plot_calibration(base, smelt, report["calibration"], p)
                        if "error" not in report["calibration"] else f"Calibration: {report['calibration']['error']}."),
                       ("length_families", lambda p: plot_length_families(report["families"], p))):
        path = out / f"{name}.png"
        path.unlink(missing_ok=True)            # never leave a stale figure of an earlier run behind
        note = draw(path)
        figures[name] = str(path) if path.exists() else None
        if note:
            notes.append(note)
    return {"figures": figures, "notes": notes}


def _read_eval(run_dir: str) -> dict:
    p = Path(run_dir) / "eval.json"
    if not p.is_file():
        raise FileNotFoundError(f"{p} not found: run `python eval.py --run {run_dir}` first")
    return json.loads(p.read_text())


def build_parser() -> argparse.ArgumentParser:
    ap = cli.parser("Evaluate a run: validation loss by source/domain/length, "
                    "few-shot shot sweep, optional comparison and loss-to-score calibration.")
    ap.add_argument("--run", required=True, help="run directory with config.json and ckpt.pt, or an endpoint / "
                                                 "checkpoint file (RUN_DIR/endpoints/branch_XXXXXXX.pt)")
    ap.add_argument("--tasks", nargs="+", default=["all"], metavar="TASK",
                    choices=["all", "real", "generated", *REAL_TASKS, *GENERATED_TASKS],
                    help=f"task names or groups real|generated|all; real: {list(REAL_TASKS)}; generated: {list(GENERATED_TASKS)}")
    ap.add_argument("--shots", nargs="+", type=cli.nonneg_int, default=list(SHOTS), help="numbers of demonstrations k")
    ap.add_argument("--seeds", type=cli.positive_int, default=10, help="demonstration seeds per k > 0 (k = 0 runs once)")
    ap.add_argument("--max-items", type=cli.nonneg_int, default=100, help="items per task (a fixed shuffle); 0 = all")
    ap.add_argument("--val-tokens", type=cli.nonneg_int, default=1 << 16,
                    help="validation tokens per source; 0 = no validation")
    ap.add_argument("--batch-size", type=cli.positive_int, default=8, help="validation batch size (rows of block_size)")
    cli.add_device(ap)
    cli.add_out_dir(ap, "where eval.json (for an endpoint file: NAME.eval.json) and the plots go (default: beside "
                    "--run, where reproduce.py and --compare / --baselines look for them)", old=())
    ap.add_argument("--compare", default=None, help="another run dir with eval.json: permutation tests and length shape vs it")
    ap.add_argument("--baselines", nargs="+", default=None,
                    help=f"Baseline run dirs with eval.json (>= {CALIBRATION_MIN_POINTS}): calibrate this run "
                         f"against them (SMELT Eq. 6-7)")
    return ap


def main(argv: Sequence[str] | None = None) -> None:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.baselines and args.val_tokens == 0:
        ap.error("--baselines calibrates against validation loss: it needs --val-tokens > 0")
    res = evaluate_endpoint(args.run, tasks=args.tasks, shots=args.shots, seeds=args.seeds,
                            max_items=args.max_items or None, val=args.val_tokens > 0,
                            val_tokens_per_source=args.val_tokens or None, batch_size=args.batch_size,
                            device=cli.resolve_device(args.device))
    src = Path(args.run)
    out = Path(args.out_dir) if args.out_dir else (src if src.is_dir() else src.parent)
    out.mkdir(parents=True, exist_ok=True)
    out_json = out / "eval.json" if src.is_dir() else out / src.with_suffix(".eval.json").name
    stem = out / ("eval" if src.is_dir() else src.stem)
    other = _read_eval(args.compare) if args.compare else None
    if other:
        res["compare"] = {"against": args.compare, **compare(other, res)}
    if args.baselines:
        base = [_read_eval(d) for d in args.baselines]
        try:
            res["calibration"] = calibration_report(base, [res])
            note = plot_calibration(base, [res], res["calibration"], f"{stem}_calibration.png")
            if note:
                print(note)
        except ValueError as e:   # e.g. this run's data_dir was unreadable: keep the task results
            res["calibration"] = {"error": str(e)}
            print(f"calibration skipped: {e}")
    tmp = out_json.with_suffix(".tmp")
    tmp.write_text(json.dumps(res, indent=1, default=float))
    os.replace(tmp, out_json)
    note = plot_shot_sweep(res, f"{stem}_shots.png", other)
    if note:
        print(note)
    for origin, s in res["summary"].items():
        print(f"{origin} tasks: mean centred accuracy {s['core']}, gold-completion loss {s['completion']}")
    print(f"wrote {out_json} and plots")


if __name__ == "__main__":
    main()
