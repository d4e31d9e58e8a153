"""FedBABU: federated averaging with body aggregation and body update; fine-tuning at evaluation.

Oh, Kim, Yun, "FedBABU: Toward Enhanced Representation for Federated Image Classification",
ICLR 2022.

During federated training the head is never updated: every client uses the same randomly initialised
head φ⁰ (the shared initialisation of method.md §1), trains only the body θ_k (E epochs of SGD from
θ_g on the cross-entropy, head frozen) and uploads it; θ_g ← Σ n_k θ_k / Σ n_k. Personalization
happens only at evaluation: each client fine-tunes a copy of the global model (θ_g, φ⁰) on its own
train split for ``finetune_epochs`` epochs and is scored with the fine-tuned model on its test split;
the fine-tuned models are thrown away (the next round starts from θ_g, φ⁰ again).

On the shared engine: the training optimizer is ``body_only(sgd)`` (the head's gradients and updates
zeroed around it), so φ⁰ stays bit-identical through every round. The fine-tuning is this method's
``personalization`` (:mod:`pfedkdh_jax.engine.protocol`): the engine runs it for all K clients at
every evaluation with the same layout as training, and the fine-tuned models (a backbone and a head
per client) give the ``personalized_*`` accuracies. The ``global_*`` accuracies are those of the
un-fine-tuned global model (θ_g, φ⁰), the paper's "initial" accuracy.

Hyperparameters (``--method-arg``):

* ``finetune_epochs`` = 5: the paper's fine-tuning epochs τ_f for its personalized accuracy (also the
  official code's ``ft_ep`` default). PFLlib uses 10 (``fine_tuning_epochs``).
* ``finetune_part`` = ``full``: the paper's personalization fine-tunes the whole network (body and
  head); ``head`` fine-tunes only the head (body frozen), the variant its abstract describes.
  Fine-tuning uses the shared optimizer, learning rate and batch size.

Differences from PFLlib: PFLlib evaluates every round with the *un*-fine-tuned model (a random head)
and fine-tunes once, after the last round; here every evaluation fine-tunes (the paper's protocol),
so FedBABU's curves are of personalized accuracy throughout. That costs K · τ_f epochs of local
training per evaluation (``--eval-every`` thins it). The paper's SGD has momentum 0.9 and its code
averages the bodies uniformly over balanced clients; here plain SGD and n_k weights, as for every
method (method.md §3/§5).
"""

from __future__ import annotations

import dataclasses

import jax

from pfedkdh_jax.algorithms import common as C
from pfedkdh_jax.algorithms.configs import FedBABUConfig
from pfedkdh_jax.engine.protocol import ClientUpdate, EvalModels, Personalization
from pfedkdh_jax.algorithms.fedavg import FedAvg
from pfedkdh_jax.data.device import FederatedData
from pfedkdh_jax.engine.local import LocalTrainer

_FINETUNE_STREAM = 1  # folded into the evaluation key for the fine-tuning's batch order


@dataclasses.dataclass(frozen=True)
class FedBABU(FedAvg):
    """FedBABU over any :class:`~pfedkdh_jax.engine.protocol.Model`: FedAvg's state, client start and evaluation models (the global
    model (θ_g, φ⁰) for everyone: the ``global_*`` metrics), a body-only local problem, a body-only
    server step, and fine-tuning as its personalization (the ``personalized_*`` metrics)."""

    config: FedBABUConfig = FedBABUConfig()

    name = "fedbabu"

    @property
    def trainer(self) -> LocalTrainer:
        """Body update only: the head gets exactly zero updates (φ⁰ stays bit-identical)."""
        return C.sgd_trainer(C.cross_entropy_loss(self.model), C.body_only(C.client_tx(self.config)),
                             self.config)

    def messages(self, state: C.SharedModelState, update: ClientUpdate):
        """The body down and up; the frozen head is φ⁰ everywhere and never sent."""
        return state.backbone, update.params["backbone"]

    def mean_upload(self, update: ClientUpdate):
        """The body is averaged; the head is not uploaded (it is φ⁰ everywhere)."""
        return update.params["backbone"], update.replace(params=None)

    def server_update_from_mean(self, state: C.SharedModelState, data: FederatedData, selected: jax.Array,
                                mean, rest: ClientUpdate, key: jax.Array) -> tuple[C.SharedModelState, dict]:
        """θ_g ← Σ n_k θ_k / Σ n_k (``mean``)."""
        del data, selected, key
        return state.replace(backbone=mean, round=state.round + 1), C.round_metrics(rest)

    @property
    def personalization(self) -> Personalization | None:
        """``finetune_epochs`` epochs of the fine-tuning optimizer (``optimizer`` unless
        ``finetune_optimizer``) on each client's train split (whole model or head only),
        from the global model (θ_g, φ⁰); every client is scored with its fine-tuned model."""
        c = self.config
        if c.finetune_epochs == 0:
            return None
        tune = C.make_tx(c.optimizer if c.finetune_optimizer is None else c.finetune_optimizer, c.lr)
        tx = tune if c.finetune_part == "full" else C.head_only(tune)
        trainer = C.sgd_trainer(C.cross_entropy_loss(self.model), tx, c, epochs=c.finetune_epochs)

        def start(state: C.SharedModelState, data: FederatedData, client: jax.Array, key: jax.Array):
            params = {"backbone": state.backbone, "head": state.head}
            return C.start_local(trainer, params, data, client, jax.random.fold_in(key, _FINETUNE_STREAM))

        def models(state: C.SharedModelState, params) -> EvalModels:
            del state
            return EvalModels(backbone=params["backbone"], heads=params["head"], per_client=True)

        return Personalization(trainer=trainer, start=start, models=models, suffix="", always=True)


def from_config(cfg, num_classes: int, args: dict) -> FedBABU:
    """FedBABU of a run: the run's model, budget and optimizer, ``args`` its own options (``--method-arg``)."""
    return FedBABU(C.run_model(cfg, num_classes), FedBABUConfig(**C.local_config(cfg), **args))
