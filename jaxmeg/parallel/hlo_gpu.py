"""What XLA's GPU compiler puts in a step that its CPU compiler does not, read from the HLO text:
library GEMMs, cuDNN attention, kernels as memory passes, and asynchronous collectives with what
the latency-hiding scheduler placed between their start and done.

  GEMMs        `__cublas$lt$matmul` / `__cublas$gemm` / `__cublas$lt$matmul$f8` (FP8)
               custom-calls: 2 x result elements x the
               contracted size (from `dot_dimension_numbers`); Triton GEMM fusions hold a `dot`
               that the fusion's walk counts.
  grouped      the experts' grouped GEMM kernels (`moe.grouped_gemm: pallas`, Triton
               custom-calls named `grouped_gemm` / `grouped_gemm_weights`): 2 x every row of
               their buffer x in x out, an upper bound (the rows past the groups compute
               nothing at run time).
  attention    `__cudnn$fmha*` custom-calls, forward and backward. `flops` as Megatron-LM counts
               attention (QK^T and AV over the whole s x s, 4 B N Sq Sk H forward, twice that
               backward), so GEMM + attention FLOPs compare with the model's; `executed` what
               the flash kernels run: half the tiles under a causal mask, and a backward of five
               such products (it recomputes QK^T).
  kernel bytes a kernel's operands and results, as it reads and writes them: a fusion's, not the
               instructions inside it; a slice of an operand counts as the slice, the buffer an
               in-place dynamic-update-slice writes into as the update.
  overlap      for each `*-start` (and each `recv` of a collective-permute split into send and
               recv), the kernels between it and its `*-done` in the schedule, and whether one
               of them (or a loop or branch among them) runs a GEMM.
"""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np

from jaxmeg.parallel.hlo import _BYTES

ARRAY_RE = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([\d,]*)\]")
_TARGET_RE = re.compile(r'custom_call_target="([^"]+)"')
FP8_GEMM = "__cublas$lt$matmul$f8"
"""cuBLASLt's FP8 GEMM (`model.fp8`), at the GPU's FP8 peak in the roofline."""
GEMM_TARGETS = ("__cublas$lt$matmul", "__cublas$gemm", FP8_GEMM)
ATTENTION_PREFIX = "__cudnn$fmha"
NOT_KERNELS = frozenset(
    "parameter constant get-tuple-element tuple bitcast while conditional call opt-barrier "
    "partition-id replica-id after-all add-dependency copy-done send-done recv-done "
    "all-reduce-done all-gather-done collective-permute-done async-done async-update "
    "reduce-scatter-done all-to-all-done ragged-all-to-all-done send recv".split()
)
DECOMPOSED_PERMUTE = "_xla_send_recv_source_target_pairs="
"""The frontend attribute of the send and recv that XLA's GPU compiler makes of a collective-permute
(`xla_gpu_collective_permute_decomposer_threshold`): a receive posted early, its wait at
recv-done, on a stream of their own."""
SLICING = frozenset({"dynamic-slice", "slice", "gather"})
IN_PLACE = {"dynamic-update-slice": 1, "scatter": 2}
"""Ops that write their operand 0's buffer in place, by the position of what they write: the
update, a (one-operand) scatter's updates."""
KERNEL_CLASSES = ("gemm", "attention", "elementwise", "copy", "loss", "optimizer")
"""What `kernel_class` sorts a kernel into, in the cost report's order."""
_SCOPES = {
    name: re.compile(rf"(?:^|/)(?:[\w\-]+\()*{name}\)*(?:/|$)") for name in ("loss", "optimizer")
}
COPY_ROOTS = frozenset({"copy", "transpose"})


def arrays(shape_text: str) -> list[tuple[str, list[int]]]:
    """(dtype, dims) of each array in a shape (tuple elements in order)."""
    return [(t, [int(d) for d in dims.split(",") if d]) for t, dims in ARRAY_RE.findall(shape_text)]


def nbytes(shape_text: str) -> int:
    return sum(int(np.prod(dims)) * _BYTES[t] for t, dims in arrays(shape_text))


def first_array_bytes(shape_text: str) -> int:
    found = arrays(shape_text)
    return int(np.prod(found[0][1])) * _BYTES[found[0][0]] if found else 0


def after_operand_tuple(shape_text: str) -> str:
    """Of an async start's result `((operands...), results...)`, the results' text (what
    moves); the whole text when it does not start with a tuple of operands."""
    if not shape_text.startswith("(("):
        return shape_text
    depth = 0
    for i, char in enumerate(shape_text[1:], start=1):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0:
            return shape_text[i + 1 :]
    return shape_text


def call_target(attributes: str) -> str:
    m = _TARGET_RE.search(attributes)
    return m.group(1) if m else ""


