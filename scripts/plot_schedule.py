"""Draw a pipeline schedule's tick timeline to a PNG.

  python scripts/plot_schedule.py --schedule interleaved_1f1b --stages 4 --microbatches 8 \
      --chunks 2 --out schedule.png
  python scripts/plot_schedule.py --table      # efficiency vs bound, as in docs/schedules.md

Rows are stages, columns ticks; each tick is split into its F slot (light) and B slot (dark),
coloured by microbatch and labelled microbatch.chunk; idle slots stay blank. The title gives the
lockstep efficiency against Megatron's asynchronous bound.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def plot(schedule, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from jaxmeg.pipeline import validate

    table, report = schedule.tick_table, validate(schedule)
    p, ticks = schedule.num_stages, table.num_ticks
    colours = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(max(6, 0.5 * ticks + 1), 0.6 * p + 1.4))
    for t in range(ticks):
        for s in range(p):
            for half, (mbs, chunks, alpha) in enumerate(
                [(table.f_mb, table.f_chunk, 0.45), (table.b_mb, table.b_chunk, 1.0)]
            ):
                mb = int(mbs[t, s])
                if mb < 0:
                    continue
                x = t + 0.5 * half
                ax.add_patch(
                    plt.Rectangle((x, p - 1 - s), 0.5, 0.9, color=colours(mb % 10), alpha=alpha)
                )
                label = f"{mb}" if schedule.num_chunks == 1 else f"{mb}.{int(chunks[t, s])}"
                ax.text(x + 0.25, p - 0.55 - s, label, ha="center", va="center", fontsize=6)
    ax.set_xlim(0, ticks)
    ax.set_ylim(0, p)
    ax.set_yticks([p - 0.55 - s for s in range(p)], [f"stage {s}" for s in range(p)])
    ax.set_xlabel("tick (each: F slot | B slot)")
    ax.set_title(
        f"{schedule.name} p={p} v={schedule.num_chunks} m={schedule.num_microbatches} "
        f"({schedule.warmup if schedule.name == '1f1b' else 'Megatron order'}): lockstep "
        f"efficiency {report.lockstep_efficiency:.3f}, bound {report.async_bound:.3f}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(out, dpi=150)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved_1f1b"])
    parser.add_argument("--stages", type=int)
    parser.add_argument("--microbatches", type=int)
    parser.add_argument("--chunks", type=int, default=1)
    parser.add_argument("--warmup", default="min_bubble", choices=["min_memory", "min_bubble"])
    parser.add_argument("--out", default="schedule.png")
    parser.add_argument(
        "--table",
        action="store_true",
        help="print the lockstep-efficiency table of docs/schedules.md and exit",
    )
    args = parser.parse_args(argv)
    from jaxmeg.pipeline import build

    if args.table:
        from jaxmeg.pipeline.analysis import efficiency_table

        print(efficiency_table())
        return 0
    if args.stages is None or args.microbatches is None:
        parser.error("--stages and --microbatches are required (or --table)")
    try:
        schedule = build(args.schedule, args.stages, args.microbatches, args.chunks, args.warmup)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    plot(schedule, args.out)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
