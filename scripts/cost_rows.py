"""The cost-report figures of the 48 rows of docs/benchmarks.md ("What the step executes"), one
JSON object per row, so that two versions of the engine can be compared figure by figure.

  python scripts/cost_rows.py --mesh 1,4,1 > before.jsonl   # 24 rows on 4 CPU devices
  python scripts/cost_rows.py --mesh 2,2,2 >> before.jsonl  # 24 rows on 8 CPU devices
  python scripts/cost_rows.py --compare before.jsonl after.jsonl
  python scripts/cost_rows.py --mesh 1,4,1 --fingerprint  # lowered step digests, no compile

gpt_tiny (8 layers, 4 heads, s 128, V 4096, fp32) at h 128 and 512, global batch 16: microbatch
2 on (1,4,1) (m 8), 4 microbatches per replica on (2,2,2); gpipe and 1f1b with one chunk,
interleaved_1f1b and breadth_first with two; every `model.remat`. Compile only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SCHEDULES = {"1f1b": 1, "gpipe": 1, "interleaved_1f1b": 2, "breadth_first": 2}
CONFIG = str(Path(__file__).resolve().parent.parent / "configs" / "gpt_tiny.yaml")


def rows(mesh: tuple[int, int, int]):
    data, pipe, tensor = mesh
    microbatches = 8 if data == 1 else 4
    for hidden in (128, 512):
        for remat in ("none", "selective", "full"):
            for schedule, chunks in SCHEDULES.items():
                key = {"h": hidden, "mesh": list(mesh), "schedule": schedule, "remat": remat}
                overrides = [
                    "model.vocab_size=4096", f"model.hidden={hidden}", f"model.remat={remat}",
                    f"parallel.data={data}", f"parallel.pipe={pipe}",
                    f"parallel.tensor={tensor}", f"parallel.schedule={schedule}",
                    f"parallel.chunks={chunks}", f"train.microbatches={microbatches}",
                ]  # fmt: skip
                yield key, overrides


EXTRA = {
    "zero1": ["parallel.data=2", "parallel.pipe=4", "parallel.zero_stage=1"],
    "zero3_bf": ["parallel.data=2", "parallel.pipe=2", "parallel.tensor=2",
                 "parallel.zero_stage=3", "parallel.schedule=breadth_first", "parallel.chunks=2"],
    "pipe_rank": ["parallel.data=2", "parallel.pipe=4", "compression.pipe_grad_rank=4"],
    "powersgd": ["parallel.data=2", "parallel.pipe=4", "compression.data_grad_rank=4",
                 "compression.fused_embedding_sync=true"],
    "zb_h1": ["parallel.data=2", "parallel.pipe=4", "parallel.schedule=zb_h1"],
    "interleaved_zb_full": ["parallel.pipe=4", "parallel.data=2", "model.remat=full",
                            "parallel.schedule=interleaved_zb", "parallel.chunks=2"],
    "zbv": ["parallel.pipe=4", "parallel.tensor=2", "parallel.schedule=zbv",
            "parallel.chunks=2"],
    "context": ["parallel.pipe=2", "parallel.context=2", "parallel.data=2"],
    "uneven": ["parallel.pipe=2", "parallel.data=2", "parallel.tensor=2",
               "parallel.stage_layers=[5,3]"],
    "pipe1": ["parallel.data=2", "parallel.tensor=4"],
}  # fmt: skip
"""Fingerprint-only rows on 8 devices: the executor's other features (ZeRO, compression, split
backwards, context, uneven stages, pipe = 1)."""


def extra_rows():
    for name, overrides in EXTRA.items():
        yield {"extra": name}, ["model.vocab_size=4096", "train.microbatches=8", *overrides]


def measure(mesh: tuple[int, int, int] | None, fingerprint: bool = False) -> None:
    """Prints each row's cost report; with `fingerprint`, instead of compiling, a digest of the
    lowered step (no source locations), of the executor's branch columns and of what one
    forward stores: equal digests are the same program weighted the same way (seconds a row)."""
    from jaxmeg.parallel import simulate_cpu_devices

    simulate_cpu_devices(mesh[0] * mesh[1] * mesh[2] if mesh else 8)
    from jaxmeg import config
    from jaxmeg.training.cost_report import cost_report
    from jaxmeg.training.trainer import prepare

    for key, overrides in rows(mesh) if mesh else extra_rows():
        trainable = prepare(config.load(CONFIG, overrides), dataset=None)
        report = _fingerprint(trainable) if fingerprint else cost_report(trainable)
        print(json.dumps({"row": key, "report": report}), flush=True)


def _fingerprint(trainable) -> dict:
    import hashlib

    import jax
    import numpy as np

    from jaxmeg.training.pipeline_step import make_loss_and_grads
    from jaxmeg.training.state import abstract_state
    from jaxmeg.training.step import make_train_step

    loss_and_grads = make_loss_and_grads(trainable)
    step = make_train_step(trainable, loss_and_grads)
    batch = jax.ShapeDtypeStruct(
        (trainable.cfg.train.global_batch, trainable.cfg.model.seq_len), np.int32,
        sharding=trainable.batch_sharding(),
    )  # fmt: skip
    with jax.set_mesh(trainable.mesh):
        text = step.lower(abstract_state(trainable), batch, batch).as_text()
    columns = hashlib.sha256()
    for name, column in sorted(loss_and_grads.program.branch_columns.items()):
        columns.update(name.encode() + np.asarray(column, np.int32).tobytes())
    return {
        "lowered": hashlib.sha256(text.encode()).hexdigest(),
        "branch_columns": columns.hexdigest(),
        "slot_bytes": int(loss_and_grads.program.trace_info["slot_bytes"]),
    }


def compare(before: str, after: str) -> int:
    """Prints every figure that differs and the rows only one file holds; returns the number
    of rows in both that differ."""
    old = _read(before)
    new = _read(after)
    differing = 0
    for key in sorted(set(old) | set(new)):
        if key not in old or key not in new:
            print(f"{key}: only in {'after' if key not in old else 'before'}")
            continue
        diffs = list(_differences(old[key], new[key]))
        if diffs:
            differing += 1
            print(key, *diffs, sep="\n  ")
    print(f"{len(set(old) & set(new))} rows in both, {differing} differ")
    return differing


def _read(path: str) -> dict[str, dict]:
    out = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            out[json.dumps(record["row"])] = record["report"]
    return out


def _differences(a, b, path=""):
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            yield from _differences(a.get(k), b.get(k), f"{path}.{k}")
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            yield from _differences(x, y, f"{path}[{i}]")
    elif a != b:
        yield f"{path}: {a} -> {b}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--mesh", help="data,pipe,tensor: 1,4,1 or 2,2,2")
    group.add_argument("--extra", action="store_true", help="with --fingerprint: EXTRA's rows")
    group.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    parser.add_argument("--fingerprint", action="store_true", help="lower only (see measure)")
    args = parser.parse_args(argv)
    if args.compare:
        return 1 if compare(*args.compare) else 0
    mesh = tuple(int(x) for x in args.mesh.split(",")) if args.mesh else None
    measure(mesh, args.fingerprint or args.extra)
    return 0


if __name__ == "__main__":
    sys.exit(main())
