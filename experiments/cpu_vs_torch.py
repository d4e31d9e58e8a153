"""pfedkdh_jax next to a PyTorch reference on identical work, in one process (BENCHMARKS.md, "CPU
against PyTorch").

Both sides train FedPer on the same partition (data seed 0; MNIST α = 0.1 and CIFAR-10 α = 0.05 by
default), with **all 20 clients every round**, so both do the same sample-steps: E = 2 (MNIST) / 3
(CIFAR-10) epochs, batch 64, lr 0.015, the CNN of method.md §1, no evaluation. PyTorch runs its
usual sequential client loop with a ``DataLoader`` per client and round
(``experiments/torch_reference.py``), on ``--threads`` intra-op threads; JAX runs the engine's
layout for this backend (``Layout()``, or the flags below). After a first round each (JAX's
compiles), the two take turns a round at a time, so both see the machine in the same state; the
ratio is the median of the rounds' JAX / PyTorch ratios. Also timed: one training step of batch 64
alone (forward, backward, SGD) in each framework.

    pip install -e '.[bench]'
    python experiments/cpu_vs_torch.py --data-dir ../shared/data/tfds --write runs/cpu_vs_torch.md

Run it with nothing else busy on the machine. Timings are benchmark output, never test assertions.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

WORK = {"mnist": (0.1, 2), "cifar10": (0.05, 3)}  # dataset -> (α, E)


def torch_side(pool, part, epochs: int, threads: int):
    """(step samples/s, a function that runs one round) of the PyTorch reference."""
    import torch

    from torch_reference import FedPerReference, TorchCNN, client_tensors, local_train

    torch.set_num_threads(threads)
    h, w, c = pool.images.shape[1:]
    clients = [client_tensors(pool.images, pool.labels, idx) for idx in part.train_idx]
    # one step of batch 64, alone
    model = TorchCNN(pool.num_classes, c, h)
    x, y = clients[int(np.argmax([len(t[1]) for t in clients]))]
    xb, yb = x[:64 * 20], y[:64 * 20]
    local_train(model, xb, yb, epochs=1)  # warm-up
    t0 = time.perf_counter()
    steps = local_train(model, xb, yb, epochs=2)
    step_rate = steps * 64 / (time.perf_counter() - t0)
    ref = FedPerReference(pool.num_classes, c, h, clients)
    return step_rate, lambda: ref.round(range(len(clients)), epochs)


def jax_side(cfg, pool, part):
    """(facts of the engine, a function that runs one round) of pfedkdh_jax."""
    import jax
    import jax.numpy as jnp
    import optax

    from pfedkdh_jax import algorithms, losses
    from pfedkdh_jax.data.device import build_federated_data
    from pfedkdh_jax.engine.layout import Layout
    from pfedkdh_jax.engine.runner import RoundRunner
    from pfedkdh_jax.model import CNN

    data = build_federated_data(pool, part)
    algo = algorithms.build(cfg, pool.num_classes)
    engine = Layout(cfg.client_parallel, cfg.step_loop, cfg.chunk_steps, client_devices=cfg.client_devices).resolved()
    runner = RoundRunner(algo, data, engine)
    state = algo.init(jax.random.key(0), data)
    everyone = np.arange(data.num_clients)
    box = {"state": state, "r": 0}

    def one_round():
        box["state"], _ = runner.round(box["state"], data, everyone, jax.random.key(100 + box["r"]))
        jax.block_until_ready(box["state"])
        box["r"] += 1

    # one step of batch 64, alone (the model's training step, unrolled 8 to a compiled call)
    model = CNN(pool.num_classes)
    params = model.init(jax.random.key(0), data.input_shape)
    tx = optax.sgd(cfg.lr)
    rng = np.random.default_rng(0)
    xs = jnp.asarray(rng.normal(size=(8, 64, *data.input_shape)).astype(np.float32))
    ys = jnp.asarray(rng.integers(0, pool.num_classes, (8, 64)).astype(np.int32))

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

    from pfedkdh_jax.engine.layout import local_training_compiler_options
    return {"step_samples_per_s": step_rate(local_training_compiler_options()),  # as the engine compiles
            "step_samples_per_s_xla_defaults": step_rate(None),
            "engine": f"{engine.client_parallel} + {engine.step_loop}"
                      + (f" (chunk {engine.chunk_steps})" if engine.step_loop == "unrolled" else "")
                      + (f", {engine.client_devices} devices" if engine.client_devices > 1 else ""),
            "xla_flags": os.environ.get("XLA_FLAGS", "")}, one_round


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--datasets", default="mnist,cifar10")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="PyTorch intra-op threads")
    ap.add_argument("--client-parallel", default=None)
    ap.add_argument("--step-loop", default=None)
    ap.add_argument("--chunk-steps", type=int, default=8)
    ap.add_argument("--client-devices", type=int, default=None,
                    help="XLA:CPU devices the sequential clients are spread over (default: as the CLI, one per "
                         "core up to 2; 1 = one device)")
    ap.add_argument("--only", choices=("torch", "jax"), default=None)
    ap.add_argument("--write", default=None, help="append the markdown table (and JSON) here")
    args = ap.parse_args()
    from pfedkdh_jax.engine.cpu_devices import request_for_client_devices
    request_for_client_devices(args.client_devices)

    from pfedkdh_jax.run.config import make_config
    from pfedkdh_jax.run.experiment import prepare_data

    rows = []
    for dataset in args.datasets.split(","):
        alpha, epochs = WORK[dataset]
        cfg = make_config("paper", method="fedper", dataset=dataset, alpha=alpha, data_dir=args.data_dir,
                          participation=1.0, local_epochs=epochs, client_parallel=args.client_parallel,
                          step_loop=args.step_loop, chunk_steps=args.chunk_steps,
                          client_devices=args.client_devices)
        pool, part, _ = prepare_data(cfg)
        sample_steps = epochs * sum(len(t) for t in part.train_idx)
        row = {"dataset": dataset, "alpha": alpha, "epochs": epochs, "sample_steps": sample_steps}
        sides = {}
        if args.only != "jax":
            rate, sides["torch"] = torch_side(pool, part, epochs, args.threads)
            row["torch"] = {"step_samples_per_s": rate, "first_round_seconds": timed(sides["torch"])}
        if args.only != "torch":
            row["jax"], sides["jax"] = jax_side(cfg, pool, part)
            row["jax"]["first_round_seconds"] = timed(sides["jax"])   # compiles
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
        rows.append(row)
        print(json.dumps(row), flush=True)

    lines = ["| work | PyTorch reference, FedPer | pfedkdh_jax, FedPer "
             "| ratio (JAX / PyTorch round time, median of the turns) | step of batch 64, samples/s: PyTorch / JAX |",
             "|---|---|---|---|---|"]
    for r in rows:
        t = statistics.median(r["torch"]["round_seconds"]) if "torch" in r else None
        j = statistics.median(r["jax"]["round_seconds"]) if "jax" in r else None
        ratio = statistics.median(r["ratios"]) if "ratios" in r else None
        name = {"mnist": "MNIST", "cifar10": "CIFAR-10"}[r["dataset"]]
        lines.append(
            f"| {name} α = {r['alpha']:g}, E = {r['epochs']}, {r['sample_steps'] / 1000:.1f}k sample-steps a round "
            f"| {f'{t:.1f} s' if t else '–'} | {f'{j:.1f} s' if j else '–'}"
            f"{' (' + r['jax']['engine'] + ')' if j else ''} | {f'{ratio:.2f}×' if ratio else '–'} "
            f"| {r['torch']['step_samples_per_s']:.0f} / {r['jax']['step_samples_per_s']:.0f} |"
            if t and j else f"| {name} | {t} | {j} | – | – |")
    table = "\n".join(lines)
    print(table)
    if args.write:
        with open(args.write, "a") as f:
            f.write(table + "\n\n" + "".join(json.dumps(r) + "\n" for r in rows) + "\n")


if __name__ == "__main__":
    main()
