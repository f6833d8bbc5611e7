"""The one table of slot kinds (`tick_columns.SLOT_KINDS`): every loop and switch the executor's
tick runs is named by a row of it and weighted by the cost report (a branch column for it), so
a kind missing from the table, or a column the executor does not name, fails here rather than
mis-weighting the report. Traced only (jaxpr), nothing compiles."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from jaxmeg import config as C
from jaxmeg.parallel.hlo_cost import StepCost
from jaxmeg.pipeline.executor import slots
from jaxmeg.pipeline.executor.columns import SLOT_KINDS
from jaxmeg.training.pipeline_step import make_loss_and_grads
from jaxmeg.training.state import abstract_state
from tests.helpers import trainable_for

MODEL = C.ModelConfig(
    vocab_size=256, hidden=32, layers=4, heads=4, seq_len=8, compute_dtype="float32"
)
LAYOUTS = {
    "pipe1": ({"data": 2}, {}),
    "1f1b_data": ({"data": 2, "pipe": 2}, {}),
    "interleaved_tensor": ({"pipe": 2, "tensor": 2, "schedule": "interleaved_1f1b",
                            "chunks": 2}, {}),
    "zero3": ({"data": 2, "pipe": 2, "zero_stage": 3}, {}),
    "zero1": ({"data": 2, "pipe": 2, "zero_stage": 1}, {}),
    "zbv": ({"pipe": 2, "schedule": "zbv", "chunks": 2}, {}),
    "zb_h1_powersgd": ({"data": 2, "pipe": 2, "schedule": "zb_h1"}, {"data_grad_rank": 2}),
    "pipe_rank": ({"data": 2, "pipe": 2}, {"pipe_grad_rank": 2}),
    "overlap_sends": ({"data": 2, "pipe": 2, "schedule": "zbv", "chunks": 2,
                       "overlap_sends": True}, {}),
    "overlap_sends_1f1b": ({"data": 2, "pipe": 2, "overlap_sends": True}, {}),
    "overlap_sends_pipe1": ({"data": 2, "overlap_sends": True}, {}),
    "overlap_sends_zb_h1": ({"data": 2, "pipe": 2, "schedule": "zb_h1", "overlap_sends": True},
                            {}),
    "overlap_sends_zero1": ({"data": 2, "pipe": 2, "zero_stage": 1, "overlap_sends": True}, {}),
    "dualpipev": ({"data": 2, "pipe": 2, "schedule": "dualpipev", "chunks": 2,
                   "overlap_sends": True}, {}),
}  # fmt: skip
REDUCING_LAST_B = {
    "overlap_sends_1f1b": {"b_last_reducing", "b_first_reducing"},
    "overlap_sends_pipe1": {"b_whole_reducing"},
    "overlap_sends_zb_h1": {"w_chunk_reducing"},
    "overlap_sends_zero1": {"b_last_reducing", "b_first_reducing"},
}
"""Where a chunk's last B (last W with a split backward) reduces its layers (chunks of 2
layers, 4 on one stage): that kind's loop is in the tick, and no other layout's."""


def _tick_scopes(jaxpr, inside_tick=False, found=None):
    """The innermost name scope of every loop and switch in the tick loop's body (the first loop
    of the executor's map, a scan over the ticks), and in the switches' branches (a split
    send's nested map); not inside the slots' own loops (the model's)."""
    found = set() if found is None else found
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if inside_tick and name in ("while", "cond"):
            found.add(str(eqn.source_info.name_stack).split("/")[-1])
            if name == "while":
                continue
        values = [*eqn.params.values()]
        values += [b for v in eqn.params.values() if isinstance(v, (tuple, list)) for b in v]
        for value in values:
            inner = getattr(value, "jaxpr", value)  # a closed jaxpr's, or the jaxpr
            if hasattr(inner, "eqns"):
                _tick_scopes(inner, inside_tick or name in ("while", "scan"), found)
    return found


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_slot_kind_is_a_row_and_weighted(layout):
    parallel, compression = LAYOUTS[layout]
    microbatches = 4
    cfg = C.Config(
        model=MODEL,
        parallel=C.ParallelConfig(**parallel),
        train=C.TrainConfig(global_batch=microbatches * parallel.get("data", 1),
                            microbatches=microbatches),
        compression=dataclasses.replace(C.CompressionConfig(), **compression),
    )  # fmt: skip
    trainable = trainable_for(cfg)
    loss_and_grads = make_loss_and_grads(trainable)
    state = abstract_state(trainable)
    batch = jax.ShapeDtypeStruct((cfg.train.global_batch, MODEL.seq_len), np.int32)
    links = (state["links"],) if "links" in state else ()

    def run(step, *args):
        return loss_and_grads(*args, step=step) if links else loss_and_grads(*args)

    with jax.set_mesh(trainable.mesh):
        jaxpr = jax.make_jaxpr(run)(state["step"], state["params"], batch, batch, *links)
    # a CPU tick's sends run in one-trip loops of their own (`slots.ordered_tick`), which the
    # cost report counts once
    scopes = _tick_scopes(jaxpr.jaxpr) - {slots.ORDERED_SCOPE}
    assert scopes, "no loop found in the tick"
    assert scopes <= set(SLOT_KINDS), scopes - set(SLOT_KINDS)
    columns = set(loss_and_grads.program.branch_columns)
    assert scopes <= columns, scopes - columns
    reducing = {scope for scope in scopes if scope.endswith("_reducing")}
    assert reducing == REDUCING_LAST_B.get(layout, set()), reducing
    pairs = {scope for scope in scopes if "_with_" in scope}
    assert bool(pairs) == (parallel.get("schedule") == "dualpipev"), pairs


def test_the_carry_refuses_a_field_it_does_not_have():
    """The tick loop's state is a typed structure: a misspelt field in a slot's write or in
    the fields a slot declares is an error, not state silently dropped."""
    from jaxmeg.pipeline.executor.carry import Carry

    carry = Carry(inputs=np.zeros(2), loss=np.zeros(()))
    with pytest.raises(TypeError, match="inptus"):
        carry.replace(inptus=np.ones(2))
    with pytest.raises(AttributeError, match="inptus"):
        carry.only(("inptus",))
    part = carry.only(("inputs",)).replace(inputs=np.ones(2))
    merged = carry.merge(part)
    assert merged.inputs.sum() == 2 and merged.loss is carry.loss and merged.y is None


def test_a_branch_column_no_kind_names_is_refused():
    mesh = jax.make_mesh((1,), ("pipe",))
    with pytest.raises(ValueError, match="no slot kind names"):
        StepCost("", mesh, {"f_frist": np.zeros((2, 1), np.int32)})
