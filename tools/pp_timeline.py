"""Render a ``--pp-timeline DIR`` trace as a Gantt chart and print the measured bubble per rank.

    python tools/pp_timeline.py DIR --output timeline.png [--step N]

One row per rank (one sub-row per virtual stage when VPP > 1); forwards light, backwards (input
gradients under a zero-bubble schedule) dark and weight gradients greyed and dotted, in one colour
per micro-batch, labelled with the micro-batch id; the optimizer tail (grad finalize + optimizer
step) hatched grey; idle time (the bubble, and P2P waits) white. Default
step: the last one every rank recorded (warm-up excluded).

Printed per rank: ``bubble`` = idle / busy inside its pipeline's compute span (first forward ->
last backward over the pipeline's ranks), beside ``model`` (the same ratio in the hop-0 model of
the step's own order, with the recorded spans' median costs: what the schedule implies) and
``theory`` = (p-1)/(m v) (1F1B's and interleaved 1F1B's, for reference); also idle/span,
comparable to (p-1)/(m v + p - 1). Measured exceeds theory by the P2P hops on the critical path
and by uneven stages (e.g. the embedding / loss on the first / last stage).
"""

from __future__ import annotations

import importlib.util
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron_ext.cli_args import ToolParser, integer, output_file  # noqa: E402
from tools.timeline_analysis import (  # noqa: E402
    get_bubble_stats,
    get_model_bubbles,
    parse_rank_step,
    read_timeline,
)


def format_bubble_table(step_records: dict[int, list[dict]]) -> str:
    """One line per rank: measured bubble beside its schedule's hop-0 model (the step's own order
    with the recorded F/B/W costs) and beside (p-1)/(m v) (1F1B's theory, for reference)."""
    metas = {rank: parse_rank_step(recs) for rank, recs in step_records.items()}
    model = get_model_bubbles(step_records)
    lines = []
    for b in get_bubble_stats(step_records):
        rs = metas[b.rank]
        p, v, m = rs.pp_size, rs.vp_size, rs.num_microbatches
        lines.append(
            f"rank {b.rank:3d}  pp {b.pp_rank:2d}  v {v}  m {m:3d}  bubble {b.idle_over_busy:.4f}  "
            f"model {model[b.rank]:.4f}  theory {b.theory:.4f}  |  idle/span {b.idle_over_span:.4f}  "
            f"theory {(p - 1) / (m * v + p - 1):.4f}  |  span {b.span * 1e3:.1f} ms  busy {b.busy * 1e3:.1f} ms"
        )
    return "\n".join(lines)


def render_timeline(step_records: dict[int, list[dict]], output: str, title: str = "") -> None:
    """Gantt chart of one step of every rank, written to ``output`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [parse_rank_step(recs) for _, recs in sorted(step_records.items())]
    t0 = min(op.start for rs in steps for op in rs.ops)  # the pipeline's first forward
    v = max(rs.vp_size for rs in steps)
    m = max(rs.num_microbatches for rs in steps)
    cmap = plt.get_cmap("tab10" if m <= 10 else "tab20")
    fig, ax = plt.subplots(figsize=(14, 0.9 + 0.75 * len(steps) * (1 if v == 1 else 1.3)))
    yticks, ylabels = [], []
    span_ms = (max(rs.end for rs in steps) - t0) * 1e3
    for row, rs in enumerate(steps):
        y0 = len(steps) - 1 - row  # rank 0 on top
        yticks.append(y0 + 0.5)
        ylabels.append(f"rank {rs.rank} (pp {rs.pp_rank})")
        _draw_rank_row(ax, rs, y0, t0, v, span_ms, cmap)
    ax.set_yticks(yticks, ylabels)
    ax.set_ylim(0, len(steps))
    ax.set_xlim(0, span_ms * 1.01)
    ax.set_xlabel("ms since the first forward of the step")
    _add_legend(ax, v, cmap)
    if v > 1:
        title += f"  (sub-rows per rank: virtual stages 0..{v - 1}, top to bottom)"
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(output, dpi=130)
    plt.close(fig)


def _op_colour(cmap, mb: int, kind: str) -> tuple[float, ...]:
    """Micro-batch ``mb``'s colour in ``cmap``: lighter for a forward, greyed for a weight gradient
    (W), darker for a backward."""
    from matplotlib.colors import to_rgb

    base = to_rgb(cmap(mb % cmap.N))
    if kind == "F":  # lighter
        return tuple(0.45 * c + 0.55 for c in base)
    if kind == "W":  # the micro-batch's colour, greyed: a weight gradient
        return tuple(0.35 * c + 0.35 for c in base)
    return tuple(0.8 * c for c in base)  # darker


def _draw_rank_row(ax, rs, y0: int, t0: float, v: int, span_ms: float, cmap) -> None:
    """One rank's row from ``y0`` to ``y0 + 1``: its ops (one sub-row per virtual stage, each labelled
    where wide enough), its optimizer tail, the sub-row separators and the row's bottom line."""
    row_h = 1.0 / v
    for op in rs.ops:
        y = y0 + (v - 1 - op.chunk) * row_h  # chunk 0 on top within the rank's row
        x, w = (op.start - t0) * 1e3, (op.end - op.start) * 1e3
        ax.broken_barh(
            [(x, w)],
            (y + 0.06 * row_h, 0.88 * row_h),
            facecolors=_op_colour(cmap, op.mb, op.kind),
            edgecolor="black",
            linewidth=0.3,
            hatch="..." if op.kind == "W" else None,
        )
        if w > span_ms / 140:
            ax.text(
                x + w / 2,
                y + 0.5 * row_h,
                f"{op.kind}{op.mb}",
                ha="center",
                va="center",
                fontsize=6 if v > 1 else 7,
                color="black" if op.kind == "F" else "white",
            )
    if rs.optimizer is not None:
        x, w = (rs.optimizer[0] - t0) * 1e3, (rs.optimizer[1] - rs.optimizer[0]) * 1e3
        ax.broken_barh([(x, w)], (y0 + 0.06, 0.88), facecolors="0.85", hatch="//", edgecolor="0.5", linewidth=0.3)
    for c in range(1, v):
        ax.axhline(y0 + c * row_h, color="0.85", linewidth=0.4)
    ax.axhline(y0, color="black", linewidth=0.6)


