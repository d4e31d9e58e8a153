"""Local-training throughput of each client-parallel layout (foundation issue, item 4).

Runs pFedKDH rounds on synthetic clients of the chosen input shape (the numbers do not depend on the
pixels) and prints, per layout, samples/second of local training (teacher forward included) and
seconds per round, as a markdown table. Every form computes the same numbers (tests/test_pfedkdh.py);
only the layout differs. Run it with nothing else busy on the machine:

    python experiments/bench_engine.py                     # MNIST shape, all forms
    python experiments/bench_engine.py --shape 32,32,3     # CIFAR-10 shape
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import numpy as np

from pfedkdh_jax.data import Pool, make_partition
from pfedkdh_jax.engine import EngineConfig
from pfedkdh_jax.federated_data import build_federated_data
from pfedkdh_jax.model import CNN
from pfedkdh_jax.pfedkdh import PFedKDH, PFedKDHConfig
from pfedkdh_jax.rounds import RoundRunner

FORMS = [("sequential", "unrolled", 4), ("sequential", "unrolled", 8), ("sequential", "unrolled", 16),
         ("sequential", "unrolled", 32), ("vmap", "unrolled", 8), ("sequential", "scan", 0),
         ("vmap", "scan", 0)]


def synthetic_federation(shape, clients: int, per_client: int, seed: int = 0):
    n = clients * per_client * 2 + 100
    rng = np.random.default_rng(seed)
    pool = Pool(images=rng.integers(0, 256, (n, *shape), dtype=np.uint8),
                labels=rng.integers(0, 10, n).astype(np.int32), num_classes=10, name="synthetic",
                is_demo=True)
    part = make_partition(pool.labels, num_clients=clients, alpha=1000.0, aux_size=100, seed=seed,
                          train_fraction=0.5)
    return build_federated_data(pool, part, eval_chunk=256)


def time_form(data, client_parallel, step_loop, chunk, selected, repeats):
    algo = PFedKDH(CNN(10), PFedKDHConfig(local_epochs=1, teacher_epochs=1))
    runner = RoundRunner(algo, data, EngineConfig(client_parallel, step_loop, chunk or 8))
    state = algo.init(jax.random.key(0), data)
    t0 = time.perf_counter()
    state, _ = runner.round(state, data, selected, jax.random.key(0))
    jax.block_until_ready(state)
    first = time.perf_counter() - t0
    times = []
    for r in range(repeats):
        t0 = time.perf_counter()
        state, _ = runner.round(state, data, selected, jax.random.key(r + 1))
        jax.block_until_ready(state)
        times.append(time.perf_counter() - t0)
    return first, times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="28,28,1")
    ap.add_argument("--clients", type=int, default=4, help="selected clients per round")
    ap.add_argument("--steps", type=int, default=16, help="local steps per client per round (batch 64)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--forms", default="all", help="comma list of indices into FORMS, or all")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    args = ap.parse_args()
    shape = tuple(int(s) for s in args.shape.split(","))
    data = synthetic_federation(shape, args.clients, 2 * 64 * args.steps)
    selected = np.arange(args.clients)
    forms = FORMS if args.forms == "all" else [FORMS[int(i)] for i in args.forms.split(",")]
    steps = sum(int(PFedKDH(CNN(10), PFedKDHConfig(local_epochs=1)).trainer.num_steps(int(n)))
                for n in np.asarray(data.train_n)[selected])
    print(f"backend={jax.default_backend()} device={jax.devices()[0].device_kind} shape={shape} "
          f"clients={args.clients} local steps/round={steps} (batch 64)")
    rows = []
    print("| clients | step loop | chunk | samples/s | s/round (median, min–max) | first round (incl. compile) |")
    print("|---|---|---|---|---|---|")
    for cp, sl, chunk in forms:
        first, times = time_form(data, cp, sl, chunk, selected, args.repeats)
        med = statistics.median(times)
        row = {"client_parallel": cp, "step_loop": sl, "chunk_steps": chunk or None,
               "samples_per_second": steps * 64 / med, "seconds_per_round": med,
               "min": min(times), "max": max(times), "first_round": first}
        rows.append(row)
        print(f"| {cp} | {sl} | {chunk or '–'} | {row['samples_per_second']:.0f} | "
              f"{med:.2f} ({min(times):.2f}–{max(times):.2f}) | {first:.1f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": shape, "steps_per_round": steps, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
