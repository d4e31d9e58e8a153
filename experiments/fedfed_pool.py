"""What FedFed's shared pool carries, read from a finished run's newest checkpoint.

FedFed's phase B trains FedAvg on each client's own images plus as many draws from the pool of
sensitive features ``x − x_r + N(0, σ²)`` (σ = 0.15 and 0.25, in [0, 1] pixel units; method.md §5.2).
How much that helps depends on how much of an image's class survives in the features. This script
reports, for the run's partition:

* the inputs f sees: the clients' own images (normalised to [−1, 1]) and the pool's features (in the
  run's ``feature_range``), their mean, spread and background (the top-left 3×3 corner);
* the spread of the noise-free features ``x − x_r`` (the global VAE, eval mode) against the images';
* the global f of the checkpoint on the clients' test images and on the pool;
* a fresh CNN (the run's model and client optimizer, batch 64) trained ``--epochs`` on the pool alone,
  on the same features in the other range (``2s − 1`` of a default run's pool, the features on [0, 1]
  pixels of a ``feature_range=images`` run's), and on the noise-free features (on [0, 1] pixels),
  each scored on the clients' test images: how far the pool's knowledge transfers to real images.

    python experiments/fedfed_pool.py RUN_DIR [--epochs 1] [--write runs/fedfed_pool.json]

RUN_DIR is a FedFed run directory with a checkpoint from phase B (the pool is built entering it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pfedkdh_jax import from_arrays
from pfedkdh_jax.algorithms import common as C
from pfedkdh_jax.data.device import gather_inputs
from pfedkdh_jax.engine.protocol import logits
from pfedkdh_jax.run.checkpoint import Checkpoints, fingerprint
from pfedkdh_jax.run.experiment import load_run_config, make_algorithm, prepare_data


def spread(x: np.ndarray) -> dict:
    return {"mean": round(float(x.mean()), 4), "std": round(float(x.std()), 4),
            "background": round(float(x[:, :3, :3].mean()), 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("--epochs", type=int, default=1, help="epochs of each fresh CNN (default 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--write", help="also write the figures to this JSON file")
    args = ap.parse_args()

    cfg = load_run_config(args.run_dir)
    if cfg.method != "fedfed":
        raise SystemExit(f"{args.run_dir} is a {cfg.method} run, not a FedFed one")
    pool, part, _ = prepare_data(cfg)
    data = from_arrays(pool.images, pool.labels, partition=part, num_classes=pool.num_classes,
                       normalize=pool.normalize, eval_chunk=cfg.eval_chunk)
    algo = make_algorithm(cfg, pool.num_classes, "lax")
    target = algo.init(jax.random.key(0), data)
    got = Checkpoints(args.run_dir, fingerprint(cfg.to_dict(), part)).restore_latest(target)
    if got is None:
        raise SystemExit(f"{args.run_dir} holds no readable checkpoint")
    rnd, state, _ = got
    valid = np.asarray(state.pool_valid)
    if not valid.any():
        raise SystemExit(f"the checkpoint of round {rnd} is from phase A: the pool is built entering phase B")
    model = algo.model
    pool_x = np.asarray(state.pool_x, np.float32)[valid]
    pool_y = np.asarray(state.pool_y)[valid]
    test_idx = jnp.asarray(np.concatenate([np.asarray(t) for t in part.test_idx]))
    x_test, y_test = (np.asarray(a) for a in gather_inputs(data, test_idx))
    train_idx = jnp.asarray(np.concatenate([np.asarray(t) for t in part.train_idx]))
    x_train, y_train = (np.asarray(a) for a in gather_inputs(data, train_idx))
    quiet = dataclasses.replace(algo, config=dataclasses.replace(algo.config, noise_std=(0.0, 0.0)))
    features = jax.jit(quiet.sensitive_features)
    clean = np.concatenate([np.asarray(features(state.vae, data, train_idx[i:i + 2048], jax.random.key(0))[0])
                            for i in range(0, len(train_idx), 2048)])

    predict = jax.jit(lambda p, x: jnp.argmax(logits(model, p, x), -1))

    def accuracy(params, x, y) -> float:
        pred = np.concatenate([np.asarray(predict(params, jnp.asarray(x[i:i + 2048]))) for i in range(0, len(x), 2048)])
        return round(float((pred == y).mean()), 4)

    tx = C.client_tx(algo.config)   # the run's optimizer at its lr (the paper preset: plain SGD)
    loss = C.cross_entropy_loss(model)

    @jax.jit
    def step(params, opt, x, y, key):
        g = jax.grad(loss)(params, None, x, y, jnp.ones(y.shape), key)
        u, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, u), opt

    def fresh_cnn(x, y) -> list[float]:
        """Test accuracy after each epoch of a fresh CNN trained on (x, y) alone."""
        params = model.init(jax.random.key(args.seed), x.shape[1:])
        opt = tx.init(params)
        rng = np.random.default_rng(args.seed)
        out = []
        for e in range(args.epochs):
            order = rng.permutation(len(x))
            for i in range(0, len(x), 64):
                b = order[i:i + 64]
                params, opt = step(params, opt, jnp.asarray(x[b]), jnp.asarray(y[b]), jax.random.key(e * 10**6 + i))
            out.append(accuracy(params, x_test, y_test))
        return out

    images_range = algo.config.feature_range == "images"   # the pool holds 2s − 1 (the default: s)
    other = (pool_x + 1) / 2 if images_range else 2 * pool_x - 1
    t0 = time.time()
    report = {
        "run_dir": args.run_dir, "round": rnd, "epochs": args.epochs, "feature_range": algo.config.feature_range,
        "own_images": spread(x_train), "pool_features": spread(pool_x),
        "clean_features_unit": spread(clean), "images_unit_std": round(float(((x_train + 1) / 2).std()), 4),
        "noise_std": list(algo.config.noise_std),
        "global_f": {"test_images": accuracy(state.params, x_test, y_test),
                     "pool": accuracy(state.params, pool_x, pool_y)},
        "fresh_cnn_test_accuracy": {
            "pool": fresh_cnn(pool_x, pool_y),
            "pool_in_the_other_range": fresh_cnn(other, pool_y),
            "clean_features": fresh_cnn(clean, y_train),
            "own_images": fresh_cnn(x_train, y_train),
        },
    }
    report["seconds"] = round(time.time() - t0, 1)
    print(json.dumps(report, indent=1))
    if args.write:
        with open(args.write, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
