"""Example (c): a grid of learning rates × seeds as one vmapped program.

    python experiments/examples/lr_seed_grid.py        # digits, 3 learning rates × 2 seeds, 5 rounds

Every member of the grid is one repetition: its own initialisation (seed), its own learning rate
(``with_hparams`` rebuilds the method inside the trace from a traced value), its own client
selections; ``jax.vmap`` runs them as one program.
"""

from __future__ import annotations

import argparse
import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp

import pfedkdh_jax as p


class MLP(nn.Module):
    """A two-layer perceptron backbone (64-d features): a model that is not the paper's CNN."""

    @nn.compact
    def __call__(self, x):
        x = x.reshape(x.shape[0], -1)
        return nn.relu(nn.Dense(64)(nn.relu(nn.Dense(128)(x))))


def model_of(name: str, num_classes: int):
    return p.CNN(num_classes) if name == "cnn" else p.LinenModel(MLP(), nn.Dense(num_classes))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--lrs", default="0.005,0.015,0.05")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--model", choices=("cnn", "mlp"), default="cnn",
                    help="the paper's CNN, or a small MLP (on XLA:CPU a convolution inside a scan or a vmap "
                         "over repetitions is slow: the test suite runs the MLP)")
    a = ap.parse_args(argv)

    pool = p.load_pool("digits")
    data = p.from_arrays(pool.images, pool.labels, num_clients=a.clients, alpha=0.5, aux_size=300, seed=0)
    algo = p.FedPer(model_of(a.model, pool.num_classes), p.FedPerConfig(local_epochs=1))
    grid = list(itertools.product([float(x) for x in a.lrs.split(",")], range(a.seeds)))
    lrs = jnp.array([lr for lr, _ in grid])
    seeds = jnp.array([s for _, s in grid])
    layout = p.Layout("vmap", "scan")

    def run(lr, seed):
        member = algo.with_hparams({"lr": lr})
        round_fn = p.make_round(member, layout)
        key = jax.random.key(seed)

        def one_round(state, t):
            k_select, k_round = jax.random.split(jax.random.fold_in(key, t))
            return round_fn(state, data, p.select_clients(k_select, a.clients, a.clients // 2), k_round)[0], None
        state = jax.lax.scan(one_round, member.init(key, data), jnp.arange(a.rounds))[0]
        return p.make_evaluate(member, layout)(state, data, key)["personalized_macro_accuracy"]

    accuracy = jax.jit(jax.vmap(run))(lrs, seeds)
    out = {f"lr={lr} seed={s}": round(float(x), 4) for (lr, s), x in zip(grid, accuracy)}
    for k, v in out.items():
        print(k, v)
    return out


if __name__ == "__main__":
    main()
