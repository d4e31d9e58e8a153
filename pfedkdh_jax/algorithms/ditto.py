"""Ditto: a FedAvg global model plus a proximally regularised personal model per client.

T. Li, S. Hu, A. Beirami, V. Smith, "Ditto: Fair and Robust Federated Learning Through
Personalization", ICML 2021 (arXiv:2012.04221).

The server keeps a global model w (the whole CNN); client k keeps a personal model v_k (a whole CNN of
its own: ``[K, ...]``, or only for the clients trained so far, ``personal_rows`` below). In a round each selected client, from the broadcast w^t,

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
* ``personal_rows`` = 0 — 0: a personal model per client, ``[K, ...]``; 0 < N < K: a
  :class:`~pfedkdh_jax.engine.client_rows.ClientRows` of N rows, one for each client trained so far (the
  others are still at w⁰, which they read). The same numbers either way; a run sets ``rounds × clients
  per round`` when that is below K, so 10,000 clients, 100 a round, 10 rounds hold 1,000 models, not
  10,000.

lr, batch size and local epochs are the run's shared options (``--lr``, ``--batch-size``,
``--local-epochs``). Differences from PFLlib: PFLlib trains the personal model for its own number of
epochs (``plocal_epochs``, default 1) before the global copy; here, as in the paper's Algorithm 1 and
the authors' code, the two updates interleave on the same minibatches. Personal models of clients
that were never selected stay at w⁰ (the paper's initialisation v_k⁰ = w⁰).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from pfedkdh_jax import losses
from pfedkdh_jax.algorithms import common as C
from pfedkdh_jax.algorithms.configs import DittoConfig
from pfedkdh_jax.engine.protocol import Algorithm, ClientUpdate, EvalModels
from pfedkdh_jax.data.device import FederatedData
from pfedkdh_jax.engine.local import LocalState, LocalTrainer
from pfedkdh_jax.engine.protocol import Model

PyTree = Any


DittoState = C.PersonalModelsState  # personal: v_k: every client's personal model, [K, ...]


@dataclasses.dataclass(frozen=True)
class Ditto(Algorithm):
    model: Model
    config: DittoConfig = DittoConfig()

    name = "ditto"

    def init(self, key: jax.Array, data: FederatedData) -> DittoState:
        """w⁰ from ``key``; every personal model starts as w⁰."""
        params = C.init_params(self.model, key, data)
        return DittoState.create(params, data.num_clients, self.config.personal_rows)

    @property
    def trainer(self) -> LocalTrainer:
        c = self.config
        tx = C.per_model({"global": C.client_tx(c), "personal": C.make_tx(
            c.optimizer if c.personal_optimizer is None else c.personal_optimizer, c.lr)})
        return C.sgd_trainer(self.local_loss, tx, c)

    def context(self, state: DittoState) -> PyTree:
        """w^t, the anchor of the personal models' proximal term."""
        return state.params

    def local_loss(self, params, ctx, x, y, mask, rng) -> jax.Array:
        """``CE(w_k) + CE(v_k) + λ/2·‖v_k − w^t‖²`` on one batch. The global copy sees ``rng`` itself
        (so it trains exactly as FedAvg would with the same keys), the personal model a derived key."""
        def ce(p, r):
            return losses.masked_mean(losses.cross_entropy(C.logits(self.model, p, x, rng=r), y), mask)
        return (ce(params["global"], rng) + ce(params["personal"], jax.random.fold_in(rng, 1))
                + losses.proximal(params["personal"], ctx, self.config.lam))

    def messages(self, state: DittoState, update: ClientUpdate):
        """The global model down, its trained copy up; the personal model stays."""
        return state.params, update.params["global"]

    def client_start(self, state: DittoState, data: FederatedData, client: jax.Array,
                     key: jax.Array) -> LocalState:
        params = {"global": state.params, "personal": C.take(state.personal, client)}
        return C.start_local(self.trainer, params, data, client, key)

    def server_update(self, state: DittoState, data: FederatedData, selected: jax.Array,
                      updates: ClientUpdate, key: jax.Array) -> tuple[DittoState, dict]:
        """FedAvg on the uploaded global copies; personal models stay with their clients."""
        del key
        params = self.aggregate(updates.params["global"], data.train_n[selected])
        personal = C.put(state.personal, selected, updates.params["personal"])
        metrics = C.with_rows_lost(C.round_metrics(updates), personal)
        return state.replace(params=params, personal=personal, round=state.round + 1), metrics

    def aggregate(self, uploads: PyTree, weights: jax.Array) -> PyTree:
        """``w ← Σ n_k w_k / Σ n_k`` over the uploads ``[C, ...]``."""
        return C.weighted_average(uploads, weights)

    def eval_models(self, state: DittoState) -> EvalModels:
        """Each client's personal model; the global model w for the ``global_*`` metrics."""
        return C.personal_eval_models(state.personal, state.params)


def from_config(cfg, num_classes: int, args: dict) -> Ditto:
    """Ditto of a run: the run's model, budget and optimizer, ``args`` its own options (``--method-arg``)."""
    return Ditto(C.run_model(cfg, num_classes), DittoConfig(**C.local_config(cfg), **C.personal_rows(cfg, args)))
