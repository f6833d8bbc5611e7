"""What each tick of the tick table executes, read from the compiled step
(`StepCost.tick_costs`), and the bounds the cost report builds on it: the kernel classes
(`hlo_gpu.kernel_class`) and the step bound with the schedule's bubble
(`cost_report.schedule_bound`)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxmeg import config as C
from jaxmeg.parallel import hlo_gpu
from jaxmeg.parallel.hlo_cost import Cost, StepCost
from jaxmeg.parallel.hlo_module import Instruction
from jaxmeg.parallel.hlo_ticks import DOUBLE_BUFFERED, TickLoop
from jaxmeg.pipeline.executor.last_stage import head_in_w_columns
from jaxmeg.training.cost_report import schedule_bound
from tests.helpers import trainable_for

pytestmark = pytest.mark.timeout(600)


def _step(schedule: str):
    from jaxmeg.training.compilation import compile_step
    from jaxmeg.training.pipeline_step import make_loss_and_grads

    cfg = C.Config(
        model=C.ModelConfig(vocab_size=512, hidden=64, layers=4, heads=4, seq_len=32),
        parallel=C.ParallelConfig(pipe=4, schedule=schedule),
        train=C.TrainConfig(global_batch=8, microbatches=8),
    )
    trainable = trainable_for(cfg)
    loss_and_grads = make_loss_and_grads(trainable)
    program = loss_and_grads.program
    text = compile_step(trainable, loss_and_grads)[0].as_text()
    return StepCost(text, trainable.mesh, program.branch_columns), program.table


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_each_tick_executes_the_slots_its_row_of_the_table_runs(schedule):
    """(1,4,1): a tick's matmul FLOPs on a stage are those of the slots the table puts there:
    nothing in a tick where the stage idles, the same wherever the same kinds of slots run, and
    summed over the ticks what the whole step's count holds (no matmul outside the loop)."""
    counter, table = _step(schedule)
    loop = counter.tick_loop()
    assert loop is not None and (loop.ticks, loop.unroll, loop.peeled) == (table.num_ticks, 1, 0)
    for stage in range(4):
        ticks = counter.tick_costs(stage)
        flops = np.array([c.matmul_flops for c in ticks])
        runs = (table.f_mb[:, stage] >= 0, table.b_mb[:, stage] >= 0, table.w_mb[:, stage] >= 0)
        # zb_h1's last stage: an F that leaves the head's weight gradient to a W is a kind
        heads = [c[:, stage] for c in head_in_w_columns(table)] if table.split else []
        by_kinds: dict[tuple, set] = {}
        for t, key in enumerate(zip(*runs, table.b_split[:, stage] > 0, *heads, strict=True)):
            by_kinds.setdefault(key, set()).add(round(float(flops[t])))
        assert by_kinds.get((False, False, False, False), {0}) == {0}, by_kinds
        assert all(len(values) == 1 for values in by_kinds.values()), by_kinds
        assert ((flops > 0) == np.logical_or.reduce(runs)).all()
        assert flops.sum() == pytest.approx(counter.per_stage()[stage].matmul_flops, rel=1e-9)


def test_the_schedule_bound_adds_the_bubble_to_the_busiest_stage():
    """Per tick the slowest stage, plus the slowest stage's work outside the loop: never
    below the busiest stage's sum, and above it by the ticks where that stage idles."""
    counter, table = _step("1f1b")
    stages = counter.per_stage()

    def seconds(cost):
        return cost.matmul_flops / 1e12

    bound = schedule_bound(counter, stages, seconds)
    busiest = max(seconds(c) for c in stages)
    per_tick = np.array([[seconds(c) for c in counter.tick_costs(s)] for s in range(4)])
    assert bound == pytest.approx(per_tick.max(axis=0).sum())  # no matmul outside the loop
    assert bound > 1.2 * busiest  # p = 4, m = 8: the last stage idles in 6 of 14 ticks


def test_a_double_buffered_body_counts_each_tick_in_its_own_copy():
    """XLA's GPU compiler unrolls the tick loop twice (`xla_gpu_enable_while_loop_double_
    buffering`): a slot's copy named `.double_buffer_clone` is the odd tick, the original the
    even one, and what runs every tick counts half in each; with an odd number of ticks the
    first ran before the loop, and the copies shift by one."""
    slot = Instruction("while.7", "()", "while", [], "", "step/f_first/while")
    clone = Instruction(f"while.7{DOUBLE_BUFFERED}", "()", "while", [], "", "step/f_first/while")
    even = TickLoop("body", ticks=14, unroll=2, peeled=0)
    assert [even.weight(slot, t, True) for t in range(4)] == [1, 0, 1, 0]
    assert [even.weight(clone, t, True) for t in range(4)] == [0, 1, 0, 1]
    assert even.weight(clone, 3, per_tick=False) == 0.5
    odd = TickLoop("body", ticks=15, unroll=2, peeled=1)
    assert [odd.weight(slot, t, True) for t in range(4)] == [1, 1, 0, 1]
    assert [odd.weight(clone, t, True) for t in range(4)] == [0, 0, 1, 0]


@pytest.mark.parametrize(
    "target,root,fusion_dot,op_name,kind",
    [
        ("__cublas$lt$matmul", "custom-call", False, "step/b_whole/mlp/dot_general", "gemm"),
        ("", "add", True, "step/f_last/attn/dot_general", "gemm"),
        ("__cudnn$fmhaSoftmaxBackward", "custom-call", False, "step/attn/bwd", "attention"),
        ("", "copy", False, "step/transpose(jvp(loss))/copy", "copy"),
        ("", "transpose", False, "step/f_last/x", "copy"),
        ("", "reduce", False, "step/f_last/transpose(jvp(loss))/reduce_sum", "loss"),
        ("", "select", False, "jit(step)/optimizer/jit(_where)/select_n", "optimizer"),
        ("", "multiply", False, "jit(step)/shard_map/b_whole/Block/norm1/mul", "elementwise"),
        ("", "multiply", False, "jit(step)/b_whole/lossy/mul", "elementwise"),
    ],
)
def test_kernel_classes(target, root, fusion_dot, op_name, kind):
    assert hlo_gpu.kernel_class(target, root, fusion_dot, op_name) == kind


