"""XLA:CPU host devices for spreading sequential clients (``Layout.client_devices``), asked for
before JAX starts its backends. No JAX import here: the CLI calls this before it validates its input.
"""

from __future__ import annotations

import os
import sys

# Measured on the 2-core machine (BENCHMARKS.md, "CPU against PyTorch"); more is unmeasured.
CPU_DEVICES_DEFAULT_MAX = 2
_COUNT_FLAG = "--xla_force_host_platform_device_count"


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the platform tells it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def request_cpu_devices(n: int | None = None) -> int | None:
    """Ask XLA:CPU for ``n`` host devices (default: one per usable core, at most
    ``CPU_DEVICES_DEFAULT_MAX``) by extending ``XLA_FLAGS``, so that sequential clients can be spread
    over them (``Layout.client_devices``). Only possible before JAX initialises its backends; returns
    the count asked for, or ``None`` where nothing was changed (the user's ``XLA_FLAGS`` already set
    a count, or JAX's backends are already up). Imports nothing heavy.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if _COUNT_FLAG in flags:
        return None
    if "jax" in sys.modules:
        try:
            from jax._src import xla_bridge
            if xla_bridge.backends_are_initialized():
                return None
        except (ImportError, AttributeError):   # private API moved: the flag may come too late
            pass
    if n is None:
        n = max(1, min(usable_cores(), CPU_DEVICES_DEFAULT_MAX))
    os.environ["XLA_FLAGS"] = f"{flags} {_COUNT_FLAG}={n}".strip()
    return n


def request_for_client_devices(client_devices: int | None) -> int | None:
    """:func:`request_cpu_devices` for a run's ``--client-devices``: at least that many host devices and
    at least ``CPU_DEVICES_DEFAULT_MAX`` (2; a smaller ``client_devices`` uses only some of them)."""
    return request_cpu_devices(max(client_devices, CPU_DEVICES_DEFAULT_MAX) if client_devices else None)


def oversubscribed(devices: int) -> str | None:
    """A one-line note where sequential clients spread over ``devices`` XLA:CPU devices share fewer
    cores (a device's clients then wait for a core), else None."""
    cores = usable_cores()
    if devices > cores:
        return (f"sequential clients spread over {devices} XLA:CPU devices that share the {cores} core(s) this "
                f"process may use (one device per core: the choice measured on 2 cores; --client-devices {cores})")
    return None
