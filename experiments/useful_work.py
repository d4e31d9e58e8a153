"""Useful vs computed sample-steps of a round with clients vmapped (issue: balanced local work).

With clients vmapped, every selected client runs as many local steps as the largest selected client;
steps past its own ``E·⌈n_k/B⌉`` are masked no-ops. This counts, for the run's real client schedule
(the same partition and sampling streams as ``pfedkdh run``), the useful fraction

    Σ_k steps_k / (C · max_k steps_k)        per round, averaged over the rounds,

and, for comparison, what packing the round's C clients into L lanes would give (each lane runs its
clients one after another; longest-first greedy assignment; computed = L · the longest lane). The
packing figures are a calculation of that design, not a measurement of an implementation.

    python experiments/useful_work.py --data-dir ../shared/data/tfds [--alphas 0.05,0.1,0.5] [--lanes 2,3,5]

Deterministic (counting only; nothing is trained).
"""

from __future__ import annotations

import argparse
import heapq
import math

import numpy as np


def packed_fraction(steps: list[int], lanes: int) -> float:
    loads = [0] * lanes
    heapq.heapify(loads)
    for s in sorted(steps, reverse=True):
        heapq.heapreplace(loads, loads[0] + s)
    return sum(steps) / (lanes * max(loads))


def count(dataset: str, alpha: float, data_dir: str | None, lanes: list[int], seed: int = 0,
          data_seed: int = 0) -> dict:
    from pfedkdh_jax.data.partition import make_partition
    from pfedkdh_jax.data.sources import load_pool
    from pfedkdh_jax.engine.runner import sample_schedule
    from pfedkdh_jax.run.config import make_config
    from pfedkdh_jax.run.experiment import streams

    cfg = make_config("paper", dataset=dataset, alpha=alpha, seed=seed, data_seed=data_seed)
    pool = load_pool(dataset, data_dir)
    part = make_partition(pool.labels, num_clients=cfg.num_clients, alpha=alpha, aux_size=cfg.aux_size,
                          min_client_samples=cfg.min_client_samples, train_fraction=cfg.train_fraction,
                          seed=data_seed)
    steps = np.array([cfg.local_epochs * math.ceil(len(idx) / cfg.batch_size) for idx in part.train_idx])
    sched = np.asarray(sample_schedule(streams(seed)["sampling"], cfg.rounds, cfg.num_clients,
                                       cfg.clients_per_round))
    vmapped = [steps[sel].sum() / (len(sel) * steps[sel].max()) for sel in sched]
    packed = {L: float(np.mean([packed_fraction(list(steps[sel]), L) for sel in sched])) for L in lanes}
    sizes = [len(i) for i in part.train_idx]
    return {"dataset": dataset, "alpha": alpha, "rounds": cfg.rounds, "train_sizes": (min(sizes), max(sizes)),
            "vmapped": float(np.mean(vmapped)), "vmapped_min": float(np.min(vmapped)), "packed": packed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--dataset", default="mnist")
    ap.add_argument("--alphas", default="0.05,0.1,0.5")
    ap.add_argument("--lanes", default="2,3,5")
    ap.add_argument("--data-seeds", default="0")
    args = ap.parse_args()
    lanes = [int(x) for x in args.lanes.split(",")]
    print("| α | data seed | client train sizes | useful fraction, vmapped (mean over rounds; worst round) | "
          + " | ".join(f"packed into {L} lanes" for L in lanes) + " |")
    print("|---|---|---|---|" + "---|" * len(lanes))
    for ds in [int(x) for x in args.data_seeds.split(",")]:
        for a in [float(x) for x in args.alphas.split(",")]:
            r = count(args.dataset, a, args.data_dir, lanes, data_seed=ds)
            print(f"| {a:g} | {ds} | {r['train_sizes'][0]}–{r['train_sizes'][1]} | {r['vmapped']:.3f} "
                  f"({r['vmapped_min']:.3f}) | " + " | ".join(f"{r['packed'][L]:.3f}" for L in lanes) + " |")


if __name__ == "__main__":
    main()
