"""pFedSim: similarity-aware aggregation of the body, personal classifiers.

J. Tan, Y. Zhou, G. Liu, J. H. Wang, S. Yu, "pFedSim: Similarity-Aware Model Aggregation Towards
Personalized Federated Learning", arXiv:2305.15706, 2023. The specification implemented here is
method.md §5.1.

* Warm-up: rounds t < R_w are plain FedAvg on the whole model, scored with the global model. After the
  last warm-up round every client's stored model becomes the global model (classifier included) and
  the client-similarity matrix W (``[K, K]``) the identity.
* Personalized rounds: the server stores every client's latest whole model (``[K, ...]``). Selected
  client i receives its own stored classifier (never aggregated) and a body (conv layers + dense 512)
  mixed from the stored bodies of *all* K clients with weights ``a_i = g(W[i]) / Σ g(W[i])``,
  ``g(w) = −log(1 − w)``, the self entry set to 0.9999 and every entry clipped to [0, 0.9999] (no inf
  for collinear classifiers). A client whose row has no positive off-diagonal entry thus keeps its own
  stored body. Downloads use the stored models as they stood at the start of the round. The client
  trains the whole model (E epochs of CE, SGD) and uploads it; the server stores it.
* Similarity update after a personalized round, for each pair i ≠ j of clients selected in it:
  ``W[i, j] = W[j, i] = max(0, mean over classes c of cos(φ_i[:, c], φ_j[:, c]))`` — the columns of the
  head's kernel (its per-class weight vectors; the bias is excluded). Other entries keep their values.
* Evaluation: each client's stored model on its own test split (clients not selected since the
  warm-up hold the warm-up global model); during the warm-up, the global model for everyone. The
  ``global_*`` metrics are the warm-up's global model's.

On the engine, the phase is a value of the state (the round counter), not a Python branch: both
phases' client starts and server steps are traced once and the phase selects between them with
``jnp.where`` (the warm-up's values are selected bit for bit, so warm-up rounds equal FedAvg's under the
same keys), so nothing retraces at the switch. Cost: client side = FedAvg; the server adds the K × K
cosines of the selected classifiers and one K-way mix of the bodies per selected client.

Hyperparameters (``--method-arg``):

* ``warmup`` = 0.5 — R_w as a fraction of the run's rounds (⌊0.5·R⌋, the default of method.md §5.1
  and of the authors' code, whose warm-up is half the rounds), or, if ≥ 1, a number of rounds.

lr, batch size and local epochs are the run's shared options. The authors fine-tune and evaluate
with the personalized models of every client each round; here, as for every method, only the
selected clients train.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct as struct
import jax
import jax.numpy as jnp

from pfedkdh_jax.algorithms import common as C
from pfedkdh_jax.algorithms.configs import PFedSimConfig
from pfedkdh_jax.engine.protocol import Algorithm, ClientUpdate, EvalModels
from pfedkdh_jax.data.device import FederatedData
from pfedkdh_jax.engine.local import LocalState, LocalTrainer
from pfedkdh_jax.engine.protocol import Model, feature_dim

PyTree = Any

SELF_SIMILARITY = 0.9999  # W[i, i] in the mixing weights, and the clip of every entry


@struct.dataclass
class PFedSimState:
    params: PyTree          # the warm-up's global model {"backbone", "head"}
    models: PyTree          # every client's stored model, [K, ...]
    similarity: jax.Array   # float32 [K, K], W
    round: jax.Array        # int32 [], rounds completed


def mixing_weights(row: jax.Array, client: jax.Array) -> jax.Array:
    """``a_i = g(W[i]) / Σ g(W[i])`` with ``g(w) = −log(1 − w)``, the self entry 0.9999, entries
    clipped to [0, 0.9999]; ``row``: W[i] ``[K]``."""
    w = jnp.clip(row.at[client].set(SELF_SIMILARITY), 0.0, SELF_SIMILARITY)
    g = -jnp.log1p(-w)
    return g / jnp.sum(g)


def classifier_rows(model: Model, head: PyTree, dim: int) -> jax.Array:
    """The per-class weight vectors ``[classes, D]`` of one head: the rows of ∂logits/∂z (at z = 0),
    which for a linear head are exactly its weight matrix's class columns (bias excluded), whatever
    the head's parameter names."""
    return jax.jacrev(lambda z: model.logits_from_features(head, z[None])[0])(jnp.zeros((dim,), jnp.float32))


def classifier_similarity(model: Model, heads: PyTree, dim: int) -> jax.Array:
    """``max(0, mean over classes of the cosine of the clients' per-class weight vectors)``,
    ``[C, C]`` for heads stacked ``[C, ...]`` (weight vectors ``[C, classes, D]``; bias excluded)."""
    rows = jax.vmap(lambda h: classifier_rows(model, h, dim))(heads)
    unit = rows / jnp.maximum(jnp.linalg.norm(rows, axis=-1, keepdims=True), 1e-12)
    cos = jnp.einsum("icd,jcd->ijc", unit, unit)
    return jnp.maximum(0.0, jnp.mean(cos, axis=-1))


