"""Reads the structure of a compiled XLA module (`compiled.as_text()`): its computations, which
computations an instruction calls, the pipeline's tick-loop body, and instructions by opcode.
For tests and reports that check what a step executes where (copies in the loop, matmuls in a
branch); collectives and their mesh axes are read by `hlo.collectives`.
"""

from __future__ import annotations

import dataclasses
import re

from jaxmeg.parallel.hlo import (
    _COMPUTATION_RE,
    _KIND_RE,
    Collective,
    _group_axes,
    collectives,
    replica_groups,
)

_CALLED_RE = re.compile(r"\b(?:calls|to_apply|body|condition)=%?([\w.\-]+)")
_BRANCHES_RE = re.compile(r"branch_computations=\{([^}]*)\}")
_PREDICATED_RE = {k: re.compile(rf"\b{k}_computation=%?([\w.\-]+)") for k in ("false", "true")}
_SHAPE_RE = re.compile(r"=\s*(\w+\[[\d,]*\])")
_TICK_LOOP_RE = re.compile(r'op_name="jit\([^)]*\)/shard_map/while"')
"""The executor's `lax.fori_loop` over ticks, directly inside the jitted step's shard_map."""
_INSTRUCTION_RE = re.compile(
    r"^\s*(?:ROOT )?%?(?P<name>[\w.\-]+) = (?P<shape>.+?) (?P<op>[a-z][\w\-]*)\((?P<rest>.*)$"
)
_OP_NAME_RE = re.compile(r'op_name="([^"]*)"')


@dataclasses.dataclass
class Instruction:
    """One instruction of a computation, as `parse` reads it."""

    name: str
    shape: str
    op: str
    operands: list[str]
    attributes: str
    op_name: str
    args: str = ""


def parse(hlo_text: str) -> tuple[dict[str, list[Instruction]], str]:
    """Computation name -> its instructions, and the entry computation's name."""
    comps: dict[str, list[Instruction]] = {}
    current, entry = None, ""
    for line in hlo_text.splitlines():
        header = _COMPUTATION_RE.match(line)
        if header and not line.startswith(" "):
            current = header.group(1)
            comps[current] = []
            if line.startswith("ENTRY"):
                entry = current
            continue
        m = _INSTRUCTION_RE.match(line)
        if current is None or not m:
            continue
        args, _, attributes = m.group("rest").partition(")")
        op_name = _OP_NAME_RE.search(line)
        comps[current].append(
            Instruction(
                name=m.group("name"),
                shape=m.group("shape"),
                op=m.group("op"),
                operands=re.findall(r"%([\w.\-]+)", args),
                attributes=attributes,
                op_name=op_name.group(1) if op_name else "",
                args=args,
            )
        )
    if not entry:
        raise ValueError("no ENTRY computation in the HLO text")
    return comps, entry


def computations(hlo_text: str) -> dict[str, list[str]]:
    """Computation name -> its instruction lines."""
    found: dict[str, list[str]] = {}
    current = None
    for line in hlo_text.splitlines():
        header = _COMPUTATION_RE.match(line)
        if header and not line.startswith(" "):
            current = header.group(1)
            found[current] = []
        elif current is not None and line.startswith("  "):
            found[current].append(line)
    return found


def branches(line: str) -> list[str]:
    """The branch computations of a `conditional` instruction, in branch-index order (of a
    predicated one, false first, as JAX orders a cond's branches)."""
    m = _BRANCHES_RE.search(line)
    if m:
        return re.findall(r"%?([\w.\-]+)", m.group(1))
    return [m.group(1) for k in ("false", "true") if (m := _PREDICATED_RE[k].search(line))]


def called(line: str) -> list[str]:
    """Every computation an instruction calls (fusions, loops, branches, reductions)."""
    return _CALLED_RE.findall(line) + branches(line)


def reachable(comps: dict[str, list[str]], name: str) -> set[str]:
    """`name` and every computation it calls, transitively."""
    seen, todo = set(), [name]
    while todo:
        current = todo.pop()
        if current in seen or current not in comps:
            continue
        seen.add(current)
        for line in comps[current]:
            todo.extend(called(line))
    return seen


