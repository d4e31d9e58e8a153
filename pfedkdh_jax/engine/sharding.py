"""Running a piece per device: each device on its own slice of a leading axis (``jax.shard_map``)."""

from __future__ import annotations

import jax


def per_device(fn, mesh: jax.sharding.Mesh, axes):
    """``fn`` run by every device on its own slice of the leading axis of the arguments whose entry
    in ``axes`` is 0 (the others are replicated; an entry may be a pytree of 0 / None), with ``jax.shard_map``; outputs are sharded along
    their leading axis.

    Left to the automatic partitioner, a ``vmap``-ed convolution with different weights per
    repetition (or per client) is a grouped convolution that XLA's SPMD partitioner does not split:
    every device computed every repetition (measured on 2 and 8 fake CPU devices, BENCHMARKS.md), so
    the devices added memory and no speed. Here each device computes only its own slice.
    """
    ax = mesh.axis_names[0]
    spec = jax.sharding.PartitionSpec

    def specs(a):   # an entry of axes: 0, None, or a pytree of them (stacked partitions' data_axes)
        if a is None or isinstance(a, int):
            return spec(ax) if a == 0 else spec()
        return jax.tree_util.tree_map(lambda b: spec(ax) if b == 0 else spec(), a, is_leaf=lambda b: b is None)
    return jax.shard_map(fn, mesh=mesh, in_specs=tuple(specs(a) for a in axes), out_specs=spec(ax), check_vma=False)


def leading_axis_sharding(mesh: jax.sharding.Mesh) -> jax.sharding.NamedSharding:
    """Arrays split along their leading axis over the mesh's (one) axis."""
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(mesh.axis_names[0]))


def replicated(mesh: jax.sharding.Mesh) -> jax.sharding.NamedSharding:
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
