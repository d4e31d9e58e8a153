"""pfedkdh_jax next to a PyTorch reference on identical work, in one process (BENCHMARKS.md, "CPU
against PyTorch"; on a GPU, issue 26's side by side).

Both sides train FedPer (``--methods fedper,fedavg`` adds FedAvg) on the same partition (data seed 0; MNIST α = 0.1 and CIFAR-10 α = 0.05 by
default), with **all 20 clients every round**, so both do the same sample-steps: E = 2 (MNIST) / 3
(CIFAR-10) epochs, batch 64, lr 0.015, the CNN of method.md §1, no evaluation. PyTorch runs its
usual sequential client loop with a ``DataLoader`` per client and round
(``experiments/torch_reference.py``), on ``--threads`` intra-op threads; JAX runs the engine's
layout for this backend (``Layout()``, or the flags below). After a first round each (JAX's
compiles), the two take turns a round at a time, so both see the machine in the same state; the
ratio is the median of the rounds' JAX / PyTorch ratios. Also timed: one training step of batch 64
alone (forward, backward, SGD) in each framework.

``--seeds 1,5`` times each method with one seed and with five: PyTorch runs the five one after another
(five models, a round of each), JAX as its CLI does (``--reps-mode auto``): one program over a
repetition axis on a GPU (``--lanes`` packs its jobs), one seed after another on a CPU; a round then
means a round of every seed. ``--device cuda`` puts PyTorch's model on the GPU
(its batches moved there from host memory, as the PyTorch FL libraries do); JAX uses its default
backend, so on a GPU machine both sides compute on the same GPU.

    pip install -e '.[bench]'
    python experiments/cpu_vs_torch.py --data-dir ../shared/data/tfds --write runs/cpu_vs_torch.md
    python experiments/cpu_vs_torch.py --datasets mnist --methods fedper,fedavg --seeds 1,5 --device cuda \
        --lanes 10   # on a GPU

Run it with nothing else busy on the machine. Timings are benchmark output, never test assertions.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

WORK = {"mnist": (0.1, 2), "cifar10": (0.05, 3), "digits": (0.5, 1)}  # dataset -> (α, E); digits: a dry run


def torch_step_rate(pool, part, threads: int | None, device: str = "cpu") -> float:
    """Samples/s of PyTorch's training step of batch 64, alone (the largest client's first 20 batches)."""
    import torch

    from torch_reference import TorchCNN, client_tensors, local_train

    if threads:
        torch.set_num_threads(threads)
    h, w, c = pool.images.shape[1:]
    big = part.train_idx[int(np.argmax([len(t) for t in part.train_idx]))]
    x, y = client_tensors(pool.images, pool.labels, big[:64 * 20])
    model = TorchCNN(pool.num_classes, c, h).to(device)
    local_train(model, x, y, epochs=1, device=device)  # warm-up
    _sync(device)
    t0 = time.perf_counter()
    steps = local_train(model, x, y, epochs=2, device=device)
    _sync(device)
    return steps * 64 / (time.perf_counter() - t0)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch
        torch.cuda.synchronize()


def torch_side(pool, part, epochs: int, threads: int | None, *, method: str = "fedper", seeds: int = 1,
               device: str = "cpu"):
    """A function that runs one round of the PyTorch reference: ``seeds`` runs of ``method`` (fedper or
    fedavg) one after another, as a PyTorch user runs a table's seeds."""
    import torch

    from torch_reference import FedPerReference, client_tensors

    if threads:
        torch.set_num_threads(threads)
    h, w, c = pool.images.shape[1:]
    clients = [client_tensors(pool.images, pool.labels, idx) for idx in part.train_idx]
    refs = [FedPerReference(pool.num_classes, c, h, clients, seed=s, personal_heads=method == "fedper",
                            device=device) for s in range(seeds)]

    def one_round():
        for ref in refs:
            ref.round(range(len(clients)), epochs)
        _sync(device)
    return one_round


