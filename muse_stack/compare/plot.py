"""Plot of two loss curves and their relative difference (matplotlib, Agg; no pyplot state)."""

from __future__ import annotations

import io
from pathlib import Path

from muse_stack.util import atomic
from muse_stack.compare.runs import Metrics


def plot_losses(golden: Metrics, candidate: Metrics, golden_name: str, candidate_name: str, out: Path,
                title: str = "") -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(9, 6.5), constrained_layout=True)
    FigureCanvasAgg(fig)
    ax, ax_rel = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1.4]})
    g = {r.step: r.loss for r in golden.steps}
    c = {r.step: r.loss for r in candidate.steps}
    ax.plot(list(g), list(g.values()), "-", color="#444444", lw=1.6, label=f"golden: {golden_name}")
    ax.plot(list(c), list(c.values()), "-", color="#d62728", lw=1.2, alpha=0.85, label=f"candidate: {candidate_name}")
    from muse_stack.compare.convergence import validation_points

    for metrics, color, name in ((golden, "#444444", "golden"), (candidate, "#d62728", "candidate")):
        val = validation_points(metrics)  # the held-out loss, where the runs validated
        if val:
            ax.plot(list(val), list(val.values()), "o--", color=color, lw=0.8, ms=4, mfc="none",
                    label=f"{name} validation")
    missing = sorted(set(g) - set(c))
    if missing:
        ax.plot(missing, [g[s] for s in missing], "x", color="#d62728", ms=5, label="missing in candidate")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    ax.set_title(title or "loss curves")
    common = sorted(set(g) & set(c))
    rel = [abs(c[s] - g[s]) / abs(g[s]) * 100 if g[s] else 0.0 for s in common]
    ax_rel.plot(common, rel, ".-", color="#1f77b4", lw=1, ms=3)
    ax_rel.set_ylabel("|rel. diff| %")
    ax_rel.set_xlabel("step")
    ax_rel.grid(alpha=0.3)
    ax_rel.xaxis.set_major_locator(MaxNLocator(integer=True))
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    return atomic.write_bytes(out, buf.getvalue())
