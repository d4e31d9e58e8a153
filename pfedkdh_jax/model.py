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
    xv = _window_view(x)                                   # [..., H/2, 2, W/2, 2, C]
    # ties counted from the four strided views (each the pooled shape): XLA:CPU fuses this into one
    # vectorized loop, where a sum over the window axes of the 6-d view ran 4x slower
    ties = sum((xv[..., :, i, :, j, :] == y).astype(g.dtype) for i in (0, 1) for j in (0, 1))
    share = (g / ties)[..., :, None, :, None, :]
    gx = jnp.where(xv == y[..., :, None, :, None, :], share, 0.0).reshape(*lead, h // 2 * 2, w // 2 * 2, c)
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


def _valid_conv(x: jax.Array, kernel: jax.Array) -> jax.Array:
    return jax.lax.conv_general_dilated(x, kernel, (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))


@jax.custom_vjp
def col2im_grad_conv(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """A VALID, stride-1 ``NHWC``/``HWIO`` convolution (XLA's), whose input gradient is a matmul and a
    col2im instead of XLA's transposed convolution.

    The input gradient is formed as ``g · kernelᵀ`` per output pixel (``[B, H', W', k, k, C]``, one
    einsum), then each of the k² taps added back at its offset (padded views, summed); the kernel's
    gradient is XLA's (the forward pass its ``vjp`` traces is unused, and XLA drops it). The same
    values to float32 rounding. On XLA:CPU a whole training step of the CNN is 14–15 % faster at 16–64
    slots and 8–11 % at 2–4 (BENCHMARKS.md, "A faster input gradient for the convolution"): XLA:CPU's
    transposed convolution runs at a fraction of its forward convolution's rate.
    """
    return _valid_conv(x, kernel)


def _col2im_conv_fwd(x, kernel):
    return _valid_conv(x, kernel), (x, kernel)


def _col2im_conv_bwd(res, g):
    x, kernel = res
    kh, kw = kernel.shape[:2]
    dkernel = jax.vjp(lambda k: _valid_conv(x, k), kernel)[1](g)[0]
    taps = jnp.einsum("nyxo,abio->nyxabi", g, kernel)          # [B, H', W', kh, kw, C]
    dx = sum(jnp.pad(taps[:, :, :, a, b, :], ((0, 0), (a, kh - 1 - a), (b, kw - 1 - b), (0, 0)))
             for a in range(kh) for b in range(kw))
    return dx, dkernel


col2im_grad_conv.defvjp(_col2im_conv_fwd, _col2im_conv_bwd)

_NHWC = jax.lax.ConvDimensionNumbers(lhs_spec=(0, 3, 1, 2), rhs_spec=(3, 2, 0, 1), out_spec=(0, 3, 1, 2))


def cpu_conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation=None, rhs_dilation=None,
                             dimension_numbers=None, feature_group_count=1, **kwargs):
    """``lax.conv_general_dilated`` as flax's ``nn.Conv`` calls it, with :func:`col2im_grad_conv` for
    the backbone's case (2-d, stride 1, VALID, undilated, ungrouped, ``NHWC``/``HWIO``) when the
    default backend is the CPU; every other call is ``lax.conv_general_dilated`` itself."""
    plain = (jax.default_backend() == "cpu" and lhs.ndim == 4 and tuple(window_strides) == (1, 1)
             and padding == "VALID" and feature_group_count == 1 and dimension_numbers == _NHWC
             and all(d is None or tuple(d) == (1, 1) for d in (lhs_dilation, rhs_dilation))
             and kwargs.get("precision") is None and kwargs.get("preferred_element_type") is None)
    if plain:
        return col2im_grad_conv(lhs, rhs)
    return jax.lax.conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation,
                                        dimension_numbers, feature_group_count, **kwargs)


def patch_matmul_conv(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """A VALID, stride-1 convolution as one matmul over patches: ``x`` ``[B, H, W, C]``, ``kernel``
    ``[k, k, C, O]`` → ``[B, H−k+1, W−k+1, O]``, the same values as ``lax.conv_general_dilated``.

    The k² shifted views of ``x`` are stacked into ``[B, H', W', k²·C]`` and contracted with the
    kernel reshaped to ``[k²·C, O]`` (``einsum``). Under ``vmap`` with weights of their own per member
    (clients or repetitions), this stays a batched matmul, where the convolution becomes a grouped
    convolution (``feature_group_count`` = members); which is faster depends on the backend
    (experiments/benchmarks.py ``--only convforms``)."""
    k = kernel.shape[0]
    h, w = x.shape[-3] - k + 1, x.shape[-2] - k + 1
    views = [x[..., i:i + h, j:j + w, :] for i in range(k) for j in range(k)]
    patches = jnp.stack(views, axis=-2).reshape(*x.shape[:-3], h, w, k * k * x.shape[-1])
    return jnp.einsum("...hwp,po->...hwo", patches, kernel.reshape(k * k * x.shape[-1], -1))


class PatchConv(nn.Module):
    """``nn.Conv(features, (k, k), padding="VALID")`` computed by :func:`patch_matmul_conv`: the same
    parameters (names, shapes, initializers, creation order), so a model's parameters do not depend
    on the form."""

    features: int
    kernel_size: int = 5

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        k = self.kernel_size
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (k, k, x.shape[-1], self.features))
        bias = self.param("bias", nn.initializers.zeros_init(), (self.features,))
        y = patch_matmul_conv(x, kernel)
        return y + bias.reshape((1,) * (y.ndim - 1) + (-1,))


CONV_FORMS = ("lax", "patches")


class Backbone(nn.Module):
    """Conv 5×5·32 → ReLU → MaxPool 2 → Conv 5×5·64 → ReLU → MaxPool 2 → Dropout → Dense 512 → ReLU.

    ``conv_form``: ``"lax"`` (flax's ``nn.Conv``, XLA's convolution, the default on every backend; on
    CPU its input gradient is :func:`col2im_grad_conv`'s, through :func:`cpu_conv_general_dilated`) or
    ``"patches"`` (:class:`PatchConv`, a matmul over patches: under ``vmap`` over per-member weights
    a batched matmul instead of a grouped convolution). The same parameters either way."""

    dropout_rate: float = 0.0
    pool: Callable[[jax.Array], jax.Array] = max_pool_2x2  # 2×2 max-pooling, per backend (swappable)
    conv_form: str = "lax"

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool = False) -> jax.Array:
        conv = ((lambda n, name: nn.Conv(n, (5, 5), padding="VALID", name=name,
                                          conv_general_dilated=cpu_conv_general_dilated))
                if self.conv_form == "lax"
                else (lambda n, name: PatchConv(n, name=name)))
        x = conv(32, "conv1")(x)
        x = nn.relu(self.pool(x))
        x = conv(64, "conv2")(x)
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

    def __init__(self, num_classes: int, dropout_rate: float = 0.0, conv_form: str = "lax"):
        if conv_form not in CONV_FORMS:
            raise ValueError(f"conv_form must be one of {CONV_FORMS}; got {conv_form!r}")
        self.num_classes = num_classes
        self.dropout_rate = dropout_rate
        self.conv_form = conv_form
        self.backbone = Backbone(dropout_rate, conv_form=conv_form)
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
