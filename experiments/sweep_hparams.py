"""Small sweep of pFedKDH's free hyperparameters (λ, T, μ, dropout, EA steps), scored on validation data.

The paper does not give λ, T, μ, the EA step count or the dropout rate. This script picks them on
real MNIST (α = 0.1, 20 clients, ρ = 0.5, E = 2, batch 64, lr 0.015 — the paper preset) with a
*shortened* schedule, scoring the personalized macro accuracy on a validation split carved from each
client's train data (``--validation-fraction 0.2``); the clients' test splits are never read.

It is a coordinate sweep around a base point (one value changed at a time), because a full grid at
~20 s per round on a 2-core CPU is out of reach; EA step counts are all scored on each run's final
model. Results: experiments/sweep_hparams.json and the table printed (copied to experiments/SWEEP.md).

    python experiments/sweep_hparams.py --data-dir ../shared/data/tfds --rounds 8
    python experiments/sweep_hparams.py --data-dir ../shared/data/tfds --grid lambda --rounds 16 \
        --out experiments/sweep_lambda.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import jax

from pfedkdh_jax.run.config import make_config
from pfedkdh_jax.engine.runner import RoundRunner
from pfedkdh_jax.run.experiment import run

BASE = dict(lam=0.5, temperature=2.0, mu=0.001, dropout=0.0)
GRIDS = {
    # stage 1: one value changed at a time around BASE (8 rounds)
    "coordinate": [{}, dict(lam=0.0), dict(lam=0.2), dict(lam=0.8), dict(temperature=1.0),
                   dict(temperature=4.0), dict(mu=0.0), dict(mu=0.01), dict(dropout=0.25)],
    # stage 2: the distillation weight over a longer horizon, at stage 1's best T (16 rounds)
    "lambda": [dict(lam=0.0, temperature=4.0, mu=0.01), dict(lam=0.2, temperature=4.0, mu=0.01),
               dict(lam=0.5, temperature=4.0, mu=0.01)],
}
EA_GRID = (0, 5, 10, 20, 40)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--dataset", default="mnist")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "sweep_hparams.json"))
    ap.add_argument("--runs-dir", default="runs/sweep")
    ap.add_argument("--grid", default="coordinate", choices=sorted(GRIDS))
    args = ap.parse_args()

    results = []
    for variant in GRIDS[args.grid]:
        hp = {**BASE, **variant}
        name = ",".join(f"{k}={v}" for k, v in variant.items()) or "base"
        cfg = make_config("paper", dataset=args.dataset, data_dir=args.data_dir, alpha=0.1,
                          rounds=args.rounds, validation_fraction=0.2, ea_steps=0,
                          out=os.path.join(args.runs_dir, args.grid, name.replace("=", "").replace(",", "-")),
                          checkpoint_every=0, **hp)
        t0 = time.time()
        summary, state, data, algo, runner = run(cfg, progress=False, log=lambda *_: None, return_state=True)
        row = {"variant": name, **hp, "val_fair": summary["personalized_macro_accuracy"],
               "val_global": summary["global_macro_accuracy"], "seconds": time.time() - t0}
        for steps in EA_GRID[1:]:
            adapted = dataclasses.replace(algo, config=dataclasses.replace(algo.config, ea_steps=steps))
            m = RoundRunner(adapted, data, runner.layout).evaluate(state, data, jax.random.key(1234),
                                                                   personalize=True)
            row[f"val_ea{steps}"] = float(m["personalized_macro_accuracy_ea"])
        results.append(row)
        print(json.dumps(row), flush=True)
        with open(args.out, "w") as f:
            json.dump({"protocol": {"grid": args.grid, "dataset": args.dataset, "alpha": 0.1, "rounds": args.rounds,
                                    "validation_fraction": 0.2, "preset": "paper", "base": BASE},
                       "results": results}, f, indent=2)
    cols = ["variant", "val_fair", "val_global"] + [f"val_ea{s}" for s in EA_GRID[1:]]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in results:
        print("| " + " | ".join(r[c] if isinstance(r[c], str) else f"{100 * r[c]:.2f}" for c in cols) + " |")


if __name__ == "__main__":
    main()
