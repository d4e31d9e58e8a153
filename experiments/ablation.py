"""The paper's component ablation of pFedKDH (method.md §6): CIFAR-10, α = 0.05, paper preset.

Five runs of the same partition and seeds, each switching one component off:

=================  ============================================================  ==================
run                what changes                                                  flags
=================  ============================================================  ==================
full               the paper's method (λ = 0.5, T = 4, μ = 0.01, refit, heads)   ``--lam 0.5``
heads-averaged     persistent heads off: heads averaged like the backbone        ``--average-heads``
no-distillation    distillation off                                              ``--lam 0``
no-proximal        proximal term off                                             ``--mu 0``
no-recalibration   the teacher head never refit                                  ``--teacher-epochs 0``
=================  ============================================================  ==================

    python experiments/ablation.py --data-dir ../shared/data/tfds --run      # runs what is missing
    python experiments/ablation.py --runs-dir runs/ablation                   # table + figure only

``--run`` runs every missing run one after another with checkpoints, resuming a run whose directory
holds checkpoints (so an interrupted ablation continues where it stopped); ``--only NAME,...`` runs a
subset (e.g. one per core in two processes). The table (``ablation.md``) and the bar figure
(``ablation.png``) go to ``--out-dir`` (default experiments/).
"""

from __future__ import annotations

import argparse
import json
import os

RUNS = {
    "full": dict(lam=0.5),
    "heads-averaged": dict(lam=0.5, persistent_heads=False),
    "no-distillation": dict(lam=0.0),
    "no-proximal": dict(lam=0.5, mu=0.0),
    "no-recalibration": dict(lam=0.5, teacher_epochs=0),
}


def run_missing(names, args) -> None:
    from pfedkdh_jax.run.config import make_config
    from pfedkdh_jax.run.experiment import resume, run

    for name in names:
        out = os.path.join(args.runs_dir, name)
        summary = os.path.join(out, "summary.json")
        if os.path.exists(summary) and json.load(open(summary)).get("status") == "completed":
            continue
        if os.path.isdir(os.path.join(out, "checkpoints")):
            resume(out, progress=False)
            continue
        cfg = make_config("paper", dataset=args.dataset, alpha=args.alpha, data_dir=args.data_dir, out=out,
                          checkpoint_every=5, ea_every=10, **RUNS[name])
        run(cfg, progress=False)


def table(runs_dir: str) -> tuple[str, dict]:
    rows, found = ["| run | personalized macro, Fair | EA | global (teacher) | best Fair (round) | s/round |",
                   "|---|---|---|---|---|---|"], {}
    for name in RUNS:
        path = os.path.join(runs_dir, name, "summary.json")
        if not os.path.exists(path):
            rows.append(f"| {name} | – | – | – | – | – |")
            continue
        s = json.load(open(path))
        found[name] = s
        pct = lambda k: f"{100 * s[k]:.2f} %" if s.get(k) is not None else "–"  # noqa: E731
        status = "" if s.get("status") == "completed" else f" ({s.get('status')}, {s.get('rounds_completed')} rounds)"
        rows.append(f"| {name}{status} | {pct('personalized_macro_accuracy')} | {pct('personalized_macro_accuracy_ea')} "
                    f"| {pct('global_macro_accuracy')} | {pct('best_personalized_macro_accuracy')} "
                    f"({s.get('best_personalized_macro_accuracy_round')}) | {s['seconds_per_round']:.1f} |")
    return "\n".join(rows), found


def figure(found: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [n for n in RUNS if n in found]
    fair = [100 * found[n]["personalized_macro_accuracy"] for n in names]
    ea = [100 * found[n].get("personalized_macro_accuracy_ea", float("nan")) for n in names]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], fair, 0.4, label="Fair")
    ax.bar([i + 0.2 for i in x], ea, 0.4, label="EA")
    ax.set_xticks(list(x), names, rotation=15)
    lo = min(v for v in fair + ea if v == v)
    ax.set_ylim(max(0.0, lo - 5), 100)
    ax.set_ylabel("personalized macro accuracy, %")
    ax.set_title("pFedKDH component ablation, CIFAR-10, α = 0.05 (test split)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--dataset", default="cifar10")
    ap.add_argument("--alpha", type=float, default=0.05)
    ap.add_argument("--runs-dir", default="runs/ablation")
    ap.add_argument("--out-dir", default=os.path.dirname(__file__))
    ap.add_argument("--run", action="store_true", help="run the missing runs first")
    ap.add_argument("--only", default=",".join(RUNS), help="the runs to run (with --run)")
    args = ap.parse_args()
    if args.run:
        run_missing([n for n in args.only.split(",") if n], args)
    text, found = table(args.runs_dir)
    print(text)
    with open(os.path.join(args.out_dir, "ablation.md"), "w") as f:
        f.write(f"{args.dataset}, α = {args.alpha:g}, paper preset, seed 0, data seed 0, test split, last round "
                "(`python experiments/ablation.py`; BENCHMARKS.md has the commands and the reading). "
                "s/round: each run on one core next to other work, not a speed figure.\n\n" + text + "\n")
    if found:
        figure(found, os.path.join(args.out_dir, "ablation.png"))


if __name__ == "__main__":
    main()
