"""Small helpers shared by the baselines whose clients keep whole models of their own.

Per-client pytrees carry a leading client axis ``[K, ...]``; a round reads and writes only the rows of
the selected clients, so the models of the other clients stay bit-identical.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pfedkdh_jax import losses
from pfedkdh_jax.config import ConfigError
from pfedkdh_jax.model import CNN

PyTree = Any


def take(tree: PyTree, client) -> PyTree:
    """Row ``client`` of every leaf of a ``[K, ...]`` pytree."""
    return jax.tree_util.tree_map(lambda x: x[client], tree)


def put(tree: PyTree, clients: jax.Array, rows: PyTree) -> PyTree:
    """``tree`` with rows ``clients [C]`` replaced by ``rows [C, ...]`` (all other rows untouched)."""
    return jax.tree_util.tree_map(lambda x, r: x.at[clients].set(r), tree, rows)


def broadcast(tree: PyTree, num_clients: int) -> PyTree:
    """``num_clients`` copies of ``tree`` along a new leading client axis."""
    return jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (num_clients,) + x.shape), tree)


def cross_entropy_loss(model: CNN):
    """The plain local objective: masked-mean cross-entropy of the full model on a batch."""
    def loss_fn(params, ctx, x, y, mask, rng):
        del ctx
        return losses.masked_mean(losses.cross_entropy(model.logits(params, x, rng=rng), y), mask)
    return loss_fn


def check_shared_options(cfg, method: str) -> None:
    """Baselines have no D_s warm-up (a pFedKDH option); fail with one line instead of ignoring it."""
    if cfg.warmup_epochs > 0:
        raise ConfigError(f"--warmup-epochs is a pFedKDH option; {method} does not use it (set it to 0)")

