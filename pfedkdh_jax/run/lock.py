"""A run directory belongs to one process at a time: ``run.lock`` in it names the process.

Taken before anything is written (``os.O_EXCL``: of two processes starting together exactly one
wins) and removed when the run ends, whether it finishes, fails or is interrupted. A lock whose
process is gone (killed; same host) is taken over; another process's live lock stops the second
``run``/``resume``/sweep with one line.
"""

from __future__ import annotations

import contextlib
import os
import socket

from pfedkdh_jax.run.config import ConfigError

LOCK = "run.lock"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _take(run_dir: str) -> str:
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, LOCK)
    me = f"{socket.gethostname()} {os.getpid()}"
    for _ in range(3):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileNotFoundError:   # the empty directory was just removed by a run that stopped early
            os.makedirs(run_dir, exist_ok=True)
            continue
        except FileExistsError:
            try:
                with open(path) as f:
                    host, pid = f.read().split()
            except (OSError, ValueError):
                host, pid = "", "0"
            if host == socket.gethostname() and not _alive(int(pid)):
                os.remove(path)   # its process is gone: a stale lock
                continue
            raise ConfigError(f"{run_dir} is in use by process {pid} on {host or 'an unknown host'} (its {LOCK}); "
                              "wait for that run to end or choose another --out") from None
        with os.fdopen(fd, "w") as f:
            f.write(me)
        return path
    raise ConfigError(f"{run_dir}: cannot take {LOCK}")


@contextlib.contextmanager
def locked(run_dirs):
    """Hold ``run.lock`` in every one of ``run_dirs`` for the duration of the block; a directory made
    here that the block left empty (a run stopped by a bad option or missing data before it wrote
    anything) is removed with its lock."""
    taken, made = [], []
    try:
        for d in run_dirs:
            made.append(_missing_dirs(d))
            taken.append(_take(d))
        yield
    finally:
        for path in taken:
            with contextlib.suppress(OSError):
                os.remove(path)
        for dirs in made:   # deepest first, each only if empty
            for d in dirs:
                try:
                    os.rmdir(d)
                except OSError:
                    break


def held_by_a_live_process(run_dir: str) -> bool:
    """Whether ``run_dir``'s ``run.lock`` names a process that is running (on this host; another host's
    lock counts as live)."""
    try:
        with open(os.path.join(run_dir, LOCK)) as f:
            host, pid = f.read().split()
    except (OSError, ValueError):
        return False
    return host != socket.gethostname() or _alive(int(pid))


def _missing_dirs(path: str) -> list[str]:
    """``path`` and those of its parents that do not exist yet, deepest first (what taking its lock makes)."""
    out, d = [], os.path.abspath(path)
    while not os.path.exists(d):
        out.append(d)
        parent = os.path.dirname(d)
        if parent == d:
            break
        d = parent
    return out
