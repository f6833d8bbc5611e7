"""Binds the GPT model to the generic pipeline executor: the step's loss and gradients.

The executor sees three functions (embed, a chunk of layers, head + loss), a tick table and the
stage layout; this module builds them from the model and splits the params into the layer stack
(`blocks`, in the layout's [v, p, Lc, ...] form) and the shared embedding/head params.

`model.remat` decides what a stage keeps for its backward, with or without a pipeline, as a
checkpoint policy around each layer (`jaxmeg.models.remat.REMAT_POLICY`):
  none       every matmul's output and each layer's input: no matmul runs twice, the cheap
             elementwise work (norms, softmax, GeLU, masks) is recomputed in the backward;
  selective  the weight matmuls' outputs and each layer's input (Megatron's selective policy:
             attention scores and softmax are recomputed);
  full       only the stage input; the backward recomputes the chunk once (under `none`),
             without a second, per-layer recompute inside it.
With one stage and one chunk there is nothing to keep across ticks: the backward runs the whole
model under one `jax.vjp` with the policy applied per layer, as plain training does.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxmeg.config import Config
from jaxmeg.models import GPT, Block, SequenceOrder, cross_entropy, split_backward
from jaxmeg.models.gpt import LayerGroup, layer_unit, output_weight, weight_gemms
from jaxmeg.models.grouped_gemm import grouped_gemm
from jaxmeg.models.moe_exchange import EXCHANGE_KEPT, UNIT_KEPT
from jaxmeg.models.parts import dtype_of
from jaxmeg.models.remat import REMAT_POLICY
from jaxmeg.parallel import activation_rules, attention, context, experts, make_constrain, zero
from jaxmeg.pipeline import executor, gradients, schedules
from jaxmeg.pipeline.executor import HeadSplit, SplitFunctions, StageFunctions, ZeroSharding
from jaxmeg.pipeline.layout import PADDING_SLOT
from jaxmeg.pipeline.tick_table import ONE_ACTION, PAIRS, build_tick_table
from jaxmeg.training.state import Trainable, links_of, zero_dims


def overlaps_sends(trainable: Trainable) -> bool:
    """`parallel.overlap_sends` resolved for the mesh's devices (on for GPUs)."""
    chosen = trainable.cfg.parallel.overlap_sends
    return trainable.platform == "gpu" if chosen is None else bool(chosen)


def pools_slots(trainable: Trainable) -> bool:
    """Whether a zero-bubble table keeps a microbatch's residuals and then its dY in one slot
    (`ExecutorOptions.pooled_slots`): on GPUs."""
    return trainable.platform == "gpu"


def sends_point_to_point(trainable: Trainable, program=None) -> bool:
    """Whether the GPU compile splits the pipe sends into send and recv
    (`gpu_target.POINT_TO_POINT_OPTIONS`): sends outside the slots (`overlaps_sends`) whose
    slots hold collectives, tensor all-reduces (tensor > 1) or a chunk's data means in its last
    B slot (`program.reduces_in_slots`, the executor's `Program`), which keep a
    collective-permute from overlapping them, on pairs without a cycle (one chunk per stage, or
    the V's chains) and no context ring. Elsewhere a collective-permute overlaps already, and a
    send would only add copies: its buffer must outlive the loop's next write of the carry (3.8
    GB per step on (1,4,1) gpt_1.3b for H100). Nor for F&B slots (DualPipeV) with both data and
    tensor > 1: XLA 0.10.2's latency-hiding scheduler cannot place the tick loop then ("failed
    to find a node to schedule ... kExceedsOverlapLimit", gpt_tiny and gpt_1.3b on (2,2,2));
    as collective-permutes it compiles, its pipe bytes under no GEMM."""
    layout, shape = trainable.layout, trainable.mesh.shape
    paired = program is not None and program.table.ticks == PAIRS
    if paired and shape["data"] > 1 and shape["tensor"] > 1:
        return False
    acyclic = layout.num_chunks == 1 or layout.placement == "v"
    reduces = program is not None and program.reduces_in_slots
    exchanges = _exchanges_in_slots(trainable, program)
    slots_hold_collectives = shape["tensor"] > 1 or reduces or exchanges
    return (
        overlaps_sends(trainable)
        and layout.num_stages > 1
        and slots_hold_collectives
        and acyclic
        and shape["context"] == 1
    )


