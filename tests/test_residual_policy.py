"""What `model.remat=none` keeps for a layer's backward (`REMAT_POLICY['none']`), read from the
pullback of the pipeline's chunk as the executor splits it (`residuals.trace_split`): the
layer's input and the matmul outputs, nothing that depends on no input, no matmul recomputed,
the same gradients as the plain layer, and the bytes `jaxmeg_memory` prices."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmeg import config as C
from jaxmeg.models.gpt import Block
from jaxmeg.models.remat import REMAT_POLICY
from jaxmeg.perf.jaxmeg_memory import stored_bytes
from jaxmeg.perf.layout import Layout
from jaxmeg.perf.model import shape_of
from jaxmeg.pipeline.executor import residuals
from jaxmeg.training.pipeline_step import stage_functions
from jaxmeg.training.state import abstract_state
from tests.helpers import trainable_for

pytestmark = pytest.mark.timeout(300)

GPT_TINY = C.load(Path(__file__).parent.parent / "configs" / "gpt_tiny.yaml").model
GPT_TINY = dataclasses.replace(GPT_TINY, vocab_size=4096, remat="none")


def chunk_split(model: C.ModelConfig, microbatch: int = 1, pipe: int = 2):
    """(the split of stage 0's chunk pullback, its layer slots, the chunk's traced jaxpr and
    its backward's, as the executor runs them)."""
    cfg = C.Config(
        model=model,
        parallel=C.ParallelConfig(data=1, pipe=pipe, tensor=1),
        train=C.TrainConfig(global_batch=pipe * 2 * microbatch, microbatch_size=microbatch),
    )
    trainable = trainable_for(cfg)
    fns = stage_functions(trainable)
    layers = abstract_state(trainable)["params"]["blocks"]["layers"]
    chunk_params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[2:], a.dtype), layers)
    x = jax.ShapeDtypeStruct(
        (microbatch, model.seq_len, model.hidden), np.dtype(model.compute_dtype)
    )
    slots = jax.tree.leaves(chunk_params)[0].shape[0]

    def chunk(params, x_):
        return fns.chunk(params, x_, slots)

    found = []

    def probe(params, x_):
        found.append(residuals.trace_split(chunk, params, x_))
        return x_

    with jax.set_mesh(trainable.mesh):
        jax.eval_shape(probe, chunk_params, x)
        (split,) = found
        forward = jax.make_jaxpr(chunk)(chunk_params, x)
        backward = jax.make_jaxpr(
            lambda p_, x_, stored, cot: residuals.backward(split, p_, x_, stored, cot)
        )(chunk_params, x, list(split.stored), x)
    return split, slots, forward, backward


def count_primitive(jaxpr, name: str) -> int:
    """Equations of primitive `name` in a jaxpr and every jaxpr nested in it (scan bodies,
    checkpoints, custom VJPs), each body counted once."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == name
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    count += count_primitive(sub, name)
    return count


def test_none_keeps_at_most_30_sbh_per_layer_on_gpt_tiny():
    """gpt_tiny (h 128, a 4, s 128, fp32): 14 s b h per layer (2 + 8 + a s / h), down from 45
    when the pullback kept every intermediate; Megatron counts ~20 without dropout. Its 4-layer
    chunk runs unrolled: the first layer's input is the stage input, kept in its own ring."""
    split, slots, _, _ = chunk_split(GPT_TINY)
    m = GPT_TINY
    per_layer = split.stored_bytes / 4 / slots / (m.seq_len * m.hidden)
    assert per_layer <= 30
    assert per_layer == 2 + 8 + m.heads * m.seq_len / m.hidden - 1 / slots


def test_none_stores_nothing_input_independent():
    """Every stored leaf is per sequence of the microbatch (b = 2): no causal
    mask, iota or other constant of the trace, and no boolean."""
    split, slots, _, _ = chunk_split(GPT_TINY, microbatch=2)
    assert split.stored
    for leaf in split.stored:
        # [b, ...] per layer in an unrolled chunk, [Lc, b, ...] stacked by a scan
        assert leaf.shape[0] == 2 or leaf.shape[:2] == (slots, 2), leaf
        assert leaf.dtype != np.dtype(bool), leaf


