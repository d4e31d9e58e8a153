"""Client data laid out on the device once: the pool as ``uint8`` and per-client index tables.

A client is a row of a padded table of pool indices plus its true size. Batches are gathered and
normalised inside the compiled step, so nothing is copied to the device after set-up. Leading axis
``[K, ...]`` = all clients.

Several partitions of one pool (other α values, other data seeds) stack into one
:class:`FederatedData` (:func:`stack_partitions`): the pool is shared and every index table gains a
leading run axis ``[R, ...]``, padded to the widest run, so R runs of different partitions run as
one program (``jax.vmap`` with ``in_axes`` :func:`data_axes`). Padding adds slots that no valid
client sample occupies (owner K, sizes unchanged) and, with the default counter-based
(``jax_threefry_partitionable``) random numbers, a client's shuffled order over its n samples does not
depend on the width of its row: a run stacked computes what it computes alone.
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
    """The federated data on the device (build it with :func:`from_arrays`, or
    :func:`build_federated_data` from a pool and a partition)."""

    images: jax.Array          # [N, ...] the whole pool's inputs: uint8 pixels, or float/int features
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
    # stacked partitions (stack_partitions): the number of runs R (train_sizes: the per-client maximum)
    runs: int | None = struct.field(pytree_node=False, default=None)
    # batches map uint8 pixels to [-1, 1] (method.md §2); else the inputs reach the model as stored
    normalize: bool = struct.field(pytree_node=False, default=True)

    @property
    def input_dtype(self):
        """The dtype of a batch's inputs as the model receives them."""
        return jnp.float32 if self.normalize else self.images.dtype

    @property
    def max_train(self) -> int:
        return int(self.train_idx.shape[-1])

    @property
    def stacked(self) -> bool:
        return self.runs is not None


# the per-partition tables (everything but the pool), and how to pad each: (axis, fill)
_INDEX_FIELDS = {"train_idx": (1, "zero"), "train_n": (None, None), "test_flat": (0, "zero"),
                 "test_client": (0, "owner"), "test_n": (None, None), "train_flat": (0, "zero"),
                 "train_flat_client": (0, "owner"), "train_flat_pos": (1, "zero"), "aux_idx": (None, None),
                 "owned_idx": (0, "zero"), "owned_slot": (0, "owner"), "owned_chunk": (0, "zero")}


def data_axes(data: FederatedData):
    """``in_axes`` of ``data`` for ``jax.vmap`` over runs: the run axis of stacked partitions' index
    tables (the pool shared), or ``None`` (the same data for every run)."""
    if not data.stacked:
        return None
    return data.replace(images=None, labels=None, **{f: 0 for f in _INDEX_FIELDS})


def run_slice(data: FederatedData, r: int) -> FederatedData:
    """Run ``r`` of stacked partitions (its tables still padded to the stack's widths, so every run's
    slice has one shape), or ``data`` itself when not stacked."""
    if not data.stacked:
        return data
    return data.replace(runs=None, **{f: getattr(data, f)[r] for f in _INDEX_FIELDS})


def stack_partitions(datas) -> FederatedData:
    """Partitions of one pool (each from :func:`build_federated_data`) as one stacked
    :class:`FederatedData` ``[R, ...]`` (module docstring). They must share the pool, the number of
    clients, ``eval_chunk`` and the size of D_s; ``train_sizes`` becomes the per-client maximum (the
    static step counts; each run's sizes are its ``train_n``)."""
    datas = list(datas)
    if not datas:
        raise ValueError("stack_partitions needs at least one partition")
    first = datas[0]
    for d in datas[1:]:
        same = (d.num_clients == first.num_clients and d.num_classes == first.num_classes
                and d.input_shape == first.input_shape and d.eval_chunk == first.eval_chunk
                and d.images.shape == first.images.shape and d.aux_idx.shape == first.aux_idx.shape)
        if not same:
            raise ValueError("stacked partitions must share the pool, the number of clients, eval_chunk "
                             "and the size of D_s")
        if d.stacked:
            raise ValueError("stack_partitions takes unstacked partitions")
    k = first.num_clients
    chunk = max(int(d.owned_idx.shape[-1]) for d in datas)   # one owner-chunk size for all: the largest
    owned = [d if d.owned_idx.shape[-1] == chunk else d.replace(**dict(zip(
        ("owned_idx", "owned_slot", "owned_chunk"),
        map(jnp.asarray, owner_chunks(np.asarray(d.test_flat), np.asarray(d.test_client), k, chunk)))))
        for d in datas]
    fields = {}
    for name, (axis, fill) in _INDEX_FIELDS.items():
        arrays = [np.asarray(getattr(d, name)) for d in owned]
        if axis is not None:
            width = max(a.shape[axis] for a in arrays)
            value = k if fill == "owner" else 0
            padded = []
            for a in arrays:
                pad = [(0, 0)] * a.ndim
                pad[axis] = (0, width - a.shape[axis])
                padded.append(np.pad(a, pad, constant_values=value))
            arrays = padded
        fields[name] = jnp.asarray(np.stack(arrays))
    sizes = np.max([d.train_sizes for d in datas], axis=0)
    return first.replace(**fields, train_sizes=tuple(int(n) for n in sizes), runs=len(datas))


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