def ops(lines: list[str], opcode: str) -> list[str]:
    """Instruction lines with this opcode (e.g. `copy`, `dot`, `conditional`)."""
    pattern = re.compile(rf"\s{re.escape(opcode)}\(")
    return [line for line in lines if pattern.search(line.split(", metadata=")[0])]


def result_shape(line: str) -> str:
    """`f32[2,64]` of an instruction line (the first array of a tuple result)."""
    m = _SHAPE_RE.search(line)
    return m.group(1) if m else ""


def tick_loop_body(hlo_text: str) -> str:
    """Name of the body computation of the executor's tick loop."""
    comps = computations(hlo_text)
    loops = [
        line
        for lines in comps.values()
        for line in ops(lines, "while")
        if _TICK_LOOP_RE.search(line)
    ]
    if len(loops) != 1:
        raise ValueError(f"expected one tick loop in the module, found {len(loops)}")
    return re.search(r"\bbody=%?([\w.\-]+)", loops[0]).group(1)


def count_ops(comps: dict[str, list[str]], name: str, opcode: str) -> int:
    """How many `opcode` instructions `name` and everything it calls hold (a loop body's
    instructions count once, however many times the loop runs)."""
    return sum(len(ops(comps[c], opcode)) for c in reachable(comps, name))


_DEFINES_RE = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = ")
_SLOT_LOOP_RE = re.compile(r'op_name="[^"]*/(\w+)/while"')


def slot_loops(lines: list[str]) -> dict[str, str]:
    """The 0-or-1-trip slot loops (`pipeline.executor.slots.run_if`) of a computation, usually
    the tick loop body: JAX name scope -> the loop's instruction line."""
    found = {}
    for line in ops(lines, "while"):
        scope = _SLOT_LOOP_RE.search(line)
        if scope:
            found[scope.group(1)] = line
    return found


def upstream(lines: list[str], line: str) -> set[str]:
    """The names of every instruction of the computation whose result `line` reads, directly
    or through others: what must finish before it can start."""
    operands = {}
    for each in lines:
        m = _DEFINES_RE.match(each)
        if m:
            args = each[m.end() :].split(", metadata=")[0]
            operands[m.group(1)] = re.findall(r"%([\w.\-]+)", args)
    seen: set[str] = set()
    todo = list(operands.get(_DEFINES_RE.match(line).group(1), []))
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(operands.get(name, []))
    return seen


def defined(line: str) -> str:
    """The name an instruction line defines."""
    return _DEFINES_RE.match(line).group(1)


_SEND_SCOPE_RE = re.compile(r"/send_\w+/")
_BLOCKING_CALL_RE = re.compile(r'custom_call_target="(lapack_\w+)"')


def pipe_collectives_in_stage_branches(hlo_text: str, mesh) -> list[Collective]:
    """Collectives inside the tick loop's slots and branches whose groups span `pipe` (for a
    collective-permute, the devices of all its pairs together: `Collective.op_axes`), other
    than the sends (collective-permutes under a `send_*` scope, whose branch index depends on
    the tick only). The slots run where a stage's table row says: a collective over `pipe`
    there waits for stages that never reach it, and the step hangs. Empty when safe."""
    comps = computations(hlo_text)
    body = tick_loop_body(hlo_text)
    nested = reachable(comps, body) - {body}
    return [
        c
        for c in collectives(hlo_text, mesh)
        if c.computation in nested
        and "pipe" in c.op_axes
        and not (c.kind == "collective-permute" and _SEND_SCOPE_RE.search(c.op_name))
    ]


_CONTROL_RE = re.compile(r"\s(?:while|conditional|call)\(")


def _meets_devices(line: str, mesh) -> bool:
    """Whether a collective instruction line waits for another device (a group of two or
    more devices, or a permute with a pair between two)."""
    groups = replica_groups(line)
    if "collective-permute" in line.split(", metadata=")[0]:
        return any(a != b for pair in groups for a, b in [pair])
    return bool(_group_axes(groups, mesh))


