"""Useful vs computed sample-steps of a round with clients vmapped, before and after packing.

With clients vmapped, every selected client runs as many local steps as the largest selected client;
steps past its own ``E·⌈n_k/B⌉`` are masked no-ops. For the run's real client schedules (the same
partition and sampling streams as ``pfedkdh run``; R stacked repetitions use seeds 0..R-1) this counts
the useful fraction, averaged over the rounds,

* before (``--lanes`` off): ``Σ_j steps_j / (J · max_j steps_j)`` over the round's J = R·C jobs;
* after (``--lanes L``): ``Σ_j steps_j / (L · longest lane)``, the lanes packed by the engine's own
  :func:`pfedkdh_jax.engine.packing.pack_jobs` (what a packed round computes and reports as
  ``packing_useful_steps`` / ``packing_computed_steps``).

It also gives the local steps a round takes one after another (the longest lane; before: the longest
job): what packing costs in sequential depth on a device that had room for every job at once.

    python experiments/useful_work.py --data-dir ../shared/data/tfds [--alphas 0.05,0.1,0.5] \
        [--lanes 2,3,5] [--reps 1,5] [--data-seeds 0,1]

Deterministic (counting only; nothing is trained).
"""

from __future__ import annotations

import argparse
import math

import numpy as np


def count(dataset: str, alpha: float, data_dir: str | None, lanes: list[int], reps: int = 1,
          data_seed: int = 0) -> dict:
    import jax
    import jax.numpy as jnp

    from pfedkdh_jax.data.partition import make_partition
    from pfedkdh_jax.data.sources import load_pool
    from pfedkdh_jax.engine.packing import pack_jobs
    from pfedkdh_jax.engine.runner import sample_schedule
    from pfedkdh_jax.run.config import make_config
    from pfedkdh_jax.run.experiment import streams

    cfg = make_config("paper", dataset=dataset, alpha=alpha, data_seed=data_seed)
    pool = load_pool(dataset, data_dir)
    part = make_partition(pool.labels, num_clients=cfg.num_clients, alpha=alpha, aux_size=cfg.aux_size,
                          min_client_samples=cfg.min_client_samples, train_fraction=cfg.train_fraction,
                          seed=data_seed)
    steps = np.array([cfg.local_epochs * math.ceil(len(idx) / cfg.batch_size) for idx in part.train_idx])
    scheds = [np.asarray(sample_schedule(streams(s)["sampling"], cfg.rounds, cfg.num_clients,
                                         cfg.clients_per_round)) for s in range(reps)]
    jobs = [np.concatenate([steps[sc[t]] for sc in scheds]) for t in range(cfg.rounds)]
    before = [j.sum() / (len(j) * j.max()) for j in jobs]
    after, depth = {}, {}
    pack = jax.jit(pack_jobs, static_argnums=1)   # one compile per lane count, not one per round
    for L in lanes:
        packed = [pack(jnp.asarray(j), L)[2] for j in jobs]
        after[L] = float(np.mean([j.sum() / (L * int(p.max())) for j, p in zip(jobs, packed)]))
        depth[L] = float(np.mean([int(p.max()) for p in packed]))
    sizes = [len(i) for i in part.train_idx]
    return {"dataset": dataset, "alpha": alpha, "rounds": cfg.rounds, "train_sizes": (min(sizes), max(sizes)),
            "jobs": reps * cfg.clients_per_round, "before": float(np.mean(before)),
            "before_min": float(np.min(before)), "before_depth": float(np.mean([j.max() for j in jobs])),
            "after": after, "depth": depth}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--dataset", default="mnist")
    ap.add_argument("--alphas", default="0.05,0.1,0.5")
    ap.add_argument("--lanes", default="2,3,5")
    ap.add_argument("--reps", default="1", help="stacked repetitions per round (comma list)")
    ap.add_argument("--data-seeds", default="0")
    args = ap.parse_args()
    lanes = [int(x) for x in args.lanes.split(",")]
    print("Useful fraction of computed local sample-steps, mean over the rounds (in brackets: local steps "
          "one after another per round, mean).\n")
    print("| α | data seed | jobs a round | client train sizes | before: one lane per job (worst round) | "
          + " | ".join(f"after: {L} lanes" for L in lanes) + " |")
    print("|---|---|---|---|---|" + "---|" * len(lanes))
    for reps in [int(x) for x in args.reps.split(",")]:
        for ds in [int(x) for x in args.data_seeds.split(",")]:
            for a in [float(x) for x in args.alphas.split(",")]:
                r = count(args.dataset, a, args.data_dir, lanes, reps=reps, data_seed=ds)
                print(f"| {a:g} | {ds} | {r['jobs']} | {r['train_sizes'][0]}–{r['train_sizes'][1]} | "
                      f"{r['before']:.3f} ({r['before_min']:.3f}) [{r['before_depth']:.0f}] | "
                      + " | ".join(f"{r['after'][L]:.3f} [{r['depth'][L]:.0f}]" for L in lanes) + " |")


if __name__ == "__main__":
    main()
