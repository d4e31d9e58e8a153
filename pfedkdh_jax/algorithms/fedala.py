"""FedALA: adaptive local aggregation of the global model into each client's model.

J. Zhang, Y. Hua, H. Wang, T. Song, Z. Xue, R. Ma, H. Guan, "FedALA: Adaptive Local Aggregation for
Personalized Federated Learning", AAAI 2023 (arXiv:2212.01197).

The server runs FedAvg on whole models. Client k keeps its local model Θ_k (``[K, ...]``, or rows for the
clients trained so far: ``personal_rows``) and
element-wise aggregation weights W_k (shaped like the head, in [0, 1], starting at 1). When selected
it first initialises its model by ALA (Algorithm 1, lines 6–16; ``client_start``):

* the lower layers (here the backbone) are overwritten by the global model;
* the p higher layers (here p = 1: the head, Dense 512 → C) become
  ``φ̂ = φ_k + (φ_g − φ_k) ⊙ W_k``, and W_k is learned on a random s% of the client's train data by
  ``W ← clip(W − η·∇_W CE, 0, 1)`` (``∇_W CE = ∇_φ̂ CE ⊙ (φ_g − φ_k)``).

Then it trains the whole model on cross-entropy (E epochs) and uploads it; the server averages the
uploads weighted by n_k. ALA is skipped while the local head equals the global head (the first round,
when every model is the initial one), as in the authors' module. Clients are scored with their local
models (the model each client holds after its last local training); the global model gives the
``global_*`` metrics.

Because the lower layers are frozen to the global backbone during ALA, the features of the s% sample are
computed once (one forward pass) and the weight learning is head-only SGD on them: a ``lax.scan`` with
no convolution inside, equally fast on CPU and accelerators.

The paper learns W "until convergence" the first time a client runs ALA (the authors' module stops once
the standard deviation of the last 10 epoch losses is below a threshold, so after at least 11 epochs)
and for one epoch afterwards. To keep the computation static and vmappable this is a fixed number of
epochs over the sample: ``start_epochs`` the first time, 1 afterwards.

Hyperparameters (``--method-arg``; the paper's defaults):

* ``eta`` = 1.0 — η, learning rate of the aggregation weights;
* ``rand_percent`` = 80 — s, the percentage of local train data sampled for ALA;
* ``start_epochs`` = 20 — fixed replacement of the first "until converged" loop (≥ 11, the fewest the
  authors' stopping rule allows).
* ``personal_rows`` = 0 — where the Θ_k are kept: 0, ``[K, ...]``; 0 < N < K, N rows for the clients
  trained so far (:class:`~pfedkdh_jax.engine.client_rows.ClientRows`; the others read the initial
  model). The same numbers either way; a run sets ``rounds × clients per round`` when that is below K.

p = 1 (the head) is fixed by the backbone/head split of this CNN (the authors' ``layer_idx = 2`` counts
the head's weight and bias). The ALA batch size is the run's batch size, like the authors'. Differences
from the authors' code / PFLlib: there the s% sample is a contiguous slice of the (pre-shuffled) data and
the last partial batch is dropped; here it is a uniformly random subset and the last partial batch is
kept (masked), as in all local training here. PFLlib also runs ALA for every client each round before
evaluating; here only selected clients run it, at the start of their local training (Algorithm 1).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.struct as struct
import jax
import jax.numpy as jnp
import optax

from pfedkdh_jax import losses
from pfedkdh_jax.algorithms import common as C
from pfedkdh_jax.algorithms.configs import FedALAConfig
from pfedkdh_jax.engine.protocol import Algorithm, ClientUpdate, EvalModels
from pfedkdh_jax.data.device import FederatedData, gather_inputs
from pfedkdh_jax.engine.local import LocalState, LocalTrainer
from pfedkdh_jax.engine.protocol import Model

PyTree = Any

_ALA_STREAM = 7  # fold_in tag of ALA's sampling key, distinct from the local-training keys


@struct.dataclass
class FedALAState:
    params: PyTree       # the global model {"backbone", "head"}
    local: PyTree        # every client's local model after its last local training: [K, ...] or ClientRows
    weights: PyTree      # W_k, head-shaped ALA weights in [0, 1], [K, ...]
    started: jax.Array   # bool [K], whether the client has had its first ("start phase") ALA
    round: jax.Array     # int32 [], rounds completed


def mix_heads(local_head: PyTree, global_head: PyTree, weights: PyTree) -> PyTree:
    """``φ_k + (φ_g − φ_k) ⊙ W``."""
    return jax.tree_util.tree_map(lambda l, g, w: l + (g - l) * w, local_head, global_head, weights)


@dataclasses.dataclass(frozen=True)
class FedALA(Algorithm):
    model: Model
    config: FedALAConfig = FedALAConfig()

    name = "fedala"

    def init(self, key: jax.Array, data: FederatedData) -> FedALAState:
        params = C.init_params(self.model, key, data)
        k = data.num_clients
        return FedALAState(
            params=params, local=C.client_models(params, k, self.config.personal_rows),
            weights=C.broadcast(jax.tree_util.tree_map(jnp.ones_like, params["head"]), k),
            started=jnp.zeros((k,), bool), round=jnp.zeros((), jnp.int32))

    @property
    def trainer(self) -> LocalTrainer:
        c = self.config
        return C.sgd_trainer(C.cross_entropy_loss(self.model), C.client_tx(c), c)

    def ala_trainer(self, epochs: int) -> LocalTrainer:
        """Projected SGD on W over precomputed features (no convolution in its loop)."""
        c = self.config
        return LocalTrainer(loss_fn=self.ala_loss, tx=optax.identity(), gather=C.gather_features,
                            epochs=epochs, batch_size=c.batch_size, update=self.ala_update)

    # ------------------------------------------------------------------------------------ ALA
    def ala_loss(self, weights, ctx, z, y, mask, rng) -> jax.Array:
        del rng
        head = mix_heads(ctx["local"], ctx["global"], weights)
        return losses.masked_mean(losses.cross_entropy(self.model.logits_from_features(head, z), y), mask)

    def ala_update(self, weights, opt_state, ctx, z, y, mask, rng):
        """``W ← clip(W − η·∇_W CE, 0, 1)``."""
        loss, g = jax.value_and_grad(self.ala_loss)(weights, ctx, z, y, mask, rng)
        eta = self.config.eta
        weights = jax.tree_util.tree_map(lambda w, gw: jnp.clip(w - eta * gw, 0.0, 1.0), weights, g)
        return loss, weights, opt_state

    def ala(self, state: FedALAState, data: FederatedData, client: jax.Array, key: jax.Array):
        """The client's initial head and its new (weights, started) after adaptive local aggregation."""
        c = self.config
        glob = state.params
        local_head = C.take(state.local, client)["head"]
        weights = C.take(state.weights, client)
        started = state.started[client]
        # Nothing to aggregate while the local head equals the global one (the first round).
        same = jnp.all(jnp.stack([jnp.array_equal(a, b) for a, b in zip(
            jax.tree_util.tree_leaves(local_head), jax.tree_util.tree_leaves(glob["head"]))]))

        # s% of the client's train samples, uniformly at random, in a static-size table.
        m = data.max_train
        m_sub = max(1, int(math.floor(c.rand_percent / 100 * m)))
        n = data.train_n[client]
        n_sub = jnp.maximum(1, jnp.floor(c.rand_percent / 100 * n).astype(jnp.int32))
        u = jax.random.uniform(key, (m,))
        order = jnp.argsort(jnp.where(jnp.arange(m) < n, u, 2.0))[:m_sub]
        x, y = gather_inputs(data, data.train_idx[client][order])
        feats = self.model.features(glob["backbone"], x)  # lower layers = the global ones, frozen

        ctx = {"local": local_head, "global": glob["head"]}
        src, rows = (feats, y), jnp.arange(m_sub)

        def learn(epochs):
            t = self.ala_trainer(epochs)
            s = t.init(weights, jax.random.fold_in(key, epochs), n_sub, m_sub)
            return t.run_scan(s, ctx, rows, src, t.num_steps(m_sub)).params

        learned = jax.tree_util.tree_map(lambda a, b: jnp.where(started, a, b),
                                         learn(1), learn(c.start_epochs))
        new_weights = jax.tree_util.tree_map(lambda old, new: jnp.where(same, old, new), weights, learned)
        head = mix_heads(local_head, glob["head"], new_weights)
        return head, new_weights, started | ~same

    def messages(self, state: FedALAState, update: ClientUpdate):
        """The global model down, the local model up."""
        return state.params, update.params

    def client_start(self, state: FedALAState, data: FederatedData, client: jax.Array,
                     key: jax.Array) -> LocalState:
        """ALA initialisation: global backbone, adaptively aggregated head; W travels in ``aux``."""
        key = jax.random.fold_in(key, client)
        head, weights, started = self.ala(state, data, client, jax.random.fold_in(key, _ALA_STREAM))
        params = {"backbone": state.params["backbone"], "head": head}
        return self.trainer.init(params, key, data.train_n[client], data.max_train,
                                 aux={"weights": weights, "started": started})

    # ------------------------------------------------------------------------------ server side
    def server_update(self, state: FedALAState, data: FederatedData, selected: jax.Array,
                      updates: ClientUpdate, key: jax.Array) -> tuple[FedALAState, dict]:
        del key
        params = C.weighted_average(updates.params, data.train_n[selected])
        local = C.put(state.local, selected, updates.params)
        metrics = C.with_rows_lost(C.round_metrics(updates), local)
        return state.replace(
            params=params, local=local,
            weights=C.put(state.weights, selected, updates.aux["weights"]),
            started=state.started.at[selected].set(updates.aux["started"]),
            round=state.round + 1), metrics

    def eval_models(self, state: FedALAState) -> EvalModels:
        """Each client's local model; the global model for ``global_*``."""
        return C.personal_eval_models(state.local, state.params)


def from_config(cfg, num_classes: int, args: dict) -> FedALA:
    """FedALA of a run: the run's model, budget and optimizer, ``args`` its own options (``--method-arg``)."""
    return FedALA(C.run_model(cfg, num_classes), FedALAConfig(**C.local_config(cfg), **C.personal_rows(cfg, args)))