def _backend_config(attributes: str) -> dict:
    start = attributes.find("backend_config=")
    if start < 0:
        return {}
    text = attributes[start + len("backend_config=") :]
    try:
        return json.JSONDecoder().raw_decode(text)[0]
    except json.JSONDecodeError:
        return {}


TRITON = "__gpu$xla.gpu.triton"
GROUPED_KERNELS = ("grouped_gemm", "grouped_gemm_weights")
"""`jaxmeg.models.grouped_kernels`' names (`MATMUL`, `WEIGHTS`), in a Triton call's config."""
_KERNEL_NAME_RE = re.compile(r'\bname = "([^"]+)"')


def grouped_kernel_flops(target: str, operand_shapes: list[str], result_shape: str,
                         attributes: str) -> float:  # fmt: skip
    """FLOPs of a grouped GEMM kernel call (0 for any other call): 2 x the rows of its first
    matrix operand (rows, or dY for the rows' cotangent) x that operand's columns x the result's
    last dim ([N, out]; [E, in, out] for the weights' gradient, whose in is that operand's)."""
    if target != TRITON:
        return 0.0
    name = _KERNEL_NAME_RE.search(attributes)
    if not name or name.group(1) not in GROUPED_KERNELS:
        return 0.0
    matrices = [dims for shape in operand_shapes for _, dims in arrays(shape) if len(dims) == 2]
    result = arrays(result_shape)
    if not matrices or not result:
        return 0.0
    rows, inner = matrices[0]
    return 2.0 * rows * inner * result[0][1][-1]


def gemm_flops(result_shape: str, lhs_shape: str, attributes: str) -> float:
    """FLOPs of a cuBLAS GEMM custom-call: 2 x result elements x contracted size."""
    config = _backend_config(attributes).get("gemm_backend_config", {})
    contracting = config.get("dot_dimension_numbers", {}).get("lhs_contracting_dimensions", [])
    lhs = arrays(lhs_shape)
    result = arrays(result_shape)
    if not lhs or not result:
        return 0.0
    k = np.prod([lhs[0][1][int(i)] for i in contracting]) if contracting else 1
    return 2.0 * float(np.prod(result[0][1])) * float(k)


def gemm_adds_into(result_shape: str, attributes: str) -> str | None:
    """The output dtype of a cuBLAS GEMM that adds its product into its output (beta != 0), or
    None: what XLA makes of `c + dot(...)` where it can alias the output to the addend. "f32": a
    weight gradient's GEMM accumulating into its fp32 accumulator (`jaxmeg.pipeline.accumulator`);
    "bf16": an input gradient added to another's (`jaxmeg.models.parts.fan_out`) or to the
    residual stream's."""
    config = _backend_config(attributes).get("gemm_backend_config", {})
    result = arrays(result_shape)
    adds = bool(result) and float(config.get("beta", 0) or 0) != 0
    return result[0][0] if adds else None


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    backward: bool
    flops: float
    """As Megatron-LM counts attention: 4 B N Sq Sk H forward, 8 B N Sq Sk H backward."""
    executed: float
    """What the flash kernel runs: a causal mask skips half the tiles; the backward is five
    B N Sq Sk H products (QK^T again, dV, dP, dQ, dK)."""


def attention_call(target: str, operand_shapes: list[str], attributes: str) -> AttentionCall:
    """A cuDNN attention custom-call's counts, from its scores shape [B, N, Sq, Sk] and the
    head dim (the contracted dim of QK^T on the query)."""
    config = _backend_config(attributes).get("cudnn_fmha_backend_config", {})
    scores = [int(d) for d in config.get("intermediate_tensor_shape", {}).get("dimensions", [])]
    dims = config.get("bmm1_dot_dimension_numbers", {}).get("lhs_contracting_dimensions", [])
    query = arrays(operand_shapes[0]) if operand_shapes else []
    if not scores or not query:
        return AttentionCall("Backward" in target, 0.0, 0.0)
    head = np.prod([query[0][1][int(i)] for i in dims]) if dims else query[0][1][-1]
    product = 2.0 * float(np.prod(scores)) * float(head)  # one B N Sq Sk H matmul
    causal = 0.5 if config.get("mask_type", "NO_MASK") in ("CAUSAL", "PADDING_CAUSAL") else 1.0
    if "Backward" in target:
        return AttentionCall(True, 4 * product, 5 * product * causal)
    return AttentionCall(False, 2 * product, 2 * product * causal)


