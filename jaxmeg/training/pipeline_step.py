"""Binds the GPT model to the generic pipeline executor.

The executor sees three functions (embed, chunk of layers, head + loss) and a schedule table;
this module builds them from the model and splits the params into the per-stage layer stack
(`blocks`, in the [v, p, L/(p v), ...] layout) and the shared embedding/head params.
"""

from __future__ import annotations

from collections.abc import Callable

from jaxmeg.models import GPT, BlockStack, cross_entropy
from jaxmeg.parallel import activation_rules, make_constrain
from jaxmeg.pipeline import schedules
from jaxmeg.pipeline.executor import StageFunctions
from jaxmeg.pipeline.executor import make_pipeline_loss_and_grads as executor
from jaxmeg.training.state import Trainable


def stage_functions(trainable: Trainable) -> StageFunctions:
    cfg = trainable.cfg
    constrain = make_constrain(
        activation_rules(cfg.parallel), manual_axes=frozenset({"data", "pipe"})
    )
    model = GPT(cfg.model, trainable.vocab, constrain)
    layers_per_chunk = cfg.model.layers // (trainable.pipe * trainable.chunks)
    chunk_stack = BlockStack(cfg.model, layers_per_chunk, constrain)
    vocab_size = cfg.model.vocab_size

    def embed(shared, tokens_BxS):
        return model.apply({"params": shared}, tokens_BxS, method=GPT.embed_tokens)

    def chunk(layer_params, x_BxSxD):
        return chunk_stack.apply({"params": {"layers": layer_params}}, x_BxSxD)

    def loss(shared, x_BxSxD, targets_BxS):
        logits = model.apply({"params": shared}, x_BxSxD, method=GPT.logits)
        return cross_entropy(logits, targets_BxS, vocab_size)

    return StageFunctions(embed=embed, chunk=chunk, loss=loss)


def build_schedule(trainable: Trainable):
    par, train = trainable.cfg.parallel, trainable.cfg.train
    return schedules.build(
        par.schedule,
        trainable.pipe,
        train.microbatches,
        num_chunks=par.chunks,
        warmup=par.pipeline_warmup,
    )


def make_pipeline_loss_and_grads(trainable: Trainable) -> Callable:
    """(params, tokens, targets) -> (loss, grads), params and grads in the pipeline layout."""
    schedule = build_schedule(trainable)
    run = executor(
        stage_functions(trainable),
        schedule.tick_table,
        trainable.mesh,
        num_chunks=trainable.chunks,
        microbatches=trainable.cfg.train.microbatches,
    )

    def loss_and_grads(params, tokens, targets):
        shared = {k: v for k, v in params.items() if k != "blocks"}
        loss, (stage_grads, shared_grads) = run(params["blocks"]["layers"], shared, tokens, targets)
        return loss, {**shared_grads, "blocks": {"layers": stage_grads}}

    return loss_and_grads
