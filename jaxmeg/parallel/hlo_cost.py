"""What a compiled step executes, counted from its HLO text: matmul and elementwise FLOPs, bytes
written by dynamic-update-slice and copy, and bytes sent per collective kind and mesh axis, per
pipeline stage and summed over all devices.

XLA's `compiled.cost_analysis()` counts a while body once and only the costliest branch of each
conditional. Here every loop body counts `known_trip_count` times, and a conditional whose JAX
name scope is listed in `branch_columns` counts each branch by how many ticks of the loop it is
in take it on that stage (the pipeline executor's slots: the same tick table the executor runs).
A conditional whose scope is in `chosen_branches` (one whose branch the data picks at run time,
such as the bound of the dropless expert exchange) counts the branch given there. Any other
conditional counts its costliest branch, and is listed in `Cost.unweighted`.

Counting rules, per executed instruction:
  dot                     2 x output elements x contracted size (matmul FLOPs)
  elementwise, reduce     one FLOP per output element (per input element for reduce)
  dynamic-update-slice    the update's bytes (the write is in place)
  copy                    the result's bytes (`transpose_bytes` too where its layout differs from
                          its operand's: a transpose the backend placed, not a move of data)
  collectives             bytes a device sends on its links: collective-permute its result if
                          it is a source, all-reduce 2 (g-1)/g of it (a ring), all-gather and
                          all-to-all (g-1)/g of the result, reduce-scatter (g-1) x the result;
                          a GPU collective-permute split into send and recv counts at its recv
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections import Counter
from collections.abc import Mapping

import numpy as np
from jax.sharding import Mesh

from jaxmeg.parallel import hlo_gpu, hlo_module, hlo_ticks
from jaxmeg.parallel.hlo import (
    _BYTES,
    KINDS,
    _group_axes,
    _result_bytes,
    moved_bytes,
    replica_groups,
)
from jaxmeg.parallel.hlo_module import Instruction, parse
from jaxmeg.parallel.hlo_ticks import TickLoop
from jaxmeg.pipeline.executor.columns import SLOT_KINDS
from jaxmeg.pipeline.executor.slots import ORDERED_SCOPE

_ARRAY_RE = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([\d,]*)\]")
_LAYOUT_RE = re.compile(r"\{[\d,]*\}")
ELEMENTWISE = frozenset(
    "add subtract multiply divide exponential exponential-minus-one log log-plus-one tanh "
    "logistic maximum minimum rsqrt sqrt cbrt power negate abs compare select clamp erf sine "
    "cosine floor ceil round-nearest-even sign and or xor not remainder atan2".split()
)
COLLECTIVES = frozenset(KINDS) | {f"{k}-start" for k in KINDS}


def _elements(shape_text: str) -> int:
    return sum(
        int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        for _, dims in _ARRAY_RE.findall(shape_text)
    )


@dataclasses.dataclass
class Cost:
    """Executed work of one device (or a sum over devices): FLOPs, bytes written, collective
    bytes keyed by (kind, sorted mesh axes)."""

    matmul_flops: float = 0.0
    elementwise_flops: float = 0.0
    dus_bytes: float = 0.0
    copy_bytes: float = 0.0
    transpose_bytes: float = 0.0
    dus_count: float = 0.0
    copy_count: float = 0.0
    kernel_bytes: float = 0.0
    """GPU programs: bytes kernels read and write (`hlo_gpu`: a fusion's operands and results)."""
    copy_kernel_bytes: float = 0.0
    """GPU programs: results of kernels that only copy or transpose (a copy, or a fusion whose
    root is a copy or transpose)."""
    attention_forward_calls: float = 0.0
    attention_backward_calls: float = 0.0
    attention_flops: float = 0.0
    """cuDNN attention, as Megatron-LM counts attention FLOPs (`hlo_gpu.AttentionCall`)."""
    fp8_gemm_flops: float = 0.0
    """Of `matmul_flops`, those of cuBLASLt FP8 GEMMs (`hlo_gpu.FP8_GEMM`)."""
    fp8_gemm_calls: float = 0.0
    adding_gemm_calls: Counter = dataclasses.field(default_factory=Counter)
    """cuBLAS GEMMs that add into their output, by its dtype (`hlo_gpu.gemm_adds_into`)."""
    roofline_seconds: float = 0.0
    """Per kernel the larger of its GEMM/attention FLOPs at the device's peak and its bytes at
    its memory bandwidth (with `StepCost(roofline=...)`); collectives not included."""
    roofline_by_class: Counter = dataclasses.field(default_factory=Counter)
    """`roofline_seconds` by kernel class (`hlo_gpu.kernel_class`)."""
    kernel_bytes_by_class: Counter = dataclasses.field(default_factory=Counter)
    collective_bytes: Counter = dataclasses.field(default_factory=Counter)
    overlapped_bytes: Counter = dataclasses.field(default_factory=Counter)
    """Of `collective_bytes`, those of async collectives with a GEMM between start and done."""
    elementwise_by_shape: Counter = dataclasses.field(default_factory=Counter)
    """Elementwise FLOPs by result array (`f32[4096,128]`): where a step touches what."""
    unweighted: set = dataclasses.field(default_factory=set)

    def add(self, other: Cost, weight: float = 1.0) -> None:
        for f in _SCALARS:
            setattr(self, f, getattr(self, f) + weight * getattr(other, f))
        for name in _COUNTERS:
            mine = getattr(self, name)
            for key, value in getattr(other, name).items():
                mine[key] += weight * value
        self.unweighted |= other.unweighted

    @property
    def written_bytes(self) -> float:
        return self.dus_bytes + self.copy_bytes

    def bytes_over(self, axis: str) -> float:
        """Collective bytes over groups that span exactly `axis`."""
        return sum(b for (_, axes), b in self.collective_bytes.items() if axes == (axis,))


_COUNTERS = tuple(f.name for f in dataclasses.fields(Cost) if f.type == "Counter")
_SCALARS = tuple(f.name for f in dataclasses.fields(Cost) if f.type == "float")
"""What `Cost.add` sums: the per-key counters and the scalar counts (every other field)."""


def _wire_share(kind: str, group: int) -> float:
    if group <= 1:
        return 0.0
    kind = kind.removesuffix("-start")
    if kind == "all-reduce":
        return 2 * (group - 1) / group
    if kind == "reduce-scatter":
        return float(group - 1)
    return (group - 1) / group


class StepCost:
    """Walks a compiled module once per pipeline stage.

    branch_columns: JAX name scope of a conditional -> int [ticks, p] branch index per (tick,
        stage) of the loop it sits in; of a loop without a known trip count -> its trips per
        (tick, stage). Every scope is a row of the executor's slot table
        (`jaxmeg.pipeline.executor.columns.SLOT_KINDS`), else ValueError: a misspelt scope would
        leave its loop counted once.
    roofline: (peak FLOP/s, memory bytes/s[, FP8 peak FLOP/s]) of one device, for
        `Cost.roofline_seconds` (FP8 GEMMs at the third where given).
    chosen_branches: JAX name scope of a conditional (under any transformation: `jvp(name)`,
        `transpose(jvp(name))`) -> the branch to count, or a tuple of one per pipeline stage.
    """

    def __init__(
        self,
        hlo_text: str,
        mesh: Mesh,
        branch_columns: Mapping[str, np.ndarray] | None = None,
        roofline: tuple[float, ...] | None = None,
        chosen_branches: Mapping[str, int] | None = None,
    ):
        unknown = sorted(set(branch_columns or {}) - set(SLOT_KINDS))
        if unknown:
            raise ValueError(f"branch columns for scopes no slot kind names: {unknown}")
        self.comps, self.entry = parse(hlo_text)
        self.roofline = roofline
        self.fused = {
            called
            for instructions in self.comps.values()
            for ins in instructions
            if ins.op == "fusion"
            for called in re.findall(r"\bcalls=%?([\w.\-]+)", ins.attributes)
        }
        self.mesh = mesh
        self.columns = dict(branch_columns or {})
        self.chosen = dict(chosen_branches or {})
        names = list(mesh.axis_names)
        self.pipe_dim = names.index("pipe") if "pipe" in names else None
        self.p = mesh.shape.get("pipe", 1)
        self._shapes = {
            comp: {ins.name: ins.shape for ins in instructions}
            for comp, instructions in self.comps.items()
        }

    def _stage_of(self, device: int) -> int:
        if self.pipe_dim is None:
            return 0
        # replica groups are written in positions on the mesh's device order
        coords = np.unravel_index(device, self.mesh.devices.shape)
        return int(coords[self.pipe_dim])

    def _fractions(
        self, scope: str, stage: int, branches: int, tick: int | None = None
    ) -> np.ndarray | None:
        column = self.columns.get(scope)
        if column is None:
            return None
        if tick is not None:
            return np.eye(branches)[min(int(column[tick, stage]), branches - 1)]
        counts = np.bincount(np.asarray(column)[:, stage], minlength=branches)[:branches]
        return counts / column.shape[0]

    @functools.cache  # noqa: B019 - one walker per compiled module
    def cost(self, comp: str, stage: int, tick: int | None = None) -> Cost:
        """What `comp` executes on a device of `stage`: its slots weighted by the share of
        ticks that run them, or with `tick` as that tick of the table runs them (in the tick
        loop's body, unrolled k times by XLA's double buffering, that tick's copy of the slots
        and 1/k of the rest)."""
        if tick is None:
            return self._walk(comp, stage, None, per_tick=None)
        if not self._per_tick(comp):
            return self.cost(comp, stage)
        # what does not change between ticks is walked once (`_walk`'s cache)
        total = Cost()
        total.add(self._walk(comp, stage, None, per_tick=False))
        total.add(self._walk(comp, stage, tick, per_tick=True))
        return total

    @functools.cache  # noqa: B019 - one walker per compiled module
    def _walk(self, comp: str, stage: int, tick: int | None, per_tick: bool | None) -> Cost:
        """`cost` of the instructions of `comp` that run per tick (`per_tick` True), or those
        the same every tick (False), or all (None, without `tick`)."""
        loop = self.tick_loop() if per_tick is not None else None
        unrolled = loop is not None and comp == loop.body and loop.unroll > 1
        total = Cost()
        shapes = self._shapes[comp]
        spans = self._spans(comp)
        for ins in self.comps[comp]:
            if per_tick is not None and self._runs_per_tick(ins) != per_tick:
                continue
            part = Cost() if unrolled else total
            before = Counter(part.collective_bytes)
            self._instruction(ins, shapes, stage, part, tick)
            if comp not in self.fused:
                self._kernel(ins, shapes, part)
            span = spans.get(ins.name)
            if span is not None and span.gemm:  # what this start added overlaps compute
                part.overlapped_bytes.update(part.collective_bytes - before)
            if unrolled:
                total.add(part, loop.weight(ins, tick or 0, bool(per_tick)))
        return total

    @functools.cache  # noqa: B019 - one walker per compiled module
    def _spans(self, comp: str) -> dict[str, hlo_gpu.AsyncSpan]:
        """Async start name -> what the schedule placed before its done."""
        instructions = self.comps[comp]
        at = {ins.name: i for i, ins in enumerate(instructions)}
        spans = {}
        for i, ins in enumerate(instructions):
            if not ins.op.endswith("-done") or not ins.operands or ins.operands[0] not in at:
                continue
            start = at[ins.operands[0]]
            between = instructions[start + 1 : i]
            spans[ins.operands[0]] = hlo_gpu.AsyncSpan(
                kernels=sum(hlo_gpu.is_kernel(b.op) for b in between),
                gemm=any(self._runs_gemm(b) for b in between),
            )
        return spans

    def _runs_gemm(self, ins: Instruction) -> bool:
        if ins.op == "dot":
            return True
        if ins.op == "custom-call":
            target = hlo_gpu.call_target(ins.attributes)
            return target in hlo_gpu.GEMM_TARGETS or target.startswith(hlo_gpu.ATTENTION_PREFIX)
        return any(self._comp_runs_gemm(c) for c in hlo_module.called(ins.attributes))

    @functools.cache  # noqa: B019 - one walker per compiled module
    def _comp_runs_gemm(self, comp: str) -> bool:
        return any(self._runs_gemm(ins) for ins in self.comps.get(comp, []))

    @staticmethod
    def _scope(ins: Instruction) -> str:
        """The JAX name scope a loop or conditional was traced under."""
        parts = ins.op_name.split("/")
        return parts[-2] if len(parts) >= 2 else ""

    @functools.cache  # noqa: B019 - one walker per compiled module
    def _per_tick(self, comp: str) -> bool:
        """Whether what `comp` executes differs between ticks (`_runs_per_tick`)."""
        return any(self._runs_per_tick(ins) for ins in self.comps.get(comp, []))

    def _runs_per_tick(self, ins: Instruction) -> bool:
        """Whether `ins` is (or calls something holding) a loop or conditional that the
        columns weight."""
        if ins.op in ("while", "conditional") and self._scope(ins) in self.columns:
            return True
        return any(self._per_tick(c) for c in hlo_module.called(ins.attributes))

    @functools.cache  # noqa: B019 - one walker per compiled module
    def tick_loop(self) -> TickLoop | None:
        """The executor's tick loop (`hlo_ticks.find`); None without columns."""
        if not self.columns:
            return None
        ticks = len(next(iter(self.columns.values())))
        return hlo_ticks.find(self.comps, ticks, self._per_tick)

    def tick_costs(self, stage: int) -> list[Cost]:
        """What one device of `stage` executes in each tick of the tick loop (empty without
        one): the executor's slots as the table runs them in that tick."""
        loop = self.tick_loop()
        if loop is None:
            return []
        return [self.cost(loop.body, stage, t) for t in range(loop.ticks)]

    def _kernel(self, ins: Instruction, shapes: dict, total: Cost) -> None:
        """A GPU kernel's bytes (and its roofline time) where `ins` launches one, by class."""
        if not hlo_gpu.is_kernel(ins.op) or ins.op in COLLECTIVES or ins.op == "async-start":
            return
        fused, fused_flops = [], 0.0
        if ins.op == "fusion":
            (name,) = hlo_module.called(ins.attributes)[:1] or [""]
            fused, fused_flops = self.comps.get(name, []), self.cost(name, 0).matmul_flops
        operands = [shapes.get(o, "") for o in ins.operands]
        kind, moved, flops = hlo_gpu.kernel(ins, operands, fused, fused_flops)
        if kind == "copy":
            total.copy_kernel_bytes += hlo_gpu.nbytes(ins.shape)
        total.kernel_bytes += moved
        total.kernel_bytes_by_class[kind] += moved
        if self.roofline is not None:
            peak, bandwidth, *fp8_peak = self.roofline
            if fp8_peak and ins.op == "custom-call":
                if hlo_gpu.call_target(ins.attributes) == hlo_gpu.FP8_GEMM:
                    peak = fp8_peak[0]
            seconds = max(flops / peak, moved / bandwidth)
            total.roofline_seconds += seconds
            total.roofline_by_class[kind] += seconds

    def _instruction(
        self, ins: Instruction, shapes: dict, stage: int, total: Cost, tick: int | None = None
    ) -> None:
        op, attrs = ins.op, ins.attributes
        if op == "while":
            trips = hlo_ticks.TRIP_RE.search(attrs)
            scope = self._scope(ins)
            column = self.columns.get(scope)
            if trips:
                n = int(trips.group(1))
            elif scope == ORDERED_SCOPE:  # a send's loop of one trip
                n = 1
            elif column is not None and tick is not None:  # that tick's trips
                n = float(np.asarray(column)[tick, stage])
            elif column is not None:  # trips per tick of the loop it sits in
                n = float(np.asarray(column)[:, stage].mean())
            else:
                n = 1
                total.unweighted.add(f"{ins.op_name} (a loop without a known trip count, once)")
            for key in ("body", "condition"):
                m = re.search(rf"\b{key}=%?([\w.\-]+)", attrs)
                total.add(self.cost(m.group(1), stage, tick), n)
            return
        if op == "conditional":
            self._conditional(ins, stage, total, tick)
            return
        if op == "custom-call":
            self._custom_call(ins, shapes, total)
        for called in re.findall(r"\bcalls=%?([\w.\-]+)", attrs):
            total.add(self.cost(called, stage, tick))
        if op == "dot":
            lhs = shapes.get(ins.operands[0], "")
            dims = [int(d) for d in _ARRAY_RE.search(lhs).group(2).split(",") if d] if lhs else []
            contract = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", attrs)
            k = np.prod([dims[int(i)] for i in contract.group(1).split(",") if i]) if dims else 1
            total.matmul_flops += 2.0 * _elements(ins.shape) * float(k)
        elif op in ELEMENTWISE:
            total.elementwise_flops += _elements(ins.shape)
            array = _ARRAY_RE.search(ins.shape)
            if array:
                total.elementwise_by_shape[f"{array.group(1)}[{array.group(2)}]"] += _elements(
                    ins.shape
                )
        elif op == "reduce":
            total.elementwise_flops += sum(_elements(shapes.get(o, "")) for o in ins.operands)
        elif op == "dynamic-update-slice":
            total.dus_bytes += _result_bytes(shapes.get(ins.operands[1], ""))
            total.dus_count += 1
        elif op in ("copy", "copy-start"):
            total.copy_bytes += _result_bytes(ins.shape)
            total.copy_count += 1
            operand = shapes.get(ins.operands[0], "") if ins.operands else ""
            if _LAYOUT_RE.search(operand) and _LAYOUT_RE.search(ins.shape):
                if _LAYOUT_RE.search(operand).group(0) != _LAYOUT_RE.search(ins.shape).group(0):
                    total.transpose_bytes += _result_bytes(ins.shape)
        elif op in COLLECTIVES or (op == "recv" and hlo_gpu.DECOMPOSED_PERMUTE in attrs):
            self._collective(ins, stage, total)

    def _custom_call(self, ins: Instruction, shapes: dict, total: Cost) -> None:
        target = hlo_gpu.call_target(ins.attributes)
        operands = [shapes.get(o, "") for o in ins.operands]
        if target in hlo_gpu.GEMM_TARGETS:
            lhs = operands[0] if operands else ""
            flops = hlo_gpu.gemm_flops(ins.shape, lhs, ins.attributes)
            total.matmul_flops += flops
            if target == hlo_gpu.FP8_GEMM:
                total.fp8_gemm_flops += flops
                total.fp8_gemm_calls += 1
            if dtype := hlo_gpu.gemm_adds_into(ins.shape, ins.attributes):
                total.adding_gemm_calls[dtype] += 1
        elif flops := hlo_gpu.grouped_kernel_flops(target, operands, ins.shape, ins.attributes):
            total.matmul_flops += flops
        elif target.startswith(hlo_gpu.ATTENTION_PREFIX):
            call = hlo_gpu.attention_call(target, operands, ins.attributes)
            if call.backward:
                total.attention_backward_calls += 1
            else:
                total.attention_forward_calls += 1
            total.attention_flops += call.flops

    def _conditional(self, ins: Instruction, stage: int, total: Cost, tick: int | None) -> None:
        branches = hlo_module.branches(ins.attributes)
        scope = self._scope(ins)
        costs = [self.cost(b, stage, tick) for b in branches]
        chosen = self.chosen.get(re.sub(r"^(?:[\w\-]+\()*([^()]*)\)*$", r"\1", scope))
        if isinstance(chosen, tuple):  # per stage
            chosen = chosen[stage]
        if chosen is not None:
            total.add(costs[min(chosen, len(costs) - 1)])
            return
        fractions = self._fractions(scope, stage, len(branches), tick)
        if fractions is None:
            worst = max(costs, key=lambda c: (c.matmul_flops, c.written_bytes))
            total.add(worst)
            total.unweighted.add(ins.op_name)
            return
        for c, f in zip(costs, fractions, strict=True):
            if f:
                total.add(c, float(f))

    def _collective(self, ins: Instruction, stage: int, total: Cost) -> None:
        line = f"x = {ins.shape} {ins.op}({ins.attributes}"
        groups = replica_groups(line)
        axes = tuple(sorted(_group_axes(groups, self.mesh))) if groups else ()
        kind = ins.op.removesuffix("-start")
        nbytes = moved_bytes(kind, ins.shape)
        if ins.op == "recv":  # one half of a collective-permute XLA split into send and recv
            kind, nbytes = "collective-permute", hlo_gpu.first_array_bytes(ins.shape)
        elif ins.op in ("collective-permute-start", "all-gather-start") and ins.shape[0] == "(":
            # a GPU start's result is (operand, result[, contexts]): the result is what moves
            nbytes = hlo_gpu.first_array_bytes(ins.shape.split(", ", 1)[1])
        elif ins.op in ("all-to-all-start", "reduce-scatter-start"):
            # ((operands...), results...): the results move (a reduce-scatter's share per
            # device is its result times group - 1; the operands counted too, 3x at 2 ranks)
            nbytes = _result_bytes(hlo_gpu.after_operand_tuple(ins.shape))
        if kind == "collective-permute":
            sources = {self._stage_of(a) for a, _ in groups}
            if stage not in sources:
                return
            # one pair per device of that stage that sends
            senders = sum(1 for a, _ in groups if self._stage_of(a) == stage)
            per_stage = self.mesh.size // self.p
            total.collective_bytes[(kind, axes)] += nbytes * senders / per_stage
            return
        group = len(groups[0]) if groups else 1
        total.collective_bytes[(kind, axes)] += nbytes * _wire_share(kind, group)

    def per_stage(self) -> list[Cost]:
        """The cost of one device of each pipeline stage."""
        return [self.cost(self.entry, s) for s in range(self.p)]

    def total(self) -> Cost:
        """Summed over every device of the mesh."""
        out = Cost()
        per_stage_devices = self.mesh.size // self.p
        for c in self.per_stage():
            out.add(c, per_stage_devices)
        return out
