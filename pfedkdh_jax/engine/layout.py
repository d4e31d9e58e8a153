"""How clients and local steps are laid out on a backend: measured choices, not assumptions.

* ``client_parallel``: ``"vmap"`` runs all selected clients in one batched computation (stacked state,
  leading client axis ``[C, ...]``); ``"sequential"`` runs them one after another with the same
  compiled function.
* ``step_loop``: ``"scan"`` loops the local steps with ``lax.scan`` inside one compiled call;
  ``"unrolled"`` compiles a chunk of ``chunk_steps`` unrolled steps once and calls it as often as
  needed, chained on the device without host synchronisation.
* ``lanes``: with ``vmap`` + ``scan``, pack the round's jobs into this many lanes of near-equal local
  work instead of giving every client the largest client's steps (:mod:`pfedkdh_jax.engine.packing`).
* ``client_devices``: with ``sequential`` clients, spread a round's clients over this many local
  devices (longest first, each to the least loaded device); on a CPU these are the XLA:CPU devices
  of ``--xla_force_host_platform_device_count`` (which the CLI sets to one per core, up to 2:
  :func:`pfedkdh_jax.engine.cpu_devices.request_cpu_devices`). The same compiled code runs on every device, so the numbers are the
  ones of one device.
* ``slot_granule``: in the host plans (``unrolled`` steps), each step computes the samples of its
  batch rounded up to this multiple (exactly that many below one multiple) instead of a full batch:
  a client's partial last batch of an epoch, and every step of a client smaller than a batch
  (:func:`pfedkdh_jax.engine.local.step_widths`): what many small clients cost follows their
  samples. ``None``: every step computes a full batch. Each width compiles its own pieces once:
  ``"auto"`` (the default) takes ``AUTO_GRANULE`` for the widths whose saving over the run pays for
  that, as told by the runner's :class:`Workload` (:func:`pfedkdh_jax.engine.local.paying_widths`):
  a short run computes full batches, a long run of many small clients narrows them all; a runner
  told no workload computes full batches. An integer narrows every width it gives.
* ``fused_steps``: in the sequential host plan, a client of at most this many local steps runs from
  start to finish (its start, every step, its finish) as one compiled call, made once per step plan
  (the widths of its steps), instead of a call per piece: what a round of thousands of clients of a
  handful of samples costs is then mostly their steps, not the host's calls between them.
  ``"auto"`` (the default): up to ``chunk_steps`` steps, for the plans whose saving over the run pays
  their compile (:func:`pfedkdh_jax.engine.local.fused_plan_pays`, told by the :class:`Workload`);
  an integer: every plan of at most that many steps; ``0``: none.

On XLA:CPU a convolution inside a while loop is 20–32× slower than the same steps unrolled (the lax form;
a matmul over patches is not slowed: BENCHMARKS.md, 'Convolutions inside loops'), so the CPU
default is sequential + unrolled; on GPU/TPU the default is vmap + scan, one compiled call per round.
All forms compute the same numbers (tests check it). BENCHMARKS.md has the figures.
"""

from __future__ import annotations

