"""Pieces the methods share: the local budget, states, objectives, optimizers, per-client pytrees.

Parameters are ``{"backbone": θ, "head": φ}`` (any :class:`~pfedkdh_jax.engine.protocol.Model`); an
optimizer sees that tree (the head frozen: :func:`body_only`; the backbone frozen: :func:`head_only`).
Per-client pytrees carry a leading client axis ``[K, ...]``; a round reads and writes only the rows of the selected clients, so the other clients'
rows stay bit-identical.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct as struct
import jax
import jax.numpy as jnp
import optax

from pfedkdh_jax import losses
from pfedkdh_jax.algorithms.configs import LocalConfig
from pfedkdh_jax.data.device import FederatedData, check_data, gather_inputs
from pfedkdh_jax.data.sources import dataset_model
from pfedkdh_jax.engine import client_rows
from pfedkdh_jax.engine.client_rows import ClientRows
from pfedkdh_jax.engine.local import LocalState, LocalTrainer
from pfedkdh_jax.engine.protocol import EvalModels, Model, init_params as _init_params, logits, sample_mean
from pfedkdh_jax.model import CNN

PyTree = Any


def may_be_nonzero(value) -> bool:
    """Whether a term weighted by hyperparameter ``value`` must be computed: a Python number only if
    it is non-zero; a traced value (runs of several values stacked into one program) always, its
    weight making the term vanish where it is 0."""
    return not isinstance(value, (int, float)) or value != 0


def init_params(model: Model, key: jax.Array, data: FederatedData):
    """The model's parameters ``{"backbone", "head"}`` for ``data``'s inputs and classes (checked
    from shapes first: :func:`pfedkdh_jax.engine.protocol.init_params`). A ``data`` or ``key`` of
    another kind is a ``TypeError`` naming it (:func:`check_init_args`)."""
    check_init_args(key, data)
    return _init_params(model, key, data.input_shape, data.num_classes, data.input_dtype)


def check_init_args(key, data) -> None:
    """A ``TypeError`` naming ``key`` or ``data`` of a method's ``init(key, data)`` when it is not a JAX
    random key (typed, or a legacy ``uint32 [..., 2]``) or not a :class:`FederatedData`."""
    check_data(data, "init(key, data)")
    dtype, shape = getattr(key, "dtype", None), tuple(getattr(key, "shape", ()))
    typed = dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
    legacy = dtype == jnp.uint32 and shape[-1:] in ((2,), (4,))
    if not (typed or legacy):
        raise TypeError(f"init(key, data): key must be a JAX random key (jax.random.key(seed)); got "
                        f"{type(key).__name__} {key!r}"[:200])


def make_tx(optimizer, lr) -> optax.GradientTransformation:
    """The optax transformation of an optimizer field (:mod:`.configs`): ``None`` → ``optax.sgd(lr)``;
    a function of the learning rate → its transformation at ``lr`` (``lr`` may be traced); a
    ``GradientTransformation`` (or any object with optax's ``init`` and ``update``) → itself (its own
    learning rate)."""
    if optimizer is None:
        return optax.sgd(lr)
    if isinstance(optimizer, optax.GradientTransformation):
        return optimizer
    if callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None)):
        return optax.GradientTransformation(optimizer.init, optimizer.update)
    tx = optimizer(lr)
    if not isinstance(tx, optax.GradientTransformation):
        raise TypeError(f"an optimizer factory must return an optax.GradientTransformation for lr={lr!r}; "
                        f"got a {type(tx).__name__}")
    return tx


def client_tx(config: LocalConfig) -> optax.GradientTransformation:
    """The client optimizer of ``config`` at its learning rate (default: plain SGD, the paper's)."""
    return make_tx(config.optimizer, config.lr)


def optimizer_from_run(cfg) -> "NamedOptimizer | None":
    """The client optimizer of a :class:`~pfedkdh_jax.run.config.RunConfig` (``--optimizer``,
    ``--momentum``, ``--weight-decay``) as a function of the learning rate, or ``None`` for plain
    SGD without weight decay (the paper's)."""
    name, wd = getattr(cfg, "optimizer", "sgd"), getattr(cfg, "weight_decay", None)
    if name == "sgd" and not wd:
        return None
    return NamedOptimizer(name, getattr(cfg, "momentum", None), wd)


@dataclasses.dataclass(frozen=True)
class NamedOptimizer:
    """One of the command line's optimizers as a function of the learning rate: ``sgd``,
    ``momentum`` (SGD with momentum, default 0.9), ``adam``, ``adamw`` (decoupled weight decay,
    default optax's 1e-4); for the others a weight decay is added to the gradient (L2) first."""

    name: str
    momentum: float | None = None
    weight_decay: float | None = None

    def __call__(self, lr) -> optax.GradientTransformation:
        wd = self.weight_decay
        if self.name == "adamw":
            return optax.adamw(lr, weight_decay=1e-4 if wd is None else wd)
        if self.name == "momentum":
            base = optax.sgd(lr, momentum=0.9 if self.momentum is None else self.momentum)
        elif self.name == "adam":
            base = optax.adam(lr)
        else:
            base = optax.sgd(lr)
        return optax.chain(optax.add_decayed_weights(wd), base) if wd else base


def run_model(cfg, num_classes: int) -> Model:
    """The run's model: the one registered with its dataset (``register_dataset(..., model=)``), else
    method.md's CNN with ``cfg.dropout`` and ``cfg.conv_form`` (``auto``, not resolved by the run for its
    layout, is the model's own: :func:`~pfedkdh_jax.model.auto_conv_form`)."""
    registered = dataset_model(getattr(cfg, "dataset", None), num_classes)
    if registered is not None:
        return registered
    return CNN(num_classes, cfg.dropout, getattr(cfg, "conv_form", "auto"))


def local_config(cfg) -> dict:
    """The shared budget's fields (and the client optimizer) from a
    :class:`~pfedkdh_jax.run.config.RunConfig`."""
    return dict(lr=cfg.lr, batch_size=cfg.batch_size, local_epochs=cfg.local_epochs,
                optimizer=optimizer_from_run(cfg))


@struct.dataclass
class SharedModelState:
    """A server-side model ``(θ_g, φ_g)`` that every client starts from (FedAvg, FedProx, FedBABU)."""

    backbone: PyTree        # θ_g
    head: PyTree            # φ_g
    round: jax.Array        # int32 [], rounds completed
    num_clients: int = struct.field(pytree_node=False)   # K (the global head is every client's model)


@struct.dataclass
class PersonalHeadsState:
    """A shared backbone and one persistent head per client (FedPer, FedRep)."""

    backbone: PyTree        # θ_g
    heads: PyTree           # φ_k for every client, [K, ...]
    round: jax.Array        # int32 [], rounds completed


@struct.dataclass
class PersonalModelsState:
    """A global model and one whole personal model per client (Ditto, pFedMe)."""

    params: PyTree          # w: the global model {"backbone", "head"}
    personal: PyTree        # every client's personal model: [K, ...], or a ClientRows of them
    round: jax.Array        # int32 [], rounds completed

    @classmethod
    def create(cls, params: PyTree, num_clients: int, rows: int = 0) -> "PersonalModelsState":
        """The global model ``params`` and every personal model a copy of it (:func:`client_models`)."""
        return cls(params=params, personal=client_models(params, num_clients, rows), round=jnp.zeros((), jnp.int32))


def personal_rows(cfg, args: dict) -> dict:
    """``args`` with ``personal_rows`` set from a run's budget when its ``--method-arg`` do not set
    it: the most clients a run writes, ``rounds × clients per round``, where that is fewer than K
    (else 0: one row per client). The personal models of the other clients never leave their start."""
    if any(key == "personal_rows" for key, _ in cfg.method_args):
        return args
    most = cfg.rounds * cfg.clients_per_round
    return {**args, "personal_rows": most if most < cfg.num_clients else 0}


def personal_eval_models(personal: PyTree, global_model: PyTree) -> EvalModels:
    """Each client's own model (``personal``: ``[K, ...]`` or a ClientRows of ``{"backbone", "head"}``)
    scored on its own test split; ``global_model`` for ``global_*`` (Ditto, pFedMe, FedALA)."""
    if isinstance(personal, ClientRows):   # backbones read a client at a time; heads [K, ...] (small)
        backbone, heads = personal.part("backbone"), personal.part("head").dense()
    else:
        backbone, heads = personal["backbone"], personal["head"]
    return EvalModels(backbone=backbone, heads=heads, global_model=global_model, per_client=True)


def client_models(params: PyTree, num_clients: int, rows: int = 0) -> PyTree:
    """Every client's copy of ``params``: ``[K, ...]``, or with ``0 < rows < num_clients`` a
    :class:`~pfedkdh_jax.engine.client_rows.ClientRows` of ``rows`` rows (only the clients written so
    far hold one; the others read ``params``)."""
    return ClientRows.create(params, num_clients, rows) if 0 < rows < num_clients else broadcast(params, num_clients)


# ------------------------------------------------------------------------------ per-client pytrees
def broadcast(tree: PyTree, num_clients: int) -> PyTree:
    """``num_clients`` copies of ``tree`` along a new leading client axis ``[K, ...]``."""
    return jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (num_clients,) + x.shape), tree)


