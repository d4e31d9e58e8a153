"""``pfedkdh report RUN_DIR ...``: a comparison table and figures from finished (or interrupted) runs.

* a table: method, dataset, α, final and best personalized macro accuracy (mean ± std over
  repetitions when the run has them), seconds per round;
* ``comparison.png``: personalized macro accuracy vs round, one line per run, with a ± std band where
  the rows carry ``*_std`` (the way the paper's convergence figure reads);
* ``clients.png`` per run: final per-client accuracy and the label histogram of every client.

A run that did not complete says so on its row (its status: diverged, interrupted); a run whose every
round compiled (one round, say) marks its seconds per round, which then include compiling. The figures go to ``--out`` (``clients-NAME.png``
per run there); without it, ``comparison.png`` goes into the first run's directory and each
``clients.png`` into its run's.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

KEY = "personalized_macro_accuracy"


def load_run(run_dir: str) -> dict[str, Any]:
    """config, summary (may be missing for an interrupted run) and metrics rows of a run directory."""
    def read(name, default):
        path = os.path.join(run_dir, name)
        if not os.path.exists(path):
            return default
        with open(path) as f:
            return json.load(f)
    if not os.path.exists(os.path.join(run_dir, "config.json")):
        hint = (f": it holds a sweep, whose runs are {os.path.join(run_dir, 'points', '*')} (and its tables, "
                "table.md)" if os.path.exists(os.path.join(run_dir, "sweep.json")) else " (no config.json)")
        raise FileNotFoundError(f"{run_dir} is not a run directory{hint}")
    return {"dir": run_dir, "config": read("config.json", {}), "summary": read("summary.json", {}),
            "rows": read_rows(run_dir)}


def read_rows(run_dir: str) -> list[dict]:
    """metrics.jsonl's rows (none without the file), up to a line cut by an interruption."""
    rows = []
    path = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    break  # a line cut by an interruption
    return rows


def _pm(summary: dict, key: str) -> str:
    if key not in summary or summary[key] is None:
        return "–"
    std = summary.get(f"{key}_std")
    return f"{100 * summary[key]:.2f}" + (f" ± {100 * std:.2f}" if std is not None else "")


def table(runs: list[dict]) -> str:
    head = ("| run | method | dataset | α | final macro acc. (%) | best macro acc. (%) | final EA (%) | "
            "s/round | rounds |")
    lines = [head, "|" + "---|" * 9]
    names = _names([r["dir"] for r in runs])
    compiled = False
    for r, name in zip(runs, names):
        c, s = r["config"], r["summary"]
        spr = s.get("seconds_per_round")
        if (c.get("validation_fraction") or 0) > 0:   # not test accuracies: say so on the row
            name += " (validation split)"
        status = s.get("status") if s else (
            "running, or stopped: no summary" if os.path.exists(os.path.join(r["dir"], "run.lock")) else
            "interrupted: no summary")
        if status and status != "completed":
            name += f" ({status})"
        mark = ""
        if s.get("seconds_per_round_includes_compile"):
            mark, compiled = " †", True
        method = " ".join([str(c.get("method"))] + _own_run_options(c)
                          + [f"{k}={v}" for k, v in c.get("method_args") or []])
        lines.append(f"| {name} | {method} | {c.get('dataset')} | "
                     f"{c.get('alpha')} | {_pm(s, KEY)} | {_pm(s, 'best_' + KEY)} | {_pm(s, KEY + '_ea')} | "
                     f"{'–' if spr is None else f'{spr:.2f}{mark}'} | {s.get('rounds_completed', len(r['rows']))} |")
    if compiled:
        lines.append("\n† a run whose every round compiled (one round, say): its seconds per round include compiling")
    return "\n".join(lines)


def _own_run_options(config: dict) -> list[str]:
    """The run options of the method's own (pFedKDH's λ, T, μ, ...) set away from their defaults, as
    ``key=value``: two pFedKDH runs of another λ are told apart on their rows."""
    from pfedkdh_jax.algorithms import METHODS   # the registry (no JAX)
    from pfedkdh_jax.run.config import RunConfig
    spec, defaults = METHODS.get(config.get("method")), RunConfig()
    return [f"{k}={config[k]}" for k in sorted(spec.run_options if spec else ())
            if k in config and config[k] != getattr(defaults, k, config[k])]


def _names(dirs: list[str]) -> list[str]:
    """Each run directory by its last path part, or by as many parts as tell it from the others."""
    parts = [os.path.normpath(os.path.abspath(d)).split(os.sep) for d in dirs]
    for depth in range(1, max(map(len, parts)) + 1):
        names = [os.path.join(*p[-depth:]) for p in parts]
        if len(set(names)) == len(names):
            return names
    return names


