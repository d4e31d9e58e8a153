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
from typing import Any

import jax
import jax.numpy as jnp
import optax

from pfedkdh_jax.baselines import _common as C
from pfedkdh_jax.engine import LocalState, LocalTrainer
from pfedkdh_jax.federated_data import FederatedData
from pfedkdh_jax.model import CNN

PyTree = Any


@dataclasses.dataclass(frozen=True)
class FedPer:
    """FedPer over a :class:`CNN`. Static; every method is pure and jittable."""

    model: CNN
    config: C.LocalConfig = C.LocalConfig()

    name = "fedper"

    def init(self, key: jax.Array, data: FederatedData) -> C.PersonalHeadsState:
        """θ_g⁰ and φ⁰ from ``key``; every client's head starts as φ⁰."""
        params = C.init_params(self.model, key, data)
        return C.PersonalHeadsState(backbone=params["backbone"],
                                    heads=C.broadcast_clients(params["head"], data.num_clients),
                                    round=jnp.zeros((), jnp.int32))

    # ------------------------------------------------------------------------------ client side
    @property
    def trainer(self) -> LocalTrainer:
        """Base and head trained together: one SGD over the full model."""
        return C.sgd_trainer(C.cross_entropy_loss(self.model), optax.sgd(self.config.lr), self.config)

    def context(self, state: C.PersonalHeadsState) -> PyTree:
        return None

    def client_start(self, state: C.PersonalHeadsState, data: FederatedData, client: jax.Array,
                     round_key: jax.Array) -> LocalState:
        """θ_k ← θ_g; the client takes up its persistent head φ_k."""
        head = jax.tree_util.tree_map(lambda h: h[client], state.heads)
        return self.trainer.init({"backbone": state.backbone, "head": head},
                                 jax.random.fold_in(round_key, client), data.train_n[client],
                                 data.max_train)

    # ------------------------------------------------------------------------------ server side
    def server_update(self, state: C.PersonalHeadsState, data: FederatedData, selected: jax.Array,
                      finals: LocalState, round_key: jax.Array) -> tuple[C.PersonalHeadsState, dict]:
        """Each selected head stays with its client; the uploaded bases are averaged."""
        del round_key
        heads = jax.tree_util.tree_map(lambda all_h, new_h: all_h.at[selected].set(new_h),
                                       state.heads, finals.params["head"])
        backbone = C.average_uploads(finals.params["backbone"], data, selected)  # the only upload
        return (state.replace(backbone=backbone, heads=heads, round=state.round + 1),
                {"train_loss": C.mean_train_loss(finals)})

    # ------------------------------------------------------------------------------- evaluation
    def eval_models(self, state: C.PersonalHeadsState):
        """(θ_g, φ_k for every client, no global head)."""
        return state.backbone, state.heads, None


def from_config(cfg, num_classes: int, args: dict) -> FedPer:
    """FedPer with the run's shared budget (no method options)."""
    del args
    return FedPer(CNN(num_classes, cfg.dropout), C.local_config(cfg))
