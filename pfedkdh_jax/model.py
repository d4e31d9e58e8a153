"""The CNN of method.md §1, split into a shared backbone and a linear head.

``f(x; θ, φ) = h_φ(b_θ(x))``. Parameters are a dict ``{"backbone": θ, "head": φ}`` so that
optax's ``partition``/``masked`` and the federated algorithms can address the two parts by name.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

Params = Any

FEATURE_DIM = 512


def _window_view(x: jax.Array) -> jax.Array:
    """``[..., H, W, C]`` → ``[..., H//2, 2, W//2, 2, C]`` (odd trailing rows/columns dropped)."""
    *lead, h, w, c = x.shape
    return x[..., : h // 2 * 2, : w // 2 * 2, :].reshape(*lead, h // 2, 2, w // 2, 2, c)


def flax_max_pool_2x2(x: jax.Array) -> jax.Array:
    """2×2 max-pooling with stride 2, flax's ``nn.max_pool`` (``reduce_window``; gradient by XLA's
    ``select_and_scatter``)."""
    return nn.max_pool(x, (2, 2), strides=(2, 2))


@jax.custom_vjp
def masked_max_pool_2x2(x: jax.Array) -> jax.Array:
    """2×2 max-pooling with stride 2 over ``[..., H, W, C]`` (odd trailing rows/columns dropped).

    The values are ``nn.max_pool``'s (the forward pass is XLA's ``reduce_window``). The gradient is
    written as a compare-and-mask over the 2×2 windows instead of XLA's ``select_and_scatter``,
    which on XLA:CPU made a whole training step about twice as slow; a reshape + ``max`` form has
    the same fast gradient but a forward pass half as fast as ``reduce_window`` (BENCHMARKS.md,
    "Pooling form"). Where entries of a window tie for the maximum the gradient is split equally
    between them (as ``jnp.max``'s), where ``select_and_scatter`` gives it all to one; the backbone
    pools before the ReLU (the two commute), so a window of negative pre-activations passes no
    gradient either way.
    """
    return flax_max_pool_2x2(x)


def _max_pool_fwd(x):
    y = flax_max_pool_2x2(x)
    return y, (x, y)


def _max_pool_bwd(res, g):
    x, y = res
    *lead, h, w, c = x.shape
    hit = (_window_view(x) == y[..., :, None, :, None, :]).astype(g.dtype)
    share = g[..., :, None, :, None, :] / hit.sum(axis=(-4, -2), keepdims=True)
    gx = (hit * share).reshape(*lead, h // 2 * 2, w // 2 * 2, c)
    pad = [(0, 0)] * len(lead) + [(0, h % 2), (0, w % 2), (0, 0)]
    return (jnp.pad(gx, pad),)


masked_max_pool_2x2.defvjp(_max_pool_fwd, _max_pool_bwd)


def max_pool_2x2(x: jax.Array) -> jax.Array:
    """The backbone's 2×2 max-pooling, in the form measured fastest on the default backend.

    On CPU :func:`masked_max_pool_2x2` (a training step 1.5–1.85× faster than with ``nn.max_pool``);
    elsewhere ``nn.max_pool``, whose ``select_and_scatter`` gradient made the training step 17–21 %
    faster than the masked form on an H200 (BENCHMARKS.md, "Pooling form"). The values are the same;
    the gradients differ only where a window's entries tie for the maximum (split there on CPU, all
    to one entry elsewhere). Chosen when the function is traced, from ``jax.default_backend()``.
    """
    if jax.default_backend() == "cpu":
        return masked_max_pool_2x2(x)
    return flax_max_pool_2x2(x)


class Backbone(nn.Module):
    """Conv 5×5·32 → ReLU → MaxPool 2 → Conv 5×5·64 → ReLU → MaxPool 2 → Dropout → Dense 512 → ReLU."""

    dropout_rate: float = 0.0
    pool: Callable[[jax.Array], jax.Array] = max_pool_2x2  # 2×2 max-pooling, per backend (swappable)

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool = False) -> jax.Array:
        x = nn.Conv(32, (5, 5), padding="VALID", name="conv1")(x)
        x = nn.relu(self.pool(x))
        x = nn.Conv(64, (5, 5), padding="VALID", name="conv2")(x)
        x = nn.relu(self.pool(x))
        x = nn.Dropout(self.dropout_rate, deterministic=not train)(x)
        x = x.reshape(x.shape[:-3] + (-1,))
        return nn.relu(nn.Dense(FEATURE_DIM, name="fc")(x))


class Head(nn.Module):
    """One dense layer from the 512 features to the class logits."""

    num_classes: int

    @nn.compact
    def __call__(self, z: jax.Array) -> jax.Array:
        return nn.Dense(self.num_classes, name="out")(z)


class CNN:
    """Pure functions of the split model; holds only static hyperparameters, never parameters."""

    def __init__(self, num_classes: int, dropout_rate: float = 0.0):
        self.num_classes = num_classes
        self.dropout_rate = dropout_rate
        self.backbone = Backbone(dropout_rate)
        self.head = Head(num_classes)

    def init(self, key: jax.Array, input_shape: tuple[int, ...]) -> Params:
        """Return ``{"backbone": θ, "head": φ}`` for inputs of shape ``input_shape`` (H, W, C)."""
        kb, kh = jax.random.split(key)
        x = jnp.zeros((1,) + tuple(input_shape), jnp.float32)
        backbone = self.backbone.init(kb, x)["params"]
        head = self.head.init(kh, jnp.zeros((1, FEATURE_DIM), jnp.float32))["params"]
        return {"backbone": backbone, "head": head}

    def features(self, backbone: Params, x: jax.Array, *, rng: jax.Array | None = None) -> jax.Array:
        """Backbone features ``[B, 512]``; dropout is active iff ``rng`` is given."""
        train = rng is not None and self.dropout_rate > 0
        rngs = {"dropout": rng} if train else {}
        return self.backbone.apply({"params": backbone}, x, train=train, rngs=rngs)

    def logits_from_features(self, head: Params, z: jax.Array) -> jax.Array:
        return self.head.apply({"params": head}, z)

    def logits(self, params: Params, x: jax.Array, *, rng: jax.Array | None = None) -> jax.Array:
        return self.logits_from_features(params["head"], self.features(params["backbone"], x, rng=rng))


def param_count(tree: Params) -> int:
    return sum(int(x.size) for x in jax.tree_util.tree_leaves(tree))
