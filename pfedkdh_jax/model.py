"""The CNN of method.md §1, split into a shared backbone and a linear head.

``f(x; θ, φ) = h_φ(b_θ(x))``. Parameters are a dict ``{"backbone": θ, "head": φ}`` so that
optax's ``partition``/``masked`` and the federated algorithms can address the two parts by name.
"""

from __future__ import annotations

import functools
from fractions import Fraction
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


def _backbone_case(lhs, window_strides, padding, lhs_dilation, rhs_dilation, dimension_numbers,
                   feature_group_count, kwargs) -> bool:
    """Whether ``nn.Conv``'s call is the backbone's kind: 2-d, stride 1, VALID, undilated, ungrouped,
    ``NHWC``/``HWIO``, default precision."""
    return (lhs.ndim == 4 and tuple(window_strides) == (1, 1) and padding == "VALID" and feature_group_count == 1
            and dimension_numbers == _NHWC and all(d is None or tuple(d) == (1, 1) for d in (lhs_dilation, rhs_dilation))
            and kwargs.get("precision") is None and kwargs.get("preferred_element_type") is None)


def cpu_conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation=None, rhs_dilation=None,
                             dimension_numbers=None, feature_group_count=1, **kwargs):
    """``lax.conv_general_dilated`` as flax's ``nn.Conv`` calls it, with :func:`col2im_grad_conv` for
    the backbone's case (2-d, stride 1, VALID, undilated, ungrouped, ``NHWC``/``HWIO``) when the
    default backend is the CPU; every other call is ``lax.conv_general_dilated`` itself."""
    if jax.default_backend() == "cpu" and _backbone_case(lhs, window_strides, padding, lhs_dilation, rhs_dilation,
                                                         dimension_numbers, feature_group_count, kwargs):
        return col2im_grad_conv(lhs, rhs)
    return jax.lax.conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation,
                                        dimension_numbers, feature_group_count, **kwargs)


# Winograd's minimal filtering, F(m×m, r×r): interpolation points (the point at infinity is added), the
# small ones first, as is usual for float32 (Lavin & Gray, "Fast Algorithms for Convolutional Neural
# Networks", CVPR 2016).
_WINOGRAD_POINTS = (0, 1, -1, 2, -2, Fraction(1, 2), Fraction(-1, 2), 3, -3, Fraction(1, 3), Fraction(-1, 3))
WINOGRAD_TILE = 4            # m: output tiles of 4×4 (F(4×4, 5×5) for the backbone's 5×5 kernels)
WINOGRAD_MIN_CHANNELS = 16   # convolutions with fewer input channels (conv1: 1 or 3) stay XLA's
WINOGRAD_MAX_BATCH = 256     # and larger batches (evaluation's chunks): there XLA's forward pass is faster


def _exact_inverse(rows: list[list[Fraction]]) -> list[list[Fraction]]:
    n = len(rows)
    a = [list(r) + [Fraction(int(i == j)) for j in range(n)] for i, r in enumerate(rows)]
    for c in range(n):
        p = next(i for i in range(c, n) if a[i][c] != 0)
        a[c], a[p] = a[p], a[c]
        a[c] = [v / a[c][c] for v in a[c]]
        for i in range(n):
            if i != c and a[i][c] != 0:
                f = a[i][c]
                a[i] = [u - f * v for u, v in zip(a[i], a[c])]
    return [r[n:] for r in a]


@functools.lru_cache(maxsize=None)
def winograd_matrices(m: int, r: int) -> tuple[tuple, tuple, tuple]:
    """``(Aᵀ [m, n], G [n, r], Bᵀ [n, n])`` of F(m, r), n = m + r − 1, as exact fractions: for a row ``d``
    of n inputs and a kernel ``g`` of r taps, ``Aᵀ((G g) ⊙ (Bᵀ d))`` is the correlation
    ``y[k] = Σ_j d[k + j] g[j]``, k < m. Built by the transposition principle from the Toom–Cook linear
    convolution at the points ``_WINOGRAD_POINTS[:n − 1]`` and infinity: G and the transpose of Aᵀ
    evaluate a polynomial of r and m coefficients there, Bᵀ is the transposed inverse of the n × n
    evaluation."""
    n = m + r - 1
    if n - 1 > len(_WINOGRAD_POINTS):
        raise ValueError(f"no Winograd points for F({m}, {r})")
    points = _WINOGRAD_POINTS[: n - 1]

    def evaluation(cols: int) -> list[list[Fraction]]:
        return ([[Fraction(p) ** k for k in range(cols)] for p in points]
                + [[Fraction(0)] * (cols - 1) + [Fraction(1)]])
    inverse = _exact_inverse(evaluation(n))
    at = tuple(zip(*evaluation(m)))
    bt = tuple(zip(*inverse))
    return at, tuple(map(tuple, evaluation(r))), bt


