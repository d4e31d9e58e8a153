"""A user's flax model as a pfedkdh_jax :class:`~pfedkdh_jax.engine.protocol.Model`.

* :class:`LinenModel` wraps a flax.linen *pair*: a backbone module (inputs → features) and a head
  module (features → logits). Its parameters are the two modules' ``"params"`` collections.
* :class:`NNXModel` wraps flax.nnx modules, given as functions of an ``nnx.Rngs`` that build them
  (so every repetition and seed initialises from its own key); it stores only their graph
  definitions, never parameters, and merges them back inside each pure call.

Both check at ``init`` that a module's state is parameters only: a method's state is a pytree of
parameters, so mutable collections (BatchNorm's ``batch_stats``) are refused with one line — use
LayerNorm or GroupNorm instead. Features of more than one axis per sample are flattened.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp

Params = Any
_TRAIN_NAMES = ("train", "training", "is_training")   # a backbone's keyword that train_kwarg should name


def _flat(z: jax.Array) -> jax.Array:
    """The backbone's output as features ``[B, D]``; anything but one array is named."""
    if not hasattr(z, "ndim") or not hasattr(z, "reshape"):
        raise TypeError(f"the backbone must return one array of features [B, ...]; it returned a {type(z).__name__}"
                        " (a tuple of outputs: return the features only)")
    return z if z.ndim == 2 else z.reshape(z.shape[0], -1)


@dataclasses.dataclass(frozen=True)
class LinenModel:
    """A flax.linen backbone and head as one model.

    Args:
      backbone: ``nn.Module``, ``apply({"params": θ}, x) -> features [B, ...]``.
      head: ``nn.Module``, ``apply({"params": φ}, z [B, D]) -> logits [B, classes]``.
      train_kwarg: the name of the backbone's boolean keyword that turns training behaviour on
        (e.g. ``"train"`` for ``__call__(self, x, train: bool)``); it is passed ``rng is not None``,
        and the ``rng`` goes to the ``"dropout"`` stream. ``None``: the backbone takes no such
        keyword (and draws no randomness).
      input_dtype: the dtype of the inputs the backbone receives, for ``init``'s example batch:
        float32 for images (mapped to [-1, 1]) and other float features; an integer dtype for inputs
        kept as stored, e.g. token ids for an ``nn.Embed`` (``from_arrays`` of int32 inputs,
        ``FederatedData.input_dtype``).
    """

    backbone: Any
    head: Any
    train_kwarg: str | None = None
    input_dtype: Any = jnp.float32

    def __post_init__(self):
        for name in ("backbone", "head"):
            module = getattr(self, name)
            if not (callable(getattr(module, "init", None)) and callable(getattr(module, "apply", None))):
                raise TypeError(f"LinenModel({name}=...) must be a flax.linen Module; got a {type(module).__name__}")
        if self.train_kwarg is None:
            try:
                takes = [n for n in inspect.signature(type(self.backbone).__call__).parameters if n in _TRAIN_NAMES]
            except (TypeError, ValueError):
                takes = []
            if takes:
                warnings.warn(f"LinenModel: the backbone's __call__ takes {takes[0]!r} but train_kwarg is None, so local "
                              f"training never passes it (the backbone runs with its default both in training and "
                              f"in evaluation): pass train_kwarg={takes[0]!r}", stacklevel=3)
        elif self.train_kwarg == "deterministic":
            raise ValueError("LinenModel(train_kwarg='deterministic'): train_kwarg names a keyword that is True in "
                             "training, and flax's deterministic is the opposite: give the backbone a train keyword "
                             "(deterministic=not train inside)")

    def _kwargs(self, train: bool) -> dict:
        return {} if self.train_kwarg is None else {self.train_kwarg: train}

    def init(self, key: jax.Array, input_shape: tuple[int, ...]) -> Params:
        kb, kh = jax.random.split(key)
        x = jnp.zeros((1, *input_shape), self.input_dtype)
        vb = self.backbone.init({"params": kb, "dropout": kb}, x, **self._kwargs(False))
        _params_only(vb, "backbone")
        z = _flat(self.backbone.apply(vb, x, **self._kwargs(False)))
        vh = self.head.init({"params": kh}, z)
        _params_only(vh, "head")
        return {"backbone": vb.get("params", {}), "head": vh.get("params", {})}   # (a part may have none)

    def features(self, backbone: Params, x: jax.Array, *, rng: jax.Array | None = None) -> jax.Array:
        rngs = {} if rng is None else {"dropout": rng}
        return _flat(self.backbone.apply({"params": backbone}, x, rngs=rngs, **self._kwargs(rng is not None)))

    def logits_from_features(self, head: Params, z: jax.Array) -> jax.Array:
        return self.head.apply({"params": head}, z)


