"""Example (b): your own training loop — the pure round inside your ``jit`` and ``lax.scan``.

    python experiments/examples/own_loop.py            # the offline digits set, 10 rounds

``make_round`` returns a pure function; inside a trace it takes its local steps in a ``lax.scan``
(whatever the backend's host-loop default), and ``select_clients`` draws a round's clients inside
the program, so all rounds are one compiled call.
"""

from __future__ import annotations

import argparse
import time

import flax.linen as nn
import jax

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
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--model", choices=("cnn", "mlp"), default="cnn",
                    help="the paper's CNN, or a small MLP (on XLA:CPU a convolution inside a scan or a vmap "
                         "over repetitions is slow: the test suite runs the MLP)")
    a = ap.parse_args(argv)

    pool = p.load_pool("digits")
    data = p.from_arrays(pool.images, pool.labels, num_clients=a.clients, alpha=0.5, aux_size=300, seed=0)
    algo = p.PFedKDH(model_of(a.model, pool.num_classes), p.PFedKDHConfig(local_epochs=1, ea_steps=10))
    round_fn, evaluate = p.make_round(algo), p.make_evaluate(algo)

    @jax.jit
    def train(state, data, key):   # data an argument: closed over, its arrays would be constants of the program
        def one_round(state, t):
            k_select, k_round = jax.random.split(jax.random.fold_in(key, t))   # one stream each
            state, metrics = round_fn(state, data, p.select_clients(k_select, a.clients, a.clients // 2), k_round)
            return state, metrics["train_loss"]
        return jax.lax.scan(one_round, state, jax.numpy.arange(a.rounds))

    start = time.perf_counter()
    state, losses = train(algo.init(jax.random.key(0), data), data, jax.random.key(1))
    scores = jax.jit(evaluate, static_argnames="personalize")(state, data, jax.random.key(2), personalize=True)
    out = {"train_loss": [round(float(x), 4) for x in losses],
           "personalized_macro_accuracy": float(scores["personalized_macro_accuracy"]),
           "personalized_macro_accuracy_ea": float(scores["personalized_macro_accuracy_ea"]),
           "seconds": time.perf_counter() - start}
    print(out)
    return out


if __name__ == "__main__":
    main()