def _combine(coefficients, parts):
    """``Σ c·part`` over the non-zero coefficients, written out (XLA fuses it into one loop)."""
    out = None
    for c, part in zip(coefficients, parts):
        if c == 0:
            continue
        term = part if c == 1 else -part if c == -1 else float(c) * part
        out = term if out is None else out + term
    return out


def winograd_conv(x: jax.Array, kernel: jax.Array, tile: int = WINOGRAD_TILE) -> jax.Array:
    """A VALID, stride-1 ``NHWC``/``HWIO`` convolution by Winograd's minimal filtering F(m×m, r×r), m = ``tile``.

    The output is cut into m×m tiles (the input zero-padded at the bottom and right where the output's
    sides are not multiples of m, the extra outputs dropped); each tile's (m + r − 1)² inputs and the kernel
    are transformed (sums with the constant coefficients of :func:`winograd_matrices`), multiplied as one
    batched matmul per transform point (``[n², tiles, C] × [n², C, O]``), and transformed back. Gradients are
    JAX's of these operations: both are again batched matmuls of the same size, so the forward pass, the
    input gradient and the kernel gradient each cost ``n²/(m²r²)`` of a direct convolution's multiply-adds
    (0.16 at F(4×4, 5×5)) plus the transforms. The same values as ``lax.conv_general_dilated`` to float32
    rounding (relative errors of a few 1e-6 at F(4×4, 5×5) with the points 0, ±1, ±2, ±½; tests/test_losses.py).
    On XLA:CPU a training step of the CNN with conv2 in this form runs 0.64× (batch 64) to 0.9× (batch 1)
    of the time with XLA's convolution (BENCHMARKS.md, "Winograd")."""
    kh, kw, c, o = kernel.shape
    if kh != kw:
        raise ValueError(f"winograd_conv needs a square kernel; got {kh}×{kw}")
    m, r = tile, kh
    n = m + r - 1
    at, g, bt = winograd_matrices(m, r)
    b, h, w, _ = x.shape
    ho, wo = h - r + 1, w - r + 1
    th, tw = -(-ho // m), -(-wo // m)
    if th * m != ho or tw * m != wo:
        x = jnp.pad(x, ((0, 0), (0, th * m - ho), (0, tw * m - wo), (0, 0)))
    # the inputs' transform, rows then columns: v[t, s] = Σ Bᵀ[t, l] Bᵀ[s, l'] x[m·i + l, m·j + l']
    rows = [x[:, l:l + m * (th - 1) + 1:m] for l in range(n)]                     # [B, th, W, C] each
    vy = jnp.stack([_combine(bt[t], rows) for t in range(n)])                      # [n, B, th, W, C]
    cols = [vy[:, :, :, l:l + m * (tw - 1) + 1:m] for l in range(n)]              # [n, B, th, tw, C] each
    v = jnp.stack([_combine(bt[s], cols) for s in range(n)], axis=1)               # [n, n, B, th, tw, C]
    # the kernel's: u = G k Gᵀ. Each slice is taken once: a slice taken again per combination would be
    # another pad and add of its gradient (a training step 1.6× slower)
    taps = [kernel[a] for a in range(r)]
    ut = jnp.stack([_combine(g[t], taps) for t in range(n)])                       # [n, r, C, O]
    taps = [ut[:, a] for a in range(r)]
    u = jnp.stack([_combine(g[s], taps) for s in range(n)], axis=1)                # [n, n, C, O]
    prod = jnp.einsum("pkc,pco->pko", v.reshape(n * n, b * th * tw, c), u.reshape(n * n, c, o))
    prod = prod.reshape(n, n, b, th, tw, o)
    # back: y[m·i + a, m·j + a'] = Σ Aᵀ[a, t] Aᵀ[a', s] prod[t, s]
    points = [prod[t] for t in range(n)]
    oy = jnp.stack([_combine(at[a], points) for a in range(m)])                    # [m, n, B, th, tw, O]
    points = [oy[:, s] for s in range(n)]
    out = jnp.stack([_combine(at[a], points) for a in range(m)], axis=1)           # [m, m, B, th, tw, O]
    return jnp.transpose(out, (2, 3, 0, 4, 1, 5)).reshape(b, th * m, tw * m, o)[:, :ho, :wo]


def winograd_conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation=None, rhs_dilation=None,
                                  dimension_numbers=None, feature_group_count=1, **kwargs):
    """``lax.conv_general_dilated`` as ``nn.Conv`` calls it, with :func:`winograd_conv` for the backbone's
    case with square kernels, at least ``WINOGRAD_MIN_CHANNELS`` input channels (conv2) and at most
    ``WINOGRAD_MAX_BATCH`` samples (under ``vmap``: per member), on any backend; every other call as
    :func:`cpu_conv_general_dilated`. Measured on XLA:CPU (BENCHMARKS.md, "Winograd"): conv1 with its 1 or 3
    input channels made a training step 2.2–2.7× slower in this form (the batched matmuls are outer
    products); a forward pass alone of 512 or more samples ran 1.2–1.5× slower than XLA's (the transformed
    tiles outgrow the caches), while training steps of 64–512 samples ran in 0.59–0.64× the time."""
    if (rhs.shape[0] == rhs.shape[1] and lhs.shape[-1] >= WINOGRAD_MIN_CHANNELS
            and lhs.shape[0] <= WINOGRAD_MAX_BATCH
            and _backbone_case(lhs, window_strides, padding, lhs_dilation, rhs_dilation, dimension_numbers,
                               feature_group_count, kwargs)):
        return winograd_conv(lhs, rhs)
    return cpu_conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation,
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