def _exchanges_in_slots(trainable: Trainable, program) -> bool:
    """Whether the slots hold the expert exchange's all-to-alls (expert > 1), with sends XLA
    schedules: not a V of one action per tick (zbv), where XLA 0.10.2's latency-hiding
    scheduler fails on the sends ("failed to find a node to schedule ... kExceedsOverlapLimit"
    on the Mixtral-shaped pipe 2 x expert 8 program). As send and recv the pipe bytes of that
    program overlap a GEMM wholly (0% before) in 1f1b and dualpipev (m = 16: schedule bound
    1117 -> 1102 and 1171 -> 1101 ms, docs/benchmarks.md)."""
    if trainable.mesh.shape["expert"] == 1 or program is None:
        return False
    return not (trainable.layout.placement == "v" and program.table.ticks == ONE_ACTION)


def unrolls_layers(trainable: Trainable) -> bool:
    """Whether a chunk runs its layers one after another rather than as a scan: short chunks
    (`StageLayout.unrolled`), and on GPUs (cuDNN attention) every chunk, however long, at a
    compile-time cost (24 layers compile several times slower). Unrolled, each layer's residuals are
    buffers of their own; a scan writes them into stacked buffers, one more pass over every
    residual (gpt_1.3b on 1 H100: roofline 941 -> 786 ms, temp 20 -> 26 GB). With data or
    pipe > 1 it is also needed: jax 0.10 gives the residuals of the attention's nested map
    (`jaxmeg.parallel.attention`) inside a scanned, checkpointed layer the shape of the whole
    mesh's stack, not the device's, and the step fails to lower there."""
    layout = trainable.layout
    return layout.unrolled or trainable.model_cfg.attention == "cudnn"


