"""FedPer: federated base layers, personal (never averaged) head layers.

Arivazhagan, Aggarwal, Singh, Choudhary, "Federated Learning with Personalization Layers",
arXiv:1912.00818, 2019.

The model is split into base layers (here the backbone θ) and personalization layers (the head φ_k).
Round t: selected client k sets θ_k ← θ_g, keeps its own φ_k, and trains both *together* for E epochs
of SGD on the cross-entropy; only θ_k is uploaded and θ_g ← Σ n_k θ_k / Σ n_k. Heads persist with
their clients between rounds and are never averaged or read by the server. Evaluation: client k's
personalized model (θ_g, φ_k). There is no server-side head, so no ``global_*`` accuracy is reported.

Hyperparameters: none of its own; lr, B, E are the run's shared budget. The base/personal split is
the one of method.md §1 (the last dense layer is personal), as in PFLlib's FedPer. Every φ_k starts
as the same initial head φ⁰ (method.md §1). Same algorithm as PFLlib's FedPer (weights n_k).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pfedkdh_jax.algorithms import common as C
from pfedkdh_jax.algorithms.configs import FedPerConfig
from pfedkdh_jax.engine.protocol import Algorithm, ClientUpdate, EvalModels
from pfedkdh_jax.data.device import FederatedData
from pfedkdh_jax.engine.local import LocalState, LocalTrainer
from pfedkdh_jax.engine.protocol import Model


@dataclasses.dataclass(frozen=True)
class FedPer(Algorithm):
    """FedPer over any :class:`~pfedkdh_jax.engine.protocol.Model`. Static; every method is pure and jittable."""

    model: Model
    config: FedPerConfig = FedPerConfig()

    name = "fedper"

    def init(self, key: jax.Array, data: FederatedData) -> C.PersonalHeadsState:
        """θ_g⁰ and φ⁰ from ``key``; every client's head starts as φ⁰."""
        params = C.init_params(self.model, key, data)
        return C.PersonalHeadsState(backbone=params["backbone"],
                                    heads=C.broadcast(params["head"], data.num_clients),
                                    round=jnp.zeros((), jnp.int32))

    # ------------------------------------------------------------------------------ client side
    @property
    def trainer(self) -> LocalTrainer:
        """Base and head trained together: one SGD over the full model."""
        return C.sgd_trainer(C.cross_entropy_loss(self.model), C.client_tx(self.config), self.config)

    def messages(self, state: C.PersonalHeadsState, update: ClientUpdate):
        """The base down and up; the head stays with the client."""
        return state.backbone, update.params["backbone"]

    def client_start(self, state: C.PersonalHeadsState, data: FederatedData, client: jax.Array,
                     key: jax.Array) -> LocalState:
        """θ_k ← θ_g; the client takes up its persistent head φ_k."""
        params = {"backbone": state.backbone, "head": C.take(state.heads, client)}
        return C.start_local(self.trainer, params, data, client, key)

    # ------------------------------------------------------------------------------ server side
    def mean_upload(self, update: ClientUpdate):
        """The base (the only upload) is averaged; the head stays with its client."""
        return update.params["backbone"], update.replace(params={"head": update.params["head"]})

    def server_update_from_mean(self, state: C.PersonalHeadsState, data: FederatedData, selected: jax.Array,
                                mean, rest: ClientUpdate, key: jax.Array) -> tuple[C.PersonalHeadsState, dict]:
        """Each selected head stays with its client; the bases' mean (``mean``) is the new base."""
        del data, key
        heads = C.put(state.heads, selected, rest.params["head"])
        return state.replace(backbone=mean, heads=heads, round=state.round + 1), C.round_metrics(rest)

    # ------------------------------------------------------------------------------- evaluation
    def eval_models(self, state: C.PersonalHeadsState) -> EvalModels:
        """(θ_g, φ_k for every client); no global head."""
        return EvalModels(backbone=state.backbone, heads=state.heads)


def from_config(cfg, num_classes: int, args: dict) -> FedPer:
    """FedPer of a run: the run's model, budget and optimizer, ``args`` its own options (``--method-arg``)."""
    return FedPer(C.run_model(cfg, num_classes), FedPerConfig(**C.local_config(cfg), **args))
