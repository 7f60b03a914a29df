"""Few-shot tasks and their scoring: how DCLM and lm-eval turn a language model into accuracies (SMELT 3.1, 5.1, E).

Tasks: six of DCLM Core's BIG-bench tasks (`load_bigbench`, tasks/bigbench/) and seeded generated ones with a known
chance rate (`generate_task`). `build_prompt` lays out k demonstrations; `fit_prompt` drops them from the left
until the prompt fits the block, then `truncate_left` cuts, keeping BOS (App. E). `score_continuations` (batched
by `plan_batches`, the head at the answer positions only) and `score_options` (a context prefilled once, its KV
cache repeated per option) score them; `evaluate_task` is one task at k shots over demonstration seeds (multiple
choice by per-token, per-character or summed log-likelihood; generation by exact match and gold-completion
loss); `centred_accuracy` is DCLM Core's Eq. 11.
Design choices and measured speed-ups: docs/tasks.md. Read next: eval.py, lab/calibration.py,
lab/downstream_claims.py.
"""
from __future__ import annotations

import contextlib
import math
import random
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from checks import JSONFileError, need_ints, read_json
from eval import forward_logits, model_device

TASK_DIR = Path(__file__).resolve().parents[1] / "tasks" / "bigbench"
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


@contextlib.contextmanager
def _head_at(model: nn.Module, pos_BM: torch.Tensor | None):
    """Within the block, the output head runs only at positions pos_BM (B, M): the final norm's output is gathered
    there first, so the logits are (B, M, V), exact (docs/tasks.md). Yields whether the model has a `norm_f` to hook."""
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


def _read_task_json(path: Path, kind: str) -> dict:
    """A BIG-bench task.json, checked field by field (checks.JSONFileError naming the file and the example)."""
    d = read_json(path)
    parts = d.get("subtasks", [d]) if isinstance(d, dict) else None
    if not isinstance(parts, list) or not parts:
        raise JSONFileError(f"{path}: expected a task object with 'examples' or 'subtasks'")
    for p, part in enumerate(parts):
        where = f"{path}: subtask {p}" if "subtasks" in d else str(path)
        exs = part.get("examples") if isinstance(part, dict) else None
        if not isinstance(exs, list) or not exs or not isinstance(part.get("name"), str):   # name: the items' group
            raise JSONFileError(f"{where}: needs a non-empty 'examples' list and a string 'name'")
        for j, ex in enumerate(exs):
            ex = ex if isinstance(ex, dict) else {}
            scores, target = ex.get("target_scores"), ex.get("target")
            ok = isinstance(ex.get("input"), str) and ((isinstance(scores, dict) and bool(scores)) or (
                kind == "gen" and (isinstance(target, str) or (isinstance(target, list) and bool(target)
                                                               and isinstance(target[0], str)))))
            if not ok:
                raise JSONFileError(f"{where}: example {j} needs a string 'input' and a non-empty 'target_scores' "
                                    f"object{' or a string target' if kind == 'gen' else ''}; re-extract the file "
                                    f"(tasks/bigbench/README.md)")
    return d


def load_bigbench(name: str, root: Path | str = TASK_DIR) -> Task:
    """A task from tasks/bigbench/NAME.json (BIG-bench task.json; cs_algorithms holds two subtasks)."""
    if name not in REAL_TASKS:
        raise KeyError(f"unknown BIG-bench task {name!r}; available: {sorted(REAL_TASKS)}")
    path = Path(root) / f"{name}.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing (see tasks/bigbench/README.md for how it was extracted)")
    kind, category, shots, rho = REAL_TASKS[name]
    d = _read_task_json(path, kind)
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
    """A procedurally generated task, the same for the same arguments: gen_dyck closes `depth` open brackets of
    `n_types` kinds, gen_copy / gen_reverse repeat / reverse `length` letters of `alphabet`, gen_kv picks the asked
    key's value among `n_pairs` (multiple choice), gen_modadd is a + b mod `modulus`. Chance: a guesser who knows
    the answer's format and length, but not the input."""
    if name not in GENERATED_TASKS:
        raise KeyError(f"unknown generated task {name!r}; available: {GENERATED_TASKS}")
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
    for it in items:
        it.group = name
    chance = {"gen_dyck": (1 / n_types) ** depth, "gen_copy": (1 / alphabet) ** length,
              "gen_reverse": (1 / alphabet) ** length, "gen_kv": 1 / n_pairs, "gen_modadd": 1 / modulus}[name]
    return Task(name, "mc" if name == "gen_kv" else "gen", items, chance, chance, "Synthetic ICL", "generated")