def kernel_class(target: str, root: str, runs_dot: bool, op_name: str) -> str:
    """A kernel's class: `gemm` (a cuBLAS call, or a fusion around a dot), `attention` (cuDNN),
    `copy` (it only copies or transposes: a copy, or a fusion whose root is one), `loss` and
    `optimizer` (the rest of what runs under the loss's or the optimizer update's name scope),
    else `elementwise` (fusions of elementwise ops, normalisations, reductions, slices and
    in-place writes). `target`: a custom-call's; `root`: the op, or a fusion's root op."""
    if target in GEMM_TARGETS or runs_dot:
        return "gemm"
    if target.startswith(ATTENTION_PREFIX):
        return "attention"
    if root in COPY_ROOTS:
        return "copy"
    for name, pattern in _SCOPES.items():
        if pattern.search(op_name):
            return name
    return "elementwise"


def kernel(ins, operands: list[str], fused: list, fused_flops: float) -> tuple[str, float, float]:
    """(class, bytes read and written, FLOPs at the device's peak) of the kernel an instruction
    (`hlo_module.Instruction`) launches: `operands` its operands' shapes, `fused` a fusion's
    instructions (root last) and `fused_flops` the dots among them."""
    flops, target, root = 0.0, "", ins.op
    if ins.op == "fusion":
        moved = fusion_bytes(operands, ins.shape, fused)
        flops, root = fused_flops, fused[-1].op if fused else ""
    elif ins.op == "custom-call":
        target = call_target(ins.attributes)
        moved = sum(nbytes(o) for o in operands) + first_array_bytes(ins.shape)
        if target in GEMM_TARGETS:
            flops = gemm_flops(ins.shape, operands[0] if operands else "", ins.attributes)
        elif target.startswith(ATTENTION_PREFIX):
            flops = attention_call(target, operands, ins.attributes).executed
        else:
            flops = grouped_kernel_flops(target, operands, ins.shape, ins.attributes)
    elif ins.op == "dynamic-update-slice":
        moved = 2 * first_array_bytes(operands[1] if len(operands) > 1 else "")
    else:
        moved = sum(nbytes(o) for o in operands) + nbytes(ins.shape)
    runs_dot = flops > 0 and (ins.op == "fusion" or target == TRITON)
    kind = kernel_class(target, root, runs_dot, ins.op_name)
    return kind, moved, flops


def is_kernel(op: str) -> bool:
    return op not in NOT_KERNELS and not op.endswith("-done")


def fusion_bytes(operand_shapes: list[str], result_shape: str, fused: list) -> float:
    """Bytes a fusion kernel reads and writes. `fused`: the fused computation's instructions
    (`hlo_module.Instruction`s), its root last."""
    params: dict[int, str] = {}
    users: dict[str, list] = {}
    by_name = {ins.name: ins for ins in fused}
    for ins in fused:
        if ins.op == "parameter" and ins.args.strip().isdigit():
            params[int(ins.args)] = ins.name
        for i, operand in enumerate(ins.operands):
            users.setdefault(operand, []).append((ins, i))
    read = 0.0
    for i, shape in enumerate(operand_shapes):
        uses = users.get(params.get(i, ""), [])
        sliced = [u for u, pos in uses if u.op in SLICING and pos == 0]
        in_place = [u for u, pos in uses if u.op in IN_PLACE and pos == 0]
        if uses and len(sliced) + len(in_place) == len(uses):
            # slices read as slices; the buffer a dynamic-update-slice or a scatter writes in
            # place is not read (a scatter-add reads the rows it adds to: its updates' bytes)
            read += sum(nbytes(u.shape) for u in sliced)
            read += sum(nbytes(_written(u, by_name)) for u in in_place if u.op == "scatter")
        else:
            read += nbytes(shape)
    root = fused[-1] if fused else None
    outputs = [by_name.get(o) for o in root.operands] if root and root.op == "tuple" else [root]
    written = 0.0
    for out in outputs:
        if out is not None:
            written += nbytes(_written(out, by_name))
    if root is None:
        written = nbytes(result_shape)
    return read + written


def _written(ins, by_name: dict) -> str:
    """The shape of what `ins` writes: an in-place op's update (a dynamic-update-slice's; a
    one-operand scatter's updates where it scatters into a fused computation's parameter, a
    buffer it then writes in place), else its result."""
    at = IN_PLACE.get(ins.op)
    if at is None or len(ins.operands) <= at:
        return ins.shape
    if ins.op == "scatter":
        target = by_name.get(ins.operands[0])
        if len(ins.operands) != 3 or target is None or target.op != "parameter":
            return ins.shape
    update = by_name.get(ins.operands[at])
    return update.shape if update is not None else ""


@dataclasses.dataclass(frozen=True)
class AsyncSpan:
    """What the schedule placed between an async collective's start and its done."""

    kernels: int
    gemm: bool
