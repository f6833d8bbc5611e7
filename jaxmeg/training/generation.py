"""Autoregressive generation with a key/value cache, on one device or a tensor-parallel mesh.

One jitted function per (prompt length, new tokens, sampling): the prompt goes through
`GPT.decode` in one call (prefill), then one token per step in a `lax.fori_loop`, each reading
and extending the cache [L, 2, B, T, K, H] (T = prompt + new tokens). The cache is an
activation: its kv heads split over `tensor` like the kv-head params (`KV_CACHE_AXES` through
the activation rules), so each tensor rank attends with its own heads, as in training.
`use_cache=False` recomputes the full forward (`GPT.__call__`) over the tokens so far at every
step instead: the same ids, by causality, at quadratic cost; it is the check on the cache.

Sampling: temperature 0 takes the argmax; otherwise softmax(logits / temperature), restricted to
the `top_k` largest logits when top_k > 0, drawn with a key folded from the seed and the step.
Logits are cut to `model.vocab_size` first, so no id of the table's padding rows can come out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxmeg.models import GPT
from jaxmeg.models.gpt import KV_CACHE_AXES, kv_cache_shape
from jaxmeg.parallel import activation_rules, make_constrain
from jaxmeg.training.compilation import check_hazards
from jaxmeg.training.state import Trainable, to_canonical_layout


def check_request(trainable: Trainable, prompt_len: int, max_new_tokens: int,
                  temperature: float = 0.0, top_k: int = 0) -> None:  # fmt: skip
    """ValueError naming the value when a generation cannot run on this model and mesh."""
    cfg = trainable.cfg
    mesh = trainable.mesh.shape
    others = {axis: mesh.get(axis, 1) for axis in ("data", "pipe", "context")}
    if any(size != 1 for size in others.values()):
        raise ValueError(
            "generation runs on a tensor-parallel mesh: parallel.data, parallel.pipe and "
            "parallel.context must be 1, got " + ", ".join(f"{n}={s}" for n, s in others.items())
        )
    if prompt_len < 1:
        raise ValueError("the prompt is empty; generation needs at least one prompt token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if prompt_len + max_new_tokens > cfg.model.seq_len:
        raise ValueError(
            f"the prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) = "
            f"{prompt_len + max_new_tokens} tokens exceed model.seq_len ({cfg.model.seq_len}), "
            f"the longest sequence the model knows positions for"
        )
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = all tokens), got {top_k}")


def sample(
    logits_BxV: jax.Array, key: jax.Array, temperature: float, top_k: int, vocab_size: int
) -> jax.Array:
    """Next ids [B] from logits over the padded vocabulary, never >= `vocab_size`."""
    logits_BxV = logits_BxV[:, :vocab_size].astype(jnp.float32)
    if temperature == 0:
        return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    logits_BxV = logits_BxV / temperature
    if 0 < top_k < vocab_size:
        kth_Bx1 = jax.lax.top_k(logits_BxV, top_k)[0][:, -1:]
        logits_BxV = jnp.where(logits_BxV < kth_Bx1, -jnp.inf, logits_BxV)
    return jax.random.categorical(key, logits_BxV, axis=-1).astype(jnp.int32)


def make_generate(
    trainable: Trainable,
    prompt_len: int,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    use_cache: bool = True,
) -> Callable:
    """Jitted (params in the run's layout and shardings, prompt ids [B, P], seed) -> new ids
    [B, N]; call it under `jax.set_mesh(trainable.mesh)`."""
    check_request(trainable, prompt_len, max_new_tokens, temperature, top_k)
    cfg = trainable.cfg
    # One token's sequence dim cannot be split: sequence parallelism is a training layout.
    rules = activation_rules(dataclasses.replace(cfg.parallel, sequence_parallel=False))
    constrain = make_constrain(rules)
    model = GPT(trainable.model_cfg, trainable.vocab, constrain, moe=trainable.moe_cfg)
    total, vocab_size = prompt_len + max_new_tokens, cfg.model.vocab_size

    def choose(logits_BxV, step, key):
        return sample(logits_BxV, jax.random.fold_in(key, step), temperature, top_k, vocab_size)

    def with_cache(params, prompt_BxP, key):
        batch = prompt_BxP.shape[0]
        cache = jnp.zeros(kv_cache_shape(cfg.model, batch, total), cfg.model.compute_dtype)
        cache = constrain(cache, KV_CACHE_AXES)
        logits_BxV, cache = model.apply({"params": params}, prompt_BxP, cache, 0, method=GPT.decode)
        new_BxN = jnp.zeros((batch, max_new_tokens), jnp.int32)
        new_BxN = new_BxN.at[:, 0].set(choose(logits_BxV, 0, key))

        def step(i, carry):
            new_BxN, cache = carry
            last_Bx1 = jax.lax.dynamic_slice_in_dim(new_BxN, i - 1, 1, axis=1)
            logits_BxV, cache = model.apply(
                {"params": params}, last_Bx1, cache, prompt_len + i - 1, method=GPT.decode
            )
            return new_BxN.at[:, i].set(choose(logits_BxV, i, key)), cache

        return jax.lax.fori_loop(1, max_new_tokens, step, (new_BxN, cache))[0]

    def without_cache(params, prompt_BxP, key):
        batch = prompt_BxP.shape[0]
        # Positions past the tokens so far hold zeros, which causal attention never reads.
        tokens_BxT = jnp.zeros((batch, total), jnp.int32).at[:, :prompt_len].set(prompt_BxP)

        def step(i, tokens_BxT):
            logits_BxTxV = model.apply({"params": params}, tokens_BxT)
            logits_BxV = jax.lax.dynamic_index_in_dim(
                logits_BxTxV, prompt_len + i - 1, axis=1, keepdims=False
            )
            return tokens_BxT.at[:, prompt_len + i].set(choose(logits_BxV, i, key))

        return jax.lax.fori_loop(0, max_new_tokens, step, tokens_BxT)[:, prompt_len:]

    run = with_cache if use_cache else without_cache

    def generate(params, prompt_BxP, seed):
        params = to_canonical_layout(params, trainable.layout)
        return run(params, prompt_BxP, jax.random.key(seed))

    return jax.jit(generate)


def generate(
    trainable: Trainable,
    params,
    prompt_ids,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int = 0,
    use_cache: bool = True,
) -> np.ndarray:
    """New ids [B, N] (int32) after each prompt of `prompt_ids` [B, P] (or one prompt [P]).
    `params` in `trainable`'s layout and shardings (as `Checkpointer.restore_latest` gives)."""
    prompt = np.asarray(prompt_ids, np.int32)
    prompt_BxP = prompt[None] if prompt.ndim == 1 else prompt
    vocab_size = trainable.cfg.model.vocab_size
    if prompt_BxP.size and (prompt_BxP.min() < 0 or prompt_BxP.max() >= vocab_size):
        bad = prompt_BxP[(prompt_BxP < 0) | (prompt_BxP >= vocab_size)][0]
        raise ValueError(f"prompt id {bad} is outside the vocabulary [0, {vocab_size})")
    run = make_generate(
        trainable, prompt_BxP.shape[1], max_new_tokens,
        temperature=temperature, top_k=top_k, use_cache=use_cache,
    )  # fmt: skip
    with jax.set_mesh(trainable.mesh):
        args = (params, jnp.asarray(prompt_BxP), seed)
        compiled = run.lower(*args).compile()
        check_hazards(compiled, trainable, "generation step")
        new_BxN = compiled(*args)
    new_BxN = np.asarray(jax.device_get(new_BxN))
    return new_BxN[0] if prompt.ndim == 1 else new_BxN


def tokenizer_path(cfg) -> Path | None:
    """The run's tokenizer.json: `data.tokenizer` when it names one (None for `none`), else the
    data's: the token file's `tokenizer`, or the default corpus's (built and cached as training
    builds it); None for data that names none (a Megatron-LM dataset, or a token file written
    without one)."""
    import json

    from jaxmeg.data import dataset_format
    from jaxmeg.training.batches import dataset_prefix, run_tokenizer

    if cfg.data.tokenizer:
        return run_tokenizer(cfg)
    prefix = dataset_prefix(cfg)
    if dataset_format(prefix) != "jaxmeg":
        return None
    path = json.loads(Path(str(prefix) + ".json").read_text()).get("tokenizer")
    return Path(path) if path and Path(path).is_file() else None
