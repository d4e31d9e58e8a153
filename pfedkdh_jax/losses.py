"""Loss terms of the local objective (method.md §3), each a pure function of arrays.

All per-batch means are *masked* means: padded slots of a partial batch carry ``mask == 0`` and do
not count, so the last partial batch of an epoch is kept and weighted by its real size.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def masked_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean of ``values[mask]``; 0 when the mask is empty (never NaN)."""
    mask = mask.astype(values.dtype)
    return jnp.sum(values * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Per-sample softmax cross-entropy with integer labels, shape ``[B]``."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels)


def distillation_kl(student_logits: jax.Array, teacher_logits: jax.Array, temperature: float) -> jax.Array:
    """Per-sample ``T² · KL(q_teacher^T ‖ q_student^T)`` with ``q^T = softmax(z / T)``, shape ``[B]``.

    The KL is taken *from* the teacher distribution: ``Σ_c q_t,c (log q_t,c − log q_s,c)``. The
    teacher logits are treated as constants (``stop_gradient``).
    """
    t = jnp.asarray(temperature, student_logits.dtype)
    log_q_t = jax.nn.log_softmax(jax.lax.stop_gradient(teacher_logits) / t, axis=-1)
    log_q_s = jax.nn.log_softmax(student_logits / t, axis=-1)
    return t * t * jnp.sum(jnp.exp(log_q_t) * (log_q_t - log_q_s), axis=-1)


def proximal(params, anchor, mu: float) -> jax.Array:
    """``μ/2 · ‖params − anchor‖²`` summed over all leaves; the anchor is a constant."""
    sq = jax.tree_util.tree_map(
        lambda p, a: jnp.sum(jnp.square(p - jax.lax.stop_gradient(a))), params, anchor)
    return 0.5 * mu * sum(jax.tree_util.tree_leaves(sq))


# Stands for log 0 in masked softmaxes: finite, so no NaN reaches a gradient through jnp.where.
_LOG_ZERO = -1e9


def restricted_distillation_kl(student_logits: jax.Array, teacher_logits: jax.Array,
                               temperature: float, support: jax.Array) -> jax.Array:
    """:func:`distillation_kl` with both distributions restricted to (renormalised over) the classes
    where ``support`` (bool ``[C]``, or ``[B, C]``) is true, shape ``[B]``.

    With a client's label support this is class-aware distillation: the teacher's mass on classes the
    client never sees is dropped, so it no longer pulls the student towards them. A support of one
    class gives 0 (both distributions are the same point mass).
    """
    t = jnp.asarray(temperature, student_logits.dtype)
    log_q_t = jax.nn.log_softmax(restrict_logits(jax.lax.stop_gradient(teacher_logits) / t, support), -1)
    log_q_s = jax.nn.log_softmax(restrict_logits(student_logits / t, support), -1)
    kl = jnp.where(jnp.broadcast_to(support, log_q_t.shape), jnp.exp(log_q_t) * (log_q_t - log_q_s), 0.0)
    return t * t * jnp.sum(kl, axis=-1)


def restrict_logits(logits: jax.Array, support: jax.Array) -> jax.Array:
    """``logits`` on the classes of ``support``, "log 0" elsewhere: a softmax over them is the
    distribution restricted to the support and renormalised."""
    return jnp.where(jnp.broadcast_to(support, logits.shape), logits, _LOG_ZERO)


def prior_adjusted_logits(logits: jax.Array, log_prior_ratio: jax.Array, support: jax.Array) -> jax.Array:
    """``logits + log π_k − log π_s`` on the classes of ``support``, "log 0" elsewhere.

    The Bayes correction of a classifier trained under the class prior π_s (the teacher, refit on D_s)
    for data drawn under π_k (a client's label distribution): ``p_k(y|x) ∝ p_s(y|x) · π_k(y) / π_s(y)``.
    """
    return restrict_logits(logits + jnp.broadcast_to(log_prior_ratio, logits.shape), support)


def true_class_probability(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """``softmax(logits)[y]`` per sample, shape ``[B]``."""
    return jnp.take_along_axis(jax.nn.softmax(logits, -1), labels[:, None], axis=-1)[:, 0]
