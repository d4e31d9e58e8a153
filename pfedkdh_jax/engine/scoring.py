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
from pfedkdh_jax.engine import client_rows
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
    """Features of pool indices ``idx`` under client ``client``'s backbone (``backbones [K, ...]``, or
    a :class:`~pfedkdh_jax.engine.client_rows.ClientRows` of them)."""
    backbone = client_rows.row(backbones, client)
    return features_of(model, backbone, data, idx)


def owned_from_flat(feats: jax.Array, data: FederatedData) -> jax.Array:
    """Features of ``data.test_flat``'s samples (``[T, D]``, one shared backbone) laid out as the
    owner-grouped chunks ``data.owned_idx`` (``[G, c, D]``). Padding slots of both hold pool index 0:
    where a padding entry of ``test_flat`` takes sample 0's position, its features are sample 0's all
    the same, and a padding slot of ``owned_idx`` (owner K) is not scored."""
    where = jnp.zeros(data.images.shape[0], jnp.int32).at[data.test_flat].set(
        jnp.arange(data.test_flat.shape[0], dtype=jnp.int32))
    return feats[where[data.owned_idx]]


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


# Up to this many clients a sample's logits are taken from its logits under every head; above, from
# its own head gathered (in chunks of OWN_HEAD_CHUNK samples).
ALL_HEADS_UP_TO = 256
OWN_HEAD_CHUNK = 1024


def _owner_logits(head_logits, heads: PyTree, feats: jax.Array, owner: jax.Array, k: int) -> jax.Array:
    """Logits of sample i under ``heads[owner[i]]`` (``head_logits(head, z)``).

    Few clients: every sample under every head, ``[T, K, classes]`` (one matmul; cheap next to the
    backbone). That grows as T·K, so with many clients (K = 10,000: 16,000 test samples × 10,000
    heads) each sample is scored by its own head only, gathered ``OWN_HEAD_CHUNK`` samples at a time:
    memory and work grow with the samples, not with K."""
    safe_owner = jnp.minimum(owner, k - 1)
    if k <= ALL_HEADS_UP_TO:
        all_logits = jax.vmap(head_logits, in_axes=(0, None), out_axes=1)(heads, feats)
        return jnp.take_along_axis(all_logits, safe_owner[:, None, None], axis=1)[:, 0]
    t = feats.shape[0]
    chunk = min(OWN_HEAD_CHUNK, t)
    pad = -t % chunk

    def one(args):
        z, who = args
        own = jax.tree_util.tree_map(lambda h: h[who], heads)
        return jax.vmap(lambda h, x: head_logits(h, x[None])[0])(own, z)
    z = jnp.pad(feats, ((0, pad), (0, 0))).reshape(-1, chunk, feats.shape[-1])
    who = jnp.pad(safe_owner, (0, pad)).reshape(-1, chunk)
    return jax.lax.map(one, (z, who)).reshape(t + pad, -1)[:t]


def _accuracies(logits, labels, owner, valid, k, prefix):
    correct = (jnp.argmax(logits, -1) == labels) & valid
    per_client_correct = jax.ops.segment_sum(correct.astype(jnp.float32), owner, num_segments=k + 1)[:k]
    per_client_n = jax.ops.segment_sum(valid.astype(jnp.float32), owner, num_segments=k + 1)[:k]
    return accuracies_from_counts(per_client_correct, per_client_n, prefix)


def accuracies_from_counts(correct: jax.Array, count: jax.Array, prefix: str) -> dict:
    """Macro, micro and per-client accuracy from per-client ``correct`` and ``count`` ``[K]``. The macro
    accuracy averages over the clients holding test samples: every client in a partition (each keeps
    one at least), the scored subset in an evaluation of some clients (``--eval-clients``). A client
    without test samples in the evaluation (not scored) has a per-client accuracy of NaN, not 0 (a
    run's records write it as null)."""
    scored = count > 0
    per_client = correct / jnp.maximum(count, 1.0)
    macro = jnp.sum(jnp.where(scored, per_client, 0.0)) / jnp.maximum(jnp.sum(scored), 1)
    return {f"{prefix}_macro_accuracy": macro,
            f"{prefix}_micro_accuracy": jnp.sum(correct) / jnp.maximum(jnp.sum(count), 1.0),
            f"{prefix}_per_client_accuracy": jnp.where(scored, per_client, jnp.nan)}
