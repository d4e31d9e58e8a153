"""Running a piece per device: each device on its own slice of a leading axis (``jax.shard_map``)."""

from __future__ import annotations

import jax


def per_device(fn, mesh: jax.sharding.Mesh, axes):
    """``fn`` run by every device on its own slice of the leading axis of the arguments whose entry
    in ``axes`` is 0 (the others are replicated), with ``jax.shard_map``; outputs are sharded along
    their leading axis.

    Left to the automatic partitioner, a ``vmap``-ed convolution with different weights per
    repetition (or per client) is a grouped convolution that XLA's SPMD partitioner does not split:
    every device computed every repetition (measured on 2 and 8 fake CPU devices, BENCHMARKS.md), so
    the devices added memory and no speed. Here each device computes only its own slice.
    """
    ax = mesh.axis_names[0]
    spec = jax.sharding.PartitionSpec
    return jax.shard_map(fn, mesh=mesh, in_specs=tuple(spec(ax) if a == 0 else spec() for a in axes),
                         out_specs=spec(ax), check_vma=False)


def leading_axis_sharding(mesh: jax.sharding.Mesh) -> jax.sharding.NamedSharding:
    """Arrays split along their leading axis over the mesh's (one) axis."""
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(mesh.axis_names[0]))


def replicated(mesh: jax.sharding.Mesh) -> jax.sharding.NamedSharding:
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
