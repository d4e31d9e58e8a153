"""Example (e): a method of your own, written outside the package against the protocol.

    python experiments/examples/own_method.py            # the offline digits set, 10 rounds

FedPerM: FedPer whose server moves the shared backbone by an optax optimizer of the clients' mean
change (server momentum, as FedAvgM does for FedAvg) instead of setting it to their mean. Every
client keeps a private head; only backbones travel. With ``server_lr = 1`` and ``momentum = 0`` it is
FedPer exactly, which this script checks before it runs both.

What the method needs from the package: ``Algorithm`` (the protocol's defaults), ``LocalTrainer``
(the local SGD loop the engine lays out), ``gather_inputs`` (a batch of a client's samples from the
data), ``logits`` and ``masked_mean``; for its config ``LocalConfig`` (the clients' budget), ``option``
and ``client_tx``. The rest is jax, optax and flax.struct; the runners, the pure round and the
evaluation take it as they take the package's own twelve, and ``register_method`` makes it a method of
runs, sweeps and the command line (``--plugin`` names this file):

    pfedkdh run --plugin experiments/examples/own_method.py --method fedperm --dataset digits
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, ClassVar

import flax.linen as nn
import flax.struct as struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

import pfedkdh_jax as p


class MLP(nn.Module):
    """A small perceptron backbone (64-d features)."""

    @nn.compact
    def __call__(self, x):
        return nn.relu(nn.Dense(64)(x.reshape(x.shape[0], -1)))


@struct.dataclass
class FedPerMState:
    backbone: Any           # θ_g
    heads: Any              # φ_k of every client, [K, ...]
    server_opt: Any         # the server optimizer's state (momentum of θ_g)
    round: jax.Array        # int32 [], rounds completed


@dataclasses.dataclass(frozen=True)
class FedPerMConfig(p.LocalConfig):
    """The clients' budget (lr, batch_size, local_epochs, optimizer) and the server's two options."""

    server_lr: float = p.option(1.0, "the server's step on the clients' mean change", lambda v: v > 0, "> 0")
    momentum: float = p.option(0.9, "the server's momentum (0: none)", lambda v: 0 <= v < 1, "in [0, 1)")

    # fields with_hparams may replace by traced scalars (a vmapped grid over server_lr; a sweep's
    # --grid fedperm:server_lr=0.5,1 --stack runs its values as one program, as FedProx's mu)
    TRACEABLE: ClassVar[tuple[str, ...]] = ("lr", "server_lr")


@dataclasses.dataclass(frozen=True)
class FedPerM(p.Algorithm):
    model: Any
    config: FedPerMConfig = FedPerMConfig()

    @property
    def server_tx(self) -> optax.GradientTransformation:
        return optax.sgd(self.config.server_lr, momentum=self.config.momentum or None)

    def init(self, key, data: p.FederatedData) -> FedPerMState:
        params = self.model.init(key, data.input_shape)
        heads = jax.tree.map(lambda h: jnp.broadcast_to(h, (data.num_clients,) + h.shape), params["head"])
        return FedPerMState(backbone=params["backbone"], heads=heads,
                            server_opt=self.server_tx.init(params["backbone"]), round=jnp.zeros((), jnp.int32))

    # --- the client: backbone and own head trained together on cross-entropy
    @property
    def trainer(self) -> p.LocalTrainer:
        def loss_fn(params, ctx, x, y, mask, rng):
            logits = p.logits(self.model, params, x, rng=rng)   # rng given: training mode (dropout)
            return p.masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits, y), mask)
        c = self.config   # client_tx: the config's optimizer at its lr (optax.sgd(lr) by default)
        return p.LocalTrainer(loss_fn=loss_fn, tx=p.client_tx(c), gather=p.gather_inputs,
                              epochs=c.local_epochs, batch_size=c.batch_size)

    def client_start(self, state, data, client, key) -> p.LocalState:
        params = {"backbone": state.backbone, "head": jax.tree.map(lambda h: h[client], state.heads)}
        return self.trainer.init(params, jax.random.fold_in(key, client), data.train_n[client], data.max_train)

    # --- the server: backbones averaged by sample counts (the engine may sum them as clients finish)
    def mean_upload(self, update: p.ClientUpdate):
        return update.params["backbone"], update.replace(params={"head": update.params["head"]})

    def server_update_from_mean(self, state, data, selected, mean, rest, key):
        step = jax.tree.map(jnp.subtract, state.backbone, mean)        # minus the mean change: a "gradient"
        updates, server_opt = self.server_tx.update(step, state.server_opt, state.backbone)
        heads = jax.tree.map(lambda h, new: h.at[selected].set(new), state.heads, rest.params["head"])
        metrics = {"train_loss": jnp.mean(rest.loss), "client_loss": rest.loss}
        return state.replace(backbone=optax.apply_updates(state.backbone, updates), heads=heads,
                             server_opt=server_opt, round=state.round + 1), metrics

    def eval_models(self, state) -> p.EvalModels:
        return p.EvalModels(backbone=state.backbone, heads=state.heads)


# a method of runs, sweeps and the command line:
#   pfedkdh run --plugin experiments/examples/own_method.py --method fedperm --method-arg momentum=0.5
p.register_method("fedperm", FedPerM, FedPerMConfig, summary="FedPerM: FedPer with server momentum (example)")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--model", choices=("cnn", "mlp"), default="cnn",
                    help="the paper's CNN, or a small MLP (cheaper to compile: the test suite runs it)")
    a = ap.parse_args(argv)

    pool = p.load_pool("digits")
    data = p.from_arrays(pool.images, pool.labels, num_clients=a.clients, alpha=0.5, aux_size=100, seed=0)
    model = p.CNN(pool.num_classes) if a.model == "cnn" else p.LinenModel(MLP(), nn.Dense(pool.num_classes))
    schedule = p.sample_schedule(jax.random.key(1), a.rounds, a.clients, a.clients // 2)

    # FedPerM with server_lr 1 and no momentum is FedPer: one round of each, from the same start
    budget = dict(lr=0.01, local_epochs=1, batch_size=64)
    plain = FedPerM(model, FedPerMConfig(server_lr=1.0, momentum=0.0, **budget))
    fedper = p.FedPer(model, p.FedPerConfig(**budget))
    key = jax.random.key(100)
    runners = {"fedper": p.RoundRunner(fedper, data)}
    a_state = p.RoundRunner(plain, data).round(plain.init(jax.random.key(0), data), data, schedule[0], key)[0]
    b_state = runners["fedper"].round(fedper.init(jax.random.key(0), data), data, schedule[0], key)[0]
    same = max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves((a_state.backbone, a_state.heads)),
                                                              jax.tree.leaves((b_state.backbone, b_state.heads))))
    print(f"FedPerM(server_lr=1, momentum=0) against FedPer after one round: largest difference {same:.2e}")

    out = {"same_as_fedper": same}
    for name, algo in (("fedper", fedper), ("fedperm", FedPerM(model, FedPerMConfig(momentum=0.9, **budget)))):
        runner = runners.get(name) or p.RoundRunner(algo, data)
        state = algo.init(jax.random.key(0), data)
        for t, selected in enumerate(schedule):
            state, metrics = runner.round(state, data, selected, jax.random.fold_in(key, t))
        acc = float(runner.evaluate(state, data, jax.random.key(2))["personalized_macro_accuracy"])
        out[name] = acc
        print(f"{name}: {a.rounds} rounds, last train loss {float(metrics['train_loss']):.4f}, "
              f"personalized macro accuracy {acc:.4f}")
    return out


if __name__ == "__main__":
    r = main()
    assert np.isfinite(r["fedperm"])
