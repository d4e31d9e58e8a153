"""Baselines of method.md §5 on the shared engine, one module per method (paper cited in each).

=========  =====================================================================================
fedavg     :mod:`~pfedkdh_jax.baselines.fedavg`: full model averaged; global-model evaluation
fedprox    :mod:`~pfedkdh_jax.baselines.fedprox`: FedAvg + μ/2‖w − w_g‖² locally
fedper     :mod:`~pfedkdh_jax.baselines.fedper`: base averaged, heads personal, trained together
fedrep     :mod:`~pfedkdh_jax.baselines.fedrep`: head epochs then body epochs, body averaged
fedbabu    :mod:`~pfedkdh_jax.baselines.fedbabu`: head frozen at φ⁰, body averaged; fine-tune to evaluate
ditto      :mod:`~pfedkdh_jax.baselines.ditto`: FedAvg global model + personal models pulled towards it
pfedme     :mod:`~pfedkdh_jax.baselines.pfedme`: Moreau-envelope personal models, β-mixed server step
fedproto   :mod:`~pfedkdh_jax.baselines.fedproto`: class prototypes exchanged instead of weights
fedala     :mod:`~pfedkdh_jax.baselines.fedala`: adaptive local aggregation of the head
=========  =====================================================================================

Each module exposes its algorithm class and ``from_config(cfg, num_classes, args)``; the registry with
the ``--method-arg`` options is :mod:`pfedkdh_jax.methods`. Imports are lazy (no JAX until used).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "FedAvg": "fedavg", "FedProx": "fedprox", "FedProxConfig": "fedprox", "FedPer": "fedper",
    "FedRep": "fedrep", "FedRepConfig": "fedrep", "FedBABU": "fedbabu", "FedBABUConfig": "fedbabu",
    "LocalConfig": "_common", "SharedModelState": "_common", "PersonalHeadsState": "_common",
    "Ditto": "ditto", "DittoConfig": "ditto", "PFedMe": "pfedme", "PFedMeConfig": "pfedme",
    "FedProto": "fedproto", "FedProtoConfig": "fedproto", "FedALA": "fedala", "FedALAConfig": "fedala",
    "head_only": "_common", "body_only": "_common",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"pfedkdh_jax.baselines.{_EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pfedkdh_jax.baselines' has no attribute {name!r}")
