"""Loss and throughput plots of a run (PNG)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from muse_stack.util import atomic  # noqa: E402


def _save(fig, path: Path) -> None:
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    atomic.write_bytes(path, buf.getvalue())


def loss_plot(metrics: list[dict[str, Any]], path: Path, title: str) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [m["step"] for m in metrics]
    ax.plot(steps, [m["loss"] for m in metrics], marker=".", lw=1, label="training")
    val = [(m["step"], m["val_loss"]) for m in metrics if m.get("val_loss") is not None]
    if val:  # the held-out split's loss (recipe validation)
        ax.plot([s for s, _ in val], [v for _, v in val], marker="o", lw=1, label="validation")
        ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel("loss (per supervised token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    _save(fig, path)


def throughput_plot(metrics: list[dict[str, Any]], path: Path, title: str, window: list[int] | None) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [m["step"] for m in metrics]
    ax.plot(steps, [m["tokens_per_s_per_gpu"] for m in metrics], marker=".", lw=1)
    if window:
        ax.axvspan(window[0] - 0.5, window[1] + 0.5, color="tab:green", alpha=0.1, label="measurement window")
        ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel("tokens/s per GPU")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    _save(fig, path)
