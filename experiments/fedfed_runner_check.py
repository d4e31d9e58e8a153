"""Is FedFed's runner-check gap round-off that its VAE's AdamW amplifies, or an impure piece?

``check_method`` compares the host runner (the pieces called one by one) with the pure round. FedFed
fails that comparison in a VAE BatchNorm mean (0.046 against a tolerance of 9e-3) with its default VAE
optimizer, AdamW, whose normalised steps turn float round-off into steps of the learning rate's size.
This runs the runner check alone, in check_method_timing.py's setting (400 digits over 4 clients, the
example MLP, one local epoch of batch 16), with the VAE's optimizer AdamW (the default), plain SGD and SGD
with momentum 0.9 (a state carried from step to step, as AdamW's, without its normalised steps): a gap that
disappears under both SGDs at check_method's default tolerance is amplified round-off; an impure piece, or
an optimizer state the runner carried otherwise than the round, would show under them too.

    python experiments/fedfed_runner_check.py [--vae-optimizers adamw,sgd,momentum] [--tol 1e-4]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vae-optimizers", default="adamw,sgd,momentum",
                    help="adamw (FedFed's default), sgd, momentum (SGD with momentum 0.9)")
    ap.add_argument("--tol", type=float, default=1e-4, help="check_method's tolerance (the runner check uses 3×)")
    a = ap.parse_args(argv)
    import flax.linen as nn
    import optax

    import pfedkdh_jax as p
    from pfedkdh_jax.data.sources import load_pool

    sys.path.insert(0, HERE)
    from check_method_timing import example_module   # its setting: the example's MLP on 400 digits

    mod = example_module()
    pool = load_pool("digits")
    data = p.from_arrays(pool.images[:400], pool.labels[:400], num_clients=4, alpha=1.0, aux_size=40, seed=0)
    model = p.LinenModel(mod.MLP(), nn.Dense(10))
    chosen = {"adamw": None, "sgd": lambda lr: optax.sgd(lr), "momentum": lambda lr: optax.sgd(lr, momentum=0.9)}
    for name in a.vae_optimizers.split(","):
        algo = p.FedFed(model, p.FedFedConfig(local_epochs=1, batch_size=16, vae_optimizer=chosen[name]))
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", p.RoundOffWarning)
            try:
                p.check_method(algo, data, checks="runner", tol=a.tol)
                outcome = f"passes at tol {a.tol:g}"
            except p.ProtocolError as e:
                outcome = "fails: " + str(e).split(";")[0]
        print(f"VAE optimizer {name}: the runner check {outcome} ({time.perf_counter() - start:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
