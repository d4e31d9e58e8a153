"""A prototype's timing: a round's clients split over one process per core instead of the engine's XLA:CPU
devices of one process (issue 28; BENCHMARKS.md, "Two cores: …").

Not a layout of the engine. Each of N processes is pinned to its own core before JAX starts and builds its own
``RoundRunner`` on one device, for the same run as ``experiments/many_clients.py`` (FedPer, MNIST α = 0.5, min 5
samples, paper preset, ``--slot-granule 8 --fused-steps 2``). Every round, it trains its longest-first share
of the round's clients (counted in steps, as the engine spreads them over its devices) and runs its own server
step on that share. A barrier keeps the processes in step a round at a time. A round's time is the slowest
process's. Nothing passes between the processes, so a real layout of this kind would also pay for sending the
state and the sums each round; the accuracy of these rounds means nothing.

    python experiments/process_per_core.py --data-dir ../shared/data/tfds --settings 100:10,1000:50 --rounds 6

Run it with nothing else busy. Timings are benchmark output, never test assertions.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import statistics
import sys
import time


def worker(i: int, n: int, k: int, c: int, rounds: int, data_dir, barrier, out) -> None:
    os.sched_setaffinity(0, {i})                       # before JAX starts its threads
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # many_clients.py's run
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=1").strip()
    import jax
    import numpy as np

    from many_clients import engine_runner, partition
    from pfedkdh_jax.data.device import build_federated_data
    from pfedkdh_jax.engine.runner import sample_schedule

    cfg, pool, part, sizes = partition(k, c, data_dir)
    schedule = sample_schedule(jax.random.key(1), rounds + 1, k, c)   # many_clients.py's cohorts
    data = build_federated_data(pool, part)
    algo, runner = engine_runner(cfg, pool, data, slot_granule=8, fused_steps=2, client_devices=1)
    state = algo.init(jax.random.key(0), data)

    def share(selected):   # longest first to the least loaded process, in local steps
        load, mine = [0] * n, []
        for client in sorted(selected, key=lambda q: -math.ceil(sizes[q] / 64)):
            j = load.index(min(load))
            load[j] += math.ceil(sizes[client] / 64)
            if j == i:
                mine.append(client)
        return np.array(mine, np.int64)

    times = []
    for t in range(rounds + 1):                        # round 0 compiles
        barrier.wait()
        s = time.perf_counter()
        state, _ = runner.round(state, data, share(schedule[t]), jax.random.key(100 + t))
        jax.block_until_ready(state)
        times.append(time.perf_counter() - s)
        barrier.wait()
    out.put((i, times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--settings", default="100:10,1000:50", help="comma list of K:C (clients, selected a round)")
    ap.add_argument("--rounds", type=int, default=6, help="timed rounds after a first (compiling) one")
    ap.add_argument("--processes", type=int, default=2, help="one per core, pinned to cores 0 … N−1")
    ap.add_argument("--write", default=None, help="append the JSON rows here")
    args = ap.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if cores[:args.processes] != list(range(args.processes)):
        ap.error(f"--processes {args.processes} pins to cores 0…{args.processes - 1}; this process may use {cores}")
    ctx = mp.get_context("spawn")
    for setting in args.settings.split(","):
        k, c = map(int, setting.split(":"))
        barrier, out = ctx.Barrier(args.processes), ctx.Queue()
        procs = [ctx.Process(target=worker, args=(i, args.processes, k, c, args.rounds, args.data_dir, barrier, out))
                 for i in range(args.processes)]
        for p in procs:
            p.start()
        got = {}
        while len(got) < len(procs):
            if any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                sys.exit(f"a worker failed at K = {k} (exit codes {[p.exitcode for p in procs]})")
            try:
                i, times = out.get(timeout=1.0)
                got[i] = times
            except Exception:   # queue.Empty: keep watching the workers
                continue
        for p in procs:
            p.join()
        rounds = [max(got[i][t] for i in got) for t in range(1, args.rounds + 1)]
        row = {"K": k, "C": c, "processes": args.processes, "round_seconds": rounds,
               "median": statistics.median(rounds), "each": {str(i): got[i][1:] for i in sorted(got)},
               "date": time.strftime("%Y-%m-%d"), "window": time.strftime("%H:%M")}
        print(f"K = {k:,}, C = {c}: {args.processes} pinned processes, round median {row['median']:.3f} s "
              f"({', '.join(f'{x:.2f}' for x in rounds)})", flush=True)
        if args.write:
            with open(args.write, "a") as fh:
                fh.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
