"""What running a client as one compiled call saves, by its number of steps (issue 28; BENCHMARKS.md, "Every
client of up to 8 steps as one call").

FedPer on the K = 1,000 MNIST partition of ``experiments/many_clients.py`` (α = 0.5, min 5 samples, paper preset,
``--slot-granule 8``), with ``--fused-steps N``: after a first round (which compiles every step plan the data's
client sizes need; its time is reported), rounds of 40 clients that all take the same number of steps (2, 4,
or 6; at most as many as exist), five rounds each, the median reported per client. Run it once per N, with
nothing else busy:

    python experiments/fused_plans.py --data-dir ../shared/data/tfds --fused-steps 2
    python experiments/fused_plans.py --data-dir ../shared/data/tfds --fused-steps 8

Timings are benchmark output, never test assertions.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--fused-steps", type=int, default=2)
    ap.add_argument("--clients", type=int, default=1000)
    ap.add_argument("--per-round", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    from pfedkdh_jax.engine.cpu_devices import request_for_client_devices
    request_for_client_devices(None)
    import jax
    import numpy as np

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from many_clients import engine_runner, partition
    from pfedkdh_jax.data.device import build_federated_data

    cfg, pool, part, sizes = partition(args.clients, args.clients // 20, args.data_dir)
    steps = cfg.local_epochs * np.ceil(sizes / cfg.batch_size).astype(int)
    print("clients by their steps:", dict(sorted(collections.Counter(steps.tolist()).items())), flush=True)
    data = build_federated_data(pool, part)
    algo, runner = engine_runner(cfg, pool, data, slot_granule=8, fused_steps=args.fused_steps)
    state = algo.init(jax.random.key(0), data)
    t = time.perf_counter()
    state, _ = runner.round(state, data, np.arange(4), jax.random.key(1))
    jax.block_until_ready(state)
    print(f"--fused-steps {args.fused_steps}: first round {time.perf_counter() - t:.1f} s (compiles every plan; "
          f"{sum(1 for k in runner.traces if 'whole' in k)} one-call plans)", flush=True)
    rng = np.random.default_rng(0)
    for s in sorted(set(steps.tolist())):
        which = np.flatnonzero(steps == s)
        n = min(args.per_round, len(which))
        times = []
        for r in range(args.rounds):
            sel = rng.choice(which, n, replace=False)
            t = time.perf_counter()
            state, _ = runner.round(state, data, sel, jax.random.key(10 + r))
            jax.block_until_ready(state)
            times.append(time.perf_counter() - t)
        print(f"--fused-steps {args.fused_steps}: {n} clients of {s} steps a round, median {np.median(times):.3f} s, "
              f"{np.median(times) / n * 1e3:.2f} ms a client", flush=True)


if __name__ == "__main__":
    main()
