"""Shared fixtures: a tiny synthetic federation (fast to compile and run) and the real data dir."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

# One persistent compilation cache for the whole test run: many tests compile the same programs
# (the CNN's evaluation pieces, a run killed and resumed in a subprocess, the CLI smoke runs), and
# compiling is most of the suite's time. Set before jax is imported, so the xdist workers and every
# subprocess a test starts inherit it; a cache dir given by the caller is used as is.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:   # the first process of the run makes it and removes it
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="pfedkdh-test-xla-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
# One XLA:CPU device unless a test asks for more (in a subprocess): the CLI, called in-process by
# many tests and as a subprocess by others, would otherwise make one device per core
# (engine/layout.py: request_cpu_devices), so a test's devices would depend on which test ran first.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=1").strip()

import jax
import numpy as np
import pytest

from pfedkdh_jax.data import Partition, Pool, make_partition
from pfedkdh_jax.data.device import build_federated_data

jax.config.update("jax_numpy_rank_promotion", "raise")

# Compiling is most of the suite's time, and the Winograd form of conv2 (the model's ``auto`` on a CPU)
# compiles a training step 2–3× longer than XLA's convolution (about 1.2 s against 0.5 s; the suite ran
# 20 % longer with it). So the tests run in this process take XLA's convolution where they leave the form
# to ``auto``; tests/test_losses.py checks the Winograd form against XLA's (values, gradients, vmapped),
# the ``measured_conv_form`` fixture gives a test the real choice (the CLI's smoke run takes it), and the
# tests that start a subprocess run the real default unless they choose (test_reps_devices' device checks).
from pfedkdh_jax import model as _model  # noqa: E402

MEASURED_AUTO_CONV_FORM = _model.auto_conv_form
_model.auto_conv_form = lambda backend=None: "lax"


@pytest.fixture
def measured_conv_form(monkeypatch):
    """``auto`` as the package chooses it (Winograd on a CPU), not the suite's faster-compiling XLA form."""
    monkeypatch.setattr(_model, "auto_conv_form", MEASURED_AUTO_CONV_FORM)


@pytest.fixture(scope="module")
def measured_conv_form_module():
    """:func:`measured_conv_form` for a whole module: where runs in this process and in subprocesses meet
    (a run killed in a subprocess and resumed here must compute the same model)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_model, "auto_conv_form", MEASURED_AUTO_CONV_FORM)
        yield


def tfds_data_dir() -> str | None:
    """$TFDS_DATA_DIR, else the shared data dir next to the repository, else None."""
    env = os.environ.get("TFDS_DATA_DIR")
    if env and Path(env).is_dir():
        return env
    shared = Path(__file__).resolve().parents[2] / "shared" / "data" / "tfds"
    return str(shared) if shared.is_dir() else None


def synthetic_pool(n: int = 240, num_classes: int = 4, seed: int = 0) -> Pool:
    """Class-dependent blobs on 28×28×1 uint8 images: learnable, tiny, deterministic."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, num_classes, n).astype(np.int32)
    images = rng.integers(0, 60, (n, 28, 28, 1))
    for c in range(num_classes):
        r, q = divmod(c, 2)
        images[labels == c, 4 + 12 * r: 12 + 12 * r, 4 + 12 * q: 12 + 12 * q, 0] += 180
    return Pool(images=images.astype(np.uint8), labels=labels, num_classes=num_classes,
                name="synthetic", is_demo=True)


@pytest.fixture(scope="session")
def tiny():
    """(pool, partition, FederatedData) with 4 clients of ragged sizes."""
    pool = synthetic_pool()
    part: Partition = make_partition(pool.labels, num_clients=4, alpha=1.0, aux_size=40,
                                     min_client_samples=10, seed=0)
    return pool, part, build_federated_data(pool, part, eval_chunk=64)


# ``slow``: tests that take minutes on a 2-core CPU (FedFed's VAE through every layout, and the same
# with repetitions vmapped). The default command skips them so CI stays within its budget; run them
# with ``pytest --runslow`` (they pass there: see the closing notes of the commits that add them).
def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="also run the tests marked slow")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: minutes on a 2-core CPU; run with --runslow")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def registry():
    """The method registry (yielded) and the dataset registry as they were, after the test: a method or
    dataset registered by a test (or by an example it loads) stays for the process otherwise."""
    from pfedkdh_jax.algorithms import METHODS
    from pfedkdh_jax.data import sources
    tables = (METHODS, sources._REGISTERED, sources._LOADED, sources._MODELS, sources._PRESETS)
    before = [dict(t) for t in tables]
    yield METHODS
    for table, saved in zip(tables, before):
        table.clear()
        table.update(saved)
