"""pfedkdh_jax: pFedKDH and its baselines as pure JAX functions over stacked client pytrees.

Packages: :mod:`pfedkdh_jax.data` (pools, partitions, device layout), :mod:`pfedkdh_jax.engine`
(local training, the round, evaluation, the host runner), :mod:`pfedkdh_jax.algorithms` (the
protocol, pFedKDH and every baseline, one file each) and :mod:`pfedkdh_jax.run` (config, experiment,
checkpoints, reports, CLI).

Public names are re-exported lazily, so ``import pfedkdh_jax`` (and the CLI's input validation) stays
cheap and does not import JAX until a numerical name is used.
"""

from __future__ import annotations

import importlib

__version__ = "0.3.0"   # the one version number (pyproject.toml reads it; CITATION.cff repeats it, tested)

_METHODS = {"PFedKDH": "pfedkdh", "FedAvg": "fedavg", "FedProx": "fedprox", "FedPer": "fedper", "FedRep": "fedrep",
            "FedBABU": "fedbabu", "Ditto": "ditto", "PFedMe": "pfedme", "FedProto": "fedproto", "FedALA": "fedala",
            "PFedSim": "pfedsim", "FedFed": "fedfed"}

_EXPORTS = {
    # data
    "DATASETS": "data", "DataError": "data", "Pool": "data", "Partition": "data", "load_pool": "data",
    "make_partition": "data", "shards_partition": "data", "natural_partition": "data", "pool_from_arrays": "data",
    "partition_summary": "data", "format_summary": "data", "register_dataset": "data", "check_partition": "data",
    "evaluation_clients": "data", "evaluation_view": "data",
    "FederatedData": "data.device", "build_federated_data": "data.device", "from_arrays": "data.device",
    "gather_inputs": "data.device",
    # models: the protocol, the paper's CNN, adapters of a user's flax modules
    "Model": "engine.protocol", "check_model": "engine.protocol", "logits": "engine.protocol",
    "feature_dim": "engine.protocol", "CNN": "model", "LinenModel": "adapters", "NNXModel": "adapters",
    # the method protocol
    "Algorithm": "engine.protocol", "ClientUpdate": "engine.protocol", "EvalModels": "engine.protocol",
    "Personalization": "engine.protocol", "Phase": "engine.protocol", "masked_mean": "losses",
    # methods (each with its config) and the CLI's registry
    **{cls: f"algorithms.{mod}" for cls, mod in _METHODS.items()},
    **{f"{cls}Config": "algorithms.configs" for cls in _METHODS},
    "LocalConfig": "algorithms.configs", "OptionError": "algorithms.configs", "PFedKDHState": "algorithms.pfedkdh",
    "METHODS": "algorithms", "make_method": "algorithms", "build_algorithm": ("algorithms", "build"),
    "register_method": "algorithms", "option": "algorithms.configs", "client_tx": "algorithms.common",
    # per-client tables and metrics, for a method of one's own
    "broadcast": "algorithms.common", "take": "algorithms.common", "put": "algorithms.common",
    "client_models": "algorithms.common", "round_metrics": "algorithms.common", "ClientRows": "engine.client_rows",
    # engine
    "Layout": "engine.layout", "Workload": "engine.layout", "LocalTrainer": "engine.local", "LocalState": "engine.local",
    "make_round": "engine.round", "make_evaluate": "engine.evaluate", "select_clients": "engine.round",
    "RoundRunner": "engine.runner", "PhasedRunner": "engine.runner", "sample_schedule": "engine.runner",
    "check_method": "engine.conformance", "RoundOffWarning": "engine.conformance", "ProtocolError": "engine.protocol",
    "StateError": "engine.protocol",
    # runs
    "RunConfig": "run.config", "ConfigError": "run.config", "make_config": "run.config",
    "run": ("run.experiment", "run"), "resume": ("run.experiment", "resume"), "run_stacked": "run.experiment",
    "save_state": "run.checkpoint", "load_state": "run.checkpoint",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        target = _EXPORTS[name]
        module, attr = target if isinstance(target, tuple) else (target, name)
        value = getattr(importlib.import_module(f"pfedkdh_jax.{module}"), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pfedkdh_jax' has no attribute {name!r}")