take = client_rows.row        # client k's value of a per-client pytree ([K, ...] or ClientRows)
put = client_rows.put_rows    # the selected clients' values replaced; every other client's untouched


weighted_average = sample_mean   # Σ_c w_c · tree_c / Σ_c w_c over the leading axis [C, ...]


def average_uploads(uploads: PyTree, data: FederatedData, selected: jax.Array) -> PyTree:
    """``Σ n_k w_k / Σ n_k`` over the selected clients (leading axis ``[C, ...]`` of ``uploads``)."""
    return weighted_average(uploads, data.train_n[selected])


def round_metrics(updates) -> dict:
    """Every method's per-round metrics: the mean local loss and each selected client's."""
    return {"train_loss": jnp.mean(updates.loss), "client_loss": updates.loss}


def with_rows_lost(metrics: dict, table) -> dict:
    """``metrics`` with ``rows_lost`` where ``table`` is a ClientRows: the clients it could not give a
    row so far (0 unless its ``personal_rows`` is below the clients trained; a run stops on it,
    :func:`pfedkdh_jax.run.records.divergence`)."""
    return {**metrics, "rows_lost": table.lost} if isinstance(table, ClientRows) else metrics


# ------------------------------------------------------------------------------------ objectives
def cross_entropy_loss(model: Model):
    """``(params, ctx, x, y, mask, rng) -> masked mean CE`` of the full model (ctx unused)."""
    def loss_fn(params, ctx, x, y, mask, rng):
        del ctx
        return losses.masked_mean(losses.cross_entropy(logits(model, params, x, rng=rng), y), mask)
    return loss_fn


