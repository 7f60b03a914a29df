"""The Dyck case study (SMELT Sec. 6.4, Fig. 27): which head closes brackets, and what it reads per visit.

`dyck_prompts`: BIG-bench dyck_languages prompts with k in {1, 2, 4, 8} "Output:" demonstrations, nested
across k. `dyck_case_study`: the Dyck head is the head of the looped span whose ablation (`ablate_head`) raises
the target loss most; its attention at the three answer targets splits into BOS, demonstration-answer tokens and
the rest, per visit (the paper, 1.6B at k = 4: BOS 0.60 -> 0.02, demonstrations 0.24 -> 0.85). Claims:
probe_claims.DYCK_CLAIMS; figure: probe_plots.plot_dyck; choices where the paper is silent: docs/dyck_probe.md.
Read next: reproduce.py.
"""
from __future__ import annotations

import random
from collections.abc import Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

import checks

DYCK_KS = (1, 2, 4, 8)
CLOSERS = (")", "]", "}", ">")


@contextmanager
def ablate_head(model, layer: int, head: int):
    """Zero head `head`'s slice of PV before W_O in physical layer `layer` (every visit: weights are shared)."""
    attn = model.blocks[layer].attn
    H, hd = attn.n_head, attn.hd
    if not 0 <= head < H:
        raise ValueError(f"ablate_head: head must be in [0, {H}), got {head}")

    def hook(_module, args):
        y = args[0].clone()
        y[..., head * hd:(head + 1) * hd] = 0
        return (y, *args[1:])

    handle = attn.wo.register_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def _char_spans_to_tokens(enc, tokens: list[int], text: str, spans: list[tuple[int, int]]) -> list[int]:
    """Indices of tokens whose characters overlap any [start, end) span of text (tokens decode to text)."""
    decoded, offsets = enc.decode_with_offsets(tokens)
    if decoded != text:
        raise ValueError("dyck prompt does not round-trip through the tokenizer")
    ends = offsets[1:] + [len(decoded)]
    return [i for i, (a, b) in enumerate(zip(offsets, ends)) if any(a < e and s < b for s, e in spans)]


