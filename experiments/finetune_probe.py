"""Fine-tune chosen clients of a saved run by hand, epoch by epoch: loss, gradient norm and test accuracy.

Written to explain FedBABU's final-round drop on MNIST α = 0.05 (the results page's "final-round swings"):
its evaluation fine-tunes the whole global model on each client's train split (``finetune_epochs`` = 5,
plain SGD at the run's learning rate and batch size), and this script does the same outside the engine,
from a checkpoint of the run, for a few clients, printing what each epoch does.

    python experiments/finetune_probe.py RUN_DIR --round 50 --clients 3,12,2 --data-dir ../shared/data/tfds

RUN_DIR is a run (or sweep point) directory with ``config.json`` and ``checkpoints/round_NNNNNN``; the
checkpoint must hold a shared model (FedAvg, FedProx, FedBABU: the global backbone and head). The batch
order and dropout keys are this script's own, so a client's figures can differ from the engine's where
it has more than one batch.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir")
    p.add_argument("--round", type=int, required=True, help="the checkpoint's round")
    p.add_argument("--clients", required=True, help="comma-separated client ids")
    p.add_argument("--epochs", type=int, default=5, help="fine-tuning epochs (FedBABU's default 5)")
    p.add_argument("--momentum", type=float, default=0.0, help="SGD momentum (the engine's fine-tuning: none)")
    p.add_argument("--data-dir", default=os.environ.get("TFDS_DATA_DIR"))
    a = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from pfedkdh_jax.model import CNN
    from pfedkdh_jax.run.experiment import load_run_config, prepare_data

    cfg = load_run_config(a.run_dir, data_dir=a.data_dir)
    pool, part, _ = prepare_data(cfg)
    model = CNN(pool.num_classes)
    template = model.init(jax.random.key(0), (1, *pool.images.shape[1:]))
    leaves, treedef = jax.tree_util.tree_flatten(template)
    path = os.path.join(a.run_dir, "checkpoints", f"round_{a.round:06d}", "state", "leaves.npz")
    with np.load(path) as z:   # a shared-model state: the model's leaves, then the round counter
        if len(z.files) != len(leaves) + 1:
            raise SystemExit(f"{path}: {len(z.files)} arrays, not a shared model's {len(leaves)} + 1")
        params = jax.tree_util.tree_unflatten(treedef, [jnp.asarray(z[f"arr_{i}"]) for i in range(len(leaves))])

    def arrays(idx):
        x = pool.images[idx]
        x = x.astype(np.float32) / 127.5 - 1.0 if x.dtype == np.uint8 else x.astype(np.float32)
        return jnp.asarray(x), jnp.asarray(pool.labels[idx])

    def accuracy(params, x, y) -> float:
        return float((jnp.argmax(model.logits(params, x), -1) == y).mean())

    tx = optax.sgd(cfg.lr, momentum=a.momentum or None)

    @jax.jit
    def step(params, opt, x, y, key):
        def loss(params):
            return optax.softmax_cross_entropy_with_integer_labels(model.logits(params, x, rng=key), y).mean()
        value, grads = jax.value_and_grad(loss)(params)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, value, optax.global_norm(grads)

    print(f"{cfg.method}, {cfg.dataset} α = {cfg.alpha:g}, round {a.round}: SGD lr {cfg.lr}, momentum {a.momentum}, batch "
          f"{cfg.batch_size}, {a.epochs} epochs, whole model")
    for c in (int(s) for s in a.clients.split(",")):
        xtr, ytr = arrays(part.train_idx[c])
        xte, yte = arrays(part.test_idx[c])
        p, opt, key = params, tx.init(params), jax.random.key(c)
        out = [f"client {c} ({len(ytr)} train, {len(yte)} test): before {accuracy(p, xte, yte):.2f}"]
        for epoch in range(a.epochs):
            order = np.asarray(jax.random.permutation(jax.random.fold_in(key, epoch), len(ytr)))
            for b in range(0, len(ytr), cfg.batch_size):
                batch = order[b:b + cfg.batch_size]
                p, opt, value, norm = step(p, opt, xtr[batch], ytr[batch], jax.random.fold_in(key, 1000 * epoch + b))
            out.append(f"epoch {epoch + 1}: loss {float(value):.2f}, |grad| {float(norm):.1f}, "
                       f"test {accuracy(p, xte, yte):.2f}")
        print("; ".join(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