@pytest.mark.parametrize("block", ["gpt", "llama"])
def test_none_backward_runs_exactly_the_forward_matmuls_twice(block):
    """No matmul is recomputed: the chunk backward's dot_generals are the input and weight
    gradients of the forward's, nothing else."""
    model = dataclasses.replace(GPT_TINY, block=block, layers=4, seq_len=16, hidden=32)
    _, slots, forward, backward = chunk_split(model)
    forward_dots = count_primitive(forward.jaxpr, "dot_general")
    assert forward_dots == (7 if block == "llama" else 6) * slots  # an unrolled chunk
    assert count_primitive(backward.jaxpr, "dot_general") == 2 * forward_dots


@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("microbatch", [1, 2])
def test_jaxmeg_memory_prices_what_the_trace_stores(compute_dtype, microbatch):
    """`stored_bytes` (t = 1) equals the trace's stored bytes; in bf16 the scores stay fp32."""
    model = dataclasses.replace(GPT_TINY, compute_dtype=compute_dtype)
    split, _, _, _ = chunk_split(model, microbatch=microbatch)
    layout = Layout(
        tensor=1, pipe=2, data=1, microbatch=microbatch, microbatches=2, recompute="none"
    )
    width = np.dtype(jnp.dtype(compute_dtype)).itemsize
    assert stored_bytes(shape_of(model), layout, width) == split.stored_bytes


@pytest.mark.parametrize("block", ["gpt", "llama"])
def test_none_layer_has_the_plain_layers_gradients(block):
    """The policy recomputes the elementwise work in the backward: same output and gradients
    as the layer differentiated as written."""
    model = dataclasses.replace(
        GPT_TINY, block=block, hidden=32, heads=4, seq_len=16, layers=2, init_std=0.2
    )
    x = jax.random.normal(jax.random.key(0), (2, model.seq_len, model.hidden))
    params = Block(model).init(jax.random.key(1), x)["params"]
    cot = jax.random.normal(jax.random.key(2), x.shape)

    def f(p, x_):
        return Block(model).apply({"params": p}, x_)[0]

    def grads(fn):
        y, pullback = jax.vjp(fn, params, x)
        return y, pullback(cot)

    kept = jax.checkpoint(f, policy=REMAT_POLICY["none"], prevent_cse=False)
    (y_kept, g_kept), (y_plain, g_plain) = grads(kept), grads(f)
    np.testing.assert_allclose(y_kept, y_plain, rtol=1e-6, atol=1e-6)
    for a, b in zip(jax.tree.leaves(g_kept), jax.tree.leaves(g_plain), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def split_chunk_stored_bytes(stage_layers: tuple[int, int], real: int) -> int:
    """Bytes a split backward's F stores per microbatch for stage 0's chunk of a (1, 2, 1)
    gpt_tiny-shaped stack (`residuals.forward_split`, as the executor runs it), `real` of its
    slots real."""
    model = dataclasses.replace(GPT_TINY, layers=sum(stage_layers), seq_len=32, hidden=64)
    cfg = C.Config(
        model=model,
        parallel=C.ParallelConfig(
            data=1, pipe=2, tensor=1, schedule="zb_h1", stage_layers=stage_layers
        ),
        train=C.TrainConfig(global_batch=4, microbatch_size=1),
    )
    trainable = trainable_for(cfg)
    sf = stage_functions(trainable).split
    layers = abstract_state(trainable)["params"]["blocks"]["layers"]
    chunk_params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[2:], a.dtype), layers)
    x = jax.ShapeDtypeStruct((1, model.seq_len, model.hidden), np.dtype(model.compute_dtype))
    found = []

    def probe(params, x_):
        taps = sf.taps(params, x_)
        weights, rest = sf.split_weights(params, taps)
        chunk = lambda w, r, x__, t: sf.chunk(sf.merge_weights(w, r), x__, real, t)  # noqa: E731
        found.append(residuals.forward_split(chunk, weights, rest, x_, taps)[1])
        return x_

    with jax.set_mesh(trainable.mesh):
        jax.eval_shape(probe, chunk_params, x)
    return found[0].stored_bytes


@pytest.mark.parametrize("real", [1, 3])
def test_a_split_backwards_padding_slots_store_no_weights_and_no_taps(real):
    """Uneven stages (3, 1): stage 0's chunk has 3 layer slots, 2 of them under a padding
    slot's conditional. Its split forward stores per microbatch exactly what an even layout's
    3-slot chunk stores: the conditional sits inside the slot's checkpoint, so the pullback
    keeps the stacked weights and the zero taps as the tracers passed in. (Around it, jax
    returned them as new arrays, stored in the rings: 7.1x the even chunk's bytes here.)"""
    assert split_chunk_stored_bytes((3, 1), real) == split_chunk_stored_bytes((3, 3), 3)
