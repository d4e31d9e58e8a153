"""A training step of the CNN inside a loop and outside one, for both convolution forms (README,
"Python API"; the CPU's conv-form choice in run/experiment.py: resolved_conv_form).

Eight SGD steps of batch 64 (MNIST shapes) compiled as one call, either unrolled or as a
``lax.fori_loop``, with XLA's convolution (``lax``) and with the matmul over patches (``patches``),
under the engine's local-training compiler options and under XLA's defaults. Prints seconds per step.

    python experiments/conv_in_loop.py

Run it with nothing else busy on the machine.
"""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import optax

from pfedkdh_jax import losses
from pfedkdh_jax.engine.layout import local_training_compiler_options
from pfedkdh_jax.model import CNN

STEPS = 8


def per_step(form: str, loop: bool, options) -> float:
    model = CNN(10, conv_form=form)
    params = model.init(jax.random.key(0), (28, 28, 1))
    tx = optax.sgd(0.015)
    x = jax.random.normal(jax.random.key(1), (STEPS, 64, 28, 28, 1))
    y = jax.random.randint(jax.random.key(2), (STEPS, 64), 0, 10)

    def step(i, carry):
        p, o = carry
        g = jax.grad(lambda q: jnp.mean(losses.cross_entropy(model.logits(q, x[i]), y[i])))(p)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o

    def run(p, o):
        if loop:
            return jax.lax.fori_loop(0, STEPS, step, (p, o))
        for i in range(STEPS):
            p, o = step(i, (p, o))
        return p, o
    f = jax.jit(run, compiler_options=options)
    carry = jax.block_until_ready(f(params, tx.init(params)))
    t0 = time.perf_counter()
    for _ in range(3):
        carry = f(*carry)
    jax.block_until_ready(carry)
    return (time.perf_counter() - t0) / (3 * STEPS)


def main() -> None:
    rows = []
    for options_name, options in (("engine", local_training_compiler_options()), ("xla_defaults", None)):
        for form in ("lax", "patches"):
            row = {"options": options_name, "conv_form": form, "backend": jax.default_backend(),
                   "unrolled_s": per_step(form, False, options), "loop_s": per_step(form, True, options)}
            row["loop_over_unrolled"] = row["loop_s"] / row["unrolled_s"]
            rows.append(row)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
