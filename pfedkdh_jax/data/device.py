"""Client data laid out on the device once: the pool as ``uint8`` and per-client index tables.

A client is a row of a padded table of pool indices plus its true size. Batches are gathered and
normalised inside the compiled step, so nothing is copied to the device after set-up. Leading axis
``[K, ...]`` = all clients.
"""

from __future__ import annotations

import flax.struct as struct
import jax
import jax.numpy as jnp
import numpy as np

from pfedkdh_jax.data.partition import Partition, padded_index_table
from pfedkdh_jax.data.sources import Pool, normalize


@struct.dataclass
class FederatedData:
    images: jax.Array          # uint8 [N, H, W, C], the whole pool
    labels: jax.Array          # int32 [N]
    train_idx: jax.Array       # int32 [K, M_train], pool indices of each client's train split (padded)
    train_n: jax.Array         # int32 [K], true train sizes n_k
    test_flat: jax.Array       # int32 [T], all clients' test samples, client after client (padded)
    test_client: jax.Array     # int32 [T], owner of each test slot (K for padding)
    test_n: jax.Array          # int32 [K]
    train_flat: jax.Array      # int32 [S], all clients' train samples (padded), for head adaptation
    train_flat_client: jax.Array  # int32 [S], owner of each slot (K for padding)
    train_flat_pos: jax.Array  # int32 [K, M_train], where client k's i-th train sample sits in train_flat
    aux_idx: jax.Array         # int32 [A], D_s
    owned_idx: jax.Array       # int32 [G, c]: the test samples regrouped in chunks of one owner each
    owned_slot: jax.Array      # int32 [G·c]: owner of every slot of owned_idx (K for padding)
    owned_chunk: jax.Array     # int32 [G]: owner of every chunk of owned_idx
    num_classes: int = struct.field(pytree_node=False)
    num_clients: int = struct.field(pytree_node=False)
    input_shape: tuple = struct.field(pytree_node=False)
    train_sizes: tuple = struct.field(pytree_node=False)  # host copy of train_n, for step counts
    eval_chunk: int = struct.field(pytree_node=False)     # test_flat / train_flat are padded to a multiple

    @property
    def max_train(self) -> int:
        return int(self.train_idx.shape[1])


def _flat(index_lists, pad_multiple: int):
    """Concatenate per-client index arrays; pad to a multiple of ``pad_multiple`` with owner K."""
    k = len(index_lists)
    flat = np.concatenate([np.asarray(a, np.int64) for a in index_lists])
    owner = np.concatenate([np.full(len(a), i) for i, a in enumerate(index_lists)])
    pad = (-len(flat)) % pad_multiple
    flat = np.concatenate([flat, np.zeros(pad, np.int64)])
    owner = np.concatenate([owner, np.full(pad, k)])
    return flat.astype(np.int32), owner.astype(np.int32)


def owner_chunks(flat_idx, owner, num_clients: int, chunk: int):
    """Regroup a flat, owner-tagged index list into single-owner chunks (host numpy).

    Returns ``idx [G, chunk]`` (pool indices; padding repeats index 0), ``slot_owner [G·chunk]``
    (the owner of every slot, ``num_clients`` for padding) and ``chunk_owner [G]``. Methods whose
    clients keep a backbone of their own score a chunk with one call of its owner's backbone.
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


def build_federated_data(pool: Pool, partition: Partition, *, eval_chunk: int = 2048,
                         owner_chunk: int = 256) -> FederatedData:
    """Place the pool and the partition's index tables on the default device (once).

    ``eval_chunk``: the flat test and train lists are padded to a multiple of it (evaluation computes
    features that many samples at a time); ``owner_chunk``: the chunk size of the owner-grouped test
    list (per-client backbones).
    """
    train_idx, train_n = padded_index_table(partition.train_idx)
    test_flat, test_client = _flat(partition.test_idx, eval_chunk)
    owned_idx, owned_slot, owned_chunk = owner_chunks(test_flat, test_client, partition.num_clients,
                                                      min(owner_chunk, eval_chunk))
    train_flat, train_flat_client = _flat(partition.train_idx, eval_chunk)
    offsets = np.concatenate([[0], np.cumsum(train_n)[:-1]])
    pos = offsets[:, None] + np.arange(train_idx.shape[1])[None, :]
    pos = np.where(np.arange(train_idx.shape[1])[None, :] < train_n[:, None], pos, 0)
    return FederatedData(
        images=jnp.asarray(pool.images, jnp.uint8),
        labels=jnp.asarray(pool.labels, jnp.int32),
        train_idx=jnp.asarray(train_idx, jnp.int32),
        train_n=jnp.asarray(train_n, jnp.int32),
        test_flat=jnp.asarray(test_flat),
        test_client=jnp.asarray(test_client),
        test_n=jnp.asarray([len(a) for a in partition.test_idx], jnp.int32),
        train_flat=jnp.asarray(train_flat),
        train_flat_client=jnp.asarray(train_flat_client),
        train_flat_pos=jnp.asarray(pos, jnp.int32),
        aux_idx=jnp.asarray(partition.aux_idx, jnp.int32),
        owned_idx=jnp.asarray(owned_idx), owned_slot=jnp.asarray(owned_slot),
        owned_chunk=jnp.asarray(owned_chunk),
        num_classes=int(pool.num_classes),
        num_clients=int(partition.num_clients),
        input_shape=tuple(int(d) for d in pool.images.shape[1:]),
        train_sizes=tuple(int(n) for n in train_n),
        eval_chunk=int(eval_chunk),
    )


def gather_inputs(data: FederatedData, pool_idx: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Images (normalised to [-1, 1], float32) and labels of the given pool indices, on device."""
    return normalize(data.images[pool_idx]), data.labels[pool_idx]