def dyck_prompts(enc, block_size: int, ks: Sequence[int] = DYCK_KS, n_items: int = 8, n_targets: int = 3,
                 seed: int = 0) -> dict:
    """Few-shot prompts (tasks.build_prompt) at every k that fits block_size, nested across k: {"prompts": [{"k",
    "item", "tokens", "targets" (positions whose next token is a closing bracket of the gold answer), "answer"
    (those brackets' tokens), "demo" (positions of demonstration-answer tokens)}], "ks", "skipped_k", ...}."""
    checks.need_ints("dyck_prompts", block_size=block_size, ks=list(ks), n_items=n_items, n_targets=n_targets)
    from lab import tasks as ev   # build_prompt, load_bigbench
    encode = getattr(enc, "encode_ordinary", None) or enc.encode
    items = ev.load_bigbench("dyck_languages").items
    length = [len(encode(it.query + it.answer + it.sep)) for it in items]
    pool = sorted(range(len(items)), key=lambda j: (length[j], j))[:max(4 * max(ks), len(items) // 4)]
    prefix = len(encode(items[0].prefix)) + 1
    room = block_size - prefix - n_targets - min(length)
    used_ks = [k for k in ks if k * min(length[j] for j in pool) <= room]
    out = {"ks": used_ks, "skipped_k": [k for k in ks if k not in used_ks], "n_targets": n_targets,
           "block_size": block_size, "prompts": []}
    cands = [j for j in range(len(items)) if len(items[j].answer.split()) == n_targets]
    while used_ks and not out["prompts"]:                            # drop the largest k until prompts fit
        out["prompts"] = _dyck_build(enc, ev, items, cands, pool, used_ks, n_items, n_targets, block_size, seed)
        if not out["prompts"]:
            out["skipped_k"].append(used_ks.pop())
    out["ks"], out["skipped_k"] = used_ks, sorted(out["skipped_k"])
    return out


def _dyck_build(enc, ev, items, cands, pool, used_ks, n_items, n_targets, block_size, seed) -> list[dict]:
    """dyck_prompts' search: up to n_items query items whose prompts fit at every k in used_ks."""
    encode = getattr(enc, "encode_ordinary", None) or enc.encode
    bos, out, done = enc.eot_token, [], 0
    rng = random.Random(f"probes/dyck/{seed}")
    for qi in rng.sample(cands, len(cands)):
        if done == n_items:
            break
        item, need = items[qi], set(items[qi].answer.split())
        firsts = [j for j in pool if j != qi and need <= set(items[j].answer.split())]
        rest = [j for j in pool if j != qi]
        if not firsts or len(rest) < max(used_ks):
            continue
        first = rng.choice(firsts)
        demos = [first] + rng.sample([j for j in rest if j != first], max(used_ks) - 1)
        prompts = []
        for k in used_ks:
            shown = [items[j] for j in demos[:k]]
            ctx, conts = ev.build_prompt(item, shown)
            body, cont = encode(ctx), encode(conts[0])
            sym = [i for i, t in enumerate(cont) if enc.decode([t]).strip() in CLOSERS]   # the closing brackets
            if len(sym) != n_targets or 1 + len(body) + len(cont) > block_size:
                break
            spans, cur = [], 0
            for d in shown:                                          # each demonstration's answer characters
                at = ctx.find(d.query + d.answer, cur)
                if at < 0:
                    raise ValueError("tasks.build_prompt did not lay demonstrations out as query + answer")
                s = at + len(d.query)
                spans.append((s, s + len(d.answer)))
                cur = s + len(d.answer)
            demo = [1 + i for i in _char_spans_to_tokens(enc, body, ctx, spans)]
            prompts.append({"k": k, "item": qi, "tokens": [bos] + body + cont,
                            "targets": [len(body) + i for i in sym], "answer": [cont[i] for i in sym], "demo": demo})
        if len(prompts) == len(used_ks):
            out += prompts
            done += 1
    return out


def _target_loss(logits: Tensor, prompts: list[dict]) -> Tensor:
    """Cross-entropy of every prompt's gold answer tokens at its target positions -> (n_prompts, n_targets)."""
    return torch.stack([F.cross_entropy(logits[i, p["targets"]].float(), torch.tensor(p["answer"],
                                        device=logits.device), reduction="none") for i, p in enumerate(prompts)])


@torch.no_grad()
def dyck_case_study(model, enc, block_size: int | None = None, ks: Sequence[int] = DYCK_KS, n_items: int = 8,
                    seed: int = 0, prompts: dict | None = None, select_k: int | None = 4) -> dict:
    """SMELT Sec. 6.4 on one model: the Dyck head is the head of the looped span (every layer if unlooped) whose
    ablation most raises the mean target loss of the k = select_k prompts (or the largest k below it; None:
    every prompt); then, per visit, its attention at every prompt's targets split into BOS, demo answers, rest."""
    cfg = model.cfg
    block = block_size or cfg.block_size
    P = prompts or dyck_prompts(enc, block, ks, n_items, seed=seed)
    out = {"ks": P["ks"], "skipped_k": P["skipped_k"], "n_prompts": len(P["prompts"])}
    if not P["prompts"]:
        return {**out, "error": f"no Dyck prompt fits block_size {block}"}
    prompts = P["prompts"]
    x = pad_sequence([torch.tensor(p["tokens"]) for p in prompts], batch_first=True, padding_value=enc.eot_token)
    x = x.to(next(model.parameters()).device)
    was_training = model.training
    model.eval()
    capture: dict = {}
    logits = model.run(x, capture=capture).logits
    clean = _target_loss(logits, prompts)                            # (n, n_targets)
    sel_k = None if select_k is None else max([k for k in P["ks"] if k <= select_k] or P["ks"][:1])
    sel = [i for i, p in enumerate(prompts) if sel_k is None or p["k"] == sel_k]
    xs = x[sel, :max(len(prompts[i]["tokens"]) for i in sel)]
    lc = cfg.loop
    layers = list(range(lc.start, lc.start + lc.length)) if lc.active else list(range(cfg.n_layer))
    effect = []
    for layer in layers:
        row = []
        for h in range(cfg.n_head):
            with ablate_head(model, layer, h):
                ablated = _target_loss(model.run(xs).logits, [prompts[i] for i in sel])
            row.append(float(ablated.mean() - clean[sel].mean()))
        effect.append(row)
    model.train(was_training)
    E = torch.tensor(effect)
    li, hi = divmod(int(E.argmax()), cfg.n_head)
    layer, head = layers[li], hi
    visits = sorted(v.visit for v in model.plan if v.layer == layer)

    def attention(i: int, v: int) -> Tensor:
        """The Dyck head's attention on visit v at prompt i's targets: (n_targets, its length)."""
        p = prompts[i]
        return capture[(layer, v)]["attn_probs"][i, head][p["targets"], :len(p["tokens"])].float().cpu()

    masses = {"bos": [], "demo": [], "other": []}                    # (n_prompts, n_visits), target-averaged
    for i, p in enumerate(prompts):
        demo = torch.zeros(len(p["tokens"]), dtype=torch.bool)
        demo[p["demo"]] = True
        rest = ~demo
        rest[0] = False
        att = [attention(i, v) for v in visits]
        masses["bos"].append([float(a[:, 0].mean()) for a in att])
        masses["demo"].append([float(a[:, demo].sum(-1).mean()) for a in att])
        masses["other"].append([float(a[:, rest].sum(-1).mean()) for a in att])
    correct = [bool((logits[i, p["targets"]].argmax(-1).cpu() == torch.tensor(p["answer"])).all())
               for i, p in enumerate(prompts)]
    by_k = {}
    for k in P["ks"]:
        at = [i for i, p in enumerate(prompts) if p["k"] == k]
        by_k[str(k)] = {"n": len(at), "accuracy": sum(correct[i] for i in at) / len(at),
                        "target_loss": float(clean[at].mean()),
                        **{f"{m}_mass": [sum(masses[m][i][j] for i in at) / len(at) for j in range(len(visits))]
                           for m in masses}}
    ex_k = max([k for k in P["ks"] if k <= 4] or P["ks"][:1])        # Fig. 27 shows a k = 4 prompt
    ex = next(i for i, p in enumerate(prompts) if p["k"] == ex_k)
    example = {"k": ex_k, "tokens": [enc.decode([t]) for t in prompts[ex]["tokens"]], "targets": prompts[ex]["targets"],
               "demo": prompts[ex]["demo"], "attention": [attention(ex, v).tolist() for v in visits]}
    return {**out, "layers": layers, "ablation_effect": effect, "selection_k": sel_k,
            "clean_loss": float(clean.mean()), "selection_loss": float(clean[sel].mean()),
            "head": {"layer": layer, "head": head, "effect": float(E.max())}, "visits": [v + 1 for v in visits],
            "prompt_keys": [[p["k"], p["item"]] for p in prompts], "mass": masses, "correct": correct,
            "by_k": by_k, "example": example}
