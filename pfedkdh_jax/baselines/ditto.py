"""Ditto: a FedAvg global model plus a proximally regularised personal model per client.

T. Li, S. Hu, A. Beirami, V. Smith, "Ditto: Fair and Robust Federated Learning Through
Personalization", ICML 2021 (arXiv:2012.04221).

The server keeps a global model w (the whole CNN); client k keeps a personal model v_k (a whole CNN of
its own, ``[K, ...]``). In a round each selected client, from the broadcast w^t,

* trains a copy w_k of the global model on plain cross-entropy (exactly FedAvg's local problem), and
* updates its personal model on ``F_k(v) + λ/2·‖v − w^t‖²``, i.e. ``v ← v − η(∇F_k(v) + λ(v − w^t))``,

one personal step next to every global step on the same minibatch (Algorithm 1 with s = the number of
local iterations, as in the authors' solver). Both run as one local problem over the pair
``{"global": w_k, "personal": v_k}`` whose loss is ``CE(w_k) + CE(v_k) + λ/2‖v_k − w^t‖²``: the
terms share no parameters, so each model gets exactly its own gradient. Only w_k is uploaded; the
server averages the uploads weighted by n_k (method.md's aggregation; the authors' code averages
uniformly over clients sampled with probability ∝ n_k, the same in expectation). Clients are scored
with their personal models v_k; the global model w gives the ``global_*`` metrics.

Hyperparameters (``--method-arg``):

* ``lam`` = 1.0 — λ. The paper tunes λ per dataset; 1 is the value of the authors' published run
  scripts (``run_*_lam1.sh`` in github.com/litian96/ditto). PFLlib's default ``mu = 0`` would turn the
  personal models into purely local training; it is not used here.

lr, batch size and local epochs are the run's shared options (``--lr``, ``--batch-size``,
``--local-epochs``). Differences from PFLlib: PFLlib trains the personal model for its own number of
epochs (``plocal_epochs``, default 1) before the global copy; here, as in the paper's Algorithm 1 and
the authors' code, the two updates interleave on the same minibatches. Personal models of clients
that were never selected stay at w⁰ (the paper's initialisation v_k⁰ = w⁰).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct as struct
import jax
import jax.numpy as jnp
import optax

from pfedkdh_jax import losses
from pfedkdh_jax.baselines._client_models import broadcast, check_shared_options, put, take
from pfedkdh_jax.engine import LocalState, LocalTrainer
from pfedkdh_jax.federated_data import FederatedData, gather_inputs
from pfedkdh_jax.model import CNN
from pfedkdh_jax.pfedkdh import weighted_average

PyTree = Any


@dataclasses.dataclass(frozen=True)
class DittoConfig:
    lr: float = 0.015          # η, client SGD learning rate of both models (no momentum)
    batch_size: int = 64
    local_epochs: int = 2
    lam: float = 1.0           # λ, weight of the proximal term of the personal objective


@struct.dataclass
class DittoState:
    params: PyTree     # w: the global model {"backbone", "head"}
    personal: PyTree   # v_k: every client's personal model, [K, ...]
    round: jax.Array   # int32 [], rounds completed


@dataclasses.dataclass(frozen=True)
class Ditto:
    model: CNN
    config: DittoConfig = DittoConfig()

    name = "ditto"
    per_client_backbone = True

    def init(self, key: jax.Array, data: FederatedData) -> DittoState:
        """w⁰ from ``key``; every personal model starts as w⁰."""
        params = self.model.init(key, data.input_shape)
        return DittoState(params=params, personal=broadcast(params, data.num_clients),
                          round=jnp.zeros((), jnp.int32))

    @property
    def trainer(self) -> LocalTrainer:
        c = self.config
        return LocalTrainer(loss_fn=self.local_loss, tx=optax.sgd(c.lr), gather=gather_inputs,
                            epochs=c.local_epochs, batch_size=c.batch_size)

    def context(self, state: DittoState) -> PyTree:
        """w^t, the anchor of the personal models' proximal term."""
        return state.params

    def local_loss(self, params, ctx, x, y, mask, rng) -> jax.Array:
        """``CE(w_k) + CE(v_k) + λ/2·‖v_k − w^t‖²`` on one batch. The global copy sees ``rng`` itself
        (so it trains exactly as FedAvg would with the same keys), the personal model a derived key."""
        def ce(p, r):
            return losses.masked_mean(losses.cross_entropy(self.model.logits(p, x, rng=r), y), mask)
        return (ce(params["global"], rng) + ce(params["personal"], jax.random.fold_in(rng, 1))
                + losses.proximal(params["personal"], ctx, self.config.lam))

    def client_start(self, state: DittoState, data: FederatedData, client: jax.Array,
                     round_key: jax.Array) -> LocalState:
        params = {"global": state.params, "personal": take(state.personal, client)}
        return self.trainer.init(params, jax.random.fold_in(round_key, client), data.train_n[client],
                                 data.max_train)

    def server_update(self, state: DittoState, data: FederatedData, selected: jax.Array,
                      finals: LocalState, round_key: jax.Array) -> tuple[DittoState, dict]:
        """FedAvg on the uploaded global copies; personal models stay with their clients."""
        del round_key
        params = self.aggregate(finals.params["global"], data.train_n[selected])
        personal = put(state.personal, selected, finals.params["personal"])
        metrics = {"train_loss": jnp.mean(finals.loss_sum / jnp.maximum(finals.step, 1))}
        return state.replace(params=params, personal=personal, round=state.round + 1), metrics

    def aggregate(self, uploads: PyTree, weights: jax.Array) -> PyTree:
        """``w ← Σ n_k w_k / Σ n_k`` over the uploads ``[C, ...]``."""
        return weighted_average(uploads, weights)

    def before_training(self, state: DittoState, data: FederatedData, key: jax.Array) -> DittoState:
        return state

    def eval_models(self, state: DittoState):
        """(personal backbones [K, ...], personal heads [K, ...], global model)."""
        return state.personal["backbone"], state.personal["head"], state.params


def from_config(cfg, num_classes: int, args: dict) -> Ditto:
    check_shared_options(cfg, "ditto")
    return Ditto(CNN(num_classes, cfg.dropout), DittoConfig(
        lr=cfg.lr, batch_size=cfg.batch_size, local_epochs=cfg.local_epochs, lam=args["lam"]))
