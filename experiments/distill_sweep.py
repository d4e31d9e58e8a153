"""Validation sweep of pFedKDH's teacher-to-client transfer forms and of its head adaptation (EA).

Every run is scored on a validation split carved from each client's *train* data
(``--validation-fraction 0.2``); the clients' test splits are never read. A run trains with one
distillation variant (``VARIANTS``) on one cell (dataset, α) with one (seed, data seed) pair, then
scores its final model with Fair (heads as they are) and with every EA schedule of ``EA_GRID``
(head-only SGD on the cached features of the client's remaining train data: a step count or whole
epochs, at a learning rate). Results go to a JSON-lines file, one line per run, appended as the
sweep goes, so an interrupted sweep resumes by running the same command (finished runs are skipped).

    python experiments/distill_sweep.py --data-dir ../shared/data/tfds --rounds 20 \\
        --cells mnist:0.1,mnist:0.05,fashion_mnist:0.1,fashion_mnist:0.05 --seeds 0:0 \\
        --out experiments/distill_sweep.jsonl
    python experiments/distill_sweep.py --table experiments/distill_sweep.jsonl   # the table only
    python experiments/distill_sweep.py --select experiments/distill_sweep.jsonl  # paired, for the defaults

``val_fair_last3`` (the mean of the last three rounds' Fair accuracy) is reported next to the final
round's, because a single final round swings by about half a point on Fashion-MNIST.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import statistics
import time

# name -> the pFedKDH options that make the variant (λ = 0.5 for every form that distils)
VARIANTS = {
    "lam0": dict(lam=0.0),
    "paper": dict(lam=0.5),
    "support": dict(lam=0.5, kd_target="support"),
    "prior": dict(lam=0.5, kd_target="prior"),
    "confidence": dict(lam=0.5, kd_gate="confidence"),
    "better": dict(lam=0.5, kd_gate="better"),
    "support+better": dict(lam=0.5, kd_target="support", kd_gate="better"),
    # second screen, around the best first-screen form (confidence): a lighter λ, a sharper teacher,
    # and the class-aware target with it
    "confidence-lam0.2": dict(lam=0.2, kd_gate="confidence"),
    "confidence-T1": dict(lam=0.5, temperature=1.0, kd_gate="confidence"),
    "support+confidence": dict(lam=0.5, kd_target="support", kd_gate="confidence"),
    # a per-client, per-step λ from the batch the client is training on: the teacher's margin over the
    # student in mean true-class probability (0 once the student is the better model). Rows labelled
    # "support+adaptive-ratio" are the first form of this gate (the share of the student's gap the
    # teacher closes), replaced after it scored 1.4-1.8 points below λ = 0 on MNIST.
    "adaptive": dict(lam=0.5, kd_gate="adaptive"),
    "support+adaptive": dict(lam=0.5, kd_target="support", kd_gate="adaptive"),
}
# EA schedules scored on every run's final model: (name, steps, epochs, lr)
EA_GRID = [("s20", 20, 0, 0.015), ("s20_lr0.05", 20, 0, 0.05), ("s50", 50, 0, 0.015),
           ("s50_lr0.05", 50, 0, 0.05), ("e1", 0, 1, 0.015), ("e1_lr0.05", 0, 1, 0.05),
           ("e3", 0, 3, 0.015), ("e3_lr0.05", 0, 3, 0.05)]
VALIDATION_FRACTION = 0.2


def run_one(dataset: str, alpha: float, variant: str, seed: int, data_seed: int, rounds: int,
            data_dir: str | None, runs_dir: str, extra: dict) -> dict:
    import jax

    from pfedkdh_jax.run.config import make_config
    from pfedkdh_jax.run.experiment import run
    from pfedkdh_jax.engine.runner import RoundRunner

    tag = "".join(f"-{k}{v}" for k, v in extra.items())
    name = f"{dataset}-a{alpha:g}-{variant}{tag}-s{seed}-d{data_seed}"
    cfg = make_config("paper", dataset=dataset, data_dir=data_dir, alpha=alpha, rounds=rounds,
                      seed=seed, data_seed=data_seed, validation_fraction=VALIDATION_FRACTION,
                      ea_steps=0, checkpoint_every=0, out=os.path.join(runs_dir, name),
                      **{**VARIANTS[variant], **extra})
    t0 = time.time()
    summary, state, data, algo, runner = run(cfg, progress=False, log=lambda *_: None, return_state=True)
    with open(os.path.join(cfg.out, "metrics.jsonl")) as f:
        history = [json.loads(line) for line in f]
    fair = [r["personalized_macro_accuracy"] for r in history if "personalized_macro_accuracy" in r]
    row = {"dataset": dataset, "alpha": alpha, "variant": variant, "seed": seed, "data_seed": data_seed,
           "rounds": rounds, "options": {**VARIANTS[variant], **extra},
           "val_fair": fair[-1], "val_fair_last3": statistics.mean(fair[-3:]),
           "val_global": summary.get("global_macro_accuracy"), "curve": fair,
           "train_seconds_per_round": summary["seconds_per_round"]}
    for ea_name, steps, epochs, lr in EA_GRID:
        adapted = dataclasses.replace(algo, config=dataclasses.replace(
            algo.config, ea_steps=steps, ea_epochs=epochs, ea_lr=lr))
        m = RoundRunner(adapted, data, runner.layout).evaluate(state, data, jax.random.key(1234), personalize=True)
        row[f"val_ea_{ea_name}"] = float(m["personalized_macro_accuracy_ea"])
    row["seconds"] = time.time() - t0
    return row


def done_keys(path: str) -> set:
    if not os.path.exists(path):
        return set()
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {(r["dataset"], r["alpha"], r["variant"], r["seed"], r["data_seed"], r["rounds"]) for r in rows}


def table(path: str) -> str:
    """Markdown: per cell, every variant's Fair (final, last-3 mean) and best EA, mean over seeds."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    cells = collections.defaultdict(lambda: collections.defaultdict(list))
    for r in rows:
        cells[(r["dataset"], r["alpha"], r["rounds"])][r["variant"]].append(r)
    ea_names = [f"val_ea_{n}" for n, *_ in EA_GRID]
    out = []
    for (dataset, alpha, rounds), variants in cells.items():
        out.append(f"\n**{dataset}, α = {alpha:g}, {rounds} rounds** (validation macro accuracy, %, "
                   "mean over the (seed, data seed) pairs listed)\n")
        out.append("| variant | pairs | Fair final | Fair last-3 | global | " + " | ".join(n[7:] for n in ea_names) + " |")
        out.append("|---|---|---|---|---|" + "---|" * len(ea_names))
        for v in sorted(variants, key=_order):
            rs = variants.get(v)
            if not rs:
                continue
            def m(key):
                vals = [r[key] for r in rs if r.get(key) is not None]
                return f"{100 * statistics.mean(vals):.2f}" if vals else "–"
            pairs = ",".join(f"{r['seed']}/{r['data_seed']}" for r in rs)
            out.append(f"| {v} | {pairs} | {m('val_fair')} | {m('val_fair_last3')} | {m('val_global')} | "
                       + " | ".join(m(n) for n in ea_names) + " |")
    return "\n".join(out)


