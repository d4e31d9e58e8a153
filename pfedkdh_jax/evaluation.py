"""Evaluation over all K clients (method.md §4).

* personalized: client k's test split scored with (θ_g, φ_k); macro = mean over clients of the
  per-client accuracy (the paper's metric), micro = all correct / all test samples;
* global: every test sample scored with (θ_g, φ_g); macro and micro likewise;
* head adaptation (pFedKDH-EA): each φ_k first takes ``ea_steps`` head-only SGD steps on client k's
  train split with θ_g frozen; the adapted heads are used for that evaluation only.
* client models: a method whose personalized model has its own backbone (FedBABU after fine-tuning)
  is scored client by client on a static window over the client's test samples
  (:func:`client_model_correct`).

Features are computed once per evaluation for the flat list of all clients' test samples (and train
samples for EA) in fixed-size chunks, so the convolutions never run on padding of ragged clients.

Methods whose clients keep whole models of their own (Ditto, pFedMe, FedProto, FedALA) have one
backbone per client (``[K, ...]``): each test sample's features then come from its owner's backbone.
:func:`owner_chunks` regroups the flat test list into chunks that each belong to one client (every
client padded to a multiple of the chunk size only), so a chunk is one call with one backbone.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pfedkdh_jax.federated_data import FederatedData, gather_inputs
from pfedkdh_jax.model import CNN

PyTree = Any


def chunked_features(model: CNN, backbone: PyTree, data: FederatedData, flat_idx: jax.Array,
                     chunk: int) -> jax.Array:
    """Features ``[len(flat_idx), 512]`` computed ``chunk`` samples at a time with ``lax.map``."""
    def one(idx):
        return model.features(backbone, gather_inputs(data, idx)[0])
    return jax.lax.map(one, flat_idx.reshape(-1, chunk)).reshape(flat_idx.shape[0], -1)


def features_of(model: CNN, backbone: PyTree, data: FederatedData, idx: jax.Array) -> jax.Array:
    """Features of the given pool indices in one call (eval mode)."""
    return model.features(backbone, gather_inputs(data, idx)[0])


def owner_chunks(flat_idx, owner, num_clients: int, chunk: int):
    """Regroup a flat, owner-tagged index list into single-owner chunks (host numpy).

    Returns ``idx [G, chunk]`` (pool indices; padding repeats index 0), ``slot_owner [G·chunk]``
    (the owner of every slot, ``num_clients`` for padding) and ``chunk_owner [G]``.
    """
    flat_idx, owner = np.asarray(flat_idx), np.asarray(owner)
    idx, slot_owner, chunk_owner = [], [], []
    for k in range(num_clients):
        rows = flat_idx[owner == k]
        g = -(-len(rows) // chunk)
        pad = g * chunk - len(rows)
        idx.append(np.concatenate([rows, np.zeros(pad, rows.dtype)]))
        slot_owner.append(np.concatenate([np.full(len(rows), k), np.full(pad, num_clients)]))
        chunk_owner.append(np.full(g, k))
    return (np.concatenate(idx).reshape(-1, chunk).astype(np.int32),
            np.concatenate(slot_owner).astype(np.int32), np.concatenate(chunk_owner).astype(np.int32))


def owned_features_of(model: CNN, backbones: PyTree, data: FederatedData, client: jax.Array,
                      idx: jax.Array) -> jax.Array:
    """Features of pool indices ``idx`` under client ``client``'s backbone (``backbones [K, ...]``)."""
    backbone = jax.tree_util.tree_map(lambda b: b[client], backbones)
    return features_of(model, backbone, data, idx)


def owned_features(model: CNN, backbones: PyTree, data: FederatedData, chunk_owner: jax.Array,
                   idx: jax.Array) -> jax.Array:
    """Features ``[G·chunk, 512]`` of single-owner chunks ``idx [G, chunk]`` with ``lax.map``."""
    def one(args):
        return owned_features_of(model, backbones, data, *args)
    return jax.lax.map(one, (chunk_owner, idx)).reshape(idx.shape[0] * idx.shape[1], -1)


def score(model: CNN, feats: jax.Array, labels: jax.Array, owner: jax.Array, heads: PyTree | None,
          global_head: PyTree | None, num_clients: int, extra_heads: dict | None = None) -> dict:
    """Accuracies of the samples ``feats`` owned by ``owner`` (``num_clients`` marks padding).

    ``heads`` holds one head per client (``[K, ...]``); sample i is scored with ``heads[owner[i]]``
    (metrics ``personalized_*``); ``global_head`` scores every sample (``global_*``); each entry
    ``name: heads [K, ...]`` of ``extra_heads`` is scored like ``heads`` (``name_*``).
    Returns device scalars plus the per-client accuracies ``[K]``.
    """
    k = num_clients
    valid = owner < k
    metrics = {}
    named = ({"personalized": heads} if heads is not None else {}) | dict(extra_heads or {})
    for prefix, client_heads in named.items():
        metrics.update(_accuracies(_owner_logits(model, client_heads, feats, owner, k), labels, owner,
                                   valid, k, prefix))
    if global_head is not None:
        metrics.update(_accuracies(model.logits_from_features(global_head, feats), labels, owner,
                                   valid, k, "global"))
    return metrics


def _owner_logits(model: CNN, heads: PyTree, feats: jax.Array, owner: jax.Array, k: int) -> jax.Array:
    """Logits of sample i under ``heads[owner[i]]``."""
    safe_owner = jnp.minimum(owner, k - 1)
    # Logits of every sample under every client head: [T, K, classes]; cheap next to the backbone.
    all_logits = jax.vmap(model.logits_from_features, in_axes=(0, None), out_axes=1)(heads, feats)
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


def client_test_window(data: FederatedData, client: jax.Array, width: int) -> tuple[jax.Array, jax.Array]:
    """Pool indices ``[width]`` of client ``client``'s test samples and their validity mask.

    ``data.test_flat`` lists the clients' test samples client after client; ``width`` (static) must be
    at least the largest ``test_n``.
    """
    offsets = jnp.cumsum(data.test_n) - data.test_n
    slots = jnp.arange(width)
    pos = jnp.minimum(offsets[client] + slots, data.test_flat.shape[0] - 1)
    return data.test_flat[pos], slots < data.test_n[client]


def client_model_correct(model: CNN, params: PyTree, data: FederatedData, client: jax.Array,
                         width: int) -> tuple[jax.Array, jax.Array]:
    """(correct, count) of client ``client``'s own full model ``params`` on its test split.

    For methods whose personalized model has its own backbone (e.g. after FedBABU's fine-tuning);
    ``width`` is the static test window (the largest ``test_n``).
    """
    idx, valid = client_test_window(data, client, width)
    x, y = gather_inputs(data, idx)
    correct = (jnp.argmax(model.logits(params, x), -1) == y) & valid
    return jnp.sum(correct.astype(jnp.float32)), jnp.sum(valid.astype(jnp.float32))