def jax_side(cfg, pool, part, seeds: int = 1, lanes: int | None = None):
    """(facts of the engine, a function that runs one round) of pfedkdh_jax: ``seeds`` repetitions as
    the CLI runs them (``cfg.reps_mode``: one vmapped program, or one after another)."""
    import jax

    from pfedkdh_jax import algorithms
    from pfedkdh_jax.data.device import build_federated_data
    from pfedkdh_jax.engine.layout import Layout
    from pfedkdh_jax.engine.local import tree_stack
    from pfedkdh_jax.engine.runner import RoundRunner
    from pfedkdh_jax.run.experiment import resolved_reps_mode

    data = build_federated_data(pool, part)
    algo = algorithms.build(cfg, pool.num_classes)
    engine = Layout(cfg.client_parallel, cfg.step_loop, cfg.chunk_steps, lanes=lanes,
                    client_devices=cfg.client_devices).resolved()
    # the seeds as the CLI runs them (--reps-mode auto): one vmapped program, or one after another on a CPU
    reps = seeds if seeds > 1 and resolved_reps_mode(cfg) == "vmap" else None
    runner = RoundRunner(algo, data, engine, reps=reps)
    states = [runner.prepare(algo.init(jax.random.key(s), data), data, jax.random.key(s)) for s in range(seeds)]
    if reps:
        states = [runner.place(tree_stack(states))]
    everyone = np.arange(data.num_clients)
    selected = np.broadcast_to(everyone, (seeds, len(everyone))) if reps else everyone
    box = {"states": states, "r": 0}

    def one_round():
        key = jax.random.key(100 + box["r"])
        keys = [jax.random.split(key, seeds)] if reps else [jax.random.fold_in(key, s) for s in range(seeds)]
        box["states"] = [runner.round(st, data, selected, k)[0] for st, k in zip(box["states"], keys)]
        jax.block_until_ready(box["states"])
        box["r"] += 1

    return {"engine": f"{engine.client_parallel} + {engine.step_loop}"
                      + (f", {engine.lanes} lanes" if engine.lanes else "")
                      + (f" (chunk {engine.chunk_steps})" if engine.step_loop == "unrolled" else "")
                      + (f", {engine.client_devices} devices" if engine.client_devices > 1 else "")
                      + (", seeds vmapped" if reps else ", seeds in turn" if seeds > 1 else ""),
            "xla_flags": os.environ.get("XLA_FLAGS", "")}, one_round


def jax_step_rates(num_classes: int, input_shape, lr: float) -> dict:
    """Samples/s of the model's training step of batch 64, alone (unrolled 8 to a compiled call), compiled
    as the engine compiles local training and, where that adds options, with XLA's defaults."""
    import jax
    import jax.numpy as jnp
    import optax

    from pfedkdh_jax import losses
    from pfedkdh_jax.engine.layout import local_training_compiler_options
    from pfedkdh_jax.model import CNN

    model = CNN(num_classes)
    params = model.init(jax.random.key(0), input_shape)
    tx = optax.sgd(lr)
    rng = np.random.default_rng(0)
    xs = jnp.asarray(rng.normal(size=(8, 64, *input_shape)).astype(np.float32))
    ys = jnp.asarray(rng.integers(0, num_classes, (8, 64)).astype(np.int32))

    def chunk(p, o):
        for i in range(8):
            g = jax.grad(lambda q: jnp.mean(losses.cross_entropy(model.logits(q, xs[i]), ys[i])))(p)
            u, o = tx.update(g, o, p)
            p = optax.apply_updates(p, u)
        return p, o

    def step_rate(options):
        f = jax.jit(chunk, compiler_options=options)
        p, o = jax.block_until_ready(f(params, tx.init(params)))
        t0 = time.perf_counter()
        for _ in range(5):
            p, o = f(p, o)
        jax.block_until_ready(p)
        return 5 * 8 * 64 / (time.perf_counter() - t0)

    engine_options = local_training_compiler_options()   # None: XLA's defaults (a GPU)
    rate = step_rate(engine_options)
    return {"step_samples_per_s": rate,
            "step_samples_per_s_xla_defaults": step_rate(None) if engine_options else rate}