def _over_layers(trainable: Trainable, layer: Callable, remat: str) -> Callable:
    """chunk(layer_params [Lc, ...], x, real_layers, extra [Lc, ...] | None) -> (x, aux
    [Lc, ...] | None): `layer(params_i, x, extra_i) -> (x, aux_i)` for each of the chunk's
    layers, one after another (`unrolls_layers`; layer_params may then also be a list of Lc
    per-layer trees, `StageFunctions.per_layer`) or as a scan over its layer slots; with
    uneven stages a padding slot (index >= real_layers) is skipped by `lax.cond` (aux zeros):
    unrolled, only the slots some stage pads (from the shortest stage's count on), each under
    the name scope `layout.PADDING_SLOT`i, which the cost report weighs per stage. jax's partial
    evaluation of a conditional returns what its branches keep of its operands as new arrays,
    which `residuals` cannot tell from activations and stores per microbatch. With `extra` (a
    split backward's zero taps, as large as every matmul output) the conditional therefore
    runs inside the slot's checkpoint, whose pullback keeps the tracers passed in (stored
    nowhere); the backward's recompute is then a conditional of its own, whose outputs XLA
    writes out. Without taps it stays around the checkpointed layer, at the cost of the slot's
    weights per microbatch (gpt_1.3b (1,4,1) 1f1b [7, 6, 6, 5] on H100s: 1.6 GB of temp,
    against a schedule bound 1.7% higher inside). A scanned chunk's pullback keeps its whole
    weight stack per microbatch. REMAT_POLICY[remat] around each layer."""

    def plain_stacked_layer(layer_params, x, extra, i):
        own, extra_i = _slot(layer_params, extra, i)
        return layer(own, x, extra_i)

    policy = REMAT_POLICY[remat]
    if remat != "full":
        # the dropless exchange keeps what it computed: the backward runs only its transpose
        # (`jaxmeg.parallel.experts`), and no other MoE block's forward (`UNIT_KEPT`)
        policy = jax.checkpoint_policies.save_from_both_policies(
            policy, jax.checkpoint_policies.save_only_these_names(EXCHANGE_KEPT, UNIT_KEPT)
        )

    def skip(params_i, x, extra_i):
        aux = jax.eval_shape(layer, params_i, x, extra_i)[1]
        # zeros that vary over the manual axes the layer's own aux would vary over
        axes = set()
        for leaf in jax.tree.leaves((params_i, x, extra_i)):
            axes |= set(jax.typeof(leaf).manual_axis_type.varying)
        zeros = lambda a: jax.lax.pcast(  # noqa: E731
            jnp.zeros(a.shape, a.dtype), tuple(sorted(axes)), to="varying"
        )
        return x, jax.tree.map(zeros, aux)

    def padding_slot(slot_layer, layer_params, x, extra, real_layers, i):
        run = partial(_run_slot, slot_layer, i)
        pad = partial(_pad_slot, skip, i)
        with jax.named_scope(f"{PADDING_SLOT}{i}"):  # the scope's last name, for the report
            return jax.lax.cond(i < real_layers, run, pad, layer_params, x, extra)

    # the layer's slice is taken inside the checkpoint, so what the pullback keeps of the
    # weights is the stacked params themselves, not a per-microbatch copy of a slice
    each = jax.checkpoint(layer, policy=policy, prevent_cse=False)
    stacked_layer = jax.checkpoint(
        plain_stacked_layer, policy=policy, prevent_cse=False, static_argnums=(3,)
    )
    around = partial(padding_slot, stacked_layer)  # the conditional around the checkpoint
    inside = jax.checkpoint(  # the conditional inside it (taps given)
        partial(padding_slot, plain_stacked_layer), policy=policy, prevent_cse=False,
        static_argnums=(4,),
    )  # fmt: skip
    padded, unrolled = trainable.layout.uneven, unrolls_layers(trainable)
    padding_slots = trainable.layout.padding_slots

    def chunk(layer_params, x_BxSxD, real_layers, extra=None):
        def body(x, scanned):
            params_i, extra_i, i = scanned
            if padded:
                return jax.lax.cond(i < real_layers, each, skip, params_i, x, extra_i)
            return each(params_i, x, extra_i)

        if isinstance(layer_params, list):
            count = len(layer_params)
        else:
            count = jax.tree.leaves(layer_params)[0].shape[0]
        if unrolled:
            # Unrolled, each layer's residuals are arrays of their own that the executor
            # writes straight into its rings; a scan would first stack them in its outputs.
            auxes = []
            for i in range(count):
                if i in padding_slots:
                    slot = around if extra is None else inside
                    x_BxSxD, aux = slot(layer_params, x_BxSxD, extra, real_layers, i)
                else:
                    x_BxSxD, aux = stacked_layer(layer_params, x_BxSxD, extra, i)
                auxes.append(aux)
            return x_BxSxD, jax.tree.map(lambda *a: jnp.stack(a), *auxes)
        slots = jnp.arange(count)
        return jax.lax.scan(body, x_BxSxD, (layer_params, extra, slots))

    return chunk


def _run_slot(stacked_layer, i, layer_params, x, extra):
    return stacked_layer(layer_params, x, extra, i)


def _pad_slot(skip, i, layer_params, x, extra):
    own, extra_i = _slot(layer_params, extra, i)
    return skip(own, x, extra_i)


def _slot(layer_params, extra, i):
    """Layer slot i's params (of a stacked tree or a list of per-layer trees) and extra."""
    pick = lambda tree: jax.tree.map(lambda a: a[i], tree)  # noqa: E731
    own = layer_params[i] if isinstance(layer_params, list) else pick(layer_params)
    return own, pick(extra)


def model_order(trainable: Trainable) -> SequenceOrder | None:
    """What the model attends with in the step: the context order (`sequence_order`), or with
    cuDNN attention the kernel run per tensor rank (`jaxmeg.parallel.attention`: jax's
    partitioner of it cannot compile inside the executor's map), else None (the model's own)."""
    cfg = trainable.cfg
    if cfg.parallel.context > 1 or trainable.model_cfg.attention != "cudnn":
        return sequence_order(cfg)
    s = cfg.model.seq_len
    return SequenceOrder(lambda: jnp.arange(s), attention.per_tensor_rank("cudnn"))