def _add_legend(ax, v: int, cmap) -> None:
    """The legend under the chart: forward, backward, weight gradient, optimizer, idle."""
    from matplotlib.patches import Patch

    legend = [
        Patch(facecolor=_op_colour(cmap, 0, "F"), edgecolor="black", label="forward (light)"),
        Patch(facecolor=_op_colour(cmap, 0, "B"), edgecolor="black", label="backward / input gradient B (dark)"),
        Patch(
            facecolor=_op_colour(cmap, 0, "W"),
            edgecolor="black",
            hatch="...",
            label="weight gradient W (grey, dotted)",
        ),
        Patch(facecolor="0.85", hatch="//", edgecolor="0.5", label="grad finalize + optimizer"),
        Patch(facecolor="white", edgecolor="black", label="idle (bubble, P2P wait)"),
    ]
    ax.legend(
        handles=legend,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.12 if v == 1 else -0.09),
        ncol=5,
        fontsize=8,
        frameon=False,
    )


def get_default_step(steps: dict[int, dict[int, list[dict]]]) -> int:
    """The last step recorded by every rank."""
    num_ranks = max(len(by_rank) for by_rank in steps.values())
    return max(s for s, by_rank in steps.items() if len(by_rank) == num_ranks)


def _fail(message: str) -> None:
    """A user error: one line on stderr, exit 2 (as pretrain_gpt.py and the other tools)."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def main(argv: list[str] | None = None) -> None:
    parser = ToolParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace_dir", help="the --pp-timeline directory (rank<N>.jsonl files)")
    parser.add_argument(
        "--output", type=output_file, default="timeline.png", help="PNG to write (default: timeline.png)"
    )
    parser.add_argument(
        "--step", type=integer(0, what="a recorded step"), default=None, help="step to draw (default: last complete)"
    )
    args = parser.parse_args(argv)
    # user errors are one line, before any work (a missing matplotlib used to fail after the table)
    if importlib.util.find_spec("matplotlib") is None:
        _fail(
            "tools/pp_timeline.py draws with matplotlib, which is not installed: "
            "pip install -e '.[plots]' (or pip install matplotlib)"
        )
    if not os.path.isdir(args.trace_dir):
        _fail(f"{args.trace_dir}: no such directory (give the directory the run wrote with --pp-timeline DIR)")
    try:
        steps = read_timeline(args.trace_dir)
    except ValueError as err:
        _fail(str(err))
    if not steps:
        _fail(
            f"{args.trace_dir}: the rank<N>.jsonl files hold no step yet (the run stopped before its first step ended)"
        )
    step = args.step if args.step is not None else get_default_step(steps)
    if step not in steps:
        _fail(f"--step {step}: not in the trace (recorded steps: {sorted(steps)})")
    first = parse_rank_step(next(iter(steps[step].values())))
    title = (
        f"step {step}: PP={first.pp_size}, VPP={first.vp_size}, m={first.num_microbatches}, {len(steps[step])} ranks"
    )
    render_timeline(steps[step], args.output, title)
    print(f"{title}\n{format_bubble_table(steps[step])}\nwrote {args.output}")


if __name__ == "__main__":
    main()