def _params_only(variables, name: str) -> None:
    other = sorted(set(variables) - {"params"})
    if other:
        raise ValueError(f"the {name} module has collections {other} besides 'params': a model's state must be "
                         "parameters only (use LayerNorm or GroupNorm instead of BatchNorm)")


class NNXModel:
    """flax.nnx modules as one model.

    Args:
      backbone: a function ``rngs -> nnx.Module`` building the backbone (inputs → features), e.g.
        ``lambda rngs: MyBackbone(rngs=rngs)``.
      head: likewise for the head (features → logits).

    ``init(key, ...)`` builds both from ``nnx.Rngs(key)`` and returns their parameters as plain
    dicts; every call merges them into the modules' graph definitions (taken once, from shapes).
    The modules run in evaluation mode (``module.eval()``: dropout off), since nnx modules draw
    randomness from state of their own that a pure round does not carry.
    """

    def __init__(self, backbone: Callable[[Any], Any], head: Callable[[Any], Any]):
        from flax import nnx

        import flax.linen as linen

        for name, make in (("backbone", backbone), ("head", head)):
            if isinstance(make, linen.Module):
                raise TypeError(f"NNXModel({name}=...) takes flax.nnx modules; got a flax.linen {type(make).__name__}: "
                                "linen modules go in LinenModel(backbone, head)")
            if isinstance(make, nnx.Module) or not callable(make):
                raise TypeError(f"NNXModel({name}=...) must be a function rngs -> nnx.Module (e.g. "
                                f"lambda rngs: MyModule(..., rngs=rngs)); got a {type(make).__name__}")
        self._make = {"backbone": backbone, "head": head}
        self._graph = {}
        for name, make in self._make.items():
            module = nnx.eval_shape(lambda make=make: make(nnx.Rngs(0)))
            graph, params, rest = nnx.split(module, nnx.Param, ...)
            if jax.tree_util.tree_leaves(rest):
                raise ValueError(f"the {name} module holds state besides nnx.Param ({type(rest).__name__}): a "
                                 "model's state must be parameters only (no BatchNorm statistics or stored "
                                 "rng streams; build Dropout without rngs, and it stays off: nnx modules run in "
                                 "evaluation mode here; for dropout in training, LinenModel)")
            if any(isinstance(node, nnx.Dropout) and node.rate > 0 for _, node in nnx.iter_graph(module)):
                warnings.warn(f"NNXModel: the {name}'s nnx.Dropout stays off in training too (nnx modules run in "
                              "evaluation mode here: their randomness is state a pure round does not carry); for "
                              "dropout in training, write the module in flax.linen and use LinenModel",
                              stacklevel=2)
            self._graph[name] = (graph, params)

    def init(self, key: jax.Array, input_shape: tuple[int, ...]) -> Params:
        from flax import nnx

        kb, kh = jax.random.split(key)
        out = {}
        for name, k in (("backbone", kb), ("head", kh)):
            _, params, _ = nnx.split(self._make[name](nnx.Rngs(k)), nnx.Param, ...)
            out[name] = nnx.to_pure_dict(params)
        return out

    def _module(self, name: str, params: Params):
        from flax import nnx

        graph, template = self._graph[name]
        state = jax.tree_util.tree_map(lambda x: x, template)   # a fresh copy to fill
        nnx.replace_by_pure_dict(state, params)
        module = nnx.merge(graph, state)
        module.eval()
        return module

    def features(self, backbone: Params, x: jax.Array, *, rng: jax.Array | None = None) -> jax.Array:
        del rng
        return _flat(self._module("backbone", backbone)(x))

    def logits_from_features(self, head: Params, z: jax.Array) -> jax.Array:
        return self._module("head", head)(z)
