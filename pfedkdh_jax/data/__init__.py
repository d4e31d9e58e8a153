"""Data: pools (sources and cache), federated partitions, and their layout on the device.

=========================  ==========================================================================
:mod:`.sources`            ``load_pool`` (tfds ArrayRecord dirs, the ``digits`` demo set, the
                           ``synthetic`` set of any size, a user's ``register_dataset``), the decoded
                           cache, ``pool_from_arrays`` (a user's arrays), ``synthetic_images``,
                           ``normalize``, ``DataError``
:mod:`.partition`          ``make_partition`` (D_s, Dirichlet clients, train/test splits),
                           ``shards_partition`` (label-sorted shards), ``natural_partition`` (a
                           client id per sample), ``validation_partition``,
                           summaries, ``padded_index_table``
:mod:`.device`             ``FederatedData`` (the pool and index tables on the device),
                           ``from_arrays`` (federated data from a user's arrays, the one constructor),
                           ``build_federated_data``, ``gather_inputs``
=========================  ==========================================================================

The names below are re-exported; :mod:`.device` (JAX) is imported only when one of its names is used,
so the CLI's option checks stay free of JAX.
"""

from __future__ import annotations

import importlib

from pfedkdh_jax.data.partition import (Partition, check_partition, evaluation_clients, evaluation_view,
                                        format_summary, make_partition, natural_partition,
                                        padded_index_table, partition_summary, shards_partition,
                                        validation_partition)
from pfedkdh_jax.data.sources import (DATASETS, DataError, Pool, dataset_names, load_pool, normalize,
                                      pool_from_arrays, register_dataset, resolve_data_dir, synthetic_images)

_DEVICE = ("FederatedData", "build_federated_data", "gather_inputs", "from_arrays")

__all__ = ["DATASETS", "DataError", "Pool", "Partition", "dataset_names", "register_dataset", "load_pool",
           "normalize", "resolve_data_dir",
           "pool_from_arrays", "synthetic_images", "make_partition", "shards_partition", "natural_partition", "validation_partition",
           "evaluation_clients", "evaluation_view", "check_partition",
           "partition_summary", "format_summary",
           "padded_index_table", *_DEVICE]


def __getattr__(name: str):
    if name in _DEVICE:
        value = getattr(importlib.import_module("pfedkdh_jax.data.device"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pfedkdh_jax.data' has no attribute {name!r}")
