"""Scores over all K clients (method.md §4): the accuracies of the models an evaluation holds.

* personalized: client k's test split scored with client k's model; macro = mean over clients of the
  per-client accuracy (the paper's metric), micro = all correct / all test samples;
* global: every test sample scored with the global model; macro and micro likewise.

Features are computed for the flat list of all clients' test samples in fixed-size chunks, so the
convolutions never run on padding of ragged clients. With per-client backbones (``[K, ...]``) each test
sample's features come from its owner's backbone: the owner-grouped chunks of
:func:`pfedkdh_jax.data.device.owner_chunks` make each chunk one call with one backbone.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pfedkdh_jax.data.device import FederatedData, gather_inputs
from pfedkdh_jax.engine.protocol import Model

PyTree = Any


def chunked_features(model: Model, backbone: PyTree, data: FederatedData, flat_idx: jax.Array,
                     chunk: int) -> jax.Array:
    """Features ``[len(flat_idx), D]`` computed ``chunk`` samples at a time with ``lax.map``."""
    def one(idx):
        return model.features(backbone, gather_inputs(data, idx)[0])
    return jax.lax.map(one, flat_idx.reshape(-1, chunk)).reshape(flat_idx.shape[0], -1)


def features_of(model: Model, backbone: PyTree, data: FederatedData, idx: jax.Array) -> jax.Array:
    """Features of the given pool indices in one call (eval mode)."""
    return model.features(backbone, gather_inputs(data, idx)[0])


def owned_features_of(model: Model, backbones: PyTree, data: FederatedData, client: jax.Array,
                      idx: jax.Array) -> jax.Array:
    """Features of pool indices ``idx`` under client ``client``'s backbone (``backbones [K, ...]``)."""
    backbone = jax.tree_util.tree_map(lambda b: b[client], backbones)
    return features_of(model, backbone, data, idx)


def owned_features(model: Model, backbones: PyTree, data: FederatedData, chunk_owner: jax.Array,
                   idx: jax.Array) -> jax.Array:
    """Features ``[G·chunk, D]`` of single-owner chunks ``idx [G, chunk]`` with ``lax.map``."""
    def one(args):
        return owned_features_of(model, backbones, data, *args)
    return jax.lax.map(one, (chunk_owner, idx)).reshape(idx.shape[0] * idx.shape[1], -1)


def score(model: Model, feats: jax.Array, labels: jax.Array, owner: jax.Array, heads: PyTree | None,
          global_head: PyTree | None, num_clients: int, extra_heads: dict | None = None,
          head_logits=None) -> dict:
    """Accuracies of the samples ``feats`` owned by ``owner`` (``num_clients`` marks padding).

    ``heads`` holds one head per client (``[K, ...]``); sample i is scored with ``heads[owner[i]]``
    (metrics ``personalized_*``); ``global_head`` scores every sample (``global_*``); each entry
    ``name: heads [K, ...]`` of ``extra_heads`` is scored like ``heads`` (``name_*``).
    ``head_logits``: ``(head, z) -> logits`` for ``heads`` (None: ``model.logits_from_features``).
    Returns device scalars plus the per-client accuracies ``[K]``.
    """
    k = num_clients
    valid = owner < k
    metrics = {}
    named = ({"personalized": heads} if heads is not None else {}) | dict(extra_heads or {})
    for prefix, client_heads in named.items():
        fn = head_logits if prefix == "personalized" and head_logits is not None else model.logits_from_features
        metrics.update(_accuracies(_owner_logits(fn, client_heads, feats, owner, k), labels, owner,
                                   valid, k, prefix))
    if global_head is not None:
        metrics.update(_accuracies(model.logits_from_features(global_head, feats), labels, owner,
                                   valid, k, "global"))
    return metrics


def _owner_logits(head_logits, heads: PyTree, feats: jax.Array, owner: jax.Array, k: int) -> jax.Array:
    """Logits of sample i under ``heads[owner[i]]`` (``head_logits(head, z)``)."""
    safe_owner = jnp.minimum(owner, k - 1)
    # Logits of every sample under every client head: [T, K, classes]; cheap next to the backbone.
    all_logits = jax.vmap(head_logits, in_axes=(0, None), out_axes=1)(heads, feats)
    return jnp.take_along_axis(all_logits, safe_owner[:, None, None], axis=1)[:, 0]


def _accuracies(logits, labels, owner, valid, k, prefix):
    correct = (jnp.argmax(logits, -1) == labels) & valid
    per_client_correct = jax.ops.segment_sum(correct.astype(jnp.float32), owner, num_segments=k + 1)[:k]
    per_client_n = jax.ops.segment_sum(valid.astype(jnp.float32), owner, num_segments=k + 1)[:k]
    return accuracies_from_counts(per_client_correct, per_client_n, prefix)


def accuracies_from_counts(correct: jax.Array, count: jax.Array, prefix: str) -> dict:
    """Macro, micro and per-client accuracy from per-client ``correct`` and ``count`` ``[K]``."""
    per_client = correct / jnp.maximum(count, 1.0)
    return {f"{prefix}_macro_accuracy": jnp.mean(per_client),
            f"{prefix}_micro_accuracy": jnp.sum(correct) / jnp.maximum(jnp.sum(count), 1.0),
            f"{prefix}_per_client_accuracy": per_client}
