"""Draw a pipeline schedule's tick timeline to a PNG, or print the efficiency table.

  python scripts/plot_schedule.py --schedule interleaved_1f1b --stages 4 --microbatches 8 \
      --chunks 2 --out schedule.png
  python scripts/plot_schedule.py --schedule zbv --stages 4 --microbatches 8 --chunks 2 \
      --out zbv.png
  python scripts/plot_schedule.py --schedule dualpipev --stages 4 --microbatches 8 \
      --chunks 2 --out dualpipev.png
  python scripts/plot_schedule.py --table      # efficiency tables of docs/benchmarks.md and
                                               # docs/schedules.md (zero bubble, DualPipeV)

Rows are stages, columns ticks; each tick is split into its F slot (light) and B slot (dark,
hatched), or for a split backward (zb_h1, interleaved_zb, zbv, dualpipev) holds one action, F,
B or I (hatched) or W (dotted), or DualPipeV's F&B pair as two halves; cells are coloured by
microbatch and labelled microbatch.chunk; idle slots stay blank. The title gives the bubble,
the lockstep efficiency and the asynchronous bound.
Needs matplotlib (imported only when drawing).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxmeg.pipeline import schedules  # noqa: E402


def plot(schedule: schedules.Schedule, out: str) -> None:
    """Draws the schedule (`jaxmeg.pipeline.plot.draw`) to the image file `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from jaxmeg.pipeline.plot import draw

    fig = draw(schedule)
    fig.savefig(out, dpi=150)
    plt.close(fig)


FLAGS = {"num_stages": "--stages", "num_microbatches": "--microbatches", "num_chunks": "--chunks"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--schedule", default="1f1b", choices=list(schedules.NAMES))
    parser.add_argument("--stages", type=int)
    parser.add_argument("--microbatches", type=int)
    parser.add_argument("--chunks", type=int, default=1)
    parser.add_argument("--warmup", default="min_bubble", choices=list(schedules.WARMUPS))
    parser.add_argument("--out", default="schedule.png")
    parser.add_argument(
        "--table",
        action="store_true",
        help="print the lockstep-efficiency tables of docs/benchmarks.md and exit",
    )
    args = parser.parse_args(argv)
    if args.table:
        from jaxmeg.pipeline.analysis import (
            dualpipev_table,
            efficiency_tables,
            zero_bubble_table,
        )

        print(efficiency_tables())
        print("\nZero bubble (docs/schedules.md): lockstep efficiency, F = I = W = 1 (held "
              "microbatches whole + split)\n")  # fmt: skip
        print(zero_bubble_table())
        print("\nDualPipeV against DeepSeek's formulas and zbv (docs/schedules.md)\n")
        print(dualpipev_table())
        return 0
    if args.stages is None or args.microbatches is None:
        parser.error("--stages and --microbatches are required (or --table)")
    from jaxmeg import paths

    try:
        schedule = schedules.build(
            args.schedule, args.stages, args.microbatches, args.chunks, args.warmup
        )
        problem = paths.file_problem(args.out, "--out", overwrite=True)  # an image: redrawn
        if problem:
            raise ValueError(problem)
        try:
            plot(schedule, args.out)
        except OSError as err:  # a disk that filled or turned read-only while drawing
            raise paths.os_error(err, args.out, "--out") or err from err
    except ValueError as err:
        message = str(err)
        for word, flag in FLAGS.items():  # schedules' own words, as this script's flags
            message = message.replace(word, flag)
        print(f"error: {message}", file=sys.stderr)
        return 2
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
