"""Pieces shared by the baselines: states, the cross-entropy objective, part-wise optimizers.

Every baseline runs on the engine of :mod:`pfedkdh_jax.engine` (one :class:`LocalTrainer` loop for all
methods); what differs is the local objective, the optax transformation, what the server reads from
the clients' final local states, and what is evaluated. Step-dependent behaviour (a frozen head, a
head phase followed by a body phase) lives in the optimizer, never in a copy of the training loop.

Parameters are ``{"backbone": θ, "head": φ}`` (:mod:`pfedkdh_jax.model`); the optimizers address
the two parts by these names with :func:`optax.multi_transform`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct as struct
import jax
import jax.numpy as jnp
import optax

from pfedkdh_jax import losses
from pfedkdh_jax.engine import LocalState, LocalTrainer
from pfedkdh_jax.federated_data import FederatedData, gather_inputs
from pfedkdh_jax.model import CNN
from pfedkdh_jax.pfedkdh import weighted_average

PyTree = Any

# Label prefix tree of the parameter dict: every leaf under "backbone" / "head" gets that label.
PART_LABELS = {"backbone": "backbone", "head": "head"}


@dataclasses.dataclass(frozen=True)
class LocalConfig:
    """The shared local-training budget (method.md Table 1; taken from the RunConfig)."""

    lr: float = 0.015          # client SGD learning rate, no momentum
    batch_size: int = 64
    local_epochs: int = 2      # E


@struct.dataclass
class SharedModelState:
    """A server-side model ``(θ_g, φ_g)`` that every client starts from (FedAvg, FedProx, FedBABU)."""

    backbone: PyTree        # θ_g
    head: PyTree            # φ_g
    round: jax.Array        # int32 [], rounds completed
    num_clients: int = struct.field(pytree_node=False)   # K (for broadcasting the head in evaluation)


@struct.dataclass
class PersonalHeadsState:
    """A shared backbone and one persistent head per client (FedPer, FedRep)."""

    backbone: PyTree        # θ_g
    heads: PyTree           # φ_k for every client, [K, ...]
    round: jax.Array        # int32 [], rounds completed


# ----------------------------------------------------------------------------------- objectives
def cross_entropy_loss(model: CNN):
    """``(params, ctx, x, y, mask, rng) -> masked mean CE`` of the full model (ctx unused)."""
    def loss_fn(params, ctx, x, y, mask, rng):
        del ctx
        return losses.masked_mean(losses.cross_entropy(model.logits(params, x, rng=rng), y), mask)
    return loss_fn


def broadcast_clients(tree: PyTree, num_clients: int) -> PyTree:
    """``tree`` repeated along a new leading client axis ``[K, ...]``."""
    return jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (num_clients,) + x.shape), tree)


def mean_train_loss(finals: LocalState) -> jax.Array:
    """Mean over the selected clients of each client's mean local loss."""
    return jnp.mean(finals.loss_sum / jnp.maximum(finals.step, 1))


def init_params(model: CNN, key: jax.Array, data: FederatedData) -> PyTree:
    return model.init(key, data.input_shape)


def average_uploads(uploads: PyTree, data: FederatedData, selected: jax.Array) -> PyTree:
    """``Σ n_k w_k / Σ n_k`` over the selected clients (leading axis ``[C, ...]`` of ``uploads``)."""
    return weighted_average(uploads, data.train_n[selected])


def steps_per_epoch(n: jax.Array, batch_size: int) -> jax.Array:
    """``ceil(n / B)``: the number of (the last one partial) batches of one epoch."""
    return (n + batch_size - 1) // batch_size


# ----------------------------------------------------------------------------------- optimizers
def by_part(backbone: optax.GradientTransformation,
            head: optax.GradientTransformation) -> optax.GradientTransformation:
    """Separate optimizers for the backbone and the head (``optax.multi_transform``)."""
    return optax.multi_transform({"backbone": backbone, "head": head}, PART_LABELS)


def head_only(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` on the head; the backbone receives exactly zero updates."""
    return by_part(optax.set_to_zero(), tx)


def body_only(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` on the backbone; the head receives exactly zero updates (it stays bit-identical)."""
    return by_part(tx, optax.set_to_zero())


def sgd_trainer(loss_fn, tx: optax.GradientTransformation, config: LocalConfig,
                epochs: int | None = None) -> LocalTrainer:
    """The engine's local loop over the client's train split with ``tx``."""
    return LocalTrainer(loss_fn=loss_fn, tx=tx, gather=gather_inputs,
                        epochs=config.local_epochs if epochs is None else epochs,
                        batch_size=config.batch_size)


def local_config(cfg) -> LocalConfig:
    """The shared budget from a :class:`~pfedkdh_jax.config.RunConfig`."""
    return LocalConfig(lr=cfg.lr, batch_size=cfg.batch_size, local_epochs=cfg.local_epochs)


def start_from_global(trainer: LocalTrainer, state, data: FederatedData, client: jax.Array,
                      round_key: jax.Array) -> LocalState:
    """Local state of ``client`` starting from the shared full model (θ_g, φ_g) of ``state``."""
    params = {"backbone": state.backbone, "head": state.head}
    return trainer.init(params, jax.random.fold_in(round_key, client), data.train_n[client], data.max_train)
