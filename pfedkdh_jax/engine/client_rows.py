"""Per-client values kept only for the clients that have one: :class:`ClientRows`.

A method that keeps a whole model per client (Ditto's and pFedMe's personal models, FedALA's local ones)
holds ``[K, ...]``
of them, K full models, although a run of R rounds of C clients writes at most R·C rows: at K = 10,000
clients, 100 a round, 10 rounds, 1,000 of the 10,000 personal models ever differ from their start.
:class:`ClientRows` keeps a table of ``capacity`` rows and, per client, the row that holds its value
(``-1``: none yet; the client's value is then ``base``, the value every client starts from). Reading a
client's value and writing a round's clients are ``take`` and ``put``, the same pure, jittable
operations as on a ``[K, ...]`` pytree (:func:`row` and :func:`put_rows` accept both), with the same
values: a client keeps its row once it has one, and never-written clients read ``base``.

Its memory is ``capacity`` rows plus ``K`` int32. ``capacity`` must cover the distinct clients a run
writes (``rounds × clients per round`` always does); ``put`` counts the clients it could not place in
``lost`` (a row for them is dropped and they keep reading ``base``), so a run can check for it.
"""

from __future__ import annotations

from typing import Any

import flax.struct as struct
import jax
import jax.numpy as jnp

PyTree = Any


@struct.dataclass
class ClientRows:
    """Per-client values of ``num_clients`` clients in ``capacity`` rows (module docstring).

    ``rows``: ``[capacity, ...]`` per leaf of ``base``; ``slot``: int32 ``[K]``, the row of client k
    (``-1``: none); ``base``: the value of a client without a row; ``used``: int32 ``[]``, rows taken;
    ``lost``: int32 ``[]``, clients ``put`` could not place (0 while ``capacity`` suffices).
    """

    rows: PyTree
    slot: jax.Array
    base: PyTree
    used: jax.Array
    lost: jax.Array

    @classmethod
    def create(cls, base: PyTree, num_clients: int, capacity: int) -> "ClientRows":
        """Every client at ``base``, ``capacity`` rows free (``1 <= capacity``)."""
        if capacity < 1:
            raise ValueError(f"ClientRows needs capacity >= 1; got {capacity}")
        rows = jax.tree_util.tree_map(lambda b: jnp.zeros((capacity,) + jnp.shape(b), jnp.result_type(b)), base)
        zero = jnp.zeros((), jnp.int32)
        return cls(rows=rows, slot=jnp.full((num_clients,), -1, jnp.int32), base=base, used=zero, lost=zero)

    @property
    def num_clients(self) -> int:
        return self.slot.shape[-1]

    @property
    def capacity(self) -> int:
        return jax.tree_util.tree_leaves(self.rows)[0].shape[0]

    def part(self, key) -> "ClientRows":
        """The same clients' values of one entry ``key`` of a dict-valued ``base`` (e.g. ``"head"``)."""
        return self.replace(rows=self.rows[key], base=self.base[key])

    def take(self, client) -> PyTree:
        """The value of ``client`` (an int or int array ``[...]``; leaves then ``[..., ...]``)."""
        s = self.slot[client]

        def one(r, b):
            got = r[jnp.maximum(s, 0)]
            has = (s >= 0).reshape(s.shape + (1,) * (got.ndim - s.ndim))
            return jnp.where(has, got, b)
        return jax.tree_util.tree_map(one, self.rows, self.base)

    def put(self, clients: jax.Array, values: PyTree) -> "ClientRows":
        """The rows of ``clients`` (int32 ``[C]``, distinct) set to ``values`` (leaves ``[C, ...]``);
        clients without a row get the next free ones, in the order given."""
        clients = jnp.asarray(clients)
        s = self.slot[clients]
        new = s < 0
        fresh = self.used + jnp.cumsum(new.astype(jnp.int32)) - 1
        fits = fresh < self.capacity
        s = jnp.where(new, jnp.where(fits, fresh, -1), s)
        target = jnp.where(s >= 0, s, self.capacity)           # out of range: the write is dropped
        rows = jax.tree_util.tree_map(lambda r, v: r.at[target].set(v, mode="drop"), self.rows, values)
        n_new = jnp.sum(new.astype(jnp.int32))
        placed = jnp.minimum(n_new, jnp.maximum(self.capacity - self.used, 0))
        return self.replace(rows=rows, slot=self.slot.at[clients].set(s), used=self.used + placed,
                            lost=self.lost + n_new - placed)

    def dense(self) -> PyTree:
        """Every client's value, ``[K, ...]`` (materialized: for small parts such as heads)."""
        return self.take(jnp.arange(self.num_clients))


def row(tree: PyTree, client) -> PyTree:
    """Client ``client``'s value of a per-client pytree: a :class:`ClientRows` or leaves ``[K, ...]``."""
    if isinstance(tree, ClientRows):
        return tree.take(client)
    return jax.tree_util.tree_map(lambda x: x[client], tree)


def put_rows(tree: PyTree, clients: jax.Array, values: PyTree) -> PyTree:
    """``tree`` (a :class:`ClientRows` or leaves ``[K, ...]``) with the values of ``clients [C]`` set to
    ``values [C, ...]``; every other client's value untouched."""
    if isinstance(tree, ClientRows):
        return tree.put(clients, values)
    return jax.tree_util.tree_map(lambda x, r: x.at[clients].set(r), tree, values)


def is_client_rows(x) -> bool:
    return isinstance(x, ClientRows)


def tables(tree: PyTree) -> list[ClientRows]:
    """Every :class:`ClientRows` in ``tree``."""
    return [x for x in jax.tree_util.tree_leaves(tree, is_leaf=is_client_rows) if is_client_rows(x)]


def has_client_rows(tree: PyTree) -> bool:
    """Whether ``tree`` holds a :class:`ClientRows` anywhere."""
    return bool(tables(tree))


def restrict(tree: PyTree, clients: jax.Array) -> PyTree:
    """``tree`` with each :class:`ClientRows` cut to the clients ``clients [C]``: a table of C rows
    holding their values (a row each, also for those still at ``base``), every other client without a
    row. What a round's clients read of the state is the same in both; the cut state is what the
    engine hands to the client pieces, so that a round moves C rows, not the whole table."""
    def one(x):
        if not is_client_rows(x):
            return x
        n = clients.shape[-1]
        slot = jnp.full_like(x.slot, -1).at[clients].set(jnp.arange(n, dtype=x.slot.dtype))
        return ClientRows(rows=x.take(clients), slot=slot, base=x.base, used=jnp.asarray(n, x.used.dtype), lost=x.lost)
    return jax.tree_util.tree_map(one, tree, is_leaf=is_client_rows)