def side_by_side(args, cfg, pool, part, rates: dict, *, method: str, seeds: int) -> dict:
    """One row: each side's first round (JAX's compiles), then ``args.rounds`` rounds taken in turns."""
    row = {"dataset": cfg.dataset, "alpha": cfg.alpha, "epochs": cfg.local_epochs,
           "sample_steps": cfg.local_epochs * sum(len(t) for t in part.train_idx),
           "method": method, "seeds": seeds, "torch_device": args.device}
    sides = {}
    if "torch" in rates:
        sides["torch"] = torch_side(pool, part, cfg.local_epochs, args.threads, method=method, seeds=seeds,
                                    device=args.device)
        row["torch"] = {**rates["torch"], "first_round_seconds": timed(sides["torch"])}
    if "jax" in rates:
        facts, sides["jax"] = jax_side(cfg, pool, part, seeds, args.lanes)
        row["jax"] = {**rates["jax"], **facts, "first_round_seconds": timed(sides["jax"])}   # compiles
    for side in sides:
        row[side]["round_seconds"] = []
    # the frameworks take turns, a round each, so that both see the machine as it is at the time
    # (its speed drifts by up to 1.4× within an hour); a short pause lets the other's threads idle
    for _ in range(args.rounds):
        for side, fn in sides.items():
            time.sleep(1.0)
            row[side]["round_seconds"].append(timed(fn))
    if len(sides) == 2:
        row["ratios"] = [j / t for t, j in zip(row["torch"]["round_seconds"], row["jax"]["round_seconds"])]
    return row


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--datasets", default="mnist,cifar10")
    ap.add_argument("--methods", default="fedper", help="fedper and/or fedavg (comma-separated)")
    ap.add_argument("--seeds", default="1", help="comma-separated counts of seeds: PyTorch runs them one after "
                                                 "another, JAX as its CLI runs repetitions (e.g. 1,5)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None,
                    help="PyTorch intra-op threads (default: 2 with --device cpu, as the 2-core benchmarks ran; "
                         "PyTorch's own otherwise)")
    ap.add_argument("--device", default="cpu", help="PyTorch's device (cpu, cuda); JAX uses its default backend")
    ap.add_argument("--client-parallel", default=None)
    ap.add_argument("--step-loop", default=None)
    ap.add_argument("--chunk-steps", type=int, default=8)
    ap.add_argument("--lanes", type=int, default=None, help="JAX: pack each round's jobs into this many lanes "
                                                            "(vmap + scan layouts)")
    ap.add_argument("--reps-mode", default="auto", choices=("auto", "vmap", "sequential"),
                    help="JAX: how the seeds run (auto: as the CLI, vmapped but on a CPU)")
    ap.add_argument("--client-devices", type=int, default=None,
                    help="XLA:CPU devices the sequential clients are spread over (default: as the CLI, one per "
                         "core up to 2; 1 = one device)")
    ap.add_argument("--only", choices=("torch", "jax"), default=None)
    ap.add_argument("--write", default=None, help="append the markdown table (and JSON) here")
    args = ap.parse_args()
    if args.threads is None and args.device == "cpu":
        args.threads = 2
    methods = args.methods.split(",")
    if not set(methods) <= {"fedper", "fedavg"}:
        ap.error(f"--methods: fedper and/or fedavg, got {args.methods!r}")
    from pfedkdh_jax.engine.cpu_devices import request_for_client_devices
    request_for_client_devices(args.client_devices)

    from pfedkdh_jax.run.config import make_config
    from pfedkdh_jax.run.experiment import prepare_data

    rows = []
    for dataset in args.datasets.split(","):
        alpha, epochs = WORK[dataset]
        cfgs = [(method, seeds, make_config(
                    "paper", method=method, dataset=dataset, alpha=alpha, data_dir=args.data_dir, participation=1.0,
                    local_epochs=epochs, client_parallel=args.client_parallel, step_loop=args.step_loop,
                    chunk_steps=args.chunk_steps, client_devices=args.client_devices, reps_mode=args.reps_mode))
                for method in methods for seeds in (int(n) for n in args.seeds.split(","))]
        pool, part, _ = prepare_data(cfgs[0][2])
        # the lone step depends on neither method nor seeds: measured once per dataset
        rates = {}
        if args.only != "jax":
            rates["torch"] = {"step_samples_per_s": torch_step_rate(pool, part, args.threads, args.device)}
        if args.only != "torch":
            rates["jax"] = jax_step_rates(pool.num_classes, pool.images.shape[1:], cfgs[0][2].lr)
        for method, seeds, cfg in cfgs:
            rows.append(side_by_side(args, cfg, pool, part, rates, method=method, seeds=seeds))
            print(json.dumps(rows[-1]), flush=True)

    lines = ["| work | method, seeds | PyTorch reference | pfedkdh_jax "
             "| ratio (JAX / PyTorch round time, median of the turns) | step of batch 64, samples/s: PyTorch / JAX |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        t = statistics.median(r["torch"]["round_seconds"]) if "torch" in r else None
        j = statistics.median(r["jax"]["round_seconds"]) if "jax" in r else None
        ratio = statistics.median(r["ratios"]) if "ratios" in r else None
        name = {"mnist": "MNIST", "cifar10": "CIFAR-10", "digits": "digits"}[r["dataset"]]
        what = {"fedper": "FedPer", "fedavg": "FedAvg"}[r["method"]] + (
            f", {r['seeds']} seeds" if r["seeds"] > 1 else "")
        lines.append(
            f"| {name} α = {r['alpha']:g}, E = {r['epochs']}, {r['sample_steps'] / 1000:.1f}k sample-steps a round "
            f"per seed | {what} | {f'{t:.2f} s' if t else '–'}"
            f"{' (' + r['torch_device'] + ')' if t else ''} | {f'{j:.2f} s' if j else '–'}"
            f"{' (' + r['jax']['engine'] + ')' if j else ''} | {f'{ratio:.2f}×' if ratio else '–'} "
            f"| {r['torch']['step_samples_per_s']:.0f} / {r['jax']['step_samples_per_s']:.0f} |"
            if t and j else f"| {name} | {what} | {t} | {j} | – | – |")
    table = "\n".join(lines)
    print(table)
    if args.write:
        with open(args.write, "a") as f:
            f.write(table + "\n\n" + "".join(json.dumps(r) + "\n" for r in rows) + "\n")


if __name__ == "__main__":
    main()
