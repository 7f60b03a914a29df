"""Which attention kernel each consumer of the model takes on CUDA (issue 24), checked on CPU.

attention.attention_kernel is the one rule; a recorder asks it, for every call the consumer makes, what
it would pick on device "cuda" while the CPU computes as usual. Flex attention compiles a kernel per
input shape when the model runs uncompiled, so only consumers with one shape may take it:
  - validation (train / eval, document ids, padded to one shape): flex, one shape per pass;
  - few-shot scoring (one sequence per right-padded row, no document ids): SDPA with is_causal, no
    compile whatever the batch's shape; tested equal to the masked paths below;
  - probes (they read the probabilities): math.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from unittest import mock

import pytest
import torch

import attention
import probes
from lab import tasks
import train
import eval as validation
from loop import LoopConfig
from model import GPT, ModelConfig

pytestmark = pytest.mark.usefixtures("one_thread")


def _cfg(**kw) -> ModelConfig:
    """A SMELT-shaped toy with CUDA-flex-sized heads (head_dim 16), 4 experts top-2."""
    base = dict(vocab_size=64, block_size=32, n_layer=4, d_model=32, n_head=2, n_kv_head=1, d_ff=32,
                n_experts=4, top_k=2, loop=LoopConfig(start=1, length=2, n_loops=2))
    return ModelConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def model() -> GPT:
    torch.manual_seed(0)
    return GPT(_cfg()).eval()


@contextlib.contextmanager
def cuda_choices(model: GPT):
    """(kernels attention_kernel picks for device "cuda", distinct input shapes of the model's forwards)."""
    real, seen, shapes = attention.attention_kernel, Counter(), set()

    def record(backend, device_type, head_dim, training_shape, masked, want_probs=False):
        seen[real(backend, "cuda", head_dim, training_shape, masked, want_probs)] += 1
        return real(backend, device_type, head_dim, training_shape, masked, want_probs)
    hook = model.tok_emb.register_forward_pre_hook(lambda _m, args: shapes.add(tuple(args[0].shape)))  # every entry
    try:
        with mock.patch.object(attention, "attention_kernel", record):
            yield seen, shapes
    finally:
        hook.remove()


def _requests(n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(4, 30, (n,), generator=g).tolist()
    return [(torch.randint(1, 64, (L,), generator=g).tolist(), 1 + L % 3) for L in lens]


def test_few_shot_scoring_takes_sdpa_causal_on_cuda_at_every_shape(model):
    with cuda_choices(model) as (seen, shapes):
        tasks.score_continuations(model, _requests(40), 32, max_tokens=128, max_logits=1 << 20)
    assert len(shapes) > 3                                  # batches of several shapes...
    assert set(seen) == {"sdpa"} and seen["sdpa"] > 0       # ...and no flex compile for any of them


def test_kernel_rule_for_validation_and_probes_on_cuda():
    """The rule's inputs on the other consumers' paths at head_dim 64 (the scoring path's, nothing masked but
    causality -> sdpa, is test_model's head-dim rule test): document ids -> flex, attention probabilities -> math."""
    assert attention.attention_kernel("auto", "cuda", 64, True, True) == "flex"      # validation, training
    assert attention.attention_kernel("auto", "cuda", 64, True, False, want_probs=True) == "math"   # probes
    assert attention.attention_kernel("flex", "cuda", 64, True, True, want_probs=True) == "math"


@pytest.mark.parametrize("who", ["train", "eval"])
def test_validation_takes_flex_on_cuda_at_one_shape(model, who):
    """train.Trainer.evaluate's and eval.val_loss_report's passes: document ids, every batch padded to one
    shape (5 contexts per source in batches of 2: the last one is padded), so eager flex compiles once."""
    import eval as ev
    data = train.SyntheticData(64, mean_doc_len=8)
    with cuda_choices(model) as (seen, shapes):
        if who == "train":
            obj = train.Objective(model)
            validation.val_loss_by(lambda i, t, d: obj(i, t, d, per_token=True), data, 32, 2, 5 * 32)
        else:
            ev.val_loss_report(model, data, 32, 2, 5 * 32)
    assert set(seen) == {"flex"} and shapes == {(2, 32)}


def test_probes_take_math_on_cuda(model):
    data = train.SyntheticData(64, mean_doc_len=8)
    batches = [b for b in data.val_batches("synthetic0", 2, 32, 4 * 32)]
    with cuda_choices(model) as (seen, _):
        probes.probe(model, batches)
    assert set(seen) == {"math"}


def test_sdpa_causal_equals_the_masked_paths_on_right_padded_rows(model):
    """Scoring's path (no document ids: SDPA is_causal) against the masked ones on the same right-padded
    batch (one document per row: SDPA with the boolean mask, and flex with the block mask) and against
    each row run alone, unpadded: equal logits at every real position."""
    torch.manual_seed(1)
    lens = [32, 21, 9, 2]
    x = torch.zeros(len(lens), 32, dtype=torch.long)
    for r, L in enumerate(lens):
        x[r, :L] = torch.randint(1, 64, (L,))
    one_doc = torch.zeros_like(x)
    flex = GPT(_cfg(attn_backend="flex")).eval()
    flex.load_state_dict(model.state_dict())
    with torch.no_grad():
        causal = model(x)[0]
        masked = model(x, doc_ids=one_doc)[0]
        by_flex = flex(x, doc_ids=one_doc)[0]
        for r, L in enumerate(lens):
            alone = model(x[r:r + 1, :L])[0][0]
            torch.testing.assert_close(causal[r, :L], alone, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(causal[r, :L], masked[r, :L], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(causal[r, :L], by_flex[r, :L], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(causal[1, :21], causal[0, :21])   # rows differ: the comparison can fail


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_scoring_compiles_nothing_at_any_shape(model):
    """On a GPU, under bf16 autocast: scoring batches of many shapes compile no graph (dynamo's graph
    counter does not move; eager flex would compile one per shape) and give finite scores."""
    from torch._dynamo.utils import counters
    gpu = GPT(_cfg()).cuda().eval()
    gpu.load_state_dict(model.state_dict())
    before = counters["stats"]["unique_graphs"]
    scores = tasks.score_continuations(gpu, _requests(40), 32, max_tokens=128, max_logits=1 << 20)
    assert counters["stats"]["unique_graphs"] == before
    assert all(torch.isfinite(torch.tensor(s)) for s, _, _ in scores)