def sequence_order(cfg) -> SequenceOrder | None:
    """With parallel.context = c > 1, the load-balanced order of the sequence's rows and ring
    attention over it (`jaxmeg.parallel.context`); None otherwise."""
    c = cfg.parallel.context
    if c == 1:
        return None
    positions = context.load_balanced_order(cfg.model.seq_len, c)
    # a collective-permute involves every device of the mesh, so the ring's sends cannot sit
    # in the stages' chunks, which run in different ticks on different stages: with pipe > 1
    # the blocks come from an all-gather within the context group instead
    gathered = cfg.parallel.pipe > 1
    return SequenceOrder(
        context.local_positions(positions, c), context.ring_attention(positions, c, gathered)
    )


def step_block(trainable: Trainable, constrain) -> Block | LayerGroup:
    """One entry of the layer stack as the step runs it (a layer, or a `LayerGroup`):
    its MoE auxiliary losses weighted 1/m in the backward, m the microbatches each replica's
    loss is the mean of (`jaxmeg.models.moe.into_backward`; 1/(m e) on each of e expert ranks
    where the executor's map is manual over `expert`, whose sum the step takes:
    `gradients.loss_scale`), its experts split over the `expert` axis
    (`jaxmeg.parallel.experts`)."""
    cfg = trainable.cfg
    dispatch = experts.dispatch_for(trainable.mesh.shape, fp8=cfg.model.fp8)
    moe = trainable.moe_cfg
    ranks = trainable.mesh.shape["expert"] if splits_experts(trainable) else 1
    return layer_unit(moe)(trainable.model_cfg, constrain, model_order(trainable), moe,
                           1.0 / (cfg.train.microbatches * ranks), dispatch)  # fmt: skip


def _chunk_function(trainable: Trainable, constrain, remat: str) -> Callable:
    """chunk(layer_params [Lc, ...], x, real_layers) -> x: the chunk's layers (`_over_layers`)."""
    block = step_block(trainable, constrain)

    def layer(layer_params, x, _):
        return block.apply({"params": layer_params}, x)[0], None

    chunk = _over_layers(trainable, layer, remat)
    return lambda layer_params, x, real_layers: chunk(layer_params, x, real_layers)[0]


def _split_functions(
    trainable: Trainable, constrain, remat: str, model: GPT, loss: Callable
) -> SplitFunctions:
    """The chunk with its backward split in I and W (`jaxmeg.models.split_backward`), and the
    head in the pieces (`HeadSplit`) that leave its weight gradient to W; `loss(logits,
    targets)` the head's loss."""
    block = step_block(trainable, constrain)
    tapped = split_backward.tapped(block)
    fp8_gemms = trainable.cfg.model.fp8 != "none"
    # W's grouped GEMMs as the forward's (an exchanged layer's scale over its map's axes;
    # delayed scales come with the rows)
    grouped = grouped_gemm(trainable.moe_cfg, trainable.cfg.model.fp8).weight_gradient

    def recompute_under(policy):
        return _over_layers(trainable, lambda lp, x, taps: tapped(lp, x, taps), policy)

    # a step's slots ask for the same chunk's taps, whose shapes depend on the shapes of the
    # params and input only (not on what they vary over): one trace of the layer per step
    tap_shapes = {}

    def taps(layer_params, x):
        one = jax.tree.map(lambda a: a[0], layer_params)
        shapes = tuple((a.shape, a.dtype) for a in jax.tree.leaves((one, x)))
        key = (jax.tree.structure((one, x)), shapes, jax.sharding.get_abstract_mesh())
        if key not in tap_shapes:
            tap_shapes[key] = split_backward.tap_shapes(block, one, x)
        count = jax.tree.leaves(layer_params)[0].shape[0]
        return jax.tree.map(lambda a: jnp.zeros((count, *a.shape), a.dtype), tap_shapes[key])

    return SplitFunctions(
        chunk=recompute_under(remat),
        chunk_recompute=recompute_under("none") if remat == "full" else None,
        taps=taps,
        split_weights=split_backward.split_weights,
        merge_weights=split_backward.merge_weights,
        weight_grads=lambda inputs, cots, lead=1: split_backward.weight_gradients(
            inputs,
            cots,
            lead=lead,
            exchanged=experts.weight_gradient,
            grouped_gradient=grouped,
            fp8_gemms=fp8_gemms,
        ),
        head=HeadSplit(
            inputs=lambda shared, x: model.apply({"params": shared}, x, method=GPT.head_input),
            weight=partial(output_weight, trainable.model_cfg),
            logits=lambda shared, z, w: model.apply(
                {"params": shared}, z, w, method=GPT.head_project
            ),
            loss=loss,
        ),
    )


