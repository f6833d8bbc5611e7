"""Every expert-parallel pipeline layout of N CPU devices, compiled and checked for what could
hang it; a sample of them run against one device.

python scripts/check_layouts.py [--devices 8] [--run-every 4] [--remat none] [--out docs/layouts.md]

The layouts: expert >= 2 and pipe >= 2 with the rest of the devices on data or tensor (sequence
parallelism on where tensor > 1), x schedules 1f1b, zb_h1 and interleaved_1f1b (2 chunks) x
dropless and capacity-factor-1 routing x top-1 and top-2, on a small Llama MoE (4 experts, the
shapes of tests/test_moe_step.py; `model.remat` from `--remat`). Each is validated (a refusal
is a row, with its message), its train step compiled as train.py compiles it
(`compilation.compile_step`, which refuses a step that could hang:
`hlo_module.deadlock_hazards`), and every `--run-every`-th layout's loss and gradients compared
with one device's (a mismatch or a hang is a row too: each run has its own process and a time
limit). Writes a markdown table.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCHEDULES = ("1f1b", "zb_h1", "interleaved_1f1b")
ROUTINGS = (("dropless", 0.0), ("capacity", 1.0))
TOP_KS = (1, 2)
TOLERANCE = 2e-5
SUITE_FLAGS = (
    "--xla_backend_optimization_level=0",
    "--xla_llvm_disable_expensive_passes=true",
    "--xla_cpu_use_fusion_emitters=false",
)
"""tests/conftest.py's XLA flags: the suite's programs (and about a quarter faster to compile)."""


def layouts(devices: int, remat: str = "none") -> list[dict]:
    """Each layout as {"data", "pipe", "expert", "tensor", "schedule", "routing", "top_k",
    "remat"}."""
    found = []
    for expert, pipe in itertools.product((2, 4, 8), (2, 4, 8)):
        rest, left = divmod(devices, expert * pipe)
        if left or rest < 1:
            continue
        meshes = [dict(data=1, tensor=1)] if rest == 1 else [
            dict(data=rest, tensor=1), dict(data=1, tensor=rest)
        ]  # fmt: skip
        for mesh, schedule, (routing, _), top_k in itertools.product(
            meshes, SCHEDULES, ROUTINGS, TOP_KS
        ):
            found.append(dict(expert=expert, pipe=pipe, **mesh, schedule=schedule,
                              routing=routing, top_k=top_k, remat=remat))  # fmt: skip
    return found


def name(layout: dict) -> str:
    axes = [a for a in ("data", "expert", "pipe", "tensor") if layout[a] > 1]
    mesh = " x ".join(f"{axis} {layout[axis]}" for axis in axes)
    remat = layout.get("remat", "none")
    words = [mesh, layout["schedule"], layout["routing"], f"top-{layout['top_k']}"]
    return ", ".join(words + ([f"remat {remat}"] if remat != "none" else []))


def config(layout: dict):
    """The layout's config (tests/test_moe_step.py's shapes: a Llama MoE of hidden 32)."""
    from jaxmeg import config as C

    chunks = 2 if layout["schedule"] == "interleaved_1f1b" else 1
    microbatches = 2 * layout["pipe"] if layout["schedule"] == "interleaved_1f1b" else 2
    if layout["schedule"] == "zb_h1":
        microbatches = layout["pipe"]
    capacity = dict(ROUTINGS)[layout["routing"]]
    model = C.ModelConfig(
        block="llama", vocab_size=500, hidden=32, layers=layout["pipe"] * chunks, heads=4,
        seq_len=8, compute_dtype="float32", tie_embeddings=False,
        remat=layout.get("remat", "none"),
    )  # fmt: skip
    moe = C.MoeConfig(experts=4, top_k=layout["top_k"], ffn_hidden=16, aux_loss=0.1,
                      z_loss=0.01, capacity_factor=capacity)  # fmt: skip
    parallel = C.ParallelConfig(
        data=layout["data"], pipe=layout["pipe"], tensor=layout["tensor"],
        expert=layout["expert"], schedule=layout["schedule"], chunks=chunks,
        sequence_parallel=layout["tensor"] > 1,
    )  # fmt: skip
    rows = 2 * layout["data"] * layout["expert"] * microbatches
    train = C.TrainConfig(global_batch=rows, microbatches=microbatches)
    return C.Config(model=model, moe=moe, parallel=parallel, train=train,
                    optimizer=C.OptimizerConfig(lr=1e-2, warmup_steps=1))  # fmt: skip


def check_one(layout: dict, run: bool) -> dict:
    """In this process (the `--one` child): validate, compile and check; with `run`, the loss
    and every gradient against one device's."""
    import jax

    from jaxmeg import config as C
    from jaxmeg.parallel import make_mesh
    from jaxmeg.training.compilation import DeadlockHazard, compile_step
    from jaxmeg.training.state import Trainable

    cfg = config(layout)
    n = cfg.parallel.data * cfg.parallel.pipe * cfg.parallel.expert * cfg.parallel.tensor
    try:
        cfg = C.validate(cfg, n)
    except C.ConfigError as err:
        return {"result": "refused", "detail": str(err)}
    trainable = Trainable.create(cfg, make_mesh(cfg.parallel, jax.devices()[:n]))
    start = time.perf_counter()
    try:
        compiled, _ = compile_step(trainable)
    except DeadlockHazard as err:
        return {"result": "hazard", "detail": str(err)}
    seconds = time.perf_counter() - start
    got = {"compile_seconds": round(seconds, 1)}
    if not run:
        return {"result": "compiled, no hazard", **got}
    difference = _against_one_device(cfg, trainable)
    result = "equal" if difference <= TOLERANCE else "DIFFERS"
    return {"result": result, "detail": f"largest relative difference {difference:.1e}", **got}


