"""`parallel.stage_layers: measured`: stage costs timed on the devices themselves.

For each node group, the devices of the first pipeline stage placed on it run the run's own
loss-and-gradient step (same data and tensor sizes, microbatch size and count) as a one-stage
model of one layer and of two layers. The difference is one layer's cost per step, m forwards
and backwards plus the data-parallel reduction of its gradients over the group's links; the
one-layer time less that is the embedding, head and loss, charged to the last stage. Each time
is the best of a few runs after a warm-up.

Only the processes that own a probed stage run its probe; the results travel through the
coordinator's key-value store. The result is written to RUN_DIR/stage_probe.json and, when the
run resumes with the same model, batch and cluster, read back instead of probing again, so a
resumed run keeps its partition.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import jax
import numpy as np

from jaxmeg.config import CompressionConfig, Config, to_dict, validate
from jaxmeg.parallel import make_mesh
from jaxmeg.parallel.placement import Placement, megatron_grid
from jaxmeg.perf.partition import StageCost
from jaxmeg.training.run_log import say

PROBE_FILE = "stage_probe.json"
REPEATS = 3
KV_TIMEOUT_MS = 600_000


def _probe_config(cfg: Config, layers: int) -> Config:
    par = dataclasses.replace(cfg.parallel, pipe=1, chunks=1, stage_layers=(),
                              schedule="1f1b")  # fmt: skip
    model = dataclasses.replace(cfg.model, layers=layers)
    return dataclasses.replace(cfg, model=model, parallel=par, compression=CompressionConfig())


def _time_step(cfg: Config, devices) -> float:
    """Best wall time of the run's loss-and-gradients on `devices` as one stage."""
    from jaxmeg.training.pipeline_step import make_loss_and_grads
    from jaxmeg.training.state import Trainable, init_state

    trainable = Trainable.create(cfg, make_mesh(cfg.parallel, devices))
    with jax.set_mesh(trainable.mesh):
        params = init_state(trainable, cfg.train.seed)["params"]
        shape = (cfg.train.global_batch, cfg.model.seq_len)
        tokens = jax.make_array_from_callback(
            shape, trainable.batch_sharding(),
            lambda index: np.zeros(shape, np.int32)[index],
        )  # fmt: skip
        run = jax.jit(make_loss_and_grads(trainable))
        jax.block_until_ready(run(params, tokens, tokens))
        best = float("inf")
        for _ in range(REPEATS):
            start = time.perf_counter()
            jax.block_until_ready(run(params, tokens, tokens))
            best = min(best, time.perf_counter() - start)
    return best


def measure_group(cfg: Config, devices) -> dict[str, float]:
    """{per_layer_s, fixed_s} of one stage's devices (a data x tensor block)."""
    n = len(devices)
    one = validate(_probe_config(cfg, 1), n)
    two = validate(_probe_config(cfg, 2), n)
    t1, t2 = _time_step(one, devices), _time_step(two, devices)
    per_layer = max(t2 - t1, 1e-9)
    return {"per_layer_s": per_layer, "fixed_s": max(t1 - per_layer, 0.0)}


def _stage_groups(cfg: Config, placement: Placement | None):
    """(group of each stage, device-id grid [data, pipe, tensor])."""
    if placement is not None:
        return placement.stage_groups(), placement.grid
    par = cfg.parallel
    ids = [d.id for d in sorted(jax.devices(), key=lambda d: (d.process_index, d.id))]
    grid = megatron_grid(ids, par.data, par.pipe, par.tensor, par.outer_axis)
    return ["all"] * par.pipe, grid


def _key(cfg: Config, groups: list[str]) -> dict:
    """What a saved probe was measured for; a resumed run reuses it only if this matches."""
    raw = to_dict(cfg)
    model = {k: v for k, v in raw["model"].items() if k != "layers"}
    par = {k: raw["parallel"][k] for k in ("data", "tensor", "sequence_parallel", "zero_stage")}
    train = {k: raw["train"][k] for k in ("microbatches", "microbatch_size")}
    return {"model": model, "parallel": par, "train": train, "stage_groups": groups}


def _measure_all(cfg: Config, groups: list[str], grid) -> dict[str, dict[str, float]]:
    by_id = {d.id: d for d in jax.devices()}
    first_stage = {g: groups.index(g) for g in dict.fromkeys(groups)}
    results = {}
    for group, stage in first_stage.items():
        devices = [by_id[int(i)] for i in grid[:, stage, :].ravel()]
        owners = sorted({d.process_index for d in devices})
        if jax.process_index() in owners:
            say(f"probing node group {group}: stage {stage}'s {len(devices)} devices")
            results[group] = measure_group(cfg, devices)
        if jax.process_count() > 1:
            results[group] = _share(f"jaxmeg/stage_probe/{group}", results.get(group), owners[0])
    return results


def _share(key: str, value, owner: int):
    from jax._src.distributed import global_state  # the coordinator's key-value store

    client = global_state.client
    if jax.process_index() == owner:
        client.key_value_set(key, json.dumps(value))
    return json.loads(client.blocking_key_value_get(key, KV_TIMEOUT_MS))


def probe_costs(
    cfg: Config, placement: Placement | None, out_dir: str | None
) -> tuple[list[StageCost], str]:
    """Per-stage costs from a probe (or the run's saved one) and where they came from."""
    groups, grid = _stage_groups(cfg, placement)
    key = _key(cfg, groups)
    path = Path(out_dir) / PROBE_FILE if out_dir else None
    saved = json.loads(path.read_text()) if path and path.is_file() else None
    if saved and saved.get("key") == key:
        measured, source = saved["groups"], f"saved probe {path}"
    else:
        if saved:
            say(f"{path} was measured for another model, batch or cluster; probing again")
        start = time.perf_counter()
        measured = _measure_all(cfg, groups, grid)
        source = f"probe ({time.perf_counter() - start:.1f} s)"
        if path and jax.process_index() == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"key": key, "groups": measured}, indent=1))
            tmp.replace(path)
    last = len(groups) - 1
    costs = [
        StageCost(measured[g]["per_layer_s"], measured[g]["fixed_s"] if s == last else 0.0)
        for s, g in enumerate(groups)
    ]
    return costs, source
