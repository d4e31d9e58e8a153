"""Example (a): your own flax.linen backbone and optimizer — a ResNet-8-sized residual network
trained with AdamW under pFedKDH and FedPer, on CIFAR-10 (or any dataset ``load_pool`` reads).

    python experiments/examples/resnet_adamw.py --dataset cifar10 --data-dir ../shared/data/tfds \\
        --rounds 10          # the paper preset's partition, budget and clients (α = 0.05)

Nothing here is the paper's CNN or its SGD: the model is a ``LinenModel`` of two modules, the
optimizer a function of the learning rate (so the learning rate stays the config's).
"""

from __future__ import annotations

import argparse
import time

import flax.linen as nn
import jax
import numpy as np
import optax

import pfedkdh_jax as p


class ResidualBlock(nn.Module):
    channels: int
    stride: int = 1

    @nn.compact
    def __call__(self, x):
        y = nn.Conv(self.channels, (3, 3), strides=self.stride)(x)
        y = nn.relu(nn.GroupNorm(num_groups=4)(y))
        y = nn.GroupNorm(num_groups=4)(nn.Conv(self.channels, (3, 3))(y))
        if x.shape[-1] != self.channels or self.stride != 1:
            x = nn.Conv(self.channels, (1, 1), strides=self.stride)(x)
        return nn.relu(x + y)


class ResNet8(nn.Module):
    """Stem conv 16 → residual blocks of 16, 32 (stride 2), 64 (stride 2) → global average pool:
    64-d features (GroupNorm, no batch statistics: a model's state is parameters only)."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(16, (3, 3))(x))
        for channels, stride in ((16, 1), (32, 2), (64, 2)):
            x = ResidualBlock(channels, stride)(x)
        return x.mean(axis=(1, 2))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", default="cifar10")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--alpha", type=float, default=0.05)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--local-epochs", type=int, default=3)
    ap.add_argument("--aux-size", type=int, default=5000)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--methods", default="pfedkdh,fedper")
    a = ap.parse_args(argv)

    pool = p.load_pool(a.dataset, data_dir=a.data_dir)
    data = p.from_arrays(pool.images, pool.labels, num_clients=a.clients, alpha=a.alpha, aux_size=a.aux_size,
                         seed=0)
    model = p.LinenModel(ResNet8(), nn.Dense(pool.num_classes))
    adamw = lambda lr: optax.adamw(lr, weight_decay=1e-4)  # noqa: E731
    budget = dict(lr=a.lr, batch_size=64, local_epochs=a.local_epochs, optimizer=adamw)
    algos = {"pfedkdh": p.PFedKDH(model, p.PFedKDHConfig(**budget, teacher_optimizer=adamw, ea_optimizer=adamw)),
             "fedper": p.FedPer(model, p.FedPerConfig(**budget))}
    schedule = p.sample_schedule(jax.random.key(1), a.rounds, a.clients, max(1, a.clients // 2))
    results = {}
    for name in a.methods.split(","):
        algo = algos[name]
        runner = p.RoundRunner(algo, data)          # the backend's fastest layout, compiled once
        state = algo.init(jax.random.key(0), data)
        times = []
        for t, selected in enumerate(schedule):
            start = time.perf_counter()
            state, metrics = runner.round(state, data, selected, jax.random.fold_in(jax.random.key(2), t))
            loss = float(metrics["train_loss"])
            times.append(time.perf_counter() - start)
            print(f"{name} round {t + 1}: train loss {loss:.4f} ({times[-1]:.1f} s)", flush=True)
        scores = runner.evaluate(state, data, jax.random.key(3), personalize=algo.personalization is not None)
        acc = float(scores["personalized_macro_accuracy"])
        results[name] = {"personalized_macro_accuracy": acc, "seconds_per_round": float(np.median(times[1:] or times)),
                         **({"ea": float(scores["personalized_macro_accuracy_ea"])}
                            if "personalized_macro_accuracy_ea" in scores else {})}
        print(f"{name}: personalized macro accuracy {100 * acc:.2f} %"
              + (f", EA {100 * results[name]['ea']:.2f} %" if "ea" in results[name] else "")
              + f", {results[name]['seconds_per_round']:.1f} s a round", flush=True)
    return results


if __name__ == "__main__":
    main()