def get_task(name: str) -> Task:
    return generate_task(name) if name in GENERATED_TASKS else load_bigbench(name)


def resolve_tasks(names: Iterable[str]) -> list[str]:
    """Expand the groups "real", "generated" and "all"; check every name."""
    known = list(REAL_TASKS) + list(GENERATED_TASKS)
    out = []
    for n in names:
        for g in {"real": list(REAL_TASKS), "generated": list(GENERATED_TASKS), "all": known}.get(n, [n]):
            if g not in known:
                raise KeyError(f"unknown task {g!r}; known: {known}")
            out += [g] if g not in out else []
    return out


def build_prompt(item: Item, demos: Sequence[Item]) -> tuple[str, list[str]]:
    """(context, continuations): BIG-bench layout; the context's trailing spaces open each continuation."""
    ctx = item.prefix + "".join(d.query + d.answer + item.sep for d in demos) + item.query
    body = ctx.rstrip(" ")
    lead = ctx[len(body):]
    return body, [lead + o for o in (item.options or [item.answer])]


def truncate_left(tokens: list[int], block_size: int) -> list[int]:
    """Keep BOS (tokens[0]) and the last block_size - 1 tokens."""
    return tokens if len(tokens) <= block_size else tokens[:1] + tokens[len(tokens) - block_size + 1:]


def fit_prompt(item: Item, demos: Sequence[Item], encode, bos: int, block_size: int):
    """(head, tails, kept, cut): [bos] + the context's tokens with as many of `demos` as fit, each option's tokens.
    Whole demonstrations are dropped from the left (bisection over the count kept) until BOS, the context and the
    longest option fit block_size; when not even the query fits, truncate_left, cut True."""
    def at(n: int):
        ctx, conts = build_prompt(item, demos[len(demos) - n:])
        head, tails = [bos] + encode(ctx), [encode(c) for c in conts]
        return head, tails, len(head) + max(len(t) for t in tails) <= block_size

    head, tails, fits = at(len(demos))
    if fits:
        return head, tails, len(demos), False
    lo, hi, best = 0, len(demos) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        h, t, fits = at(mid)
        if fits:
            best, lo = (h, t, mid, False), mid + 1
        else:
            hi = mid - 1
    if best is not None:
        return best
    head, tails, _ = at(0)
    return truncate_left(head, block_size - max(len(t) for t in tails)), tails, 0, True


MAX_LOGITS = 1 << 26   # logit entries per scoring batch (rows x answer positions x vocabulary): 256 MiB of fp32