# The chunk sizes of the owner-grouped test list, and a chunk call's fixed cost (dispatch, reading the
# owner's backbone) in sample slots: :func:`owner_chunk_size` picks the size of least padded slots + calls.
# Measured on 2 cores (MNIST CNN, one backbone of 10,000 per call): 1.23 ms a call of 8 samples, 6.4 ms
# of 128, 11.5 ms of 256: about 0.04 ms a slot and 0.9–1.4 ms a call, i.e. 23–36 slots.
OWNER_CHUNKS = (8, 16, 32, 64, 128, 256)
OWNER_CALL_SLOTS = 32


def owner_chunk_size(test_sizes, limit: int = OWNER_CHUNKS[-1]) -> int:
    """The chunk size (of :data:`OWNER_CHUNKS`, at most ``limit``) that scores clients of ``test_sizes``
    test samples each in the fewest slots, a call counted as :data:`OWNER_CALL_SLOTS` more (ties: the
    larger): 128 or 256 for the paper's 20 clients of hundreds of test samples; 8 for 10,000 clients of
    1–10, where chunks of 256 computed 99 % padding."""
    sizes = np.asarray(test_sizes, np.int64)
    options = [c for c in OWNER_CHUNKS if c <= limit] or [int(limit)]
    return min(options, key=lambda c: (int(np.sum(-(-sizes // c))) * (c + OWNER_CALL_SLOTS), -c))


def build_federated_data(pool: Pool, partition: Partition, *, eval_chunk: int = 2048,
                         owner_chunk: int | None = None) -> FederatedData:
    """Place the pool and the partition's index tables on the default device (once); the inputs keep
    their dtype (``pool.normalize`` says whether batches scale uint8 pixels to [-1, 1]).

    ``eval_chunk``: the flat test and train lists are padded to a multiple of it (evaluation computes
    features that many samples at a time); ``owner_chunk``: the chunk size of the owner-grouped test
    list (per-client backbones; ``None``: :func:`owner_chunk_size` of the clients' test sizes).
    """
    train_idx, train_n = padded_index_table(partition.train_idx)
    test_flat, test_client = _flat(partition.test_idx, eval_chunk)
    if owner_chunk is None:
        owner_chunk = owner_chunk_size([len(t) for t in partition.test_idx], eval_chunk)
    owned_idx, owned_slot, owned_chunk = owner_chunks(test_flat, test_client, partition.num_clients,
                                                      min(owner_chunk, eval_chunk))
    train_flat, train_flat_client = _flat(partition.train_idx, eval_chunk)
    offsets = np.concatenate([[0], np.cumsum(train_n)[:-1]])
    pos = offsets[:, None] + np.arange(train_idx.shape[1])[None, :]
    pos = np.where(np.arange(train_idx.shape[1])[None, :] < train_n[:, None], pos, 0)
    return FederatedData(
        images=jnp.asarray(pool.images),
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
        normalize=bool(pool.normalize),
    )


def from_arrays(inputs, labels, *, client_ids=None, num_clients: int | None = None, alpha: float | None = None,
                partition: Partition | None = None, num_classes: int | None = None, aux_size: int = 0,
                min_client_samples: int | None = None, balance_cap: bool = False, fill: str = "auto",
                train_fraction: float = 0.75, seed: int = 0, normalize: bool | None = None,
                eval_chunk: int = 2048) -> FederatedData:
    """Federated data from a user's arrays, on the device (the tfds datasets come through here too).

    * ``inputs [N, ...]``: any per-sample shape; ``uint8`` pixels are mapped to [-1, 1] in every batch
      (method.md §2) unless ``normalize=False``; float features stay float, integer features stay
      integer (the model receives them as stored);
    * ``labels [N]``: integers in ``[0, num_classes)`` (default ``num_classes = max(labels) + 1``);
    * the clients, one of: ``client_ids [N]`` (a natural partition: sample i belongs to client
      ``client_ids[i]``, ids ``0 … K−1``); ``num_clients`` and ``alpha`` (the class-wise Dirichlet
      partition of method.md §2, redrawn until every client holds ``min_client_samples``, default
      10; above 100 clients, or with ``fill="top_up"``, drawn once and topped up); or a ready
      :class:`~pfedkdh_jax.data.partition.Partition` (e.g. :func:`~pfedkdh_jax.data.partition.shards_partition`);
    * ``aux_size``: the server's auxiliary set D_s, drawn uniformly first (pFedKDH's teacher needs it);
      ``train_fraction``: each client's train share, the rest its test split; ``seed``: the partition's.

    Wrong shapes or dtypes, labels out of range, empty clients or an impossible partition stop with
    one line (:class:`~pfedkdh_jax.data.sources.DataError`).
    """
    from pfedkdh_jax.data.partition import check_partition, make_partition, natural_partition
    from pfedkdh_jax.data.sources import DataError, pool_from_arrays

    pool = pool_from_arrays(inputs, labels, num_classes=num_classes, normalize=normalize)
    given = [name for name, v in (("client_ids", client_ids), ("num_clients/alpha", num_clients or alpha),
                                  ("partition", partition)) if v is not None]
    if len(given) != 1:
        raise DataError("give the clients one way: client_ids (a natural partition), num_clients and alpha "
                        f"(a Dirichlet partition) or a partition; got {' and '.join(given) or 'none'}")
    # options the chosen way does not read: an error, not silently ignored
    options = dict(aux_size=(aux_size, 0), min_client_samples=(min_client_samples, None),
                   balance_cap=(balance_cap, False), fill=(fill, "auto"), train_fraction=(train_fraction, 0.75),
                   seed=(seed, 0))
    unread = {"partition": ("aux_size", "min_client_samples", "balance_cap", "fill", "train_fraction", "seed"),
              "client_ids": ("balance_cap", "fill")}.get(given[0], ())
    ignored = [name for name in unread if options[name][0] != options[name][1]]
    if ignored:
        why = ("a ready partition holds its own aux_idx and train/test splits" if given[0] == "partition" else
               "a natural partition keeps every client's samples (no Dirichlet draw to cap, fill or redraw)")
        raise DataError(f"from_arrays({given[0]}=...) does not read {', '.join(ignored)}: {why}; leave "
                        f"{'it' if len(ignored) == 1 else 'them'} out")
    if client_ids is not None:
        if len(np.asarray(client_ids)) != len(pool.labels):
            raise DataError(f"client_ids must hold one id per sample: {len(pool.labels)}; got {len(np.asarray(client_ids))}")
        partition = natural_partition(client_ids, aux_size=aux_size, train_fraction=train_fraction, seed=seed,
                                      min_client_samples=2 if min_client_samples is None else min_client_samples)
    elif partition is None:
        if num_clients is None or alpha is None:
            raise DataError("a Dirichlet partition needs both num_clients and alpha")
        partition = make_partition(pool.labels, num_clients=num_clients, alpha=alpha, aux_size=aux_size,
                                   min_client_samples=10 if min_client_samples is None else min_client_samples,
                                   balance_cap=balance_cap, train_fraction=train_fraction, seed=seed,
                                   fill=fill)
    else:
        check_partition(partition, len(pool.labels))
    return build_federated_data(pool, partition, eval_chunk=eval_chunk)


def check_data(data, where: str, pointer: bool = True) -> None:
    """A ``TypeError`` naming ``where`` when ``data`` is not a :class:`FederatedData` (a pool, a tuple of
    arrays); ``pointer``: say how to build one (a pool's own arrays through :func:`from_arrays`)."""
    if isinstance(data, FederatedData):
        return
    how = ((": build it with from_arrays(pool.images, pool.labels, ...)" if hasattr(data, "images") else
            " (pfedkdh_jax.from_arrays)") if pointer else "")
    raise TypeError(f"{where}: data must be a FederatedData{how}; got a {type(data).__name__}")


def gather_inputs(data: FederatedData, pool_idx: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Inputs and labels of the given pool indices, on device: uint8 pixels normalised to [-1, 1]
    (float32) when ``data.normalize``, else the inputs as stored."""
    x = data.images[pool_idx]
    return (normalize(x) if data.normalize else x), data.labels[pool_idx]