def _against_one_device(cfg, trainable) -> float:
    """The largest difference (relative to each leaf's largest value) of the loss and every
    gradient of one step against one device's."""
    import jax
    import numpy as np

    from jaxmeg import config as C
    from jaxmeg.parallel import make_mesh
    from jaxmeg.training.expert_balance import without_bound_counts
    from jaxmeg.training.pipeline_step import make_loss_and_grads
    from jaxmeg.training.reference import make_plain_loss_and_grads
    from jaxmeg.training.state import (
        Trainable,
        init_state,
        state_shardings,
        to_canonical_layout,
        to_stage_layout,
    )

    one = dataclasses.replace(cfg, parallel=C.ParallelConfig(), train=C.TrainConfig(
        global_batch=cfg.train.global_batch))  # fmt: skip
    single = Trainable.create(C.validate(one, 1), make_mesh(one.parallel, jax.devices()[:1]))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.model.vocab_size, (cfg.train.global_batch, cfg.model.seq_len + 1))
    tokens = tokens.astype(np.int32)

    def run(t, fn, params):
        sharding = t.batch_sharding()
        batch = (jax.device_put(tokens[:, :-1], sharding), jax.device_put(tokens[:, 1:], sharding))
        with jax.set_mesh(t.mesh):
            loss, grads = jax.jit(fn)(params, *batch)
        return float(loss), to_canonical_layout(jax.tree.map(np.asarray, grads), t.layout)

    with jax.set_mesh(single.mesh):
        params = init_state(single, seed=0)["params"]
    canonical = to_canonical_layout(jax.tree.map(np.asarray, params), single.layout)
    ref_loss, ref_grads = run(single, make_plain_loss_and_grads(single), params)
    placed = jax.device_put(
        to_stage_layout(canonical, trainable.layout), state_shardings(trainable)["params"]
    )
    loss, grads = run(trainable, make_loss_and_grads(trainable), placed)
    grads = without_bound_counts(grads)  # the exchange's statistic: one device has none
    worst = abs(loss - ref_loss) / max(abs(ref_loss), 1e-12)
    for ref, got in zip(jax.tree.leaves(ref_grads), jax.tree.leaves(grads), strict=True):
        scale = max(float(np.abs(ref).max()), 1e-12)
        worst = max(worst, float(np.abs(got - ref).max()) / scale)
    return worst


def _child(layout: dict, run: bool, devices: int, timeout: int) -> dict:
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices}",
                                 *SUITE_FLAGS])  # fmt: skip
    env["JAX_PLATFORMS"] = "cpu"
    args = [sys.executable, __file__, "--one", json.dumps(layout)] + (["--run"] if run else [])
    try:
        proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"result": "HUNG", "detail": f"no result in {timeout} s"}
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        return {"result": "FAILED", "detail": tail[0][:300]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def table(rows: list[tuple[dict, dict]]) -> str:
    lines = [
        "| layout | result | detail |",
        "|---|---|---|",
    ]
    for layout, got in rows:
        detail = got.get("detail", "")
        if "compile_seconds" in got:
            detail = f"{detail}; compiled in {got['compile_seconds']} s".lstrip("; ")
        lines.append(f"| {name(layout)} | {got['result']} | {detail.replace('|', '/')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument(
        "--run-every",
        type=int,
        default=4,
        help="run every k-th layout against one device (0: none)",
    )
    parser.add_argument("--timeout", type=int, default=300, help="seconds per layout")
    parser.add_argument("--remat", default="none", help="model.remat of every layout")
    parser.add_argument("--out", help="also write the table to this markdown file")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--run", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if args.one:
        print(json.dumps(check_one(json.loads(args.one), args.run)))
        return 0
    found = layouts(args.devices, args.remat)
    rows = []
    for k, layout in enumerate(found):
        run = args.run_every > 0 and k % args.run_every == 0
        got = _child(layout, run, args.devices, args.timeout)
        rows.append((layout, got))
        print(f"[{k + 1}/{len(found)}] {name(layout)}: {got['result']}", file=sys.stderr,
              flush=True)  # fmt: skip
    text = table(rows)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    bad = [got for _, got in rows if got["result"] in ("HUNG", "FAILED", "DIFFERS", "hazard")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