def plan_batches(lengths: Sequence[int], n_conts: Sequence[int], vocab: int | None,
                 max_tokens: int, max_logits: int) -> list[list[int]]:
    """Sequence indices in batches, longest first, each at most max_tokens padded tokens (the activations) and
    max_logits logit entries (rows x its longest continuation x vocab); one row per batch when vocab is unknown."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])   # similar lengths together: little padding
    out, i = [], 0
    while i < len(order):
        T, M, j = lengths[order[i]], n_conts[order[i]], i + 1
        while vocab and j < len(order):
            M2 = max(M, n_conts[order[j]])
            if (j - i + 1) * T > max_tokens or (j - i + 1) * M2 * vocab > max_logits:
                break
            M, j = M2, j + 1
        out.append(order[i:j])
        i = j
    return out


def scoring_batches(requests: Sequence[tuple[list[int], int]], block_size: int, vocab: int | None,
                    head_hooked: bool, max_tokens: int, max_logits: int) -> tuple[list, list, list[list[int]]]:
    """(sequences truncated on the left, continuation lengths, batches of indices): what score_continuations
    runs (costs.scoring_counts counts from it); head_hooked: logit rows at the answer positions only."""
    seqs = [truncate_left(t, block_size) for t, _ in requests]
    ns = [n for _, n in requests]
    for s, n in zip(seqs, ns):
        if not 0 < n < len(s):
            raise ValueError(f"continuation of {n} tokens does not fit a {len(s)}-token sequence")
    lens = [len(s) for s in seqs]
    return seqs, ns, plan_batches(lens, ns if head_hooked else lens, vocab, max_tokens, max_logits)


def batch_shape(seqs: Sequence[list[int]], ns: Sequence[int], chunk: Sequence[int]) -> tuple[int, int]:
    """(T, M) of one scoring batch: its rows are padded to T tokens and logits kept at their last M positions."""
    return max(len(seqs[j]) for j in chunk), max(ns[j] for j in chunk)


@torch.no_grad()
def score_continuations(model: nn.Module, requests: Sequence[tuple[list[int], int]], block_size: int,
                        pad_id: int = 0, max_tokens: int = 1 << 16, max_logits: int = MAX_LOGITS,
                        counts: Counter | None = None) -> list[tuple[float, int, bool]]:
    """Each (tokens, n_cont) -> (sum of -log p over the last n_cont tokens, n_cont, all of them the argmax),
    in plan_batches' right-padded batches, each read to the host once; counts adds forward calls, rows and tokens."""
    model.eval()
    dev = model_device(model)
    vocab = getattr(getattr(model, "cfg", None), "vocab_size", None)
    hooked = isinstance(getattr(model, "norm_f", None), nn.Module)          # no head to hook: every position
    seqs, ns, batches = scoring_batches(requests, block_size, vocab, hooked, max_tokens, max_logits)
    out: list[tuple[float, int, bool] | None] = [None] * len(seqs)
    for chunk in batches:
        lens_l = [len(seqs[j]) for j in chunk]
        T, M = batch_shape(seqs, ns, chunk)                # from Python ints: no tensor read
        lens, n = torch.tensor(lens_l), torch.tensor([ns[j] for j in chunk])
        x = torch.tensor([seqs[j] + [pad_id] * (T - len(seqs[j])) for j in chunk]).to(dev)      # (rows, T)
        m = torch.arange(M)
        # row r's logits predicting its last M tokens; its own continuation is the last n[r] of them
        pos = (lens[:, None] - M - 1 + m).clamp(min=0).to(dev)                                  # (rows, M)
        mine = (m >= M - n[:, None]).to(dev)                                                    # (rows, M)
        tgt = x.gather(1, pos + 1)
        with _head_at(model, pos) as head_hooked:
            logits = forward_logits(model, x)
        if not head_hooked:
            logits = logits.gather(1, pos[..., None].expand(-1, -1, logits.shape[-1]))         # (rows, M, V)
        nll = -torch.log_softmax(logits, -1).gather(-1, tgt[..., None])[..., 0]
        nll = torch.where(mine, nll, 0).sum(1)
        hit = ((logits.argmax(-1) == tgt) | ~mine).all(1)
        for j, (s, h) in zip(chunk, torch.stack([nll.double(), hit.double()], 1).tolist()):   # one host read
            out[j] = (s, ns[j], bool(h))
        if counts is not None:
            counts.update(forward_calls=1, sequences=len(chunk), tokens=sum(lens_l),
                          padded_tokens=len(chunk) * T, host_reads=1)
    return out  # type: ignore[return-value]


@torch.no_grad()
def score_options(model: nn.Module, head: list[int], tails: Sequence[list[int]], block_size: int,
                  pad_id: int = 0, counts: Counter | None = None) -> list[tuple[float, int, bool]]:
    """score_continuations for several continuations of one context (cut on the left once, to fit the longest
    option): the context runs once into a KV cache, repeated per option (Cache.repeat) for one batch of options."""
    if not tails or min(len(t) for t in tails) < 1:
        raise ValueError("score_options: every option needs at least one token")
    longest = max(len(t) for t in tails)
    if longest > block_size - 2:
        raise ValueError(f"score_options: an option of {longest} tokens leaves no room for context in {block_size}")
    model.eval()
    dev = model_device(model)
    head = truncate_left(head, block_size - longest)
    cache = model.new_cache(1, len(head) + longest)
    with torch.autocast("cuda", torch.bfloat16, enabled=dev.type == "cuda"):
        with _head_at(model, torch.tensor([[len(head) - 1]], device=dev)):   # the head at the last position only
            first = model.forward_step(torch.tensor([head], device=dev), cache)[0, -1].float()   # (V,)
        rest = None
        if longest > 1:
            x = torch.full((len(tails), longest - 1), pad_id, dtype=torch.long)
            for r, t in enumerate(tails):
                x[r, :len(t) - 1] = torch.tensor(t[:-1])
            rest = model.forward_step(x.to(dev), cache.repeat(len(tails))).float()          # (n, longest-1, V)
    res = []
    for r, t in enumerate(tails):
        lg = first[None] if len(t) == 1 else torch.cat([first[None], rest[r, :len(t) - 1]])   # (len(t), V)
        tgt = torch.tensor(t, device=dev)
        res.append(torch.stack([F.cross_entropy(lg, tgt, reduction="sum").double(),
                                (lg.argmax(-1) == tgt).all().double()]))
    if counts is not None:
        counts.update(forward_calls=1 + (longest > 1), sequences=len(tails), host_reads=1,
                      tokens=len(head) + sum(len(t) - 1 for t in tails),
                      padded_tokens=len(head) + len(tails) * (longest - 1))
    return [(s, len(t), bool(h)) for t, (s, h) in zip(tails, torch.stack(res).tolist())]   # one host read


