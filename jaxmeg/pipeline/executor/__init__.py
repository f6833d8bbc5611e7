"""The pipeline executor: one `jax.shard_map`, manual over `pipe` and `data` (and `context`
when the sequence is split over it: each rank then holds its part of every sequence, and the
gradients are averaged over data x context; and `expert` where the caller asks,
`ExecutorOptions.expert_dims`: each rank then holds its share of every microbatch's rows, and
the dense gradients are summed over it; over every axis where the others have size 1:
`gradients.map_axes`), that runs a schedule's tick table for a generic
model given as `StageFunctions`. Every layout takes this path; pipe = 1 is the degenerate
pipeline of one stage.

The rooms, in the order a step meets them:
  contract  what the executor is given: StageFunctions, SplitFunctions (HeadSplit),
            ZeroSharding, options
  columns   static per-(tick, stage) columns from the table, and SLOT_KINDS: the one table of
            every scope the tick runs something under (the cost report weights by it)
  plan      everything static about the build, decided once (the mode flags, specs, columns)
  reduction where a chunk's gradients are reduced over data inside the loop: one mode
  carry     per device: the stage's context (`Stage`) and the loop's rings and accumulators
  bodies    the F, B / I and W slot bodies, one function per slot kind; weight_grads: a
            split backward's dW = X^T dY into the accumulator; head_split: the last stage's
            head with its weight gradient left to the next W (zb_h1)
  paired    the F&B slot (DualPipeV): one microbatch's F and another's B in one loop
  beside    what runs beside the slots: sends and receives (compressed where asked), ZeRO-3's
            gather ahead, the in-loop reduction over data
  run       the tick (about ten lines in schedule order), the final reduction, the map
  slots     how a slot runs (a loop of 0 or 1 trips), sends (one ppermute per pattern) and
            receives; residuals: what a forward keeps for its backward

Per tick, every stage looks up its actions in static tables at (tick, axis_index('pipe')): the
F slot runs the forward of its kind and its activation goes to stage s+1 on the pairs that send
in that tick (the wrap p-1 -> 0 only when v > 1); the B slot the backward of its kind (or I,
then a W slot, for zero-bubble tables), and its input cotangent goes to stage s-1; a V
placement (zbv) sends both ways. The B slot reads its inputs before the F slot's receive is
written. The sends' index depends on the tick only, so every stage runs the same ppermute: a
pipe collective that only some stages reach deadlocks. Collectives over `tensor` inside the
stage-dependent slot loops are fine (a tensor group shares a stage). The loop runs the table's
ticks plus an idle one before them (ZeRO-3: the first gather) and one after (the last
reduction); accumulation and the reductions over `data` and `pipe` live in `gradients`.
"""

from jaxmeg.pipeline.executor.contract import (
    ExecutorOptions,
    HeadSplit,
    SplitFunctions,
    StageFunctions,
    ZeroSharding,
)
from jaxmeg.pipeline.executor.run import Program, build

__all__ = [
    "ExecutorOptions",
    "HeadSplit",
    "Program",
    "SplitFunctions",
    "StageFunctions",
    "ZeroSharding",
    "build",
]
