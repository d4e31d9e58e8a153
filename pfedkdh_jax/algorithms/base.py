"""The protocol between a federated method and the engine.

A method is a frozen dataclass deriving from :class:`Algorithm` that holds static hyperparameters
only (never parameters) and supplies pure functions of explicit state and keys:

=====================  ==================================================================  ============
piece                  what it is                                                          default
=====================  ==================================================================  ============
``init``               ``(key, data) -> state``: server state and every client's state     –
``before_training``    ``(state, data, key, train) -> state``: once before round 0; the    unchanged
                       ``train`` service runs a local problem with the engine's layout
``trainer``            the local problem (:class:`~pfedkdh_jax.engine.local.LocalTrainer`)  –
``context``            ``(state) -> ctx``: what every selected client receives              ``None``
``client_start``       ``(state, data, k, key) -> LocalState``: client k's starting point  –
``local_samples``      ``n_k -> samples`` client k visits per epoch (host ints, static)    ``n_k``
``client_finish``      ``(state, data, k, local, key) -> ClientUpdate``: what the round    params, loss,
                       produced at client k (what it uploads and what it keeps)            ``local.aux``
``server_update``      ``(state, data, selected, updates [C], key) -> (state, metrics)``   –
``eval_models``        ``(state) -> EvalModels``: what an evaluation scores                 –
``personalization``    evaluation-time adaptation (:class:`Personalization`) the engine    ``None``
                       runs for every client before scoring, or ``None``
``messages``           ``(state, update) -> (download, upload)``: what one selected client     ``None``
                       receives and sends in a round (counted in bytes, never transferred)
``phases``             consecutive phases of rounds, each run by an algorithm of its own   one: itself
                       on the same state (:class:`Phase`; FedFed's two phases)
``with_hparams``       ``(values) -> Algorithm``: the method with some config fields       ``config``
                       replaced by traced scalars (stacked runs of other values)           replaced
=====================  ==================================================================  ============

Leading axes: per-client pytrees in the state are ``[K, ...]``; ``updates`` and the selected clients'
local states are stacked ``[C, ...]``. The engine adds a repetition axis ``[R, ...]`` in front of
everything with ``jax.vmap``, so a method never sees it. Uploads and evaluation models have one type
each, :class:`ClientUpdate` and :class:`EvalModels`, whatever the method.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar

import flax.struct as struct
import jax

from pfedkdh_jax.engine.local import LocalState, LocalTrainer, mean_loss

PyTree = Any


@struct.dataclass
class ClientUpdate:
    """What one client's round produced; stacked ``[C, ...]`` over the selected clients.

    ``server_update`` reads from it both what the client uploads and what stays with the client (the
    simulation keeps every client's private state inside the algorithm state): FedPer, say, averages
    ``params["backbone"]`` and stores ``params["head"]`` back as client k's own.
    """

    params: PyTree          # the client's parameters after local training
    loss: jax.Array         # float32 []: mean loss of its local steps
    aux: PyTree = None      # method-specific values (class prototypes, aggregation weights, ...)


@struct.dataclass
class EvalModels:
    """What an evaluation scores, the same type for every method.

    * ``heads [K, ...]``: client k's head scores client k's test split on client k's features
      (``personalized_*``); ``None`` for a method without personalized models;
    * ``backbone``: the shared backbone θ — or, with ``per_client=True``, every client's own backbone
      ``[K, ...]`` (each test sample's features then come from its owner's backbone);
    * ``global_head``: a head scored on every test sample's shared-backbone features (``global_*``);
      methods with a shared backbone only;
    * ``global_model``: a whole model ``{"backbone", "head"}`` scored on every test sample
      (``global_*``); methods with per-client backbones only;
    * ``extra_heads``: ``{name: heads [K, ...]}`` scored like ``heads`` on the same features
      (``name_*`` metrics), e.g. FedProto's own heads next to its prototypes.
    """

    backbone: PyTree
    heads: PyTree = None
    global_head: PyTree = None
    global_model: PyTree = None
    extra_heads: dict | None = None
    per_client: bool = struct.field(pytree_node=False, default=False)


@dataclasses.dataclass(frozen=True)
class Personalization:
    """Evaluation-time adaptation: a local problem the engine runs for every client (all K) before
    scoring; the adapted models are used for that evaluation only and never persisted.

    * ``trainer`` and ``start(state, data, k, key) -> LocalState``: the local problem;
    * ``models(state, params [K, ...]) -> EvalModels``: what is scored, from the adapted parameters;
    * ``on_features``: the problem trains a head on the shared backbone's features of client k's
      train split (the engine computes them once per evaluation: the source is ``(features [S, D],
      labels [S])`` and client k's row ``data.train_flat_pos[k]``), so it runs as one ``vmap`` +
      ``scan`` (no convolution in the loop) and the test features of the shared backbone are reused.
      Otherwise it trains on the images with the engine's layout, like a round;
    * ``suffix``: ``"_ea"`` adds ``personalized_*_ea`` metrics; ``""`` replaces ``personalized_*``;
    * ``always``: at every evaluation (else only when the evaluation asks for it).
    """

    trainer: LocalTrainer
    start: Callable[..., LocalState]
    models: Callable[[PyTree, PyTree], EvalModels]
    on_features: bool = False
    suffix: str = "_ea"
    always: bool = False


@dataclasses.dataclass(frozen=True)
class Phase:
    """Consecutive rounds run by one algorithm. A method of several phases lists them in order; the
    algorithms of its phases share one state type (so checkpoints and the repetition axis are those of
    any method), and ``enter(state, data, key) -> state`` prepares the state at the phase's first round
    (e.g. FedFed builds its shared pool there)."""

    algorithm: "Algorithm"
    rounds: int | None = None       # None: every remaining round
    enter: Callable | None = None


# ``train(trainer, local_state, ctx, row, source) -> local_state``: every step of one local problem,
# laid out as the engine lays out a client's round (given to ``before_training``).
TrainService = Callable[[LocalTrainer, LocalState, PyTree, jax.Array, Any], LocalState]


class Algorithm:
    """Base of every method: the pieces of the protocol, with their defaults (module docstring)."""

    name: ClassVar[str] = ""

    # ---------------------------------------------------------------------------------- set-up
    def init(self, key: jax.Array, data) -> PyTree:
        raise NotImplementedError

    def before_training(self, state: PyTree, data, key: jax.Array, train: TrainService) -> PyTree:
        """Once, before round 0 (pFedKDH's warm-up on D_s). Default: nothing."""
        del data, key, train
        return state

    # ----------------------------------------------------------------------------- client side
    @property
    def trainer(self) -> LocalTrainer:
        raise NotImplementedError

    def context(self, state: PyTree) -> PyTree:
        """What every selected client receives besides its start (e.g. a frozen teacher)."""
        del state
        return None

    def client_start(self, state: PyTree, data, client: jax.Array, key: jax.Array) -> LocalState:
        raise NotImplementedError

    def local_samples(self, n: int) -> int:
        """How many samples a client with ``n`` train samples visits per epoch (static step counts);
        more than ``n`` when its start draws extra samples into ``LocalState.row`` (FedFed)."""
        return n

    def client_finish(self, state: PyTree, data, client: jax.Array, local: LocalState,
                      key: jax.Array) -> ClientUpdate:
        """Default: the trained parameters, the mean local loss and ``local.aux``."""
        del state, data, client, key
        return ClientUpdate(params=local.params, loss=mean_loss(local), aux=local.aux)

    # ----------------------------------------------------------------------------- server side
    def server_update(self, state: PyTree, data, selected: jax.Array, updates: ClientUpdate,
                      key: jax.Array) -> tuple[PyTree, dict]:
        raise NotImplementedError

    # ------------------------------------------------------------------------------ evaluation
    def eval_models(self, state: PyTree) -> EvalModels:
        raise NotImplementedError

    def messages(self, state: PyTree, update: ClientUpdate) -> tuple[PyTree, PyTree] | None:
        """``(download, upload)``: the pytrees one selected client receives from the server and sends
        back in a round (``update`` is that client's :class:`ClientUpdate`, unstacked). The run
        counts their bytes (``summary.json``: ``bytes_per_client_round``); ``None``: not counted."""
        return None

    @property
    def personalization(self) -> Personalization | None:
        return None

    # ------------------------------------------------------------------------ stacked values
    def with_hparams(self, values: dict) -> "Algorithm":
        """This algorithm with the config fields ``values`` replaced, inside a trace: runs stacked
        along the repetition axis that differ in plain-number hyperparameters (the method's
        ``MethodSpec.traced`` fields) each rebuild their algorithm from their own traced scalars. A
        method may read such a field only in arithmetic (no Python ``if`` on it: see
        :func:`~pfedkdh_jax.algorithms.common.may_be_nonzero`). Default: ``self.config`` replaced."""
        return dataclasses.replace(self, config=dataclasses.replace(self.config, **values))

    # ---------------------------------------------------------------------------------- phases
    @property
    def phases(self) -> tuple[Phase, ...]:
        """The phases of a run, in order. Default: one, this algorithm for every round."""
        return (Phase(self),)


def message_bytes(algorithm: Algorithm, data, key: jax.Array) -> dict | None:
    """Bytes one selected client downloads and uploads in a round of ``algorithm``, from the shapes of
    its :meth:`Algorithm.messages` (nothing is computed: ``jax.eval_shape``); per phase for a method of
    several (``{"phase1": {...}, ...}``); ``None`` where a method does not count them."""
    state = jax.eval_shape(lambda k: algorithm.init(k, data), key)

    def count(algo: Algorithm):
        def messages(s):
            k0 = jax.numpy.zeros((), jax.numpy.int32)
            local = algo.client_start(s, data, k0, key)
            return algo.messages(s, algo.client_finish(s, data, k0, local, key))
        shapes = jax.eval_shape(messages, state)
        if shapes is None:
            return None
        size = lambda t: int(sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(t)))  # noqa: E731
        return {"download": size(shapes[0]), "upload": size(shapes[1])}

    phases = algorithm.phases
    if len(phases) == 1:
        return count(phases[0].algorithm)
    return {f"phase{i + 1}": count(p.algorithm) for i, p in enumerate(phases)}
