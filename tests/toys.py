"""Toy configs the training and fault tests share (one definition, imported by both)."""
import train as T
from loop import LoopConfig
from model import ModelConfig


def tiny_model(**kw) -> ModelConfig:
    """A SMELT-shaped toy: 4 layers, middle two looped twice, 4 experts top-2."""
    base = dict(vocab_size=64, block_size=32, n_layer=4, d_model=32, n_head=2, n_kv_head=1, d_ff=32,
                n_experts=4, top_k=2, loop=LoopConfig(start=1, length=2, n_loops=2))
    return ModelConfig(**{**base, **kw})


def tiny_train(**kw) -> T.TrainConfig:
    """Stable 6 steps, branches at 3 and 6 decaying 2 steps each, a checkpoint every 3 steps."""
    base = dict(lr=1e-2, warmup_steps=2, stable_steps=6, branch_steps=[3, 6], decay_steps=2, batch_size=4,
                block_size=32, log_interval=1, eval_tokens=128, ckpt_interval=3, flops_ctx=16.0, device="cpu")
    return T.TrainConfig(**{**base, **kw})