CONV_FORMS = ("lax", "patches", "winograd")


def auto_conv_form(backend: str | None = None) -> str:
    """The form of the model's convolutions where none is chosen: ``"winograd"`` on the CPU, where a training
    step ran 1.25–1.6× (MNIST) and 1.04–1.27× (CIFAR-10) as fast as with XLA's convolution, for one member
    and ten vmapped ones, ahead of ``"patches"`` too (BENCHMARKS.md, "Winograd"); ``"lax"`` on other backends
    (not measured there yet). A run's ``--conv-form auto`` also looks at its layout
    (``run.experiment.resolved_conv_form``)."""
    return "winograd" if (backend or jax.default_backend()) == "cpu" else "lax"


class Backbone(nn.Module):
    """Conv 5×5·32 → ReLU → MaxPool 2 → Conv 5×5·64 → ReLU → MaxPool 2 → Dropout → Dense 512 → ReLU.

    ``conv_form``: ``"lax"`` (flax's ``nn.Conv``, XLA's convolution; on CPU its input gradient is
    :func:`col2im_grad_conv`'s, through :func:`cpu_conv_general_dilated`),
    ``"patches"`` (:class:`PatchConv`, a matmul over patches: under ``vmap`` over per-member weights
    a batched matmul instead of a grouped convolution), ``"winograd"`` (``nn.Conv`` with conv2 by
    :func:`winograd_conv`, conv1 as ``"lax"``) or ``"auto"`` (the default: :func:`auto_conv_form` when
    traced). The same parameters in every form."""

    dropout_rate: float = 0.0
    pool: Callable[[jax.Array], jax.Array] = max_pool_2x2  # 2×2 max-pooling, per backend (swappable)
    conv_form: str = "auto"

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool = False) -> jax.Array:
        form = auto_conv_form() if self.conv_form == "auto" else self.conv_form
        if form == "patches":
            conv = lambda n, name: PatchConv(n, name=name)  # noqa: E731
        else:
            hook = winograd_conv_general_dilated if form == "winograd" else cpu_conv_general_dilated
            conv = lambda n, name: nn.Conv(n, (5, 5), padding="VALID", name=name,  # noqa: E731
                                           conv_general_dilated=hook)
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

    def __init__(self, num_classes: int, dropout_rate: float = 0.0, conv_form: str = "auto"):
        if conv_form != "auto" and conv_form not in CONV_FORMS:
            raise ValueError(f"conv_form must be 'auto' or one of {CONV_FORMS}; got {conv_form!r}")
        self.num_classes = num_classes
        self.dropout_rate = dropout_rate
        self.conv_form = conv_form
        self.backbone = Backbone(dropout_rate, conv_form=conv_form)
        self.head = Head(num_classes)

    def init(self, key: jax.Array, input_shape: tuple[int, ...]) -> Params:
        """Return ``{"backbone": θ, "head": φ}`` for inputs of shape ``input_shape`` (H, W, C)."""
        shape = tuple(input_shape)
        # two 5×5 VALID convolutions, each followed by a 2×2 pool, leave (H − 4) // 2 − 4 ≥ 2 before the second pool
        if len(shape) != 3 or min(shape[:2]) < 16:
            # the two layouts a grey or channels-first image set arrives in, each with its one-line remedy
            hint = ("grey images without a channel axis: give from_arrays images[..., None]" if len(shape) == 2
                    and min(shape) >= 16 else "channels first: give from_arrays images.transpose(0, 2, 3, 1)"
                    if len(shape) == 3 and shape[0] <= 4 and min(shape[1:]) >= 16 else
                    "use a model of your own for other inputs (pfedkdh_jax.LinenModel)")
            raise ValueError(f"CNN.init: the paper's CNN takes images (H, W, C) of at least 16×16 (two 5×5 VALID "
                             f"convolutions and two 2×2 pools); got input_shape {shape}: {hint}")
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