# padded tokens per scoring batch (the activations; logits: max_logits): CPU caches vs a GPU's width (docs/tasks.md)
BATCH_TOKENS = {"cpu": 1 << 15, "cuda": 1 << 18}


def demos_available(task: Task) -> int:
    """The most demonstrations every item can draw from its own group (its items other than the item and its
    duplicates): a k above this is skipped by eval.evaluate_endpoint (and so by costs.scoring_counts)."""
    size = Counter(it.group for it in task.items)
    copies = Counter((it.group, it.query, it.answer) for it in task.items)
    return min(size[g] - n for (g, _, _), n in copies.items())


def continuations(req: dict) -> list[tuple[list[int], int]]:
    """task_requests' (head, tails) -> one (tokens, continuation length) per option: what evaluate_task scores."""
    return [(head + t, len(t)) for head, tails in req["requests"] for t in tails]


def task_requests(enc, task: Task, k: int, seeds: int, max_items: int | None, block_size: int, bos: int) -> dict:
    """The prompts of one task at k shots, before any model runs (fit_prompt for each item and seed): {"used"
    (item indices), "skipped" (answer cannot fit), "requests" ((head, tails) per item and seed), "plan" ((used
    index, seed, first score, options) per request), "kept" (demonstrations kept), "cut" (truncate_left ran)}."""
    encode = getattr(enc, "encode_ordinary", None) or enc.encode
    n = len(task.items)
    order = random.Random(f"{task.name}/items").sample(range(n), n)
    by_group = defaultdict(list)
    for j, it in enumerate(task.items):
        by_group[it.group].append(j)
    run_seeds = [0] if k == 0 else list(range(seeds))
    out = {"used": [], "skipped": 0, "requests": [], "plan": [], "kept": [], "cut": []}
    n_scored = 0
    for i in order:
        if max_items is not None and len(out["used"]) >= max_items:
            break
        item = task.items[i]
        same = (item.query, item.answer)   # a duplicate of the item (gen_modadd: 49 sums) would hand it its answer
        pool = [j for j in by_group[item.group] if j != i and (task.items[j].query, task.items[j].answer) != same]
        if k > len(pool):
            raise ValueError(f"{task.name}: {k} demonstrations requested, only {len(pool)} other distinct items")
        prompts = [fit_prompt(item, [task.items[j] for j in random.Random(f"{task.name}/{s}/{i}").sample(pool, k)],
                              encode, bos, block_size) for s in run_seeds]
        if max(len(t) for p in prompts for t in p[1]) > block_size - 2:
            out["skipped"] += 1
            continue
        out["used"].append(i)
        for s, (head, tails, kept, cut) in enumerate(prompts):
            out["plan"].append((len(out["used"]) - 1, s, n_scored, len(tails)))   # scores [n_scored, + len)
            out["requests"].append((head, tails))
            out["kept"].append(kept)
            out["cut"].append(cut)
            n_scored += len(tails)
    return out


