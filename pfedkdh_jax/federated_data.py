"""Client data laid out for the device once (foundation issue, item 1).

The pool images stay on the device as ``uint8``; a client is a row of a padded table of pool
indices plus its true size. Batches are gathered and normalised inside the compiled step, so nothing
is copied to the device after set-up. Leading axis ``[K, ...]`` = all clients.
"""

from __future__ import annotations

import flax.struct as struct
import jax
import jax.numpy as jnp
import numpy as np

from pfedkdh_jax.data import Partition, Pool, normalize, padded_index_table


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
    num_classes: int = struct.field(pytree_node=False)
    num_clients: int = struct.field(pytree_node=False)
    input_shape: tuple = struct.field(pytree_node=False)
    train_sizes: tuple = struct.field(pytree_node=False)  # host copy of train_n, for step counts

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


def build_federated_data(pool: Pool, partition: Partition, *, eval_chunk: int = 2048) -> FederatedData:
    """Place the pool and the partition's index tables on the default device (once)."""
    train_idx, train_n = padded_index_table(partition.train_idx)
    test_flat, test_client = _flat(partition.test_idx, eval_chunk)
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
        num_classes=int(pool.num_classes),
        num_clients=int(partition.num_clients),
        input_shape=tuple(int(d) for d in pool.images.shape[1:]),
        train_sizes=tuple(int(n) for n in train_n),
    )


def gather_inputs(data: FederatedData, pool_idx: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Images (normalised to [-1, 1], float32) and labels of the given pool indices, on device."""
    return normalize(data.images[pool_idx]), data.labels[pool_idx]
