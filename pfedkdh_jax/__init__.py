"""pfedkdh_jax: pFedKDH and its baselines as pure JAX functions over stacked client pytrees.

Public names are re-exported lazily, so ``import pfedkdh_jax`` (and the CLI's input validation) stays
cheap and does not import JAX until a numerical name is used.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    # data protocol
    "DATASETS": "data", "DataError": "data", "Pool": "data", "Partition": "data", "load_pool": "data",
    "make_partition": "data", "partition_summary": "data", "format_summary": "data",
    "FederatedData": "federated_data", "build_federated_data": "federated_data",
    # model and algorithm
    "CNN": "model", "PFedKDH": "pfedkdh", "PFedKDHConfig": "pfedkdh", "PFedKDHState": "pfedkdh",
    "weighted_average": "pfedkdh",
    # engine
    "EngineConfig": "engine", "LocalTrainer": "engine", "LocalState": "engine",
    "RoundRunner": "rounds", "sample_schedule": "rounds",
    # runs
    "RunConfig": "config", "ConfigError": "config", "make_config": "config", "run": "experiment",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"pfedkdh_jax.{_EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pfedkdh_jax' has no attribute {name!r}")
