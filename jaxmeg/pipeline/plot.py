"""Drawing a schedule's tick timeline (matplotlib, imported only when drawing): the one home of
the picture that scripts/plot_schedule.py saves and the notebook shows."""

from __future__ import annotations

from jaxmeg.pipeline.analysis import validate
from jaxmeg.pipeline.schedules import Schedule
from jaxmeg.pipeline.tick_table import TWO_SLOTS, build_tick_table


def _draw_slot(
    ax, corner, colour, alpha: float, hatch: str | None, label: str, width: float = 0.5
) -> None:
    """One cell at (x, y), half a tick wide (a whole one in unit ticks): a coloured box
    (hatched for backwards) and its label."""
    from matplotlib.patches import Rectangle

    x, y = corner
    ax.add_patch(Rectangle((x, y + 0.05), width, 0.9, facecolor=colour, alpha=alpha))
    if hatch:
        box = Rectangle((x, y + 0.05), width, 0.9, fill=False, hatch=hatch, edgecolor="white")
        box.set_linewidth(0)
        ax.add_patch(box)
    white = {"facecolor": "white", "alpha": 0.7, "pad": 0.4, "linewidth": 0}
    ax.text(x + width / 2, y + 0.5, label, ha="center", va="center", fontsize=6, bbox=white)


def draw(schedule: Schedule):
    """The schedule's tick table (validated first) as a matplotlib Figure: rows are stages,
    columns ticks, each tick split into its F slot (light) and B slot (dark, hatched), or in
    one-action ticks (split backwards) one cell of F (light), B or I (dark, hatched) or W
    (medium, dotted), an F&B pair (DualPipeV) as two halves of its tick, cells coloured by
    microbatch and labelled (kind) microbatch(.chunk); the title gives the
    asynchronous bubble, the lockstep efficiency and the asynchronous bound."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    table, report = build_tick_table(schedule), validate(schedule)
    p, ticks = schedule.num_stages, table.num_ticks
    colours = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * ticks + 1.5), 0.6 * p + 1.6))
    cells = [("F", table.f_mb, table.f_chunk, 0.45, None),
             ("I", table.b_mb, table.b_chunk, 1.0, "///"),
             ("W", table.w_mb, table.w_chunk, 0.7, "..")]  # fmt: skip
    two_slots, paired = table.ticks == TWO_SLOTS, table.paired
    for t in range(ticks):
        for s in range(p):
            halves = two_slots or paired[t, s]
            width = 0.5 if halves else 1.0
            for half, (kind, mbs, chunks, alpha, hatch) in enumerate(cells):
                mb = int(mbs[t, s])
                if mb < 0:
                    continue
                x, y = t + (0.5 * half if halves else 0), p - 1 - s
                label = f"{mb}" if schedule.num_chunks == 1 else f"{mb}.{int(chunks[t, s])}"
                if not two_slots:
                    kind = "B" if kind == "I" and not table.b_split[t, s] else kind
                    label = f"{kind}{label}"
                _draw_slot(ax, (x, y), colours(mb % 10), alpha, hatch, label, width)
    ax.set_xlim(0, ticks)
    ax.set_ylim(0, p)
    ax.set_yticks([p - 0.5 - s for s in range(p)], [f"stage {s}" for s in range(p)])
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    label = "microbatch" if schedule.num_chunks == 1 else "microbatch.chunk"
    slots = (
        "F slot (light) | B slot (dark, hatched)"
        if two_slots
        else "one action: F (light), B or I (dark, hatched), W (dotted); F&B pairs halved"
    )
    ax.set_xlabel(f"tick: {slots}; cells: {label}")
    variant = {"1f1b": schedule.warmup, "interleaved_1f1b": "Megatron order"}.get(
        schedule.name, "order" if two_slots else "PyTorch's order"
    )
    ax.set_title(
        f"{schedule.name} ({variant}) p={p} v={schedule.num_chunks} "
        f"m={schedule.num_microbatches}\nbubble {report.bubble:.3f}, lockstep efficiency "
        f"{report.lockstep_efficiency:.3f} vs bound {report.async_bound:.3f}, "
        f"{table.num_ticks} ticks, K={table.num_input_slots} J={table.num_cot_slots}",
        fontsize=9,
    )
    fig.tight_layout()
    return fig
