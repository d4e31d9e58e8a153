"""Bytes exchanged per selected client and round, counted from each method's ``messages`` shapes."""

import jax
import numpy as np

from pfedkdh_jax import algorithms
from pfedkdh_jax.engine.protocol import message_bytes
from pfedkdh_jax.model import CNN
from pfedkdh_jax.run.config import make_config


def nbytes(tree):
    return sum(np.asarray(x).nbytes for x in jax.tree_util.tree_leaves(tree))


def count(name, data, **kw):
    args = {"fedfed": (("vae_width", "8"),)}.get(name, ())
    cfg = make_config("smoke", method=name, rounds=20, method_args=args, **kw)
    return message_bytes(algorithms.build(cfg, data.num_classes), data, jax.random.key(0))


def test_every_method_counts_what_it_exchanges(tiny):
    _, _, data = tiny
    params = CNN(data.num_classes).init(jax.random.key(0), data.input_shape)
    body, head = nbytes(params["backbone"]), nbytes(params["head"])
    got = {name: count(name, data) for name in algorithms.METHODS}
    assert all(v is not None for v in got.values())
    whole = {"download": body + head, "upload": body + head}
    for name in ("fedavg", "fedprox", "ditto", "pfedme", "fedala", "pfedsim"):
        assert got[name] == whole, name
    for name in ("fedper", "fedrep", "fedbabu"):            # the head never travels
        assert got[name] == {"download": body, "upload": body}, name
    # pFedKDH: θ_g and the teacher head down, the backbone up; with averaged heads the head goes up too
    assert got["pfedkdh"] == {"download": body + head, "upload": body}
    assert count("pfedkdh", data, persistent_heads=False) == whole
    # FedProto: prototypes only, [classes, 512] float32 (+ flags down, counts up)
    assert 512 * 4 * data.num_classes <= got["fedproto"]["upload"] < body / 10
    # FedFed: f and the VAE in phase A, f alone in phase B
    assert got["fedfed"]["phase2"] == whole and got["fedfed"]["phase1"]["upload"] > body + head
