"""Helpers of experiments/gpu_sweep.sh (issue 12's accelerator figures).

    python experiments/gpu_sweep.py prepare runs/gpu-data --data-dir ../shared/data/tfds
        # a data dir the device call can carry (< 64 MiB): MNIST's and Fashion-MNIST's decoded-array
        # caches and, per dataset, its dataset_info.json with empty stand-ins for the shard files
        # (the loader checks their names; the cache holds the images)
    python experiments/gpu_sweep.py fraction SWEEP_DIR --seconds S --rate FLOPS
        # the sweep's useful training FLOPs (sample-steps of the selected clients × the model's FLOPs
        # per sample, + a teacher forward where λ > 0) over S seconds at the measured matmul rate
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(__file__))


def prepare(dest: str, data_dir: str, datasets=("mnist", "fashion_mnist")) -> None:
    from pfedkdh_jax.data.sources import _cache_path, _registered_version, load_pool

    cache = os.path.join(dest, "cache")
    os.makedirs(cache, exist_ok=True)
    for name in datasets:
        load_pool(name, data_dir)   # makes sure the cache exists here
        version = _registered_version(name, data_dir)
        src = os.path.join(data_dir, name, version)
        out = os.path.join(dest, "tfds", name, version)
        os.makedirs(out, exist_ok=True)
        shutil.copy(os.path.join(src, "dataset_info.json"), out)
        for shard in os.listdir(src):
            if ".array_record-" in shard:
                open(os.path.join(out, shard), "wb").close()
        shutil.copy(_cache_path(name, version, data_dir, None), cache)
    size = sum(os.path.getsize(p) for p in glob.glob(os.path.join(dest, "**"), recursive=True) if os.path.isfile(p))
    print(f"{dest}: {size / 2**20:.1f} MiB (pass --data-dir {dest}/tfds with PFEDKDH_CACHE_DIR={dest}/cache)")


def useful_flops(sweep_dir: str) -> tuple[float, int]:
    """Training FLOPs of every point's selected clients (E epochs over n_k samples each round, every
    repetition), and the number of sample-steps."""
    import numpy as np
    from benchmarks import model_flops

    from pfedkdh_jax.engine.runner import sample_schedule
    from pfedkdh_jax.run.experiment import load_run_config, streams

    flops = samples = 0.0
    for point in sorted(glob.glob(os.path.join(sweep_dir, "points", "*"))):
        cfg = load_run_config(point)
        with open(os.path.join(point, "summary.json")) as f:
            summary = json.load(f)
        with open(os.path.join(point, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        sizes = np.asarray(summary["partition"]["train_sizes"])
        shape = {"cifar10": (32, 32, 3)}.get(cfg.dataset, (28, 28, 1))
        per = model_flops(shape)["pfedkdh_step" if cfg.method == "pfedkdh" and cfg.lam > 0 else "train"]
        seeds = [r["seed"] for r in summary.get("repetitions", [])] or [cfg.seed]
        steps = 0
        for seed in seeds:   # each repetition's own client schedule, as the run drew it
            sched = sample_schedule(streams(seed)["sampling"], len(rows), cfg.num_clients, cfg.clients_per_round)
            steps += cfg.local_epochs * int(sizes[sched].sum())
        samples += steps
        flops += steps * per
    return flops, int(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("dest")
    p.add_argument("--data-dir", required=True)
    p.add_argument("--datasets", default="mnist,fashion_mnist")
    f = sub.add_parser("fraction")
    f.add_argument("sweep_dir")
    f.add_argument("--seconds", type=float, required=True)
    f.add_argument("--rate", type=float, required=True, help="measured matmul FLOP/s")
    args = ap.parse_args()
    if args.cmd == "prepare":
        prepare(args.dest, args.data_dir, tuple(args.datasets.split(",")))
    else:
        flops, samples = useful_flops(args.sweep_dir)
        print(f"{samples} useful sample-steps, {flops / 1e12:.2f} TFLOP in {args.seconds:.1f} s = "
              f"{flops / args.seconds / 1e12:.2f} TFLOP/s = {100 * flops / args.seconds / args.rate:.1f} % "
              f"of the matmul rate ({args.rate / 1e12:.1f} TFLOP/s)")


if __name__ == "__main__":
    main()
