"""XLA:CPU host devices for spreading sequential clients (``Layout.client_devices``), asked for
before JAX starts its backends. No JAX import here: the CLI calls this before it validates its input.
"""

from __future__ import annotations

import os
import sys

# Measured on the 2-core machine (BENCHMARKS.md, "CPU against PyTorch"); more is unmeasured.
CPU_DEVICES_DEFAULT_MAX = 2
_COUNT_FLAG = "--xla_force_host_platform_device_count"


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
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        n = max(1, min(cores, CPU_DEVICES_DEFAULT_MAX))
    os.environ["XLA_FLAGS"] = f"{flags} {_COUNT_FLAG}={n}".strip()
    return n


def request_for_client_devices(client_devices: int | None) -> int | None:
    """:func:`request_cpu_devices` for a run's ``--client-devices``: at least that many host devices and
    at least ``CPU_DEVICES_DEFAULT_MAX`` (2; a smaller ``client_devices`` uses only some of them)."""
    return request_cpu_devices(max(client_devices, CPU_DEVICES_DEFAULT_MAX) if client_devices else None)
