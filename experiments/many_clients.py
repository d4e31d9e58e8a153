"""Many small clients: pfedkdh_jax next to the PyTorch client loop at K = 100 … 10,000 (issue 28;
BENCHMARKS.md, "Many clients").

For each ``K:C`` (K clients, C of them a round) both sides train FedPer (persistent heads, the
backbone averaged by n_k: ``experiments/torch_reference.py``) on the same MNIST partition (α, data
seed 0, paper preset: E = 2, batch 64, lr 0.015, no evaluation) and **the same selected clients
every round**, so they do the same steps (each client 2·ceil(n/64), the last batch partial, no
client skipped). Three sides take turns a round at a time: PyTorch, the engine as a long run runs it
(steps of a client under a batch compute its size rounded up to 8 slots: ``--slot-granule 8``; a
client under one batch, two steps, is one compiled call: ``--fused-steps 2``), and the engine computing a
full batch every step, piece by piece (``--slot-granule 0 --fused-steps 0``, the form before). Reported per
K: the median round time of each and the ratios, and the share of computed batch slots that hold a
real sample (sample-passes ÷ computed slots, counted on the host from the partition).

    pip install -e '.[bench]'
    python experiments/many_clients.py --data-dir ../shared/data/tfds --write runs/many_clients.md

Run it with nothing else busy on the machine. Timings are benchmark output, never test assertions.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time

import numpy as np


def slots(sizes, selected, epochs: int, batch: int, granule: int | None) -> tuple[int, int]:
    """(sample-passes, computed slots) of one round's selected clients, each step computing its
    batch's size rounded up to ``granule`` (``None``: a full batch), as the engine's host plan does."""
    from pfedkdh_jax.engine.local import step_widths
    real = computed = 0
    for k in selected:
        n = int(sizes[k])
        real += epochs * n
        computed += sum(batch if w is None else w for w in step_widths([n], epochs, batch, granule))
    return real, computed


def partition(k: int, c: int, data_dir, alpha: float = 0.5, min_client_samples: int = 5, client_parallel=None):
    """The run of this benchmark at K clients, C a round: ``(cfg, pool, part, sizes)`` (FedPer, MNIST, paper
    preset; ``sizes``: each client's train samples). Also used by process_per_core.py and fused_plans.py."""
    from pfedkdh_jax.run.config import make_config
    from pfedkdh_jax.run.experiment import prepare_data
    cfg = make_config("paper", method="fedper", dataset="mnist", alpha=alpha, data_dir=data_dir, num_clients=k,
                      participation=c / k, min_client_samples=min_client_samples, client_parallel=client_parallel)
    pool, part, _ = prepare_data(cfg)
    return cfg, pool, part, np.array([len(t) for t in part.train_idx])


def engine_runner(cfg, pool, data, slot_granule: int, fused_steps: int, client_devices=None):
    """``(algo, RoundRunner)`` of ``cfg`` on ``data`` with the given step widths and one-call clients."""
    from pfedkdh_jax.engine.runner import RoundRunner
    from pfedkdh_jax.run.experiment import engine_layout, make_algorithm, resolved_conv_form
    layout = engine_layout(dataclasses.replace(cfg, slot_granule=slot_granule, fused_steps=fused_steps,
                                               client_devices=client_devices))
    algo = make_algorithm(cfg, pool.num_classes, resolved_conv_form(cfg, layout))
    return algo, RoundRunner(algo, data, layout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--settings", default="100:10,1000:50,10000:100",
                    help="comma list of K:C (clients, selected a round)")
    ap.add_argument("--alpha", type=float, default=0.5)
    ap.add_argument("--min-client-samples", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=4, help="timed rounds after a first (compiling) one")
    ap.add_argument("--threads", type=int, default=2, help="PyTorch intra-op threads")
    ap.add_argument("--sides", default="torch,jax,jax_full")
    ap.add_argument("--client-parallel", default=None, help="the engine's layout (default: the backend's)")
    ap.add_argument("--fused-steps", type=int, default=2,
                    help="the 'jax' side's --fused-steps: clients of at most this many steps run as one call")
    ap.add_argument("--write", default=None, help="append the markdown table (and JSON) here")
    args = ap.parse_args()
    sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(__file__)))
    from pfedkdh_jax.engine.cpu_devices import request_for_client_devices
    request_for_client_devices(None)
    import jax

    from pfedkdh_jax.data.device import build_federated_data
    from pfedkdh_jax.engine.runner import sample_schedule

    wanted = args.sides.split(",")
    rows = []
    for setting in args.settings.split(","):
        k, c = map(int, setting.split(":"))
        cfg, pool, part, sizes = partition(k, c, args.data_dir, args.alpha, args.min_client_samples,
                                           args.client_parallel)
        schedule = sample_schedule(jax.random.key(1), args.rounds + 1, k, c)
        sides = {}
        if "torch" in wanted:
            import torch

            from torch_reference import FedPerReference, client_tensors
            torch.set_num_threads(args.threads)
            h, w, ch = pool.images.shape[1:]
            ref = FedPerReference(pool.num_classes, ch, h, [client_tensors(pool.images, pool.labels, i)
                                                          for i in part.train_idx])
            sides["torch"] = lambda sel: ref.round([int(i) for i in sel], cfg.local_epochs)
        data = build_federated_data(pool, part)
        for side, granule in (("jax", 8), ("jax_full", 0)):
            if side not in wanted:
                continue
            algo, runner = engine_runner(cfg, pool, data, granule, args.fused_steps if granule else 0)
            box = {"state": algo.init(jax.random.key(0), data), "t": 0}

            def one(sel, runner=runner, box=box):
                box["state"], _ = runner.round(box["state"], data, sel, jax.random.key(100 + box["t"]))
                jax.block_until_ready(box["state"])
                box["t"] += 1
            sides[side] = one
        row = {"K": k, "C": c, "alpha": args.alpha, "min_client_samples": args.min_client_samples,
               "fused_steps": args.fused_steps,
               "train_sizes": [int(sizes.min()), float(sizes.mean()), int(sizes.max())],
               "selected_samples": float(np.mean([sizes[s].sum() for s in schedule[1:]])),
               "steps": float(np.mean([sum(cfg.local_epochs * math.ceil(n / 64) for n in sizes[s]) for s in schedule[1:]]))}
        for granule, name in ((8, "useful_slots"), (None, "useful_slots_full")):
            r, comp = map(sum, zip(*(slots(sizes, s, cfg.local_epochs, 64, granule) for s in schedule[1:])))
            row[name] = r / comp
        t0 = {}
        for side, fn in sides.items():   # first round: compiles (JAX), warms up (PyTorch)
            s = time.perf_counter()
            fn(schedule[0])
            t0[side] = time.perf_counter() - s
        row["first_round_seconds"] = t0
        times = {side: [] for side in sides}
        for sel in schedule[1:]:          # the sides take turns, a round each, on the same clients
            for side, fn in sides.items():
                time.sleep(0.5)
                s = time.perf_counter()
                fn(sel)
                times[side].append(time.perf_counter() - s)
        row["round_seconds"] = times
        med = {side: statistics.median(v) for side, v in times.items()}
        if "torch" in med:
            row["ratio"] = {side: med[side] / med["torch"] for side in med if side != "torch"}
        rows.append(row)
        print(json.dumps(row), flush=True)

    lines = ["| K, C a round | train samples a client (min / mean / max) | selected samples, steps a round "
             "| PyTorch loop | pfedkdh_jax | ratio | useful slots | full batch every step (before) | ratio | useful slots |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        med = {s: statistics.median(v) for s, v in r["round_seconds"].items()}
        f = lambda s: f"{med[s]:.2f} s" if s in med else "–"   # noqa: E731
        g = lambda s: f"{r['ratio'][s]:.2f}×" if "ratio" in r and s in r["ratio"] else "–"   # noqa: E731
        lines.append(f"| {r['K']:,}, {r['C']} | {r['train_sizes'][0]} / {r['train_sizes'][1]:.1f} / {r['train_sizes'][2]} "
                     f"| {r['selected_samples']:.0f}, {r['steps']:.0f} | {f('torch')} | {f('jax')} | {g('jax')} "
                     f"| {100 * r['useful_slots']:.0f} % | {f('jax_full')} | {g('jax_full')} | {100 * r['useful_slots_full']:.0f} % |")
    table = "\n".join(lines)
    print(table)
    if args.write:
        with open(args.write, "a") as fh:
            fh.write(table + "\n\n" + "".join(json.dumps(r) + "\n" for r in rows) + "\n")


if __name__ == "__main__":
    main()
