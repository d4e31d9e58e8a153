"""FedAvg: federated averaging of the full model.

McMahan, Moore, Ramage, Hampson, Agüera y Arcas, "Communication-Efficient Learning of Deep Networks
from Decentralized Data", AISTATS 2017.

Round t: every selected client k starts from the global model w_g = (θ_g, φ_g), runs E epochs of
minibatch SGD on its train split minimising the cross-entropy, and uploads its full model w_k; the
server sets w_g ← Σ n_k w_k / Σ n_k over the selected clients. FedAvg has one shared model, so it is
evaluated with the global model (method.md §5): ``eval_models`` gives every client the global head,
hence ``personalized_*`` accuracies equal the ``global_*`` ones.

Hyperparameters: none of its own; lr, B and E are the shared budget of the run (method.md Table 1).
PFLlib's FedAvg is the same algorithm (weights n_k; plain SGD).
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

FedAvgConfig = C.LocalConfig


@dataclasses.dataclass(frozen=True)
class FedAvg:
    """FedAvg over a :class:`CNN`. Static; every method is pure and jittable."""

    model: CNN
    config: C.LocalConfig = C.LocalConfig()

    name = "fedavg"

    def init(self, key: jax.Array, data: FederatedData) -> C.SharedModelState:
        params = C.init_params(self.model, key, data)
        return C.SharedModelState(backbone=params["backbone"], head=params["head"],
                                  round=jnp.zeros((), jnp.int32), num_clients=data.num_clients)

    # ------------------------------------------------------------------------------ client side
    @property
    def trainer(self) -> LocalTrainer:
        return C.sgd_trainer(self.local_loss, optax.sgd(self.config.lr), self.config)

    def local_loss(self, params, ctx, x, y, mask, rng) -> jax.Array:
        """Mean cross-entropy of one batch (masked)."""
        return C.cross_entropy_loss(self.model)(params, ctx, x, y, mask, rng)

    def context(self, state: C.SharedModelState) -> PyTree:
        """Nothing beyond the starting point is needed by the local objective."""
        return None

    def client_start(self, state: C.SharedModelState, data: FederatedData, client: jax.Array,
                     round_key: jax.Array) -> LocalState:
        """Client ``client`` starts from the global model."""
        return C.start_from_global(self.trainer, state, data, client, round_key)

    # ------------------------------------------------------------------------------ server side
    def server_update(self, state: C.SharedModelState, data: FederatedData, selected: jax.Array,
                      finals: LocalState, round_key: jax.Array) -> tuple[C.SharedModelState, dict]:
        """w_g ← Σ n_k w_k / Σ n_k over the uploaded full models."""
        del round_key
        params = C.average_uploads(finals.params, data, selected)
        return (state.replace(backbone=params["backbone"], head=params["head"], round=state.round + 1),
                {"train_loss": C.mean_train_loss(finals)})

    # ------------------------------------------------------------------------------- evaluation
    def eval_models(self, state: C.SharedModelState):
        """The global model for everyone: (θ_g, φ_g broadcast to [K, ...], φ_g)."""
        return state.backbone, C.broadcast_clients(state.head, state.num_clients), state.head


def from_config(cfg, num_classes: int, args: dict) -> FedAvg:
    """FedAvg with the run's shared budget (no method options)."""
    del args
    return FedAvg(CNN(num_classes, cfg.dropout), C.local_config(cfg))
