"""Example (d): your own arrays and a natural partition (a client id per sample, as LEAF/FEMNIST-style
data come) — here float feature vectors, not images, with a small MLP.

    python experiments/examples/natural_partition.py

The digits set's 8×8 images flattened to 64 float features in [0, 1]; each "writer" (client) is a
block of consecutive samples. Float data stay float; the model sees them as given.
"""

from __future__ import annotations

import argparse

import flax.linen as nn
import jax
import numpy as np
from sklearn.datasets import load_digits

import pfedkdh_jax as p


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.relu(nn.Dense(64)(nn.relu(nn.Dense(128)(x))))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--writers", type=int, default=12)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--local-epochs", type=int, default=5)
    a = ap.parse_args(argv)

    bunch = load_digits()
    x = (bunch.data / 16.0).astype(np.float32)                     # [N, 64], floats in [0, 1]
    writers = np.arange(len(x)) * a.writers // len(x)             # a client id per sample
    data = p.from_arrays(x, bunch.target, client_ids=writers, aux_size=100, seed=0)
    algo = p.FedPer(p.LinenModel(MLP(), nn.Dense(10)), p.FedPerConfig(lr=a.lr, local_epochs=a.local_epochs))
    runner = p.RoundRunner(algo, data)
    state = algo.init(jax.random.key(0), data)
    for t, selected in enumerate(p.sample_schedule(jax.random.key(1), a.rounds, data.num_clients,
                                                   data.num_clients // 2)):
        state, _ = runner.round(state, data, selected, jax.random.fold_in(jax.random.key(2), t))
    acc = float(runner.evaluate(state, data, jax.random.key(3))["personalized_macro_accuracy"])
    print(f"{data.num_clients} writers, personalized macro accuracy {100 * acc:.2f} %")
    return {"clients": data.num_clients, "personalized_macro_accuracy": acc}


if __name__ == "__main__":
    main()
