"""What splitting the backward into I and W costs beyond the FLOPs (zero-bubble schedules,
`jaxmeg.models.split_backward`): the bytes a microbatch keeps between I and W, and the memory
traffic of keeping them, which the H100 program shows (docs/benchmarks.md): I writes each
matmul's output cotangent dY into the slot it holds until W (an in-place update reads what it
writes: twice the bytes), and W copies X and dY out of their slots before its GEMMs read them
(a cuBLAS operand read from a ring slot is copied: twice the bytes again). gpt_1.3b on 4
H100s, 6 layers a stage: 1.08 ms of I's updates and 1.92 ms of W's copies per microbatch, what
`ring_seconds` gives. 1F1B's backward reads its kept matmul inputs out of their slots too, but
GEMMs of its own stage consume dY where it is made."""

from __future__ import annotations

from jaxmeg.perf.context import local_seq_len
from jaxmeg.perf.hardware import Hardware
from jaxmeg.perf.layout import Layout
from jaxmeg.perf.shape import Shape


def split_store_bytes_per_layer(shape: Shape, layout: Layout) -> float:
    """What a split backward keeps per layer between I and W (`jaxmeg.models.split_backward`):
    each weight matmul's input X and output cotangent dY, 16-bit. The column-parallel matmuls'
    inputs and the row-parallel ones' output cotangents are whole over the tensor group, split
    on the sequence with sequence parallelism: s b (4 h + (4 h + 2 f) / t), with it s b (8 h +
    2 f) / t, f the MLP width (16 s b h / t)."""
    s, b, h, t = local_seq_len(shape, layout), layout.microbatch, shape.hidden, layout.tensor
    f = shape.mlp_ratio * h
    residual = h / t if layout.sequence_parallel else h  # a residual-stream-shaped tensor
    return 2 * s * b * (4 * residual + (4 * h + 2 * f) / t)


def matmul_input_bytes_per_layer(shape: Shape, layout: Layout) -> float:
    """The matmul inputs X a split backward's forward keeps for W (with stored residuals, in
    the ring slot the forward wrote, until W), 16-bit: s b (2 h + (h + f) / t), the first term
    / t with sequence parallelism."""
    s, b, h, t = local_seq_len(shape, layout), layout.microbatch, shape.hidden, layout.tensor
    f = shape.mlp_ratio * h
    residual = h / t if layout.sequence_parallel else h
    return 2 * s * b * (2 * residual + (h + f) / t)


def ring_seconds(shape: Shape, layout: Layout, hw: Hardware) -> tuple[float, float]:
    """(I's, W's) seconds per layer and microbatch of the slots a split backward keeps X and dY
    in, at the device's memory bandwidth: I writes dY (with `full` recompute X too, which no
    forward kept), W copies both out."""
    kept = split_store_bytes_per_layer(shape, layout)
    written = (
        kept if layout.recompute == "full" else kept - matmul_input_bytes_per_layer(shape, layout)
    )
    bandwidth = hw.hbm_tb_per_s * 1e12
    return 2 * written / bandwidth, 2 * kept / bandwidth