def test_a_fusion_reading_a_slice_of_the_buffer_it_writes_in_place_reads_the_slice():
    """A ring write that keeps the old slot where nothing is written (select(pred, new,
    ring[slot]) into ring[slot]) reads one slot of the ring, not the ring."""
    hlo = """HloModule m
%fused (param_0: f32[8,4], param_1: f32[1,4], param_2: s32[]) -> f32[8,4] {
  %param_0 = f32[8,4]{1,0} parameter(0)
  %param_1 = f32[1,4]{1,0} parameter(1)
  %param_2 = s32[] parameter(2)
  %c = s32[] constant(0)
  %old = f32[1,4]{1,0} dynamic-slice(%param_0, %param_2, %c), dynamic_slice_sizes={1,4}
  %new = f32[1,4]{1,0} add(%param_1, %old)
  ROOT %dus = f32[8,4]{1,0} dynamic-update-slice(%param_0, %new, %param_2, %c)
}

ENTRY %main (a: f32[8,4], b: f32[1,4], i: s32[]) -> f32[8,4] {
  %a = f32[8,4]{1,0} parameter(0)
  %b = f32[1,4]{1,0} parameter(1)
  %i = s32[] parameter(2)
  ROOT %f = f32[8,4]{1,0} fusion(%a, %b, %i), kind=kLoop, calls=%fused
}
"""
    import jax

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    cost = StepCost(hlo, mesh, roofline=(1e12, 1e9)).cost("main", 0)
    slot = 4 * 4
    assert cost.kernel_bytes == 3 * slot + 4  # old slot + new + the slot written, the index
    assert isinstance(cost, Cost) and cost.kernel_bytes_by_class["elementwise"] == cost.kernel_bytes


SCATTER_DIMS = (
    "update_window_dims={1,2}, inserted_window_dims={}, scatter_dims_to_operand_dims={0}, "
    "index_vector_dim=1"
)


@pytest.mark.parametrize("into", ["accumulator", "zeros"])
def test_a_scatter_into_the_buffer_it_writes_in_place_moves_its_rows(into):
    """An embedding's gradient scattered into its accumulator (a loop's carry, the fusion's
    operand) reads and writes the rows it adds to, not the table; scattered into zeros made in
    the fusion it writes the whole table."""
    target = "%param_0" if into == "accumulator" else "%zeros"
    hlo = f"""HloModule m
%add (x: f32[], y: f32[]) -> f32[] {{
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}}

%fused (param_0: f32[1000,64], param_1: f32[8,1,64], param_2: s32[8,1]) -> f32[1000,64] {{
  %param_0 = f32[1000,64]{{1,0}} parameter(0)
  %param_1 = f32[8,1,64]{{2,1,0}} parameter(1)
  %param_2 = s32[8,1]{{1,0}} parameter(2)
  %c = f32[] constant(0)
  %zeros = f32[1000,64]{{1,0}} broadcast(%c), dimensions={{}}
  ROOT %s = f32[1000,64]{{1,0}} scatter({target}, %param_2, %param_1), {SCATTER_DIMS}, to_apply=%add
}}

ENTRY %main (a: f32[1000,64], b: f32[8,1,64], i: s32[8,1]) -> f32[1000,64] {{
  %a = f32[1000,64]{{1,0}} parameter(0)
  %b = f32[8,1,64]{{2,1,0}} parameter(1)
  %i = s32[8,1]{{1,0}} parameter(2)
  ROOT %f = f32[1000,64]{{1,0}} fusion(%a, %b, %i), kind=kInput, calls=%fused
}}
"""
    import jax

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    cost = StepCost(hlo, mesh, roofline=(1e12, 1e9)).cost("main", 0)
    rows, table, indices = 8 * 64 * 4, 1000 * 64 * 4, 8 * 4
    if into == "accumulator":  # the updates read, the rows they add to read and written
        assert cost.kernel_bytes == 3 * rows + indices
    else:  # the operand it does not use is read whole (it is the fusion's input all the same)
        assert cost.kernel_bytes == table + rows + indices + table


def test_a_gpu_reduce_scatter_moves_its_result_times_the_group_less_one():
    """A GPU `reduce-scatter-start` returns ((operand), result): each device sends (g - 1)
    result-sized blocks. Counting the operand too made every reduce-scatter 3x its bytes at
    2 ranks (sequence parallelism's, and a sharded optimizer's over `data`)."""
    start = (
        "((bf16[4,8]{1,0}), bf16[2,8]{1,0}) reduce-scatter-start(%a), channel_id=1, "
        "replica_groups={{0,1}}, use_global_device_ids=true, dimensions={0}, to_apply=%sum"
    )
    hlo = f"""HloModule m
ENTRY %main (a: bf16[4,8]) -> bf16[2,8] {{
  %a = bf16[4,8]{{1,0}} parameter(0)
  %rs = {start}
  ROOT %d = bf16[2,8]{{1,0}} reduce-scatter-done(%rs)
}}
"""
    import jax

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
    cost = StepCost(hlo, mesh).cost("main", 0)
    assert dict(cost.collective_bytes) == {("reduce-scatter", ("data",)): 2 * 8 * 2}
