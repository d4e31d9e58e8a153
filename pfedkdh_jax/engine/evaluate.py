"""An evaluation of any algorithm over all K clients as pure functions: ``make_evaluate(algo, layout)``.

``evaluate_fn = make_evaluate(algo, layout)`` is ``(state, data, key, personalize=False) -> metrics``
(un-jitted; ``personalize`` is static). It scores the algorithm's :class:`EvalModels`
(``personalized_*``, ``global_*``, extra heads), and, when the algorithm has a
:class:`Personalization` and it is due (``always``, or asked for with ``personalize``), adapts every
client's model first and scores the adapted models too (suffix ``_ea``) or instead (no suffix).
Features are computed ``data.eval_chunk`` samples at a time with ``lax.map``. A personalization on
features adapts its clients grouped by the slots their batches need (:func:`feature_groups`), each
group vmapped at its width (with sequential clients, a large group a chunk of clients at a time).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pfedkdh_jax.engine.protocol import Algorithm, EvalModels, Personalization, check_algorithm
from pfedkdh_jax.data.device import FederatedData
from pfedkdh_jax.data.sources import DataError
from pfedkdh_jax.engine import scoring
from pfedkdh_jax.engine.layout import Layout
from pfedkdh_jax.engine.round import LocalProblem, check_state_clients, max_local_steps, same_pieces

PyTree = Any


def image_problem(p: Personalization, step_loop: str) -> LocalProblem:
    """The local problem of a personalization that trains on the images."""
    return LocalProblem(p.trainer, p.start, None, step_loop)


def adapted_clients(data: FederatedData) -> np.ndarray | None:
    """The clients a personalization adapts: those holding train samples when some hold none (the
    evaluation view of ``--eval-clients``, :func:`~pfedkdh_jax.data.partition.evaluation_view`), so
    its cost follows the clients scored; ``None``: all K (host ints, from the static sizes)."""
    kept = [k for k, n in enumerate(data.train_sizes) if n > 0]
    return None if len(kept) == data.num_clients else np.asarray(kept, np.int32)


def spread_to_all(params: PyTree, clients: np.ndarray, num_clients: int, axis: int = 0) -> PyTree:
    """Per-client ``params`` of ``clients`` (stacked on ``axis``) placed at their rows of ``[K, ...]``;
    the other rows are zeros (clients that are not scored)."""
    def one(a):
        shape = a.shape[:axis] + (num_clients,) + a.shape[axis + 1:]
        index = (slice(None),) * axis + (jnp.asarray(clients),)
        return jnp.zeros(shape, a.dtype).at[index].set(a)
    return jax.tree_util.tree_map(one, params)


def feature_steps(p: Personalization, data: FederatedData) -> int:
    """Steps of a feature personalization for the largest client (static)."""
    return max_local_steps(p.trainer, data)


FEATURE_WIDTHS = (8, 16, 32)   # the narrow widths of a personalization on features (then a full batch)
# With sequential clients (the CPU layout), a group of more than FEATURE_CHUNK_FROM clients runs
# FEATURE_CHUNK clients at a time (a ``lax.map`` over chunks, each vmapped): every chunk takes all its
# steps while its heads and batches stay in the cache (vmapped clients, an accelerator's layout, keep
# one vmap: not measured there). Measured (BENCHMARKS.md, "pFedKDH-EA's head steps at each client's own width"): 10,000 clients
# of 3–8 samples, 20 steps, 5.7 s vmapped at once, 2.9–3.0 s in chunks of 16–128; at 1,000 clients
# (groups of a few hundred) chunks of 32–128 were 3–20 % slower than none.
FEATURE_CHUNK, FEATURE_CHUNK_FROM = 128, 1024


def feature_groups(trainer, data: FederatedData, clients: np.ndarray | None) -> list[tuple[np.ndarray, int | None]]:
    """The clients a personalization on features adapts, grouped by the slots their steps need:
    ``[(clients, width), ...]``, each client in the group of the narrowest of :data:`FEATURE_WIDTHS`
    holding ``min(n_k, B)`` samples (``None``: a full batch of B). A client's steps are the same on
    any width that holds its batch (:class:`~pfedkdh_jax.engine.local.LocalTrainer`'s ``width``), so
    thousands of clients of a few samples each do not each compute a batch of 64 (host ints, from the
    static sizes: the per-client maximum over stacked partitions)."""
    ids = np.arange(data.num_clients) if clients is None else np.asarray(clients)
    b = trainer.batch_size if trainer.width is None else trainer.width
    groups: dict[int | None, list[int]] = {}
    for k in ids:
        need = min(int(data.train_sizes[k]), b)
        groups.setdefault(next((w for w in FEATURE_WIDTHS if need <= w < b), None), []).append(int(k))
    return [(np.asarray(groups[w], np.int32), w) for w in sorted(groups, key=lambda w: b if w is None else w)]


@dataclasses.dataclass(frozen=True)
class EvaluatePieces:
    """The pure pieces of an evaluation of ``algo`` with ``layout`` (resolved); calling it evaluates."""

    algo: Algorithm
    layout: Layout

    # ------------------------------------------------------------------------------- features
    def features(self, backbone: PyTree, data: FederatedData, flat_idx: jax.Array) -> jax.Array:
        """Features ``[N, D]`` of a padded flat index list (``lax.map`` over chunks)."""
        return scoring.chunked_features(self.algo.model, backbone, data, flat_idx, data.eval_chunk)

    def owned_features(self, backbones: PyTree, data: FederatedData) -> jax.Array:
        """Features ``[G·c, D]`` of the owner-grouped test chunks, each from its owner's backbone."""
        return scoring.owned_features(self.algo.model, backbones, data, data.owned_chunk, data.owned_idx)

    # --------------------------------------------------------------------------------- scores
    def score(self, models: EvalModels, feats: jax.Array, data: FederatedData) -> dict:
        """``personalized_*`` (and extra heads) of ``models`` from its test features: shared-backbone
        features of ``data.test_flat``, or owner-grouped ones with ``models.per_client``; plus
        ``global_*`` of a ``global_head`` on shared features."""
        model, k = self.algo.model, data.num_clients
        if models.per_client:
            labels, owner = data.labels[data.owned_idx.reshape(-1)], data.owned_slot
        else:
            labels, owner = data.labels[data.test_flat], data.test_client
        global_head = None if models.per_client else models.global_head
        return scoring.score(model, feats, labels, owner, models.heads, global_head, k, models.extra_heads,
                             models.head_logits)

    def score_global_model(self, models: EvalModels, feats: jax.Array, data: FederatedData) -> dict:
        """``global_*`` of ``models.global_model`` from its features of ``data.test_flat``."""
        return scoring.score(self.algo.model, feats, data.labels[data.test_flat], data.test_client, None,
                             models.global_model["head"], data.num_clients)

    # -------------------------------------------------------------------------- personalization
    def adapt_on_features(self, state, data: FederatedData, key: jax.Array, train_feats: jax.Array):
        """Every client's adapted parameters ``[K, ...]`` of a personalization on features."""
        p = self.algo.personalization
        source = (train_feats, data.labels[data.train_flat])
        steps = feature_steps(p, data)

        def adapted(trainer, ids):
            def one(k):
                local = p.start(state, data, k, key)
                return trainer.run_scan(local, None, data.train_flat_pos[k], source, steps).params
            c = FEATURE_CHUNK
            if self.layout.client_parallel != "sequential" or len(ids) <= max(c, FEATURE_CHUNK_FROM):
                return jax.vmap(one)(jnp.asarray(ids))
            g = -(-len(ids) // c)
            padded = np.concatenate([ids, np.full(g * c - len(ids), ids[-1], ids.dtype)]).reshape(g, c)
            out = jax.lax.map(jax.vmap(one), jnp.asarray(padded))
            return jax.tree_util.tree_map(lambda a: a.reshape((g * c,) + a.shape[2:])[:len(ids)], out)
        clients = adapted_clients(data)
        groups = feature_groups(p.trainer, data, clients)
        if clients is None and len(groups) == 1 and groups[0][1] is None:   # every client a full batch
            return adapted(p.trainer, np.arange(data.num_clients))
        parts = [adapted(p.trainer if w is None else dataclasses.replace(p.trainer, width=w), ids) for ids, w in groups]
        params = jax.tree_util.tree_map(lambda *a: jnp.concatenate(a), *parts)
        return spread_to_all(params, np.concatenate([ids for ids, _ in groups]), data.num_clients)

    def adapt_on_images(self, state, data: FederatedData, key: jax.Array):
        """Every client's adapted parameters ``[K, ...]`` of a personalization on the images."""
        p = self.algo.personalization
        problem = image_problem(p, self.layout.step_loop)
        clients = adapted_clients(data)
        finals = problem.clients(state, None, data, jnp.arange(data.num_clients) if clients is None else
                                 jnp.asarray(clients), key, max_local_steps(p.trainer, data), self.layout.client_parallel)
        return finals.params if clients is None else spread_to_all(finals.params, clients, data.num_clients)

    def test_features(self, models: EvalModels, data: FederatedData) -> jax.Array:
        """Test features of ``models``: shared-backbone ones, or owner-grouped per-client ones."""
        return (self.owned_features(models.backbone, data) if models.per_client
                else self.features(models.backbone, data, data.test_flat))

    # the operations :func:`evaluation` composes (the runner supplies compiled ones)
    def models(self, state) -> EvalModels:
        return self.algo.eval_models(state)

    score_personal = score

    def adapted_on_features(self, state, data: FederatedData, key: jax.Array, train_feats: jax.Array):
        return self.algo.personalization.models(state, self.adapt_on_features(state, data, key, train_feats))

    def adapted_on_images(self, state, data: FederatedData, key: jax.Array):
        return self.algo.personalization.models(state, self.adapt_on_images(state, data, key))

    def __call__(self, state, data: FederatedData, key: jax.Array, personalize: bool = False) -> dict:
        """Every metric of an evaluation (see the module docstring)."""
        if not isinstance(personalize, (bool, np.bool_)):   # a traced flag would fail deep in the trace
            raise TypeError(f"personalize must be a Python bool (under jax.jit: static_argnames='personalize'); "
                            f"got {type(personalize).__name__}")
        check_state_clients(self.algo, state, data, "evaluate")
        return evaluation(self, self.algo.personalization, state, data, key, personalize)


def evaluation(ops, personalization: Personalization | None, state, data: FederatedData, key: jax.Array,
               personalize: bool) -> dict:
    """An evaluation composed of ``ops``' pieces: :class:`EvaluatePieces` itself (pure), or the host
    runner's compiled ones (same names and signatures). ``personalize`` on an algorithm without a
    personalization is a ValueError (it would add no metric)."""
    if personalize and personalization is None:
        raise ValueError(f"personalize=True: {type(ops.algo).__name__} has no personalization step, so there "
                         f"are no *_ea metrics to add (pFedKDH has one when ea_steps or ea_epochs > 0; see "
                         f"the README's table of methods); evaluate without it")
    if data.test_flat.shape[-1] == 0:
        raise DataError("no client holds a test sample (every Partition.test_idx is empty): there is nothing to "
                        "score; keep a test share (train_fraction < 1) or evaluate on data that has one")
    models = ops.models(state)
    feats = ops.test_features(models, data)
    metrics = ops.score(models, feats, data)
    if models.global_model is not None:
        g = ops.features(models.global_model["backbone"], data, data.test_flat)
        metrics.update(ops.score_global_model(models, g, data))
    p = personalization
    if p is not None and (p.always or personalize):
        if p.on_features:  # heads adapted on the shared backbone's features: its test features again
            adapted = ops.adapted_on_features(state, data, key, ops.features(models.backbone, data, data.train_flat))
            m = ops.score_personal(adapted, feats, data)
        else:
            adapted = ops.adapted_on_images(state, data, key)
            m = ops.score_personal(adapted, ops.test_features(adapted, data), data)
        metrics.update(suffixed(m, p.suffix))
    return metrics


def suffixed(metrics: dict, suffix: str) -> dict:
    """Personalization metrics under their names: ``personalized_*`` + suffix (``global_*`` dropped)."""
    return {f"{k}{suffix}": v for k, v in metrics.items() if not k.startswith("global_")}


def make_evaluate(algo: Algorithm, layout: Layout = Layout()) -> EvaluatePieces:
    """The evaluation of ``algo`` as a pure function ``(state, data, key, personalize=False) ->
    metrics`` (un-jitted; mark ``personalize`` static when jitting)."""
    check_algorithm(algo, "make_evaluate(algo)")
    return same_pieces(EvaluatePieces(algo, layout.resolved()))
