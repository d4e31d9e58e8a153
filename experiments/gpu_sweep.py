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
import time

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


def profile(out: str, data_dir: str | None, dataset: str, alpha: float, seeds: int, lanes: int | None,
            rounds: int, threads_like: str | None = None) -> dict:
    import jax

    from cpu_vs_torch import jax_side
    from pfedkdh_jax.run.config import make_config
    from pfedkdh_jax.run.experiment import prepare_data

    cfg = make_config("paper", method="pfedkdh", dataset=dataset, alpha=alpha, data_dir=data_dir, participation=1.0,
                      reps_mode="vmap")
    pool, part, _ = prepare_data(cfg)
    facts, one_round = jax_side(cfg, pool, part, seeds, lanes)
    one_round()   # compiles
    one_round()
    os.makedirs(out, exist_ok=True)
    t0 = time.perf_counter()
    with jax.profiler.trace(out, create_perfetto_trace=True):
        for _ in range(rounds):
            one_round()
    wall = time.perf_counter() - t0
    found = sorted(glob.glob(os.path.join(out, "**", "*perfetto_trace.json.gz"), recursive=True))
    summary = {"engine": facts["engine"], "rounds": rounds, "seeds": seeds, "host_seconds": wall,
               **(summarise_trace(found[-1], threads_like=threads_like) if found else {"error": f"no perfetto trace under {out}"})}
    print(json.dumps(summary, indent=1))
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary


def summarise_trace(path: str, top: int = 10, threads_like: str | None = None) -> dict:
    """Kernel time against the traced window from a Chrome/Perfetto JSON trace: the device processes'
    stream threads (their kernels and copies), else every thread of a device process; with
    ``threads_like``, the threads whose name holds it (a CPU dry run: ``XLAEigen``, the op threads)."""
    import gzip

    with gzip.open(path, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    procs = {e["pid"]: e["args"].get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"].get("name", "") for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    devices = {p for p, n in procs.items() if "GPU" in n or "TPU" in n or "/device:" in n}
    if threads_like:
        devices = {k[0] for k, n in threads.items() if threads_like in n}
    if not devices:
        return {"error": "no device process in the trace", "processes": sorted(set(procs.values()))}
    streams = {k for k, n in threads.items() if k[0] in devices
               and (threads_like in n if threads_like else n.lower().startswith("stream"))}
    spans = sorted((e["ts"], e["ts"] + e.get("dur", 0), e.get("name", "")) for e in events
                   if e.get("ph") == "X" and e.get("pid") in devices
                   and ((e["pid"], e.get("tid")) in streams if streams else True))
    if not spans:
        return {"error": "no kernels in the device processes", "processes": [procs[p] for p in devices]}
    busy, end, gaps = 0.0, spans[0][0], []
    for a, b, _ in spans:   # the union of the intervals, and the idle gaps between them
        if a > end:
            gaps.append(a - end)
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
    window = end - spans[0][0]
    per_name: dict[str, float] = {}
    for a, b, name in spans:
        per_name[name] = per_name.get(name, 0.0) + (b - a)
    total = sum(per_name.values())
    gaps_sorted = sorted(gaps)
    return {"device_processes": [procs[p] for p in sorted(devices)], "stream_threads": len(streams),
            "kernels": len(spans), "window_ms": window / 1e3, "busy_ms": busy / 1e3,
            "busy_fraction": busy / window if window else None,
            "mean_kernel_us": total / len(spans), "gaps": len(gaps), "gap_ms_total": sum(gaps) / 1e3,
            "gap_us_median": gaps_sorted[len(gaps) // 2] if gaps else 0.0,
            "gaps_over_100us_ms": sum(g for g in gaps if g > 100) / 1e3,
            "top_kernels": [{"name": n[:120], "ms": t / 1e3, "share": t / total}
                            for n, t in sorted(per_name.items(), key=lambda kv: -kv[1])[:top]]}


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
    q = sub.add_parser("profile")
    q.add_argument("out")
    q.add_argument("--data-dir", default=None)
    q.add_argument("--dataset", default="mnist")
    q.add_argument("--alpha", type=float, default=0.1)
    q.add_argument("--seeds", type=int, default=5)
    q.add_argument("--lanes", type=int, default=None)
    q.add_argument("--rounds", type=int, default=3)
    q.add_argument("--threads-like", default=None, help="count the threads whose name holds this as the device "
                                                        "(a CPU dry run: XLAEigen)")
    args = ap.parse_args()
    if args.cmd == "prepare":
        prepare(args.dest, args.data_dir, tuple(args.datasets.split(",")))
    elif args.cmd == "profile":
        profile(args.out, args.data_dir, args.dataset, args.alpha, args.seeds, args.lanes, args.rounds,
                args.threads_like)
    else:
        flops, samples = useful_flops(args.sweep_dir)
        print(f"{samples} useful sample-steps, {flops / 1e12:.2f} TFLOP in {args.seconds:.1f} s = "
              f"{flops / args.seconds / 1e12:.2f} TFLOP/s = {100 * flops / args.seconds / args.rate:.1f} % "
              f"of the matmul rate ({args.rate / 1e12:.1f} TFLOP/s)")


if __name__ == "__main__":
    main()
