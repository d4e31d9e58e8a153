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

import jax
import jax.numpy as jnp

from pfedkdh_jax.algorithms import common as C
from pfedkdh_jax.algorithms.configs import FedAvgConfig
from pfedkdh_jax.engine.protocol import Algorithm, ClientUpdate, EvalModels
from pfedkdh_jax.data.device import FederatedData
from pfedkdh_jax.engine.local import LocalState, LocalTrainer
from pfedkdh_jax.engine.protocol import Model


@dataclasses.dataclass(frozen=True)
class FedAvg(Algorithm):
    """FedAvg over any :class:`~pfedkdh_jax.engine.protocol.Model`. Static; every method is pure and jittable."""

    model: Model
    config: FedAvgConfig = FedAvgConfig()

    name = "fedavg"

    def init(self, key: jax.Array, data: FederatedData) -> C.SharedModelState:
        params = C.init_params(self.model, key, data)
        return C.SharedModelState(backbone=params["backbone"], head=params["head"],
                                  round=jnp.zeros((), jnp.int32), num_clients=data.num_clients)

    # ------------------------------------------------------------------------------ client side
    @property
    def trainer(self) -> LocalTrainer:
        return C.sgd_trainer(self.local_loss, C.client_tx(self.config), self.config)

    def local_loss(self, params, ctx, x, y, mask, rng) -> jax.Array:
        """Mean cross-entropy of one batch (masked)."""
        return C.cross_entropy_loss(self.model)(params, ctx, x, y, mask, rng)

    def messages(self, state: C.SharedModelState, update: ClientUpdate):
        """The global model down, the trained model up."""
        return {"backbone": state.backbone, "head": state.head}, update.params

    def client_start(self, state: C.SharedModelState, data: FederatedData, client: jax.Array,
                     key: jax.Array) -> LocalState:
        """Client ``client`` starts from the global model."""
        return C.start_local(self.trainer, {"backbone": state.backbone, "head": state.head}, data, client, key)

    # ------------------------------------------------------------------------------ server side
    def mean_upload(self, update: ClientUpdate):
        """The whole model is averaged; the loss is the rest."""
        return update.params, update.replace(params=None)

    def server_update_from_mean(self, state: C.SharedModelState, data: FederatedData, selected: jax.Array,
                                mean, rest: ClientUpdate, key: jax.Array) -> tuple[C.SharedModelState, dict]:
        """w_g ← Σ n_k w_k / Σ n_k over the uploaded full models (``mean``)."""
        del data, selected, key
        return (state.replace(backbone=mean["backbone"], head=mean["head"], round=state.round + 1),
                C.round_metrics(rest))

    # ------------------------------------------------------------------------------- evaluation
    def eval_models(self, state: C.SharedModelState) -> EvalModels:
        """The global model for everyone: (θ_g, φ_g for every client), global head φ_g."""
        return EvalModels(backbone=state.backbone, heads=C.broadcast(state.head, state.num_clients),
                          global_head=state.head)


def from_config(cfg, num_classes: int, args: dict) -> FedAvg:
    """FedAvg of a run: the run's model, budget and optimizer, ``args`` its own options (``--method-arg``)."""
    return FedAvg(C.run_model(cfg, num_classes), FedAvgConfig(**C.local_config(cfg), **args))