def residual_rows(trainable: Trainable) -> int | None:
    """A microbatch's rows on each (data, expert) rank, which sequence parallelism splits over
    `tensor` where it can (`rules.activation_rules`); None with MoE layers, whose residual stream
    stays split on the sequence: split on its rows, XLA partitioned a shared expert's GEMM with
    a collective that nothing ordered against the exchange's (tests/test_moe_step.py,
    e2p2t2-sequence_parallel-shared-gpt: a hazard of a hang)."""
    cfg = trainable.cfg
    if trainable.moe_cfg.experts:
        return None
    return cfg.train.microbatch_size // cfg.parallel.expert


def stage_functions(trainable: Trainable) -> StageFunctions:
    cfg = trainable.cfg
    constrain = make_constrain(
        activation_rules(cfg.parallel, residual_rows(trainable)),
        manual_axes=frozenset(gradients.map_axes(trainable.mesh.shape, splits_experts(trainable))),
    )
    model = GPT(
        trainable.model_cfg, trainable.vocab, constrain, model_order(trainable), trainable.moe_cfg
    )
    vocab_size = cfg.model.vocab_size

    def embed(shared, tokens_BxS):
        return model.apply({"params": shared}, tokens_BxS, method=GPT.embed_tokens)

    def loss(logits, targets_BxS):
        return cross_entropy(logits, targets_BxS, vocab_size)

    def head_loss(shared, x_BxSxD, targets_BxS):
        return loss(model.apply({"params": shared}, x_BxSxD, method=GPT.logits), targets_BxS)

    remat = cfg.model.remat
    recompute = _chunk_function(trainable, constrain, "none") if remat == "full" else None
    split = None
    if schedules.splits_backward(cfg.parallel.schedule):
        split = _split_functions(trainable, constrain, remat, model, loss)
    return StageFunctions(
        embed=embed,
        chunk=_chunk_function(trainable, constrain, remat),
        head_loss=head_loss,
        chunk_recompute=recompute,
        split=split,
        per_layer=unrolls_layers(trainable),
        weight_gemms=weight_gemms(trainable.model_cfg),
    )


def schedule_for(cfg: Config, pipe: int) -> schedules.Schedule:
    """The schedule `parallel.schedule` names, for `pipe` stages."""
    par = cfg.parallel
    return schedules.build(
        par.schedule, pipe, cfg.train.microbatches, num_chunks=par.chunks,
        warmup=par.pipeline_warmup,
    )  # fmt: skip


def build_schedule(trainable: Trainable) -> schedules.Schedule:
    return schedule_for(trainable.cfg, trainable.pipe)


def splits_experts(trainable: Trainable) -> bool:
    """Whether the executor's map is manual over `expert` (> 1): each expert rank then holds
    its share of every microbatch's rows, and the dense gradients are summed over `expert` once
    per step with the data-parallel reduction (`jaxmeg.pipeline.gradients`), not by XLA in
    every backward. Not with `tensor` > 1: the MoE layer splits its experts' width over
    `tensor` in a map of its own (`jaxmeg.parallel.experts`), and nested in the executor's map,
    which does not check its values' variance where it reduces in the loop, a map that checks
    types what its collectives over an enclosing `expert` give as varying where nothing around
    it does, so the step's backward refuses them, while one that does not check transposes
    its sums over `tensor` into sums of replicated cotangents. Not with current FP8 scaling
    (`model.fp8: current`): a dense linear scales by the amax of the whole microbatch's rows,
    which an automatic `expert` reduces for it and a manual one would leave to each rank. And
    only where it moves fewer bytes: XLA reduces each microbatch's gradients as the backward
    makes them, in the compute dtype, the step's one reduction the fp32 sums, so it pays from
    m x (the compute dtype's bytes) > 4 (bf16: 3 microbatches; docs/benchmarks.md measures 1,
    2 and 8 on a Mixtral-shaped stack)."""
    cfg, shape = trainable.cfg, trainable.mesh.shape
    compute_bytes = jnp.dtype(dtype_of(cfg.model.compute_dtype)).itemsize
    fewer_bytes = cfg.train.microbatches * compute_bytes > 4
    manual = shape["expert"] > 1 and shape["tensor"] == 1 and cfg.model.fp8 != "current"
    return manual and fewer_bytes