def evaluate_task(model: nn.Module, enc, task: Task, k: int, seeds: int = 10, max_items: int | None = None,
                  block_size: int | None = None, bos: int | None = None, counts: Counter | None = None,
                  batch_tokens: int | None = None) -> dict:
    """One task at k shots: accuracy per demonstration seed ("acc_by_seed", what App. C's permutation test
    pairs), mean, s.e., centred accuracy, per-item results and how many demonstrations fit; generation tasks add
    the gold-completion loss, per seed and per item ("gold_nll_by_item": the units of downstream_claims._item_noise).

    enc: a tokenizer with encode (or encode_ordinary) and eot_token (BOS and padding). counts: adds
    score_continuations' counters. batch_tokens: padded tokens per scoring batch (BATCH_TOKENS by device)."""
    need_ints("evaluate_task", 0, k=k)
    need_ints("evaluate_task", seeds=seeds)
    need_ints("evaluate_task", 1, True, max_items=max_items, batch_tokens=batch_tokens)
    need_ints("evaluate_task", 3, True, block_size=block_size)
    if task.kind not in ("mc", "gen") or (task.kind == "mc" and task.norm not in ("token", "char", "none")):
        raise ValueError(f"evaluate_task: {task.name}: kind must be 'mc' or 'gen' and norm 'token', 'char' or "
                         f"'none', got kind={task.kind!r} norm={task.norm!r}")
    block_size = block_size or model.cfg.block_size
    bos = enc.eot_token if bos is None else bos
    dev = model_device(model)
    batch_tokens = batch_tokens or BATCH_TOKENS.get(dev.type, BATCH_TOKENS["cpu"])
    req = task_requests(enc, task, k, seeds, max_items, block_size, bos)
    used, own = req["used"], Counter()
    if task.kind == "mc" and hasattr(model, "new_cache") and dev.type == "cpu":
        # one prefill per context, forked per option: measured faster on CPU only (docs/tasks.md)
        scores = [sc for head, tails in req["requests"] for sc in score_options(model, head, tails, block_size, bos,
                                                                                counts=own)]
    else:
        scores = score_continuations(model, continuations(req), block_size, pad_id=bos, max_tokens=batch_tokens,
                                     counts=own)
    run_seeds = 1 if k == 0 else seeds
    correct = np.zeros((run_seeds, len(used)))
    nll_s, tok_s = np.zeros(run_seeds), np.zeros(run_seeds, dtype=np.int64)   # gold loss per seed
    nll_i, tok_i = np.zeros(len(used)), np.zeros(len(used), dtype=np.int64)   # and per item, seeds summed
    for u, s, start, m in req["plan"]:
        res = scores[start:start + m]
        if task.kind == "mc":
            item = task.items[used[u]]
            per = {"token": [nt for _, nt, _ in res], "char": [max(1, len(o)) for o in item.options],   # lm-eval: chars
                   "none": [1] * len(res)}[task.norm]
            crit = [nll / d for (nll, _, _), d in zip(res, per)]
            correct[s, u] = float(item.options[int(np.argmin(crit))] == item.answer)
        else:
            correct[s, u] = float(res[0][2])
            nll_s[s] += res[0][0]
            tok_s[s] += res[0][1]
            nll_i[u] += res[0][0]
            tok_i[u] += res[0][1]
    acc = correct.mean(1) if used else np.full(run_seeds, np.nan)
    mean = float(acc.mean())
    kept = np.array(req["kept"], dtype=float)
    out = {"k": k, "n_items": len(used), "skipped": req["skipped"], "seeds": run_seeds,
           "acc": mean, "acc_se": float(acc.std(ddof=1) / math.sqrt(len(acc))) if len(acc) > 1 else 0.0,
           "acc_by_seed": acc.tolist(), "centred": centred_accuracy(mean, task.rho),
           "items": used, "per_item": correct.mean(0).tolist(), "per_item_by_seed": correct.tolist(),
           "demos_kept": float(kept.mean()) if len(kept) else float("nan"),
           "share_short": float((kept < k).mean()) if len(kept) else float("nan"),
           "share_cut": float(np.mean(req["cut"])) if len(kept) else float("nan"),
           "forward_calls": own["forward_calls"]}
    if task.kind == "gen":
        nll_sum, n_tok = float(nll_s.sum()), int(tok_s.sum())
        out.update(gold_loss=nll_sum / n_tok if n_tok else float("nan"), gold_nll_sum=nll_sum, gold_tokens=n_tok,
                   gold_loss_by_seed=[float(a / b) if b else float("nan") for a, b in zip(nll_s, tok_s)],
                   gold_nll_by_item=nll_i.tolist(), gold_tokens_by_item=tok_i.tolist())
    if counts is not None:
        counts.update(own)
    return out


def centred_accuracy(acc: float, rho: float) -> float:
    """DCLM Core / SMELT Eq. 11: (a - rho) / (1 - rho); 0 at the random baseline, 1 at perfect."""
    if not 0 <= rho < 1:
        raise ValueError(f"random baseline rho must be in [0, 1), got {rho}")
    if not ((np.asarray(acc, dtype=float) >= 0) & (np.asarray(acc, dtype=float) <= 1)).all():
        raise ValueError(f"accuracy must be in [0, 1] (not nan), got {acc}")
    return (acc - rho) / (1 - rho)


def chance_of(task: dict) -> float:
    """A task entry's chance accuracy: its exact chance rate where one is defined, else DCLM's rho."""
    return float(task["rho"] if task.get("chance") is None else task["chance"])
