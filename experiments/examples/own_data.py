"""Example (f): a dataset of your own in runs, sweeps and the command line.

    pfedkdh run --plugin experiments/examples/own_data.py --dataset stripes --method fedper
    python experiments/examples/own_data.py          # the same from Python: FedPer and FedAvg, 10 rounds

``register_dataset(name, load)`` names a function that returns a ``Pool`` (``pool_from_arrays`` of your
arrays: images as uint8 pixels, or any float features with a model that takes them); a run partitions
it like MNIST (Dirichlet over ``--alpha``, ``--clients``, D_s of ``--aux-size`` drawn first), and
``--plugin`` names this file (kept in the run's config.json, so ``pfedkdh resume`` finds it). Its
``preset`` gives the options every preset takes for it: here a D_s of 500, the presets' 5000 being
most of this pool of 6000.

The dataset here is generated, so the example runs anywhere: "stripes", 28×28 grey images of sine
gratings whose class sets the orientation and frequency, under noise and a random phase.
"""

from __future__ import annotations

import argparse

import numpy as np

import pfedkdh_jax as p


def stripes(num_samples: int = 6000, num_classes: int = 10, seed: int = 0) -> p.Pool:
    """Sine gratings: class c has orientation c·π/num_classes and 2 + c % 3 periods across the image."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, num_classes, num_samples).astype(np.int32)
    yy, xx = np.mgrid[0:28, 0:28].astype(np.float32) / 28.0
    angle = labels * np.pi / num_classes
    freq = 2.0 + labels % 3
    phase = rng.uniform(0, 2 * np.pi, num_samples)
    along = np.cos(angle)[:, None, None] * xx + np.sin(angle)[:, None, None] * yy
    wave = np.sin(2 * np.pi * freq[:, None, None] * along + phase[:, None, None])
    pixels = 127.5 + 70.0 * wave + rng.normal(0.0, 50.0, wave.shape)
    images = np.clip(pixels, 0, 255).astype(np.uint8)[..., None]
    return p.pool_from_arrays(images, labels, num_classes=num_classes)


p.register_dataset("stripes", stripes, preset=dict(aux_size=500))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--out", default="runs/own-data")
    a = ap.parse_args(argv)
    out = {}
    for method in ("fedper", "fedavg"):
        cfg = p.make_config(dataset="stripes", method=method, rounds=a.rounds, num_clients=a.clients, alpha=0.3,
                            local_epochs=1, eval_every=a.rounds, out=f"{a.out}/{method}")
        summary = p.run(cfg, progress=False, log=lambda *_: None)
        metric = p.METHODS[method].table_metric
        out[method] = summary[metric]
        print(f"{method}: {a.rounds} rounds on stripes, {a.clients} clients, α = 0.3: {metric} {summary[metric]:.4f}")
    return out


if __name__ == "__main__":
    main()
