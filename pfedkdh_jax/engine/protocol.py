"""The two contracts the engine runs on: what a *model* is and what a *method* is.

**The model** (:class:`Model`). Any object with three pure functions of explicit parameters:

=============================================  ==================================================
``init(key, input_shape) -> params``           ``{"backbone": θ, "head": φ}`` for inputs of one
                                               sample's shape (e.g. ``(28, 28, 1)``)
``features(backbone, x, *, rng=None)``         ``[B, D]`` features of a batch ``x [B, ...]``;
                                               training mode (dropout) iff ``rng`` is given
``logits_from_features(head, z)``              ``[B, num_classes]`` logits of features ``z [B, D]``
=============================================  ==================================================

The feature size D is the model's own (:func:`feature_dim` reads it from the shapes). Parameters
must be arrays only (no mutable collections such as batch statistics). The paper's CNN
(:class:`pfedkdh_jax.model.CNN`) is one implementation; :mod:`pfedkdh_jax.adapters` wraps a flax.linen
backbone/head pair (``LinenModel``) or flax.nnx modules (``NNXModel``). Methods reach a model only
through these three functions (and :func:`logits`), so every method works with any conforming model
(FedFed's own VAE, beside the model, needs image inputs);
:func:`check_model` rejects a non-conforming object with one error naming what is missing.

**The method** (:class:`Algorithm`). A method is a frozen dataclass deriving from :class:`Algorithm` that holds static hyperparameters
only (never parameters) and supplies pure functions of explicit state and keys:

===========================  ==================================================================  ============
piece                        what it is                                                          default
===========================  ==================================================================  ============
``init``                     ``(key, data) -> state``: server state and every client's state     –
``before_training``          ``(state, data, key, train) -> state``: once before round 0; the    unchanged
                             ``train`` service runs a local problem with the engine's layout
``trainer``                  the local problem (:class:`~pfedkdh_jax.engine.local.LocalTrainer`)  –
``round_start``              ``(state, data, selected [C]) -> state``: what the server prepares   unchanged
                             for the round's clients before any starts (pFedSim's mixed
                             downloads); the clients read the result, the server step the state
``context``                  ``(state) -> ctx``: what every selected client receives              ``None``
``client_start``             ``(state, data, k, key) -> LocalState``: client k's starting point  –
``local_samples``            ``n_k -> samples`` client k visits per epoch (host ints, static)    ``n_k``
``client_finish``            ``(state, data, k, local, key) -> ClientUpdate``: what the round    params, loss,
                             produced at client k (what it uploads and what it keeps)            ``local.aux``
``server_update``            ``(state, data, selected, updates [C], key) -> (state, metrics)``   see below
``mean_upload``              ``(update) -> (averaged, rest)``: what of one client's update the    ``None``
                             server uses only through its weighted mean, and the rest
``upload_weight``            ``(data, k, update) -> w``: client k's weight in that mean           ``n_k``
``server_update_from_mean``  ``(state, data, selected, mean, rest [C], key) -> (state,          –
                             metrics)``: the server step given that mean (methods that split)
``eval_models``              ``(state) -> EvalModels``: what an evaluation scores                 –
``personalization``          evaluation-time adaptation (:class:`Personalization`) the engine    ``None``
                             runs for every client before scoring, or ``None``
``messages``                 ``(state, update) -> (download, upload)``: what one selected client     ``None``
                             receives and sends in a round (counted in bytes, never transferred)
``phases``                   consecutive phases of rounds, each run by an algorithm of its own   one: itself
                             on the same state (:class:`Phase`; FedFed's two phases)
``with_hparams``             ``(values) -> Algorithm``: the method with some config fields       ``config``
                             replaced by traced scalars (stacked runs of other values)           replaced
===========================  ==================================================================  ============

A method whose server averages (part of) the uploads weighted by the clients' sample counts (FedAvg's
whole model, FedPer's backbone), or by weights of its own (``upload_weight``), says so with
``mean_upload`` and writes ``server_update_from_mean``;
its ``server_update`` is then that step on the mean of the stacked uploads (:func:`sample_mean`), and the
engine's host loop may instead form the mean as the clients finish, a running sum on each device, and
never hold the C uploads at once (:func:`splits_uploads`).

The server step returns the new state and the round's metrics. The state keeps the structure,
shapes, dtypes and static fields it was given (a compiled round is reused every round; a runner
stops, naming the leaf, when the first round changes them). The metrics are a dict of arrays with
at least ``train_loss`` (a scalar: the clients' mean local loss) and, to name a diverging client,
``client_loss`` (``[C]``); ``pfedkdh_jax.round_metrics(updates)`` gives both.

Leading axes: per-client pytrees in the state are ``[K, ...]``; ``updates`` and the selected clients'
local states are stacked ``[C, ...]``. The engine adds a repetition axis ``[R, ...]`` in front of
everything with ``jax.vmap``, so a method never sees it. Uploads and evaluation models have one type
each, :class:`ClientUpdate` and :class:`EvalModels`, whatever the method.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Mapping
from typing import Any, Callable, ClassVar

import flax.struct as struct
import jax
import jax.numpy as jnp
import numpy as np

from pfedkdh_jax.engine.local import LocalState, LocalTrainer, mean_loss

PyTree = Any
Params = Any


# ------------------------------------------------------------------------------------------ model
@typing.runtime_checkable
class Model(typing.Protocol):
    """A model split into a backbone and a linear (or any) head; see the module docstring."""

    def init(self, key: jax.Array, input_shape: tuple[int, ...]) -> Params: ...

    def features(self, backbone: Params, x: jax.Array, *, rng: jax.Array | None = None) -> jax.Array: ...

    def logits_from_features(self, head: Params, z: jax.Array) -> jax.Array: ...


_MODEL_FUNCTIONS = {"init": "init(key, input_shape) -> {'backbone': ..., 'head': ...}",
                    "features": "features(backbone, x, *, rng=None) -> [B, D]",
                    "logits_from_features": "logits_from_features(head, z) -> [B, num_classes]"}


def check_model(model: Any, where: str = "model") -> Any:
    """``model`` itself if it has the three functions of :class:`Model`; else a ``TypeError`` naming
    what is missing (and the adapter to use for a flax module)."""
    missing = [sig for name, sig in _MODEL_FUNCTIONS.items() if not callable(getattr(model, name, None))]
    if not missing:
        try:
            params = inspect.signature(model.features).parameters
        except (TypeError, ValueError):   # a callable without a signature: taken as it is
            return model
        if "rng" not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            raise TypeError(f"{where}: {type(model).__name__}.features must take the keyword rng "
                            f"({_MODEL_FUNCTIONS['features']}: rng is given in training, for dropout)")
        return model
    hint = ""
    if hasattr(model, "apply") and hasattr(model, "init"):
        hint = ("; a flax.linen module is not a model by itself: wrap a backbone module and a head module "
                "with pfedkdh_jax.LinenModel(backbone, head)")
    elif type(model).__module__.startswith("flax.nnx") or hasattr(model, "__nnx_repr__"):
        hint = "; wrap flax.nnx modules with pfedkdh_jax.NNXModel(backbone, head)"
    raise TypeError(f"{where}: the {type(model).__name__} given is not a pfedkdh_jax Model: it lacks "
                    f"{', '.join(missing)}{hint}")


def logits(model: Model, params: Params, x: jax.Array, *, rng: jax.Array | None = None) -> jax.Array:
    """``h_φ(b_θ(x))``: the logits of the whole model ``params = {"backbone", "head"}``."""
    return model.logits_from_features(params["head"], model.features(params["backbone"], x, rng=rng))


def feature_dim(model: Model, input_shape: tuple[int, ...], input_dtype=jnp.float32) -> int:
    """The size D of ``model``'s features for inputs of ``input_shape`` and ``input_dtype`` (a
    :class:`~pfedkdh_jax.FederatedData`'s ``input_shape`` and ``input_dtype``; from shapes: nothing runs)."""
    def feats(key):
        params = model.init(key, tuple(input_shape))
        return model.features(params["backbone"], jnp.zeros((1, *input_shape), input_dtype))
    return int(jax.eval_shape(feats, jax.random.key(0)).shape[-1])


