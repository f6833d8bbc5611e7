"""AdamW with linear warm-up, cosine decay and global-norm clipping.

The global norm is computed by XLA over the sharded gradient arrays, so it is the norm of the
whole model whatever the mesh. Biases and norm scales get no weight decay (as in Megatron).
"""

from __future__ import annotations

import jax
import optax

from jaxmeg.config import OptimizerConfig

DECAYED_NAMES = ("token", "position", "unembed")


def learning_rate_schedule(opt: OptimizerConfig) -> optax.Schedule:
    """Learning rate of optimizer step `count` (0-based): the first step already has lr > 0."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=opt.lr,
        warmup_steps=opt.warmup_steps,
        decay_steps=opt.warmup_steps + max(opt.decay_steps, 1),
        end_value=opt.min_lr,
    )
    return lambda count: schedule(count + 1)


def _decay_mask(params):
    def decayed(path, _):
        name = str(getattr(path[-1], "key", path[-1]))
        return name.startswith("w_") or name in DECAYED_NAMES

    return jax.tree_util.tree_map_with_path(decayed, params)


def make_optimizer(opt: OptimizerConfig) -> optax.GradientTransformation:
    adamw = optax.adamw(
        learning_rate_schedule(opt),
        b1=opt.beta1,
        b2=opt.beta2,
        eps=opt.eps,
        weight_decay=opt.weight_decay,
        mask=_decay_mask,
    )
    if opt.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(opt.grad_clip), adamw)
    return adamw
