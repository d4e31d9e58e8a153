"""FedFed's runner check: does the host runner carry each client's VAE optimizer state as the pure round does,
and is the rest of its gap round-off?

``check_method`` compares the host runner (the pieces called one by one) with the pure round. FedFed keeps each
client's VAE optimizer state from round to round (``vae_opt``, never uploaded), and its runner check failed by
~1e-3 with AdamW (its default) and with SGD with momentum, while plain SGD (no state) passed. Three modes, in
check_method_timing.py's setting (400 digits over 4 clients, the example MLP, one local epoch):

* ``check`` (default): the runner check at ``--tol`` for each VAE optimizer of ``--vae-optimizers``;
* ``--frozen``: the same with every weight frozen (lr 0 for f and the VAE: the optimizer states only add up
  gradients and nothing moves the weights, so nothing grows round-off), three rounds of three of the four
  clients (each trains at least twice, taking its state back), at ``tol=1e-6``: a state carried otherwise shows
  in full. With ``--pure-defaults`` the pure round is compiled with XLA's defaults, as check_method compiled it
  before 2026-12-08, while the runner's steps take the local-training options;
* ``--sensitivity``: how far one round of three clients (weights frozen) moves the VAE's summed gradients (its
  momentum buffers) when the VAE's weights are changed by a relative 1e-7 and 1e-6 (float32 round-off is
  ~6e-8): a slope gives gaps in proportion, a jump gives the same gap for both.

    python experiments/fedfed_runner_check.py [--vae-optimizers adamw,sgd,momentum] [--tol 1e-4]
    python experiments/fedfed_runner_check.py --frozen [--pure-defaults] [--vae-optimizers momentum,adamw]
    python experiments/fedfed_runner_check.py --sensitivity
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))


def _largest(a, b) -> str:
    """The largest gap between the float leaves of two states, against that leaf's largest value."""
    import jax
    import numpy as np
    rows = [(float(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)).max()),
             float(np.abs(np.asarray(y, np.float64)).max()), jax.tree_util.keystr(path))
            for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves(b))
            if np.asarray(x).dtype.kind == "f"]
    gap, scale, where = max(rows)
    return f"{gap:.3g} in {where} (its largest value {scale:.3g})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vae-optimizers", default=None,
                    help="adamw (FedFed's default), sgd, momentum (SGD with momentum 0.9); default adamw,sgd,momentum "
                         "(--frozen: momentum,adamw)")
    ap.add_argument("--tol", type=float, default=None,
                    help="check_method's tolerance (the runner check uses 3x); default 1e-4 (--frozen: 1e-6)")
    ap.add_argument("--frozen", action="store_true", help="every weight frozen (lr 0), clients training twice")
    ap.add_argument("--pure-defaults", action="store_true",
                    help="with --frozen: the pure round compiled with XLA's defaults (check_method before 2026-12-08)")
    ap.add_argument("--sensitivity", action="store_true", help="the summed gradients' change for a weight change")
    a = ap.parse_args(argv)
    import flax.linen as nn
    import jax
    import optax

    import pfedkdh_jax as p
    from pfedkdh_jax.data.sources import load_pool
    from pfedkdh_jax.engine import conformance

    sys.path.insert(0, HERE)
    from check_method_timing import example_module   # its setting: the example's MLP on 400 digits

    mod = example_module()
    pool = load_pool("digits")
    data = p.from_arrays(pool.images[:400], pool.labels[:400], num_clients=4, alpha=1.0, aux_size=40, seed=0)
    model = p.LinenModel(mod.MLP(), nn.Dense(10))
    if a.sensitivity:
        return _sensitivity(p, model, data, optax, jax)
    lr = 0.0 if a.frozen else None
    chosen = {"adamw": None if lr is None else optax.adamw(0.0, weight_decay=1e-6),
              "sgd": (lambda r: optax.sgd(r)) if lr is None else optax.sgd(0.0),
              "momentum": (lambda r: optax.sgd(r, momentum=0.9)) if lr is None else optax.sgd(0.0, momentum=0.9)}
    names = a.vae_optimizers or ("momentum,adamw" if a.frozen else "adamw,sgd,momentum")
    tol = a.tol if a.tol is not None else (1e-6 if a.frozen else 1e-4)
    rounds, per_round = (3, 3) if a.frozen else (2, 2)   # check_method's defaults without --frozen
    if a.pure_defaults:
        conformance.local_training_compiler_options = lambda: None
    for name in names.split(","):
        config = p.FedFedConfig(local_epochs=1, batch_size=16, vae_optimizer=chosen[name],
                                **({} if lr is None else {"optimizer": optax.sgd(0.0), "feature_rounds": 10}))
        algo = p.FedFed(model, config)
        start = time.perf_counter()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always", p.RoundOffWarning)
            try:
                p.check_method(algo, data, checks="runner", tol=tol, rounds=rounds, clients_per_round=per_round)
                said = [str(w.message) for w in seen if issubclass(w.category, p.RoundOffWarning)]
                outcome = f"passes at tol {tol:g}" + (f" with a RoundOffWarning: {said[0]}" if said else "")
            except p.ProtocolError as e:
                outcome = "fails: " + str(e)
        print(f"VAE optimizer {name}{' (weights frozen)' if a.frozen else ''}: the runner check {outcome} "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
    return 0


def _sensitivity(p, model, data, optax, jax) -> int:
    import jax.numpy as jnp

    from pfedkdh_jax.engine.layout import Layout, local_training_compiler_options
    from pfedkdh_jax.engine.round import make_round
    algo = p.FedFed(model, p.FedFedConfig(local_epochs=1, batch_size=16, feature_rounds=10, optimizer=optax.sgd(0.0),
                                          vae_optimizer=optax.sgd(0.0, momentum=0.9)))
    features = algo.phases[0].algorithm
    round_ = jax.jit(make_round(features, Layout("sequential", "unrolled", chunk_steps=2)),
                     compiler_options=local_training_compiler_options())
    state = algo.init(jax.random.key(0), data)
    selected, key = jnp.asarray([1, 2, 3]), jax.random.key(7)
    base = round_(state, data, selected, key)[0].vae_opt
    leaves, tree = jax.tree_util.tree_flatten(state.vae["params"])
    for eps in (1e-7, 1e-6):
        moved = [x * (1 + eps * jax.random.normal(jax.random.key(i), x.shape)) for i, x in enumerate(leaves)]
        changed = state.replace(vae={"params": jax.tree_util.tree_unflatten(tree, moved),
                                     "batch_stats": state.vae["batch_stats"]})
        got = round_(changed, data, selected, key)[0].vae_opt
        print(f"the VAE's weights changed by a relative {eps:g}: its summed gradients (momentum buffers, weights "
              f"frozen) move by {_largest(got, base)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