def expert_dims(trainable: Trainable):
    """Where the executor's map is manual over `expert` (`splits_experts`): per stage leaf
    (run layout) the dim split over `expert` (-1 none) (`ExecutorOptions`); else None."""
    if not splits_experts(trainable):
        return None
    specs, _ = trainable.run_layout_params

    def dim(spec) -> int:
        names = [entry if isinstance(entry, tuple) else (entry,) for entry in spec]
        return next((i for i, n in enumerate(names) if experts.EXPERT in n), -1)

    return jax.tree.map(dim, specs["blocks"]["layers"], is_leaf=lambda x: isinstance(x, P))


def zero_sharding(trainable: Trainable) -> ZeroSharding:
    """What the executor needs to know of `parallel.zero_stage`."""
    par = trainable.cfg.parallel
    if par.zero_stage == 0:
        return ZeroSharding()
    dims, (specs, _) = zero_dims(trainable), trainable.run_layout_params
    return ZeroSharding(
        stage=par.zero_stage,
        stage_dims=dims["blocks"]["layers"],
        shared_dims={k: v for k, v in dims.items() if k != "blocks"},
        shared_axes=zero.SHARED_AXES,
        stage_specs=specs["blocks"]["layers"],
        shared_specs={k: v for k, v in specs.items() if k != "blocks"},
    )


class LossAndGrads:
    """(params, tokens, targets) -> (mean loss, fp32 grads), params and grads in the run's
    layout and shardings, for every mesh (pipe = 1 included). With compression state (the
    train state's `links`, `jaxmeg.training.links`): (params, tokens, targets, links, step=)
    -> (loss, grads, links); `step` is the optimizer step (PowerSGD's warm-up).

    `program` is the built executor (`executor.Program`): its tick `table`, the
    `branch_columns` the cost report weights the compiled slots by, and `trace_info` (what one
    forward stores, filled when it is traced)."""

    def __init__(self, trainable: Trainable):
        cfg = trainable.cfg
        run_links = links_of(trainable)
        table = build_tick_table(build_schedule(trainable))
        options = executor.ExecutorOptions(
            microbatches=cfg.train.microbatches,
            zero=zero_sharding(trainable),
            pipe_compression=run_links.pipe(table),
            data_compression=run_links.data,
            fused_embedding_sync=cfg.compression.fused_embedding_sync,
            scatter_gather=cfg.parallel.uses_scatter_gather,
            overlap_sends=overlaps_sends(trainable),
            expert_dims=expert_dims(trainable),
            pooled_slots=pools_slots(trainable),
        )
        self.program = executor.build(
            stage_functions(trainable), table, trainable.layout, trainable.mesh, options
        )
        self.rows = None
        if cfg.parallel.context > 1:  # the rows in the order the context ranks hold them
            self.rows = context.load_balanced_order(cfg.model.seq_len, cfg.parallel.context)
        self.__name__ = "loss_and_grads"

    def __call__(self, params, tokens, targets, links=None, step=0):
        shared = {k: v for k, v in params.items() if k != "blocks"}
        if self.rows is not None:
            tokens, targets = tokens[:, self.rows], targets[:, self.rows]
        step = None if links is None else jnp.asarray(step, jnp.int32)
        loss, (stage_grads, shared_grads), links_out = self.program.run(
            params["blocks"]["layers"], shared, tokens, targets, links, step
        )
        grads = {**shared_grads, "blocks": {"layers": stage_grads}}
        return (loss, grads) if links is None else (loss, grads, links_out)


def make_loss_and_grads(trainable: Trainable) -> LossAndGrads:
    """The step's loss and gradients from the executor (`LossAndGrads`)."""
    return LossAndGrads(trainable)