def _order(variant: str) -> tuple:
    """Table order: VARIANTS' order, then the variants no longer defined (recorded results only)."""
    base = variant.split("[")[0]
    return (list(VARIANTS).index(base) if base in VARIANTS else len(VARIANTS), variant)


def _rows(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _cell(r: dict) -> str:
    return f"{ {'mnist': 'MNIST', 'fashion_mnist': 'FMNIST', 'cifar10': 'CIFAR-10'}.get(r['dataset'], r['dataset'])} {r['alpha']:g}"


def selection(path: str, reference: str = "lam0") -> str:
    """Markdown for choosing the defaults, from paired differences only (a variant against the
    reference on the same cell and (seed, data seed) pair, so partitions that are easier or harder do
    not move the comparison):

    * each variant's Fair (final round; mean of the last three) and best-EA accuracy minus the
      reference's, per cell and over every pair both ran;
    * the reference's EA schedules: EA minus Fair per cell, and over all pairs (the EA default is the
      schedule with the largest mean gain).
    """
    rows = _rows(path)
    by = {(r["dataset"], r["alpha"], r["rounds"], r["variant"], r["seed"], r["data_seed"]): r for r in rows}
    cells = sorted({(r["dataset"], r["alpha"], r["rounds"]) for r in rows},
                   key=lambda c: (["mnist", "fashion_mnist", "cifar10"].index(c[0]) if c[0] in
                                  ("mnist", "fashion_mnist", "cifar10") else 9, -c[1]))
    names = {c: _cell({"dataset": c[0], "alpha": c[1]}) for c in cells}
    ea_keys = [f"val_ea_{n}" for n, *_ in EA_GRID]
    best_ea = lambda r: max(r[k] for k in ea_keys if r.get(k) is not None)  # noqa: E731
    measures = [("Fair final", lambda r: r["val_fair"]), ("Fair last-3", lambda r: r["val_fair_last3"]),
                ("best EA", best_ea)]
    out = [f"Paired differences to `{reference}` in points (n: the (seed, data seed) pairs both ran); "
           "the last column pools every pair of every cell.\n"]
    variants = sorted({r["variant"] for r in rows if r["variant"] != reference}, key=_order)
    for label, f in measures:
        out.append(f"\n**{label}**, variant − {reference}\n")
        out.append("| variant | " + " | ".join(names[c] for c in cells) + " | all cells |")
        out.append("|---|" + "---|" * (len(cells) + 1))
        for v in variants:
            pooled, parts = [], []
            for c in cells:
                diffs = [100 * (f(r) - f(by[(*c, reference, r["seed"], r["data_seed"])])) for r in rows
                         if (r["dataset"], r["alpha"], r["rounds"], r["variant"]) == (*c, v)
                         and (*c, reference, r["seed"], r["data_seed"]) in by]
                pooled += diffs
                parts.append(f"{statistics.mean(diffs):+.2f} (n {len(diffs)})" if diffs else "–")
            out.append(f"| {v} | " + " | ".join(parts) + " | "
                       + (f"{statistics.mean(pooled):+.2f} (n {len(pooled)})" if pooled else "–") + " |")
    out.append(f"\n**EA schedules of `{reference}`**: EA − Fair (final round), points\n")
    out.append("| schedule | " + " | ".join(names[c] for c in cells) + " | all cells |")
    out.append("|---|" + "---|" * (len(cells) + 1))
    for name, steps, epochs, lr in EA_GRID:
        key, pooled, parts = f"val_ea_{name}", [], []
        for c in cells:
            gains = [100 * (r[key] - r["val_fair"]) for r in rows
                     if (r["dataset"], r["alpha"], r["rounds"], r["variant"]) == (*c, reference) and r.get(key) is not None]
            pooled += gains
            parts.append(f"{statistics.mean(gains):+.2f} (n {len(gains)})" if gains else "–")
        what = f"{steps} steps" if steps else f"{epochs} epoch(s)"
        out.append(f"| {name} ({what}, lr {lr:g}) | " + " | ".join(parts) + " | "
                   + (f"{statistics.mean(pooled):+.2f} (n {len(pooled)})" if pooled else "–") + " |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--cells", default="mnist:0.1", help="dataset:alpha,... ")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--seeds", default="0:0", help="seed:data_seed,...")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--set", default="", help="extra options for every run, key=value,... (e.g. dropout=0.25)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "distill_sweep.jsonl"))
    ap.add_argument("--runs-dir", default="runs/distill")
    ap.add_argument("--table", default=None, help="only print the table of this results file")
    ap.add_argument("--select", default=None, help="only print the paired comparison (defaults) of this results file")
    args = ap.parse_args()
    if args.table:
        print(table(args.table))
        return
    if args.select:
        print(selection(args.select))
        return
    extra = {}
    for pair in filter(None, args.set.split(",")):
        k, v = pair.split("=", 1)
        try:
            extra[k] = int(v) if v.isdigit() else float(v)
        except ValueError:
            extra[k] = v
    done = done_keys(args.out)
    for cell in args.cells.split(","):
        dataset, alpha = cell.split(":")
        for pair in args.seeds.split(","):
            seed, data_seed = map(int, pair.split(":"))
            for variant in args.variants.split(","):
                label = variant + (f"[{args.set}]" if args.set else "")
                key = (dataset, float(alpha), label, seed, data_seed, args.rounds)
                if key in done:
                    continue
                row = run_one(dataset, float(alpha), variant, seed, data_seed, args.rounds, args.data_dir,
                              args.runs_dir, extra)
                row["variant"] = label
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
                print(json.dumps({k: v for k, v in row.items() if k != "curve"}), flush=True)
    print(table(args.out))


if __name__ == "__main__":
    main()