def init_params(model: Model, key: jax.Array, input_shape: tuple[int, ...], num_classes: int,
                input_dtype=jnp.float32) -> Params:
    """``model.init(key, input_shape)``, after checking from shapes alone (nothing is computed twice)
    that the parameters are ``{"backbone", "head"}`` of arrays, the features ``[B, D]`` and the
    logits ``[B, num_classes]``; a ``ValueError`` names the first mismatch."""
    name = type(model).__name__
    shape = tuple(input_shape)
    try:
        params = jax.eval_shape(lambda k: model.init(k, shape), key)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{name}.init(key, {shape}) failed on the data's inputs{_dtype_hint(model, input_dtype)}: "
                      f"{_first_line(e)}") from e
    if not isinstance(params, dict) or set(params) != {"backbone", "head"}:
        got = f"a dict with keys {sorted(params)}" if isinstance(params, dict) else f"a {type(params).__name__}"
        raise ValueError(f"{name}.init(key, {shape}) must return {{'backbone': ..., 'head': ...}}; got {got}")
    bad = [x for x in jax.tree_util.tree_leaves(params) if not hasattr(x, "shape")]
    if bad:
        raise ValueError(f"{name}.init returned leaves that are not arrays ({type(bad[0]).__name__}): "
                         "parameters must be arrays only")
    x = jax.ShapeDtypeStruct((2, *shape), input_dtype)
    try:
        z = jax.eval_shape(lambda p, x: model.features(p["backbone"], x), params, x)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{name}.features(backbone, x) failed for x of shape {(2, *shape)} and dtype "
                      f"{jnp.dtype(input_dtype).name} (the data's): {_first_line(e)}") from e
    if getattr(z, "ndim", None) != 2 or z.shape[0] != 2:
        raise ValueError(f"{name}.features(backbone, x) must return [B, D] features for x of shape "
                         f"{(2, *shape)}; got shape {getattr(z, 'shape', type(z).__name__)}")
    try:
        out = jax.eval_shape(lambda p, z: model.logits_from_features(p["head"], z), params, z)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{name}.logits_from_features(head, z) failed for features z of shape {z.shape}: "
                      f"{_first_line(e)}") from e
    if getattr(out, "shape", None) != (2, num_classes):
        raise ValueError(f"{name}.logits_from_features(head, z) must return [B, {num_classes}] logits "
                         f"(the data's classes) for z of shape {z.shape}; got shape {getattr(out, 'shape', None)}")
    return model.init(key, shape)


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _dtype_hint(model, input_dtype) -> str:
    """Where a model's own example inputs are float and the data's integer (token ids): the fix."""
    own = getattr(model, "input_dtype", None)
    if own is not None and jnp.issubdtype(input_dtype, jnp.integer) and not jnp.issubdtype(own, jnp.integer):
        name = jnp.dtype(input_dtype).name
        return (f" (its example inputs are {jnp.dtype(own).name}, the data's {name}: "
                f"give {type(model).__name__}(..., input_dtype=jnp.{name}))")
    return ""


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
      ``[K, ...]`` or a :class:`~pfedkdh_jax.engine.client_rows.ClientRows` of them (each test sample's
      features then come from its owner's backbone);
    * ``global_head``: a head scored on every test sample's shared-backbone features (``global_*``);
      methods with a shared backbone only;
    * ``global_model``: a whole model ``{"backbone", "head"}`` scored on every test sample
      (``global_*``); methods with per-client backbones only;
    * ``extra_heads``: ``{name: heads [K, ...]}`` scored like ``heads`` on the same features
      (``name_*`` metrics), e.g. FedProto's own heads next to its prototypes;
    * ``head_logits``: ``(head, z [B, D]) -> logits`` for ``heads`` when they are not the model's own
      heads (FedProto's nearest-prototype rule); ``None``: the model's ``logits_from_features``.
    """

    backbone: PyTree
    heads: PyTree = None
    global_head: PyTree = None
    global_model: PyTree = None
    extra_heads: dict | None = None
    per_client: bool = struct.field(pytree_node=False, default=False)
    head_logits: Callable | None = struct.field(pytree_node=False, default=None)


@dataclasses.dataclass(frozen=True)
class Personalization:
    """Evaluation-time adaptation: a local problem the engine runs for every client scored (all K, or
    the ``--eval-clients`` subset) before scoring; the adapted models are used for that evaluation
    only and never persisted.

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
    Algorithm objects of its phases share one state type (so checkpoints and the repetition axis are those of
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

    def __post_init__(self):
        """A method's model is checked when the method is built (one error naming what is missing),
        and, where the method's own class declares its ``config`` field, the config is of that class or
        has its fields exactly (another method's config, whose own fields this one would not read, is
        refused; a subclass that inherits the field takes a config of its own)."""
        model = getattr(self, "model", None)
        if model is not None:
            check_model(model, f"{type(self).__name__}(model=...)")
        elif dataclasses.is_dataclass(self) and "model" in {f.name for f in dataclasses.fields(self)}:
            raise TypeError(f"{type(self).__name__}(model=None): a method needs a model (p.CNN(num_classes), "
                            "p.LinenModel(backbone, head), p.NNXModel(...), or one of the Model protocol)")
        declares = "config" in inspect.get_annotations(type(self))
        field = {f.name: f for f in dataclasses.fields(self)}.get("config") if dataclasses.is_dataclass(self) else None
        if declares and field is not None and dataclasses.is_dataclass(field.default):
            want, got = type(field.default), self.config
            names = lambda c: {f.name for f in dataclasses.fields(c)}  # noqa: E731
            if not (isinstance(got, want) or (dataclasses.is_dataclass(got) and names(got) == names(want))):
                hint = f" (e.g. {want.__name__}(**options))" if isinstance(got, dict) else ""
                raise TypeError(f"{type(self).__name__}(config=...) must be a {want.__name__}; got a "
                                f"{type(got).__name__}{hint}")

    # ---------------------------------------------------------------------------------- set-up
    def init(self, key: jax.Array, data) -> PyTree:
        raise NotImplementedError(_missing(self, "init"))

    def before_training(self, state: PyTree, data, key: jax.Array, train: TrainService) -> PyTree:
        """Once, before round 0 (pFedKDH's warm-up on D_s). Default: nothing."""
        del data, key, train
        return state

    @property
    def prepares(self) -> bool:
        """Whether :meth:`before_training` changes the state as configured (a runner whose first round
        comes before its ``prepare`` warns then). Default: whether the method defines it."""
        return type(self).before_training is not Algorithm.before_training

    # ----------------------------------------------------------------------------- client side
    @property
    def trainer(self) -> LocalTrainer:
        raise NotImplementedError(_missing(self, "trainer"))

    def round_start(self, state: PyTree, data, selected: jax.Array) -> PyTree:
        """The server's preparation for the round's clients ``selected [C]``, before any of them starts:
        the state the round's ``context``, ``client_start`` and ``client_finish`` read (pFedSim mixes
        the selected clients' downloads here, once, from every stored model). ``server_update`` gets
        the state as it was, so what this adds must not be needed by it. Pure and jittable; a method
        whose ``client_start`` also works on an unprepared state keeps every caller of it correct.
        Default: the state unchanged (and the engine skips the call)."""
        del data, selected
        return state

    def context(self, state: PyTree) -> PyTree:
        """What every selected client receives besides its start (e.g. a frozen teacher)."""
        del state
        return None

    def client_start(self, state: PyTree, data, client: jax.Array, key: jax.Array) -> LocalState:
        raise NotImplementedError(_missing(self, "client_start"))

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
        """The server step on the selected clients' stacked updates ``[C, ...]``. Default, for a method
        that splits its uploads (:meth:`mean_upload`): :meth:`server_update_from_mean` on the mean of
        the averaged parts weighted by :meth:`upload_weight` (a method that splits does not override this;
        one that writes its own ``server_update`` does not read ``upload_weight``)."""
        if type(self).mean_upload is Algorithm.mean_upload:
            raise NotImplementedError(f"{type(self).__name__} defines neither server_update nor mean_upload "
                                      f"(with server_update_from_mean): a method needs one of them")
        averaged, rest = jax.vmap(self.mean_upload)(updates)
        weights = jax.vmap(lambda k, u: upload_weight_of(self, data, k, u))(selected, updates)
        return server_step_result(self, self.server_update_from_mean(
            state, data, selected, sample_mean(averaged, weights), rest, key), "server_update_from_mean")

    def mean_upload(self, update: ClientUpdate) -> tuple[PyTree, ClientUpdate] | None:
        """``(averaged, rest)`` of one client's update (unstacked): ``averaged`` is what the server uses
        only through its weighted mean over the selected clients (``Σ w_k x_k / Σ w_k``, ``w_k`` from
        :meth:`upload_weight`: by default the train samples ``n_k = data.train_n[k]``), ``rest`` a
        :class:`ClientUpdate` of what else it reads (a kept head, the loss). Default ``None``: the
        method does not split (it writes :meth:`server_update`)."""
        del update
        return None

    def upload_weight(self, data, client: jax.Array, update: ClientUpdate) -> jax.Array:
        """Client ``client``'s weight (a scalar ≥ 0; the round's weights must not all be 0) in the mean
        of what :meth:`mean_upload` averages, given its whole update (unstacked). Default: its train
        sample count ``data.train_n[client]``. A method may weigh its clients equally (``1.0``) or by
        what its update carries (a loss, a count in ``aux``); the running sums of the host loop and the
        stacked mean of :meth:`server_update` both use it."""
        del update
        return data.train_n[client]

    def server_update_from_mean(self, state: PyTree, data, selected: jax.Array, mean: PyTree,
                                rest: ClientUpdate, key: jax.Array) -> tuple[PyTree, dict]:
        """The server step of a method that splits its uploads: ``mean`` (no client axis) is the
        weighted mean of the averaged parts (:meth:`upload_weight`), ``rest`` the stacked rests ``[C, ...]``."""
        raise NotImplementedError(_missing(self, "server_update_from_mean"))

    # ------------------------------------------------------------------------------ evaluation
    def eval_models(self, state: PyTree) -> EvalModels:
        raise NotImplementedError(_missing(self, "eval_models"))

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
        along the repetition axis that differ in plain-number hyperparameters each rebuild their
        algorithm from their own traced scalars. Only the fields the config declares traceable
        (its class attribute ``TRACEABLE``) may be replaced; another stops with a ``ValueError``
        naming it. A method reads such a field only in arithmetic (no Python ``if`` on it).
        Default: ``self.config`` replaced."""
        config = self.config
        allowed = tuple(getattr(type(config), "TRACEABLE", ()))
        fields = {f.name for f in dataclasses.fields(config)}
        for field in values:
            if field not in fields:
                raise ValueError(f"{type(config).__name__} has no field {field!r}; traceable fields: "
                                 f"{', '.join(allowed) or 'none'}")
            if field not in allowed:
                raise ValueError(f"{type(config).__name__}.{field} cannot take a traced value (it may set shapes "
                                 f"or control flow); traceable fields: {', '.join(allowed) or 'none'}")
        return dataclasses.replace(self, config=dataclasses.replace(config, **values))

    # ---------------------------------------------------------------------------------- phases
    @property
    def phases(self) -> tuple[Phase, ...]:
        """The phases of a run, in order. Default: one, this algorithm for every round."""
        return (Phase(self),)


class ProtocolError(AssertionError):
    """A promise of the protocol a method does not keep; the message says which and where."""


class StateError(ProtocolError, ValueError):
    """A state, or the evaluation models of one, that does not fit the data or the model it meets (a
    ``ValueError`` too: the data may be what is wrong)."""


def state_change(before, after) -> str | None:
    """How ``after`` (a round's new state) differs from ``before`` (the state it was given) in what a
    compiled round is keyed on — structure, a leaf's shape or dtype, a static field — as text naming
    the first difference (``".round: int32[] → float32[]"``); ``None`` when they agree. Reads shapes
    only: device values are not waited for."""
    lb, tb = jax.tree_util.tree_flatten_with_path(before)
    la, ta = jax.tree_util.tree_flatten_with_path(after)
    pb, pa = [jax.tree_util.keystr(k) for k, _ in lb], [jax.tree_util.keystr(k) for k, _ in la]
    if pb != pa:
        gone = [x for x in pb if x not in set(pa)]
        new = [x for x in pa if x not in set(pb)]
        return ("leaves differ: " + (f"{gone[0] or '(the whole state)'} is gone" if gone else "")
                + ("; " if gone and new else "") + (f"{new[0] or '(the whole state)'} is new" if new else "")
                if gone or new else "its leaves come in another order")
    for path, (_, x), (_, y) in zip(pb, lb, la):
        sx, sy = _shape_dtype(x), _shape_dtype(y)
        if sx != sy:
            return f"{path or '(the whole state)'}: {sx[1]}{list(sx[0])} → {sy[1]}{list(sy[0])}"
    if tb != ta:   # same leaves: a static field (pytree metadata) or a container's type differs
        named = _static_change(before, after, "")
        if named:
            return named
        b, a = str(tb), str(ta)
        i = next((i for i, (x, y) in enumerate(zip(b, a)) if x != y), min(len(a), len(b)))
        return f"a static field or container differs: …{b[max(0, i - 40):i + 30]}… → …{a[max(0, i - 40):i + 30]}…"
    return None


def _static_change(before, after, path: str) -> str | None:
    """The first static field of a dataclass node that differs between the two trees, by its path."""
    if not (dataclasses.is_dataclass(before) or isinstance(before, (dict, list, tuple))):
        return None   # a leaf
    if type(before) is not type(after):
        return f"{path or '(the whole state)'}: a {type(before).__name__} → a {type(after).__name__}"
    if dataclasses.is_dataclass(before):
        for f in dataclasses.fields(before):
            b, a = getattr(before, f.name), getattr(after, f.name)
            if not f.metadata.get("pytree_node", True):
                if b != a:
                    return f"{path}.{f.name} (a static field): {b!r} → {a!r}"
            else:
                found = _static_change(b, a, f"{path}.{f.name}")
                if found:
                    return found
    elif isinstance(before, dict) and before.keys() == after.keys():
        for k in before:
            found = _static_change(before[k], after[k], f"{path}[{k!r}]")
            if found:
                return found
    elif isinstance(before, (list, tuple)) and len(before) == len(after):
        for i, (b, a) in enumerate(zip(before, after)):
            found = _static_change(b, a, f"{path}[{i}]")
            if found:
                return found
    return None


def missing_pieces(algo) -> list[str]:
    """The pieces without a default that ``algo`` (a method or its class) does not define: ``init``,
    ``trainer``, ``client_start``, ``eval_models``, and ``server_update`` or ``mean_upload`` with
    ``server_update_from_mean``. A method of several phases (its own ``phases``) is its phases'."""
    cls = algo if isinstance(algo, type) else type(algo)
    if cls.phases is not Algorithm.phases:
        return []
    def own(name):
        return getattr(cls, name) is not getattr(Algorithm, name)
    missing = [_REQUIRED[n] for n in ("init", "trainer", "client_start", "eval_models") if not own(n)]
    if not own("server_update") and not (own("mean_upload") and own("server_update_from_mean")):
        missing.append("server_update(state, data, selected, updates, key) -> (state, metrics), or mean_upload "
                       "with server_update_from_mean")
    return missing


def check_algorithm(algo, where: str) -> None:
    """A ``TypeError`` naming ``where`` when ``algo`` is not a method: its class (not built), or another
    object (a config, a model, ``None``)."""
    if isinstance(algo, type):
        raise TypeError(f"{where}: give a method, not its class: build one with {algo.__name__}(model, config)")
    if not isinstance(algo, Algorithm) and not callable(getattr(algo, "eval_models", None)):
        raise TypeError(f"{where}: takes a method (an Algorithm, e.g. p.FedPer(model, p.FedPerConfig())); got a "
                        f"{type(algo).__name__}")


def check_pieces(algo, where: str) -> None:
    """A :class:`ProtocolError` naming ``where`` and every piece :func:`missing_pieces` finds."""
    missing = missing_pieces(algo)
    if missing:
        name = (algo if isinstance(algo, type) else type(algo)).__name__
        raise ProtocolError(f"{where}: {name} must define {'; '.join(missing)} (pieces of the protocol without "
                            "a default, pfedkdh_jax/engine/protocol.py)")


def _shape_dtype(x) -> tuple:
    return tuple(np.shape(x)), jnp.result_type(x)


# the pieces without a default, as the errors name them
_REQUIRED = {"init": "init(key, data) -> state", "trainer": "trainer (a LocalTrainer property)",
             "client_start": "client_start(state, data, k, key) -> LocalState",
             "eval_models": "eval_models(state) -> EvalModels",
             "server_update_from_mean": "server_update_from_mean(state, data, selected, mean, rest, key) -> "
                                        "(state, metrics), as it gives mean_upload"}


def _missing(algo: Algorithm, piece: str) -> str:
    return f"{type(algo).__name__} must define {_REQUIRED[piece]} (a piece of the protocol without a default)"


def prepares_rounds(algo: Algorithm) -> bool:
    """Whether ``algo`` defines its own :meth:`Algorithm.round_start`."""
    return type(algo).round_start is not Algorithm.round_start


def splits_uploads(algo: Algorithm) -> bool:
    """Whether ``algo`` splits its uploads into a weighted mean and a rest: it overrides
    :meth:`Algorithm.mean_upload` and keeps the default :meth:`Algorithm.server_update` (a subclass
    that writes its own ``server_update`` is given the stacked updates, whatever it inherits)."""
    cls = type(algo)
    return cls.mean_upload is not Algorithm.mean_upload and cls.server_update is Algorithm.server_update


def server_step_result(algo: Algorithm, out, piece: str = "server_update"):
    """``out``, a server step's result, if it is ``(state, metrics)`` with metrics a mapping; else a
    :class:`ProtocolError` naming the method and ``piece`` (before the caller fails to unpack it)."""
    pair = isinstance(out, (tuple, list))
    if not (pair and len(out) == 2 and isinstance(out[1], Mapping)):
        got = f"a {type(out).__name__} of {len(out)}" if pair and len(out) != 2 else (
            f"({type(out[0]).__name__}, {type(out[1]).__name__})" if pair else f"a {type(out).__name__}")
        raise ProtocolError(f"{type(algo).__name__}.{piece} must return (state, metrics), the metrics a dict with "
                            f"train_loss; got {got}")
    return out


def upload_weight_of(algo: Algorithm, data, client: jax.Array, update: ClientUpdate) -> jax.Array:
    """``algo.upload_weight(data, client, update)`` as a float32 scalar; any other shape is a
    :class:`ProtocolError` naming the method."""
    w = jnp.asarray(algo.upload_weight(data, client, update))
    if w.shape != ():
        raise ProtocolError(f"{type(algo).__name__}.upload_weight must give one client's weight as a scalar; "
                            f"got shape {w.shape}")
    return w.astype(jnp.float32)


def check_floating(tree: PyTree, where: str) -> None:
    """A ``TypeError`` naming ``where`` and the first leaf of ``tree`` that is not floating (what is
    averaged must be: the mean of integers is not an integer)."""
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        if not jnp.issubdtype(jnp.result_type(x), jnp.inexact):
            raise TypeError(f"{where}: averages floating leaves only; {jax.tree_util.keystr(path) or 'the leaf'} is "
                            f"{jnp.result_type(x)} (keep integer or boolean values out of what is averaged)")


def sample_mean(trees: PyTree, weights: jax.Array) -> PyTree:
    """``Σ_c w_c · tree_c / Σ_c w_c`` over the leading axis ``[C, ...]`` of every leaf (``weights [C]``,
    e.g. the clients' train sample counts), summed in float32 (or a wider leaf's own dtype) and given
    back in each leaf's dtype (a bfloat16 model stays bfloat16, as a server step's state must). Leaves
    must be floating: a mean of integers or booleans is not one of them (a ``TypeError`` names the leaf)."""
    check_floating(trees, "sample_mean")
    w = weights.astype(jnp.float32) / jnp.sum(weights.astype(jnp.float32))

    def mean(x):
        wide = jnp.promote_types(x.dtype, jnp.float32)
        return jnp.tensordot(w.astype(wide), x.astype(wide), axes=1).astype(x.dtype)
    return jax.tree_util.tree_map(mean, trees)


def client_update_shape(algo: Algorithm, state, data, key: jax.Array) -> ClientUpdate:
    """The shapes of one client's round result under ``algo`` (client 0's :class:`ClientUpdate`, leaves
    ``jax.ShapeDtypeStruct``; nothing is computed: ``jax.eval_shape``); ``state`` concrete or shapes."""
    def result(s):
        k0 = jnp.zeros((), jnp.int32)
        return algo.client_finish(s, data, k0, algo.client_start(s, data, k0, key), key)
    return jax.eval_shape(result, state)


def message_bytes(algorithm: Algorithm, data, key: jax.Array) -> dict | None:
    """Bytes one selected client downloads and uploads in a round of ``algorithm``, from the shapes of
    its :meth:`Algorithm.messages` (nothing is computed: ``jax.eval_shape``); per phase for a method of
    several (``{"phase1": {...}, ...}``); ``None`` where a method does not count them."""
    state = jax.eval_shape(lambda k: algorithm.init(k, data), key)

    def count(algo: Algorithm):
        shapes = jax.eval_shape(algo.messages, state, client_update_shape(algo, state, data, key))
        if shapes is None:
            return None
        size = lambda t: int(sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(t)))  # noqa: E731
        return {"download": size(shapes[0]), "upload": size(shapes[1])}

    phases = algorithm.phases
    if len(phases) == 1:
        return count(phases[0].algorithm)
    return {f"phase{i + 1}": count(p.algorithm) for i, p in enumerate(phases)}