def comparison_figure(runs: list[dict], path: str, title: str = "") -> None:
    """Accuracy vs round, one line per run (``run['label']`` if given), ± std bands with repetitions."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for r, name in zip(runs, _names([r["dir"] for r in runs])):
        pts = [(row["round"], row[KEY], row.get(f"{KEY}_std", 0.0)) for row in r["rows"] if KEY in row]
        if not pts:
            continue
        xs = [p[0] for p in pts]
        ys = [100 * p[1] for p in pts]
        sd = [100 * p[2] for p in pts]
        label = r.get("label") or f"{r['config'].get('method')} ({name})"
        ax.plot(xs, ys, marker="o" if len(xs) < 25 else None, ms=3, label=label)   # (one evaluation: a dot)
        if any(sd):
            ax.fill_between(xs, [y - d for y, d in zip(ys, sd)], [y + d for y, d in zip(ys, sd)], alpha=0.2)
    ax.set_xlabel("round")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))   # rounds are whole
    ax.set_ylabel("personalized macro accuracy (%)")
    ax.grid(alpha=0.3)
    if title:
        ax.set_title(title)
    if ax.get_lines():
        ax.legend(fontsize=8, loc="lower right")
    else:   # runs stopped before their first evaluation
        ax.text(0.5, 0.5, "no evaluated round yet", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _per_client(summary: dict) -> tuple[list | None, list | None]:
    """Final per-client accuracies (None: a client not scored) and, with repetitions, their std over the
    repetitions (the summary keeps each repetition's list under ``repetitions``; the mean is drawn)."""
    acc = summary.get("per_client_personalized_accuracy")
    if acc:
        return acc, None
    reps = [r.get("per_client_personalized_accuracy") for r in summary.get("repetitions") or []]
    if not reps or not all(reps) or len({len(r) for r in reps}) != 1:
        return None, None
    cols = [[a for a in client if a is not None] for client in zip(*reps)]
    mean = [sum(c) / len(c) if c else None for c in cols]
    std = [(sum((a - m) ** 2 for a in c) / len(c)) ** 0.5 if len(c) > 1 else None for c, m in zip(cols, mean)]
    return mean, std   # (no std where fewer than two repetitions scored the client)


def clients_figure(run: dict, path: str) -> bool:
    s = run["summary"]
    acc, std = _per_client(s)
    hist = (s.get("partition") or {}).get("label_histogram")
    if not acc or not hist:
        return False
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    hist = np.asarray(hist, float)
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(7, 6), dpi=120, sharex=True)
    a1.bar(range(len(acc)), [np.nan if a is None else 100 * a for a in acc],   # None: a client not scored
           yerr=None if std is None else [0 if d is None else 100 * d for d in std], error_kw={"elinewidth": 0.8})
    scored = sum(a is not None for a in acc)
    a1.set_ylabel("final accuracy (%)" + (f", {scored} of {len(acc)} scored" if scored < len(acc) else "")
                  + (f"\nmean ± std of {len(s['repetitions'])} repetitions" if std is not None else ""))
    a1.set_title(f"{run['config'].get('method')} on {run['config'].get('dataset')}, α={run['config'].get('alpha')}")
    bottom = np.zeros(hist.shape[0])
    cmap = plt.get_cmap("tab10" if hist.shape[1] <= 10 else "tab20")
    for c in range(hist.shape[1]):
        a2.bar(range(hist.shape[0]), hist[:, c], bottom=bottom, color=cmap(c % cmap.N),
               label=str(c) if hist.shape[1] <= 20 else None)
        bottom += hist[:, c]
    a2.set_xlabel("client")
    a2.set_ylabel("samples per label")
    if hist.shape[1] <= 20:
        a2.legend(ncol=10, fontsize=6, loc="upper right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def main(run_dirs: list[str], out: str | None = None) -> int:
    try:
        runs = [load_run(d) for d in run_dirs]
    except FileNotFoundError as e:
        print(f"pfedkdh: error: {e}", file=sys.stderr)
        return 2
    print(table(runs))
    given = out is not None
    out = out or run_dirs[0]
    os.makedirs(out, exist_ok=True)
    comparison_figure(runs, os.path.join(out, "comparison.png"))
    written = [os.path.join(out, "comparison.png")]
    for r, name in zip(runs, _names(run_dirs)):
        p = (os.path.join(out, f"clients-{name.replace(os.sep, '_')}.png") if given
             else os.path.join(r["dir"], "clients.png"))
        if clients_figure(r, p):
            written.append(p)
        else:
            print(f"no clients figure for {name}: its summary has no per-client accuracies or label histogram "
                  "(a run that did not finish?)")
    print("figures: " + ", ".join(written))
    return 0
