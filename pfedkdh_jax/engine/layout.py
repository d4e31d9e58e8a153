"""How clients and local steps are laid out on a backend: measured choices, not assumptions.

* ``client_parallel``: ``"vmap"`` runs all selected clients in one batched computation (stacked state,
  leading client axis ``[C, ...]``); ``"sequential"`` runs them one after another with the same
  compiled function.
* ``step_loop``: ``"scan"`` loops the local steps with ``lax.scan`` inside one compiled call;
  ``"unrolled"`` compiles a chunk of ``chunk_steps`` unrolled steps once and calls it as often as
  needed, chained on the device without host synchronisation.
* ``lanes``: with ``vmap`` + ``scan``, pack the round's jobs into this many lanes of near-equal local
  work instead of giving every client the largest client's steps (:mod:`pfedkdh_jax.engine.packing`).

On XLA:CPU a convolution inside a while loop is ~15–20× slower than the same steps unrolled, so the CPU
default is sequential + unrolled; on GPU/TPU the default is vmap + scan, one compiled call per round.
All forms compute the same numbers (tests check it). BENCHMARKS.md has the figures.
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax

CLIENT_PARALLEL = ("vmap", "sequential")
STEP_LOOPS = ("scan", "unrolled")


@dataclasses.dataclass(frozen=True)
class Layout:
    """How clients and local steps are laid out. ``None`` fields take the backend's default."""

    client_parallel: str | None = None   # "vmap" | "sequential"
    step_loop: str | None = None         # "scan" | "unrolled"
    chunk_steps: int = 8                 # steps per compiled chunk when step_loop == "unrolled"
    lanes: int | None = None             # pack each round's (run, client) jobs into this many lanes
                                         # (engine/packing.py; vmap + scan only); None: one per job

    def resolved(self, backend: str | None = None) -> "Layout":
        backend = backend or jax.default_backend()
        cpu = backend == "cpu"
        cfg = dataclasses.replace(
            self,
            client_parallel=self.client_parallel or ("sequential" if cpu else "vmap"),
            step_loop=self.step_loop or ("unrolled" if cpu else "scan"))
        if cfg.client_parallel not in CLIENT_PARALLEL:
            raise ValueError(f"client_parallel must be one of {CLIENT_PARALLEL}, got {cfg.client_parallel!r}")
        if cfg.step_loop not in STEP_LOOPS:
            raise ValueError(f"step_loop must be one of {STEP_LOOPS}, got {cfg.step_loop!r}")
        if cfg.chunk_steps < 1:
            raise ValueError(f"chunk_steps must be >= 1, got {cfg.chunk_steps}")
        if cfg.lanes is not None:
            if cfg.lanes < 1:
                raise ValueError(f"lanes must be >= 1, got {cfg.lanes}")
            if (cfg.client_parallel, cfg.step_loop) != ("vmap", "scan"):
                raise ValueError("lanes packs vmapped clients inside one compiled round: it needs "
                                 f"client_parallel='vmap' and step_loop='scan' (got {cfg.client_parallel!r}, "
                                 f"{cfg.step_loop!r})")
        return cfg


# XLA:CPU option that turns off its YNNPACK library calls (on by default in jaxlib 0.10).
_YNN_OPTION = "xla_cpu_experimental_ynn_fusion_type"


def local_training_compiler_options(backend: str | None = None) -> dict | None:
    """``jax.jit`` compiler options for the compiled calls that take local SGD steps of the CNN.

    On XLA:CPU these calls compile without YNNPACK (``xla_cpu_experimental_ynn_fusion_type`` empty):
    measured on the 2-core machine, a batch-64 training step ran 1.4× (MNIST) and 2.2× (CIFAR-10)
    faster without it, while large-batch forward passes (evaluation, the teacher's D_s features) ran
    up to 3× faster *with* it on MNIST shapes (BENCHMARKS.md, "CPU against PyTorch"), so those
    keep XLA's default. ``None`` (XLA's defaults) on other backends, and when the user's
    ``XLA_FLAGS`` already set the option (theirs wins).
    """
    if (backend or jax.default_backend()) != "cpu" or _YNN_OPTION in os.environ.get("XLA_FLAGS", ""):
        return None
    return {_YNN_OPTION: ""}


def num_chunks(steps: int, chunk_steps: int) -> int:
    return max(1, math.ceil(steps / chunk_steps))


