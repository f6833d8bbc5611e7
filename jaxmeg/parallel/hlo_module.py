"""Reads the structure of a compiled XLA module (`compiled.as_text()`): its computations, which
computations an instruction calls, the pipeline's tick-loop body, and instructions by opcode.
For tests and reports that check what a step executes where (copies in the loop, matmuls in a
branch); collectives and their mesh axes are read by `hlo.collectives`.
"""

from __future__ import annotations

import re

from jaxmeg.parallel.hlo import _COMPUTATION_RE

_CALLED_RE = re.compile(
    r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)"
)
_BRANCHES_RE = re.compile(r"branch_computations=\{([^}]*)\}")
_SHAPE_RE = re.compile(r"=\s*(\w+\[[\d,]*\])")
TICK_LOOP_OP_NAME = 'op_name="jit(step)/shard_map/while"'
"""The executor's `lax.fori_loop` over ticks, directly inside the step's shard_map."""


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
    """The branch computations of a `conditional` instruction, in branch-index order."""
    m = _BRANCHES_RE.search(line)
    return re.findall(r"%?([\w.\-]+)", m.group(1)) if m else []


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
        if TICK_LOOP_OP_NAME in line
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
    """The 0-or-1-trip slot loops (`pipeline.slots.run_if`) of a computation, usually the tick
    loop body: JAX name scope -> the loop's instruction line."""
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
