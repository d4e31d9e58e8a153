"""Accuracy-vs-round figure of a run (matplotlib, no display needed)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

CURVES = (("personalized_macro_accuracy", "personalized (Fair), macro"),
          ("personalized_macro_accuracy_ea", "personalized (EA), macro"),
          ("global_macro_accuracy", "global model, macro"))


def plot_curves(history: list[dict], path: str, title: str = "") -> None:
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    for key, label in CURVES:
        pts = [(r["round"], 100 * r[key], 100 * r.get(f"{key}_std", 0.0)) for r in history if key in r]
        if pts:
            xs, ys, sd = zip(*pts)
            line, = ax.plot(xs, ys, marker="o" if len(pts) < 25 else None, ms=3, label=label)
            if any(sd):  # repetitions: mean ± std band
                ax.fill_between(xs, [y - d for y, d in zip(ys, sd)], [y + d for y, d in zip(ys, sd)],
                                color=line.get_color(), alpha=0.2)
    ax.set_xlabel("round")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))   # rounds are whole (a 2-round run: no 1.2, 1.4)
    ax.set_ylabel("accuracy (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if ax.get_lines():   # (a run stopped before its first evaluation has none)
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