def unordered_collectives(hlo_text: str, mesh, within: str | None = None) -> list[tuple[str, str]]:
    """Pairs of instructions of one computation (`within`: that one only) that each wait for
    other devices (a collective, or a loop, conditional or call that holds one), that no data
    orders, and of which the first in the program's order is a loop, conditional or call:
    (op name, op name). XLA:CPU starts the collectives of a computation in the program's
    order (one waits for the one before it to start, not to end) and a loop or conditional
    may still run its collectives on another thread when the next one starts, while a plain
    collective returns when it is done: so after a nested collective one device may enter the
    next collective while another still waits in the nested one for it, and the step hangs
    (`jaxmeg.ordering`). A GPU runs the one order its scheduler chose on every device."""
    comps = computations(hlo_text)
    waits: dict[str, bool] = {}

    def holds(name: str) -> bool:
        if name not in waits:
            waits[name] = False  # a cycle (none in HLO) counts as nothing
            waits[name] = any(_waiting(line) for line in comps.get(name, []))
        return waits[name]

    def _waiting(line: str) -> bool:
        head = line.split(", metadata=")[0]
        if _KIND_RE.match(line):
            return _meets_devices(line, mesh)
        return bool(_CONTROL_RE.search(head)) and any(holds(c) for c in called(line))

    found = []
    for name, lines in comps.items():
        if within is not None and name != within:
            continue
        waiting = [line for line in lines if _waiting(line)]
        control = [bool(_CONTROL_RE.search(w.split(", metadata=")[0])) for w in waiting]
        if len(waiting) < 2 or not any(control[:-1]):
            continue
        before = {defined(w): upstream(lines, w) for w in waiting}
        for i, a in enumerate(waiting):
            if not control[i]:
                continue
            for b in waiting[i + 1 :]:
                if defined(a) not in before[defined(b)]:
                    found.append((_op_name(a), _op_name(b)))
    return found


def _op_name(line: str) -> str:
    m = re.search(r'op_name="([^"]*)"', line)
    return m.group(1) if m else defined(line)


def deadlock_hazards(hlo_text: str, mesh) -> list[str]:
    """What could hang a step, one line each (empty when safe):
    - a collective over `pipe` in a stage-dependent slot or branch of the tick loop
      (`pipe_collectives_in_stage_branches`; a table of one tick runs no loop, XLA removes it);
    - a CPU LAPACK call (`jnp.linalg` on CPU) anywhere in the step: it spreads a batch over
      the thread pool and waits for it, while other devices hold those threads waiting in a
      collective (PowerSGD's QR hung a 2 x 2 x 2 step this way);
    - on CPU devices, two collectives of one computation that no data orders, the first
      inside a loop, conditional or call (`unordered_collectives` of every computation: the
      tick's slots, which the executor orders, `slots.ordered_tick`, and inside them each
      layer's forward and backward). A GPU runs the one order its scheduler chose.
    Costs a few hundred milliseconds of HLO text reading on a pipeline step."""
    comps = computations(hlo_text)
    found = []
    found_loop = any(_TICK_LOOP_RE.search(line) for lines in comps.values() for line in lines)
    if found_loop:
        found = [
            f"{c.kind} over {sorted(c.axes)} in a stage branch: {c.op_name}"
            for c in pipe_collectives_in_stage_branches(hlo_text, mesh)
        ]
    for lines in comps.values():
        for line in lines:
            call = _BLOCKING_CALL_RE.search(line)
            if call:
                op_name = re.search(r'op_name="([^"]*)"', line)
                where = op_name.group(1) if op_name else ""
                found.append(f"{call.group(1)} in the step: {where}")
    if found_loop and mesh.devices.flat[0].platform == "cpu":
        found += [
            f"collectives that no data orders, the first nested (a device may enter the "
            f"second while another waits in the first): {a} | {b}"
            for a, b in unordered_collectives(hlo_text, mesh)
        ]
    return found
