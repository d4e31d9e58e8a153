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
same keys), so nothing retraces at the switch. Cost: client side = FedAvg; the server adds the C × C
cosines of the selected classifiers and, at the round's start, the selected clients' mixes of the
stored bodies (one ``[C, N]`` by ``[N, ...]`` contraction, N stored models).

Hyperparameters (``--method-arg``):

* ``warmup`` = 0.5 — R_w as a fraction of the run's rounds (⌊0.5·R⌋, the default of method.md §5.1
  and of the authors' code, whose warm-up is half the rounds), or, if ≥ 1, a number of rounds. R is
  the config's ``rounds``: a run sets it to ``--rounds``; a loop of one's own sets it to its length
  (the default 50 is the paper's).
* ``personal_rows`` = 0 — where the stored models are kept: 0, one per client (``[K, ...]``, W
  ``[K, K]``); 0 < N < K, a :class:`~pfedkdh_jax.engine.client_rows.ClientRows` of N rows for the
  clients trained since the warm-up (the others hold the warm-up global model, its ``base``), and W
  over those rows (``[N, N]``). A run sets (rounds − R_w) × clients per round when that is below K.

The same values either way: a client never trained since the warm-up has W's identity row, so it
keeps its own stored body and adds nothing to another client's mix (g(0) = 0); with rows, the mix runs
over the rows only. The mixed downloads of a round's clients are made once, on the server, before
they start (``round_start``: one ``[C, N]`` by ``[N, ...]`` contraction), not by each client from all K
stored bodies.

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
from pfedkdh_jax.engine.client_rows import ClientRows
from pfedkdh_jax.engine.protocol import Algorithm, ClientUpdate, EvalModels
from pfedkdh_jax.data.device import FederatedData
from pfedkdh_jax.engine.local import LocalState, LocalTrainer
from pfedkdh_jax.engine.protocol import Model, feature_dim

PyTree = Any

SELF_SIMILARITY = 0.9999  # W[i, i] in the mixing weights, and the clip of every entry


@struct.dataclass
class PFedSimState:
    params: PyTree          # the warm-up's global model {"backbone", "head"}
    models: PyTree          # every client's stored model, [K, ...] or a ClientRows of them
    similarity: jax.Array   # float32 [N, N], W over the models' rows (N = K, or the ClientRows' capacity)
    round: jax.Array        # int32 [], rounds completed
    downloads: Any = None   # the round's clients' downloads (a ClientRows of C rows), set by round_start


def model_rows(models: PyTree, clients: jax.Array) -> jax.Array:
    """The rows of W (and of the stored models) of ``clients``: the clients themselves for ``[K, ...]``
    models, their ClientRows slots otherwise (``-1``: no row, the client holds the base model)."""
    return models.slot[clients] if isinstance(models, ClientRows) else clients


def mixed_downloads(state: "PFedSimState", clients: jax.Array) -> PyTree:
    """The personalized-round downloads of ``clients [C]``, ``[C, ...]``: each one's body mixed from
    every stored body with :func:`mixing_weights` of its row of W, and its own stored classifier. A
    client without a row of its own (ClientRows) has W's identity row: it keeps its stored body."""
    models = state.models
    rows = model_rows(models, clients)
    has = rows >= 0
    weights = jax.vmap(mixing_weights)(state.similarity[jnp.maximum(rows, 0)], jnp.maximum(rows, 0))
    weights = jnp.where(has[:, None], weights, 0.0)
    table = models.rows if isinstance(models, ClientRows) else models
    body = jax.tree_util.tree_map(lambda x: jnp.tensordot(weights, x, axes=1).astype(x.dtype), table["backbone"])
    if isinstance(models, ClientRows):
        body = jax.tree_util.tree_map(
            lambda b, base: jnp.where(has.reshape((-1,) + (1,) * base.ndim), b, base), body, models.base["backbone"])
    return {"backbone": body, "head": C.take(_part(models, "head"), clients)}


def _part(models: PyTree, key: str) -> PyTree:
    return models.part(key) if isinstance(models, ClientRows) else models[key]


def _num_clients(models: PyTree) -> int:
    return models.num_clients if isinstance(models, ClientRows) else jax.tree_util.tree_leaves(models)[0].shape[0]


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
    """W with the entries (i, j), i ≠ j both in ``selected`` (W's rows; ``-1``: none, skipped), set from
    ``sim [C, C]``."""
    off = ~jnp.eye(selected.shape[0], dtype=bool)
    selected = jnp.where(selected >= 0, selected, w.shape[0])     # out of range: the write is dropped
    rows, cols = jnp.meshgrid(selected, selected, indexing="ij")
    return w.at[rows, cols].set(jnp.where(off, sim, w.at[rows, cols].get(mode="clip")), mode="drop")


@dataclasses.dataclass(frozen=True)
class PFedSim(Algorithm):
    """pFedSim over any :class:`~pfedkdh_jax.engine.protocol.Model`. Static; every method is pure and jittable."""

    model: Model
    config: PFedSimConfig = PFedSimConfig()

    name = "pfedsim"

    def init(self, key: jax.Array, data: FederatedData) -> PFedSimState:
        params = C.init_params(self.model, key, data)
        models = C.client_models(params, data.num_clients, self.config.personal_rows)
        n = models.capacity if isinstance(models, ClientRows) else data.num_clients
        return PFedSimState(params=params, models=models, similarity=jnp.eye(n, dtype=jnp.float32),
                            round=jnp.zeros((), jnp.int32))

    def personal_phase(self, state: PFedSimState) -> jax.Array:
        return state.round >= self.config.warmup_rounds

    # ------------------------------------------------------------------------------ client side
    @property
    def trainer(self) -> LocalTrainer:
        return C.sgd_trainer(C.cross_entropy_loss(self.model), C.client_tx(self.config), self.config)

    def download(self, state: PFedSimState, client: jax.Array) -> PyTree:
        """Client ``client``'s starting model in a personalized round: the similarity-weighted mix of
        all stored bodies and its own stored classifier (``round_start``'s, where it ran)."""
        if state.downloads is not None:
            return C.take(state.downloads, client)
        return jax.tree_util.tree_map(lambda x: x[0], mixed_downloads(state, jnp.asarray(client)[None]))

    def round_start(self, state: PFedSimState, data: FederatedData, selected: jax.Array) -> PFedSimState:
        """The selected clients' downloads, mixed once from the stored models as they stand at the
        round's start (during the warm-up they are unused, and the global model is sent)."""
        del data
        n = selected.shape[-1]
        slot = jnp.full((_num_clients(state.models),), -1, jnp.int32)
        downloads = ClientRows(rows=mixed_downloads(state, selected), slot=slot.at[selected].set(jnp.arange(n, dtype=jnp.int32)),
                               base=state.params, used=jnp.asarray(n, jnp.int32), lost=jnp.zeros((), jnp.int32))
        return state.replace(downloads=downloads)

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
        if isinstance(state.models, ClientRows):   # every client back at the base, now the global model
            m = state.models
            warm_models = m.replace(base=jax.tree_util.tree_map(lambda b, g: jnp.where(switch, g, b), m.base, params),
                                    slot=jnp.where(switch, -1, m.slot), used=jnp.where(switch, 0, m.used))
        else:
            warm_models = jax.tree_util.tree_map(lambda m, g: jnp.where(switch, jnp.broadcast_to(g, m.shape), m),
                                                 state.models, params)
        eye = jnp.eye(state.similarity.shape[0], dtype=jnp.float32)
        warm_w = jnp.where(switch, eye, state.similarity)
        # personalized branch (W's rows are the models' rows: set after the uploads are stored)
        models = C.put(state.models, selected, updates.params)
        w = update_similarity(state.similarity, model_rows(models, selected),
                              classifier_similarity(self.model, updates.params["head"],
                                                    feature_dim(self.model, data.input_shape, data.input_dtype)))

        def pick(a, b):
            return jax.tree_util.tree_map(lambda x, y: jnp.where(personal, x, y), a, b)
        if isinstance(models, ClientRows):
            # the rows as written in both phases (in the warm-up no slot points at them, and the switch
            # frees them): no select over the whole table
            models = pick(models.replace(rows=None), warm_models.replace(rows=None)).replace(rows=models.rows)
        else:
            models = pick(models, warm_models)
        return (state.replace(params=pick(state.params, params), models=models,
                              similarity=jnp.where(personal, w, warm_w), round=done, downloads=None),
                C.with_rows_lost(C.round_metrics(updates), models))

    # ------------------------------------------------------------------------------- evaluation
    def eval_models(self, state: PFedSimState) -> EvalModels:
        """Each client's stored model (the global model for everyone during the warm-up)."""
        personal = self.personal_phase(state)
        if isinstance(state.models, ClientRows):   # in the warm-up every client at the base: the global model
            m = state.models
            models = m.replace(slot=jnp.where(personal, m.slot, -1),
                               base=jax.tree_util.tree_map(lambda b, g: jnp.where(personal, b, g), m.base, state.params))
        else:
            models = jax.tree_util.tree_map(lambda m, g: jnp.where(personal, m, jnp.broadcast_to(g, m.shape)),
                                            state.models, state.params)
        return C.personal_eval_models(models, state.params)


def from_config(cfg, num_classes: int, args: dict) -> PFedSim:
    """PFedSim of a run: the run's model, budget and optimizer, ``args`` its own options (``--method-arg``)."""
    config = PFedSimConfig(**C.local_config(cfg), **args, rounds=cfg.rounds)
    if not any(key == "personal_rows" for key, _ in cfg.method_args):
        # the clients a run trains after the warm-up, where that is fewer than K
        most = (cfg.rounds - config.warmup_rounds) * cfg.clients_per_round
        config = dataclasses.replace(config, personal_rows=most if 0 < most < cfg.num_clients else 0)
    return PFedSim(C.run_model(cfg, num_classes), config)