def update_similarity(w: jax.Array, selected: jax.Array, sim: jax.Array) -> jax.Array:
    """W with the entries (i, j), i ≠ j both in ``selected``, set from ``sim [C, C]``."""
    off = ~jnp.eye(selected.shape[0], dtype=bool)
    rows, cols = jnp.meshgrid(selected, selected, indexing="ij")
    return w.at[rows, cols].set(jnp.where(off, sim, w[rows, cols]))


@dataclasses.dataclass(frozen=True)
class PFedSim(Algorithm):
    """pFedSim over any :class:`~pfedkdh_jax.engine.protocol.Model`. Static; every method is pure and jittable."""

    model: Model
    config: PFedSimConfig = PFedSimConfig()

    name = "pfedsim"

    def init(self, key: jax.Array, data: FederatedData) -> PFedSimState:
        params = C.init_params(self.model, key, data)
        k = data.num_clients
        return PFedSimState(params=params, models=C.broadcast(params, k),
                            similarity=jnp.eye(k, dtype=jnp.float32), round=jnp.zeros((), jnp.int32))

    def personal_phase(self, state: PFedSimState) -> jax.Array:
        return state.round >= self.config.warmup_rounds

    # ------------------------------------------------------------------------------ client side
    @property
    def trainer(self) -> LocalTrainer:
        return C.sgd_trainer(C.cross_entropy_loss(self.model), C.client_tx(self.config), self.config)

    def download(self, state: PFedSimState, client: jax.Array) -> PyTree:
        """Client ``client``'s starting model in a personalized round: the similarity-weighted mix of
        all K stored bodies and its own stored classifier."""
        a = mixing_weights(state.similarity[client], client)
        body = jax.tree_util.tree_map(lambda x: jnp.tensordot(a, x, axes=1), state.models["backbone"])
        return {"backbone": body, "head": C.take(state.models["head"], client)}

    def messages(self, state: PFedSimState, update: ClientUpdate):
        """A whole model down (the global one in the warm-up; later a mixed body and the client's
        stored classifier) and the trained model up."""
        return state.params, update.params

    def client_start(self, state: PFedSimState, data: FederatedData, client: jax.Array,
                     key: jax.Array) -> LocalState:
        """The global model during the warm-up, the mixed download afterwards."""
        personal = self.personal_phase(state)
        params = jax.tree_util.tree_map(lambda p, g: jnp.where(personal, p, g),
                                        self.download(state, client), state.params)
        return C.start_local(self.trainer, params, data, client, key)

    # ------------------------------------------------------------------------------ server side
    def server_update(self, state: PFedSimState, data: FederatedData, selected: jax.Array,
                      updates: ClientUpdate, key: jax.Array) -> tuple[PFedSimState, dict]:
        """Warm-up: FedAvg (and, after its last round, every stored model ← the global, W ← I).
        Personalized: store the uploads; update W for the pairs selected together."""
        del key
        personal = self.personal_phase(state)
        done = state.round + 1
        # warm-up branch
        params = C.average_uploads(updates.params, data, selected)
        switch = done == self.config.warmup_rounds
        k = data.num_clients
        warm_models = jax.tree_util.tree_map(lambda m, g: jnp.where(switch, jnp.broadcast_to(g, m.shape), m),
                                             state.models, params)
        warm_w = jnp.where(switch, jnp.eye(k, dtype=jnp.float32), state.similarity)
        # personalized branch
        models = C.put(state.models, selected, updates.params)
        w = update_similarity(state.similarity, selected, classifier_similarity(self.model, updates.params["head"],
                                                                    feature_dim(self.model, data.input_shape)))

        def pick(a, b):
            return jax.tree_util.tree_map(lambda x, y: jnp.where(personal, x, y), a, b)
        return state.replace(params=pick(state.params, params), models=pick(models, warm_models),
                             similarity=jnp.where(personal, w, warm_w), round=done), C.round_metrics(updates)

    # ------------------------------------------------------------------------------- evaluation
    def eval_models(self, state: PFedSimState) -> EvalModels:
        """Each client's stored model (the global model for everyone during the warm-up)."""
        personal = self.personal_phase(state)
        models = jax.tree_util.tree_map(lambda m, g: jnp.where(personal, m, jnp.broadcast_to(g, m.shape)),
                                        state.models, state.params)
        return EvalModels(backbone=models["backbone"], heads=models["head"], global_model=state.params,
                          per_client=True)


def from_config(cfg, num_classes: int, args: dict) -> PFedSim:
    """PFedSim of a run: the run's model, budget and optimizer, ``args`` its own options (``--method-arg``)."""
    return PFedSim(C.cnn(cfg, num_classes), PFedSimConfig(**C.local_config(cfg), **args, rounds=cfg.rounds))