import dataclasses
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
    client_devices: int | None = None    # sequential clients spread over this many local devices;
                                         # None: every local device with sequential clients, else 1
    slot_granule: int | str | None = "auto"  # host plans: a step computes its batch's size rounded
                                         # up to this multiple; None: a full batch every step; "auto":
                                         # AUTO_GRANULE for the widths that pay (with a Workload)
    fused_steps: int | str = "auto"      # sequential clients of at most this many steps: one compiled call
                                         # each; "auto": the plans that pay (with a Workload); 0: none

    def __post_init__(self):
        # the two names a typo would otherwise carry to the first round (the rest: resolved())
        for field, allowed in (("client_parallel", CLIENT_PARALLEL), ("step_loop", STEP_LOOPS)):
            value = getattr(self, field)
            if value is not None and value not in allowed:
                raise ValueError(f"Layout({field}={value!r}): must be one of {allowed} or None (the backend's default)")

    def resolved(self, backend: str | None = None) -> "Layout":
        backend = backend or jax.default_backend()
        cpu = backend == "cpu"
        cfg = dataclasses.replace(
            self,
            client_parallel=self.client_parallel or ("sequential" if cpu else "vmap"),
            step_loop=self.step_loop or ("unrolled" if cpu else "scan"))
        local = len(jax.local_devices(backend=backend))
        if cfg.client_devices is None:
            cfg = dataclasses.replace(cfg, client_devices=local if cfg.client_parallel == "sequential" else 1)
        if not 1 <= cfg.client_devices <= local:
            raise ValueError(f"client_devices must be between 1 and the {local} local {backend} device(s); "
                             f"got {cfg.client_devices}")
        if cfg.client_devices > 1 and cfg.client_parallel != "sequential":
            raise ValueError(f"client_devices={cfg.client_devices} spreads sequential clients over devices: "
                             f"it needs client_parallel='sequential' (got {cfg.client_parallel!r})")
        if cfg.client_parallel not in CLIENT_PARALLEL:
            raise ValueError(f"client_parallel must be one of {CLIENT_PARALLEL}, got {cfg.client_parallel!r}")
        if cfg.step_loop not in STEP_LOOPS:
            raise ValueError(f"step_loop must be one of {STEP_LOOPS}, got {cfg.step_loop!r}")
        if cfg.chunk_steps < 1:
            raise ValueError(f"chunk_steps must be >= 1, got {cfg.chunk_steps}")
        if cfg.slot_granule is not None and cfg.slot_granule != "auto" and (
                not isinstance(cfg.slot_granule, int) or cfg.slot_granule < 1):
            raise ValueError(f"slot_granule must be 'auto', an int >= 1 or None, got {cfg.slot_granule!r}")
        if cfg.fused_steps != "auto" and (not isinstance(cfg.fused_steps, int) or isinstance(cfg.fused_steps, bool)
                                          or cfg.fused_steps < 0):
            raise ValueError(f"fused_steps must be 'auto' or an int >= 0, got {cfg.fused_steps!r}")
        if cfg.lanes is not None:
            if cfg.lanes < 1:
                raise ValueError(f"lanes must be >= 1, got {cfg.lanes}")
            if (cfg.client_parallel, cfg.step_loop) != ("vmap", "scan"):
                raise ValueError("lanes packs vmapped clients inside one compiled round: it needs "
                                 f"client_parallel='vmap' and step_loop='scan' (got {cfg.client_parallel!r}, "
                                 f"{cfg.step_loop!r})")
        return cfg


AUTO_GRANULE = 8   # slot_granule="auto": this granule, for the widths whose saving pays their compile


@dataclasses.dataclass(frozen=True)
class Workload:
    """How much a run will ask of a runner, told to it so that it compiles only what pays: the narrow
    step widths of ``Layout.slot_granule`` whose expected saving covers their compile time.

    ``rounds``: the rounds the runner will train (of a phased method, all phases together);
    ``clients_per_round``: the clients each trains; ``evaluations``: the evaluations that
    personalize every client on images (fine-tuning methods), at most one a round."""

    rounds: int
    clients_per_round: int
    evaluations: int = 0

    def visits(self, num_clients: int) -> float:
        """How often each of ``num_clients`` clients trains over the rounds, on average."""
        return self.rounds * self.clients_per_round / max(num_clients, 1)


# XLA:CPU's choice of the operations it hands to its YNNPACK library (all kinds by default in jaxlib 0.10).
_YNN_OPTION = "xla_cpu_experimental_ynn_fusion_type"
# Local training hands it single dots and reductions only: no convolutions, no elementwise fusions.
_YNN_TRAINING = "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT,LIBRARY_FUSION_TYPE_REDUCE"


def local_training_compiler_options(backend: str | None = None) -> dict | None:
    """``jax.jit`` compiler options for the compiled calls that take local SGD steps of the CNN.

    On XLA:CPU these calls give YNNPACK (``xla_cpu_experimental_ynn_fusion_type``) only single dots and
    reductions. Measured on the 2-core machine, a batch-64 training step with YNNPACK's default set
    ran 1.4× (MNIST) and 2.2× (CIFAR-10) slower than with none (its convolutions and elementwise
    fusions are the slow part: 0.4× and 0.6× of none on CIFAR-10 shapes), and with dots and
    reductions only 1.15–1.17× faster than with none (a round 13 % faster on MNIST), while
    large-batch forward passes (evaluation, the teacher's D_s features) ran up to 3× faster with the
    default set on MNIST shapes, so those keep XLA's default (BENCHMARKS.md, "CPU against PyTorch").
    ``None`` (XLA's defaults) on other backends, and when the user's ``XLA_FLAGS`` already set the
    option (theirs wins).
    """
    if (backend or jax.default_backend()) != "cpu" or _YNN_OPTION in os.environ.get("XLA_FLAGS", ""):
        return None
    return {_YNN_OPTION: _YNN_TRAINING}


