"""XLA:CPU compiler options of local training (engine/layout.py): what they hand to YNNPACK."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pfedkdh_jax import losses
from pfedkdh_jax.engine.layout import local_training_compiler_options
from pfedkdh_jax.model import CNN


def _ynn_ops(hlo: str) -> set[str]:
    """The HLO opcodes inside the fusions XLA:CPU hands to YNNPACK."""
    bodies, name = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%([\w.\-]+) .*\{$", line)
        if head:
            name = head.group(1)
            bodies[name] = []
        elif name is not None:
            bodies[name].append(line)
    called = [m.group(1) for line in hlo.splitlines() if "__ynn_fusion" in line
              for m in [re.search(r"calls=%([\w.\-]+)", line)] if m]
    assert called, "no YNNPACK fusion found"
    return {op.group(1) for c in called for line in bodies[c]
            for op in [re.search(r"= \S+ ([a-z\-]+)\(", line)] if op}


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU options")
def test_training_options_give_ynnpack_dots_and_reductions_only_and_keep_the_numbers(monkeypatch):
    opts = local_training_compiler_options()
    kinds = set(opts["xla_cpu_experimental_ynn_fusion_type"].split(","))
    assert kinds == {"LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT", "LIBRARY_FUSION_TYPE_REDUCE"}
    model = CNN(10)
    params = model.init(jax.random.key(0), (28, 28, 1))
    x = jax.random.normal(jax.random.key(1), (16, 28, 28, 1))
    y = jnp.arange(16) % 10

    def grad(p):
        return jax.grad(lambda q: jnp.mean(losses.cross_entropy(model.logits(q, x), y)))(p)
    compiled = jax.jit(grad, compiler_options=opts).lower(params).compile()
    ours = _ynn_ops(compiled.as_text())
    assert "dot" in ours and "convolution" not in ours
    # the check can fail: with XLA's defaults YNNPACK gets the convolutions too
    assert "convolution" in _ynn_ops(jax.jit(grad).lower(params).compile().as_text())
    for a, b in zip(jax.tree_util.tree_leaves(compiled(params)), jax.tree_util.tree_leaves(jax.jit(grad)(params))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    # the user's own XLA_FLAGS setting of the option wins
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_experimental_ynn_fusion_type=")
    assert local_training_compiler_options() is None
    assert local_training_compiler_options("gpu") is None