def head_loss(model: Model):
    """Masked mean CE of a head over precomputed features (``x`` holds the features)."""
    def loss_fn(head, ctx, z, y, mask, rng):
        del ctx, rng
        return losses.masked_mean(losses.cross_entropy(model.logits_from_features(head, z), y), mask)
    return loss_fn


def gather_features(source, idx):
    """The ``gather`` of a local problem over a ``(features [N, D], labels [N])`` table."""
    feats, labels = source
    return feats[idx], labels[idx]


def head_trainer(model: Model, *, lr: float, batch_size: int, epochs: int,
                 max_steps: int | None = None, optimizer=None) -> LocalTrainer:
    """SGD (or ``optimizer``, a :func:`make_tx` field) on a head over precomputed features (teacher
    refit, head adaptation, FedRep's head epochs). The optimizer sees the head as the head part of a
    model's ``{"backbone", "head"}`` tree (:func:`as_head_part`), as it does in local training."""
    return LocalTrainer(loss_fn=head_loss(model), tx=as_head_part(make_tx(optimizer, lr)), gather=gather_features,
                        epochs=epochs, batch_size=batch_size, max_steps=max_steps)


def as_head_part(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` over a bare head, shown to it as ``{"backbone": {}, "head": head}``: an optimizer that reads
    a model's structure (``optax.adamw(mask={"backbone": True, "head": False})``, labels over both
    parts) takes a head trained on its own as the head of a model; any other optimizer computes what it
    computes on the bare head."""
    def wrap(tree):
        return None if tree is None else {"backbone": {}, "head": tree}

    def update(updates, state, params=None):
        updates, state = _fitted(tx.update, _AS_HEAD, wrap(updates), state, wrap(params))
        return updates["head"], state

    return optax.GradientTransformation(lambda params: _fitted(tx.init, _AS_HEAD, wrap(params)), update)


_AS_HEAD = ("a head trained on its own (FedRep's head epochs, pFedKDH's EA and teacher refit) is shown to its "
            "optimizer as {'backbone': {}, 'head': head}")
_HEAD_ONLY = ("a head trained with its backbone frozen (FedBABU's head-only fine-tuning) is shown to its optimizer "
              "as the model's tree with the backbone masked (optax.multi_transform)")


def _fitted(call, shown: str, *args):
    """``call(*args)`` of an optimizer's init or update; a tree of its own over the whole model's leaves (a
    mask, labels) that does not fit the tree it is shown (``shown``) is a one-line ValueError saying so."""
    try:
        return call(*args)
    except (ValueError, TypeError) as e:
        if "pytree" not in str(e).lower() and "tree structure" not in str(e).lower():
            raise
        raise ValueError(f"{shown}, and this optimizer's tree (a mask or labels over the whole model's leaves) "
                         "does not fit it: give it as a function of the parameters, e.g. mask=lambda params: "
                         f"jax.tree.map(lambda a: a.ndim > 1, params) (optax: {str(e).strip().splitlines()[0]})") from e


def fit_head(trainer: LocalTrainer, head: PyTree, feats: jax.Array, labels: jax.Array,
             key: jax.Array) -> tuple[PyTree, jax.Array]:
    """Train ``head`` on all of ``(feats, labels)`` (``lax.scan``: no convolution in the loop)."""
    if trainer.epochs == 0:
        return head, jnp.zeros((), jnp.float32)
    n = feats.shape[0]
    state = trainer.init(head, key, jnp.asarray(n), n)
    state = trainer.run_scan(state, None, jnp.arange(n), (feats, labels), trainer.num_steps(n))
    return state.params, state.loss_sum / jnp.maximum(state.step, 1)


# ------------------------------------------------------------------------------------ optimizers
def per_model(txs: dict) -> optax.GradientTransformation:
    """``{name: tx}`` over parameters ``{name: model}``: each model's optimizer sees that model's own
    ``{"backbone", "head"}`` tree (Ditto's global and personal copies, pFedMe's w and θ), as it would
    in any other method, so an optimizer that reads the tree's structure (``optax.adamw(mask=...)``,
    ``optax.multi_transform`` with labels ``{"backbone", "head"}``) takes each copy as it takes one model.
    (``optax.multi_transform`` would hand each the whole ``{name: ...}`` tree with the others masked.)"""
    txs = {k: optax.with_extra_args_support(tx) for k, tx in txs.items()}

    def init(params):
        return {k: tx.init(params[k]) for k, tx in txs.items()}

    def update(updates, state, params=None, **extra_args):
        out = {k: tx.update(updates[k], state[k], None if params is None else params[k], **extra_args)
               for k, tx in txs.items()}
        return {k: u for k, (u, _) in out.items()}, {k: s for k, (_, s) in out.items()}

    return optax.GradientTransformationExtraArgs(init, update)


def _zero_part(part: str) -> optax.GradientTransformation:
    """Zeros in place of the ``part`` of a model's ``{"backbone", "head"}`` updates, the rest as given."""
    def update(updates, state, params=None):
        del params
        return {**updates, part: jax.tree_util.tree_map(jnp.zeros_like, updates[part])}, state
    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def _one_part(tx: optax.GradientTransformation, frozen: str) -> optax.GradientTransformation:
    """``tx`` on the whole model's tree with the ``frozen`` part's gradients zeroed before it and its
    updates after: the part stays bit-identical, ``tx`` sees only the other part's gradients (a norm
    clip measures those) and the model's whole structure (a mask or label tree over the model's leaves
    fits, which ``optax.multi_transform`` would hand masked nodes in the frozen part's place)."""
    return optax.chain(_zero_part(frozen), tx, _zero_part(frozen))


def head_only(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` on the head; the backbone receives exactly zero updates. ``optax.multi_transform``: the
    optimizer keeps a state for the head's leaves only (the backbone, far larger, would double or treble
    every fine-tuned client's memory under Adam), so a tree over the whole model does not fit it."""
    both = optax.multi_transform({"backbone": optax.set_to_zero(), "head": tx}, {"backbone": "backbone",
                                                                                  "head": "head"})

    def update(updates, state, params=None):
        return _fitted(both.update, _HEAD_ONLY, updates, state, params)

    return optax.GradientTransformation(lambda params: _fitted(both.init, _HEAD_ONLY, params), update)


def body_only(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` on the backbone; the head receives exactly zero updates (it stays bit-identical). The
    optimizer sees the whole model (:func:`_one_part`): its state over the head, the smaller part."""
    return _one_part(tx, "head")


def sgd_trainer(loss_fn, tx: optax.GradientTransformation, config: LocalConfig,
                epochs: int | None = None, **kw) -> LocalTrainer:
    """The engine's local loop over the client's train split with ``tx``."""
    return LocalTrainer(loss_fn=loss_fn, tx=tx, gather=gather_inputs,
                        epochs=config.local_epochs if epochs is None else epochs,
                        batch_size=config.batch_size, **kw)


def start_local(trainer: LocalTrainer, params: PyTree, data: FederatedData, client: jax.Array,
                key: jax.Array, aux: PyTree = None) -> LocalState:
    """Client ``client``'s local state over its train split, from ``params``; its key is the round
    key folded with the client index."""
    return trainer.init(params, jax.random.fold_in(key, client), data.train_n[client], data.max_train,
                        aux=aux)
