"""What keeping K per-client models on disk would cost a round (issue 28; BENCHMARKS.md, "Two cores: …",
the last part).

Ditto, pFedMe, FedALA and pFedSim keep a whole model per client (582,026 float32 for the MNIST CNN,
2.3 MB). At K = 10,000 that is 21.7 GiB, which the memory pre-flight refuses on a 24 GiB machine. A store on
disk (``numpy.memmap``) gathered and written back per round is the way such a run could fit there. This
script measures that store's costs on the machine's disk, without the engine: write K rows, then per round
gather C random rows and write them back (flushed), then read every row once in chunks (what an evaluation
of all K personal models would read).

    python experiments/rows_on_disk.py --dir /tmp --clients 10000 --per-round 100

It needs K × 2.3 MB of free disk and removes its file at the end. Timings are benchmark output.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np

MODEL_FLOATS = 582_026   # the MNIST CNN of method.md §1 (backbone and head)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the store's file goes")
    ap.add_argument("--clients", type=int, default=10_000, help="K: rows of the store")
    ap.add_argument("--per-round", type=int, default=100, help="C: rows gathered and written back a round")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--row-floats", type=int, default=MODEL_FLOATS)
    ap.add_argument("--chunk", type=int, default=128, help="rows read at a time in the full pass")
    args = ap.parse_args()
    if not 0 < args.per_round <= args.clients:
        ap.error(f"--per-round must be in [1, --clients]; got {args.per_round}")
    need = args.clients * args.row_floats * 4
    free = os.statvfs(args.dir).f_bavail * os.statvfs(args.dir).f_frsize
    if need > free:
        ap.error(f"the store needs {need / 2**30:.1f} GiB in {args.dir}, which has {free / 2**30:.1f} GiB free")
    fd, path = tempfile.mkstemp(suffix=".npy", dir=args.dir)
    os.close(fd)
    try:
        t = time.perf_counter()
        store = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(args.clients, args.row_floats))
        row = np.random.default_rng(0).random(args.row_floats, dtype=np.float32)
        for k in range(0, args.clients, 100):
            store[k:k + 100] = row
        store.flush()
        print(f"wrote {need / 2**30:.1f} GiB ({args.clients} rows) in {time.perf_counter() - t:.1f} s", flush=True)
        rng = np.random.default_rng(1)
        gather, scatter = [], []
        for _ in range(args.rounds):
            sel = np.sort(rng.choice(args.clients, args.per_round, replace=False))
            t = time.perf_counter()
            rows = store[sel]
            gather.append(time.perf_counter() - t)
            t = time.perf_counter()
            store[sel] = rows + 1
            store.flush()
            scatter.append(time.perf_counter() - t)
        print(f"a round's {args.per_round} rows ({args.per_round * args.row_floats * 4 / 2**20:.0f} MiB): gather "
              f"{np.median(gather):.3f} s median ({min(gather):.3f}–{max(gather):.3f}), write back and flush "
              f"{np.median(scatter):.3f} s median ({min(scatter):.3f}–{max(scatter):.3f})", flush=True)
        t = time.perf_counter()
        total = 0.0
        for k in range(0, args.clients, args.chunk):
            total += float(np.asarray(store[k:k + args.chunk]).sum(dtype=np.float64))
        print(f"every row read once, {args.chunk} at a time: {time.perf_counter() - t:.1f} s", flush=True)
        del store
    finally:
        os.remove(path)


if __name__ == "__main__":
    main()
