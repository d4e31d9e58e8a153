"""FedFed's VAE (method.md §5.2): the model that splits an image into a robust part x_r (its
reconstruction) and a performance-sensitive part x_s = x − x_r.

Encoder: two stride-2 4×4 convolutions (16 then 32 channels), each with batch norm and ReLU, then two
residual blocks; the latent has the flattened feature size F (7·7·32 = 1568 for 28×28 inputs,
8·8·32 = 2048 for 32×32) and comes from dense mean / log-variance layers; the decoder mirrors the
encoder (a dense layer back to F, two residual blocks, two stride-2 transposed convolutions, the last
with a sigmoid). Inputs and reconstructions are pixels in [0, 1]. Batch norm keeps running statistics
(``batch_stats``), which FedFed averages with the parameters; padded samples of a partial batch are
masked out of the batch statistics. ``width`` (32, the specification's) is the encoder's second
channel count (the first is half of it); narrower VAEs exist for tests and small machines only.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
from flax.linen.dtypes import promote_dtype
import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any
WIDTH = 32   # channels (16, 32)


class ResBlock(nn.Module):
    """conv 3×3 → BN → ReLU → conv 3×3 → BN, plus the input, then ReLU."""

    channels: int

    @nn.compact
    def __call__(self, x, train: bool, mask):
        y = nn.Conv(self.channels, (3, 3))(x)
        y = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(y, mask=mask))
        y = nn.Conv(self.channels, (3, 3))(y)
        y = nn.BatchNorm(use_running_average=not train, momentum=0.9)(y, mask=mask)
        return nn.relu(x + y)


# S[p, y, u] = 1 where an output pixel of parity p (along one axis) reads the input at window offset y
# (rows i − 1, i, i + 1 of a 3×3 window) through kernel tap u of a stride-2 4×4 transposed convolution
# ('SAME' padding): even outputs read x[i − 1]·K[0] + x[i]·K[2], odd ones x[i]·K[1] + x[i + 1]·K[3]
_PARITY_TAPS = np.zeros((2, 3, 4), np.float32)
for _p, _y, _u in ((0, 0, 0), (0, 1, 2), (1, 1, 1), (1, 2, 3)):
    _PARITY_TAPS[_p, _y, _u] = 1.0


class UpConv(nn.Module):
    """``nn.ConvTranspose(features, (4, 4), strides=(2, 2))`` ('SAME' padding): the same parameters,
    initialisation and values, computed as one 3×3 convolution to ``4·features`` channels (one group per
    output pixel's parity along each axis) and a depth-to-space. XLA:CPU computes a transposed
    convolution's gradients as input-dilated convolutions, about 15× its forward pass at the decoder's shapes
    (``experiments/fedfed_cost.py --step``); these are the plain convolution's."""

    features: int

    @nn.compact
    def __call__(self, x):
        c = x.shape[-1]
        # float32 parameters whatever JAX's default float (as flax's layers keep them), computed in the
        # wider of theirs and the input's (under jax_enable_x64 the kernel followed the default, float64,
        # and the convolution refused the float32 features)
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (4, 4, c, self.features), jnp.float32)
        bias = self.param("bias", nn.initializers.zeros_init(), (self.features,), jnp.float32)
        x, kernel, bias = promote_dtype(x, kernel, bias)
        taps = jnp.asarray(_PARITY_TAPS, kernel.dtype)
        w = jnp.einsum("pyu,qxv,uvco->yxcpqo", taps, taps, kernel).reshape(3, 3, c, 4 * self.features)
        y = jax.lax.conv_general_dilated(x, w, (1, 1), ((1, 1), (1, 1)),
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
        b, h, wd = x.shape[:3]
        y = y.reshape(b, h, wd, 2, 2, self.features).transpose(0, 1, 3, 2, 4, 5)
        return y.reshape(b, 2 * h, 2 * wd, self.features) + bias.reshape(1, 1, 1, -1)


class VAE(nn.Module):
    """``(x [B, H, W, C] in [0, 1], rng) -> (x_r, mean, logvar)``; ``z = mean`` without ``rng``."""

    out_channels: int
    width: int = WIDTH

    def _bn(self, train: bool):
        return nn.BatchNorm(use_running_average=not train, momentum=0.9)

    @nn.compact
    def __call__(self, x, *, train: bool = False, rng: jax.Array | None = None, mask=None):
        m = None if mask is None else mask.reshape(-1, 1, 1, 1)
        h = x
        channels = (self.width // 2, self.width)
        for ch in channels:
            h = nn.relu(self._bn(train)(nn.Conv(ch, (4, 4), strides=(2, 2))(h), mask=m))
        for _ in range(2):
            h = ResBlock(self.width)(h, train, m)
        shape = h.shape[1:]
        flat = h.reshape(h.shape[0], -1)
        f = flat.shape[-1]
        mean, logvar = nn.Dense(f, name="mean")(flat), nn.Dense(f, name="logvar")(flat)
        z = mean if rng is None else mean + jnp.exp(0.5 * logvar) * jax.random.normal(rng, mean.shape)
        h = nn.Dense(f, name="decoder_input")(z).reshape((-1,) + shape)
        for _ in range(2):
            h = ResBlock(self.width)(h, train, m)
        # flax's ConvTranspose computed as plain convolutions (UpConv); its names keep the parameter tree
        h = nn.relu(self._bn(train)(UpConv(channels[0], name="ConvTranspose_0")(h), mask=m))
        x_r = nn.sigmoid(UpConv(self.out_channels, name="ConvTranspose_1")(h))
        return x_r, mean, logvar


def latent_size(input_shape, width: int = WIDTH) -> int:
    """F, the flattened feature size (the latent's size): ``(H/4)·(W/4)·width``."""
    h, w, _ = input_shape
    return (-(-h // 4)) * (-(-w // 4)) * width


def kl_term(mean: jax.Array, logvar: jax.Array, mask: jax.Array) -> jax.Array:
    """``KL(q(z|x) ‖ N(0, I))`` summed over the valid samples and the latent, divided by
    ``64 · 3 · F`` as in method.md §5.2 (mean 1, log-variance 0, B = 32, F = 1568 → 0.08333)."""
    f = mean.shape[-1]
    per = 0.5 * jnp.sum(jnp.square(mean) + jnp.exp(logvar) - 1.0 - logvar, axis=-1)
    return jnp.sum(per * mask) / (64 * 3 * f)


def reconstruction(x_r: jax.Array, x: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean squared error over the valid samples' pixels."""
    per = jnp.mean(jnp.square(x_r - x), axis=tuple(range(1, x.ndim)))
    return jnp.sum(per * mask) / jnp.maximum(jnp.sum(mask), 1.0)
