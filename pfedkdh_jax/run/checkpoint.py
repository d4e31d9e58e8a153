"""Atomic checkpoints of a run, with fall-back to the previous good one.

Layout: ``RUN_DIR/checkpoints/round_000012/{state/leaves.npz, meta.json}``. A checkpoint is written
under a temporary name and renamed into place only once complete, so a process killed mid-save leaves no
half checkpoint under a real name (leftover temporaries are removed on the next save). ``meta.json``
holds the round, the run's fingerprint (config and partition hashes) and the metrics rows so far;
the state pytree (server state, every client's persistent state, optimizer states) is a host pytree
whose leaves go, in flattening order, into one ``.npz`` (its structure is the run's own: restoring
checks every leaf's shape and dtype against it). Each process writes only its own runs' files, so
a sweep split over the processes of a ``jax.distributed`` job checkpoints as a single process does
(orbax, used before, writes numpy leaves from process 0 alone there); checkpoints written by orbax
(a ``state/`` folder without ``leaves.npz``) are still read. The random keys of a run are derived
from its seeds and the round number, so the round counter restores them exactly.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
import zipfile
from typing import Any

import jax
import numpy as np

PREFIX = "round_"
# Settings that may differ between the run that wrote a checkpoint and the one resuming it.
# client_devices: the same compiled code on other devices of the host (the same numbers);
# conv_form: the same model computed another way (the same numbers up to float rounding; and runs
# checkpointed before the option existed stay resumable)
_NOT_FINGERPRINTED = ("out", "data_dir", "cache_dir", "rounds", "eval_chunk", "client_devices", "conv_form",
                      "slot_granule", "fused_steps",   # engine forms: the same steps, other float rounding
                      "plugins")                       # where a method of one's own lives (a path), not what it does


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used for this run; the message says why."""


# options added after checkpoints were first written: left out of the hash at these (their defaults,
# the behaviour before they existed), so a checkpoint written before them still resumes
_ADDED_LATER = {"optimizer": "sgd", "momentum": None, "weight_decay": None, "partition": "dirichlet",
                "shards_per_client": 2, "fill": "auto", "eval_clients": 0, "per_round": 0,
                "synthetic_samples": 70_000}


def fingerprint(config: dict, partition) -> dict[str, str]:
    """Hashes of what a checkpoint depends on: the config (less paths/length) and the partition."""
    cfg = {k: v for k, v in sorted(config.items()) if k not in _NOT_FINGERPRINTED
           and not (k in _ADDED_LATER and v == _ADDED_LATER[k])}
    h = hashlib.sha256()
    for arr in (partition.aux_idx, *partition.train_idx, *partition.test_idx):
        h.update(np.asarray(arr, np.int64).tobytes())
        h.update(b"|")
    return {"config": hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()[:16],
            "partition": h.hexdigest()[:16], "dataset": str(config.get("dataset")),
            "method": str(config.get("method"))}


class Checkpoints:
    """Save and restore the checkpoints of one run directory."""

    def __init__(self, run_dir: str, fp: dict[str, str], keep: int = 2, log=print):
        self.dir = os.path.join(run_dir, "checkpoints")
        self.fp = fp
        self.keep = keep
        self.log = log

    def rounds(self) -> list[int]:
        if not os.path.isdir(self.dir):
            return []
        out = []
        for name in os.listdir(self.dir):
            if name.startswith(PREFIX) and name[len(PREFIX):].isdigit():
                out.append(int(name[len(PREFIX):]))
        return sorted(out)

    def save(self, round_: int, state: Any, history: list[dict]) -> str:
        os.makedirs(self.dir, exist_ok=True)
        for name in os.listdir(self.dir):  # debris of a save that was killed
            if name.startswith(".tmp-"):
                shutil.rmtree(os.path.join(self.dir, name), ignore_errors=True)
        final = os.path.join(self.dir, f"{PREFIX}{round_:06d}")
        tmp = os.path.join(self.dir, f".tmp-{PREFIX}{round_:06d}")
        os.makedirs(tmp)
        os.makedirs(os.path.join(tmp, "state"))
        with open(os.path.join(tmp, "state", LEAVES), "wb") as f:
            np.savez(f, *_host_leaves(state))
            f.flush()
            os.fsync(f.fileno())
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump({"round": round_, "fingerprint": self.fp, "history": history}, f)
            f.flush()
            os.fsync(f.fileno())
        pause = float(os.environ.get("PFEDKDH_TEST_SAVE_PAUSE", "0"))  # lets tests kill mid-save
        if pause:
            time.sleep(pause)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.rename(tmp, final)
        for old in self.rounds()[:-self.keep]:
            shutil.rmtree(os.path.join(self.dir, f"{PREFIX}{old:06d}"), ignore_errors=True)
        return final

    def check_fingerprint(self, meta: dict, where: str) -> None:
        theirs = meta.get("fingerprint", {})
        diff = [k for k in ("dataset", "method", "partition", "config") if theirs.get(k) != self.fp.get(k)]
        if diff:
            raise CheckpointError(
                f"checkpoint {where} was written with a different {', '.join(diff)} "
                f"({', '.join(f'{k}: {theirs.get(k)} vs {self.fp.get(k)}' for k in diff)}); "
                "resume it with its own config (pfedkdh resume RUN_DIR) or use another --out")

    def restore_latest(self, target: Any, upto: int | None = None) -> tuple[int, Any, list[dict]] | None:
        """The newest readable checkpoint (of round ``upto`` at most, if given) as ``(round, state,
        history)``; ``None`` if there is none.

        A checkpoint whose files are unreadable is skipped with a message naming it; one written for
        another config or partition is refused (:class:`CheckpointError`).
        """
        for r in reversed([r for r in self.rounds() if upto is None or r <= upto]):
            path = os.path.join(self.dir, f"{PREFIX}{r:06d}")
            try:
                with open(os.path.join(path, "meta.json")) as f:
                    meta = json.load(f)
            except (OSError, ValueError) as e:
                self.log(f"checkpoint {path} is unreadable ({type(e).__name__}); trying the previous one")
                continue
            self.check_fingerprint(meta, path)
            try:
                state = _read_state(os.path.join(path, "state"), target)
            except Exception as e:  # numpy (or orbax, for an old checkpoint) raises many types for bad files
                self.log(f"checkpoint {path} is corrupt ({type(e).__name__}: {str(e)[:120]}); "
                         "falling back to the previous one")
                continue
            return int(meta["round"]), state, list(meta["history"])
        return None


LEAVES = "leaves.npz"


def save_state(path: str, state: Any) -> str:
    """Writes ``state`` (any pytree of arrays: a method's state, stacked runs' states, your loop's
    carry) to the file ``path`` (``.npz``; its leaves in flattening order, typed random keys as their
    key data), atomically: written under a temporary name, renamed when complete, so a process killed
    mid-save leaves the previous file whole. Returns ``path``. :func:`load_state` reads it back."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".tmp-{os.path.basename(path)}")
    leaves = _host_leaves(state)
    try:
        with open(tmp, "wb") as f:
            np.savez(f, *leaves)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):   # a save that failed leaves no temporary behind
            os.remove(tmp)
    return path


def load_state(path: str, like: Any) -> Any:
    """The state :func:`save_state` wrote to ``path``, in the structure of ``like`` (a state of the same
    method, data and run shape, e.g. ``algo.init(key, data)``), each leaf with
    ``like``'s shape, dtype and placement. A file that does not hold such a state is a ``ValueError``
    naming the first leaf that differs (by its path in the pytree)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ValueError(f"load_state: {path!r} does not exist")
    if any(_is_key(t) and not isinstance(t, jax.Array) for t in jax.tree_util.tree_leaves(like)):
        raise ValueError("load_state: like holds an abstract random key (a jax.eval_shape state): give a concrete "
                         "state, e.g. algo.init(key, data)")
    try:
        return _read_leaves(path, like)
    except _LeafMismatch as e:
        raise ValueError(f"load_state: {path}: {e}") from None
    except (OSError, EOFError, KeyError, ValueError, TypeError, zipfile.BadZipFile) as e:   # not a .npz of ours
        raise ValueError(f"load_state: {path!r} is not a state written by save_state ({type(e).__name__})") from None


def _is_key(x) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


class _LeafMismatch(ValueError):
    """A file's leaves that do not fit the state they are read into."""


def _host_leaves(state: Any) -> list[np.ndarray]:
    """``state``'s leaves on the host, in flattening order (typed random keys as their key data)."""
    return [np.asarray(jax.random.key_data(x) if _is_key(x) else x)
            for x in jax.tree_util.tree_leaves(jax.device_get(state))]


def _read_leaves(file: str, target: Any) -> Any:
    """The leaves in ``file`` (an ``.npz`` of :func:`save_state` or a checkpoint) shaped as ``target``."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(target)
    with np.load(file) as z:
        if len(z.files) != len(flat):
            raise _LeafMismatch(f"{len(z.files)} arrays for a state of {len(flat)} leaves")
        got = [z[f"arr_{i}"] for i in range(len(flat))]
    out = []
    for (where, t), a in zip(flat, got):
        want = jax.random.key_data(t) if _is_key(t) else t if hasattr(t, "shape") else np.asarray(t)
        if a.dtype.kind == "V" and np.dtype(want.dtype).kind == "V" and a.dtype.itemsize == np.dtype(want.dtype).itemsize:
            # bfloat16 (float8, ...): .npz keeps their bytes under a void dtype and not which type they were,
            # so they are read as like's (a file of another such type of the same size is not told apart)
            a = a.view(want.dtype)
        if a.shape != tuple(want.shape) or a.dtype != want.dtype:
            raise _LeafMismatch(f"leaf {jax.tree_util.keystr(where)} is {a.dtype}{list(a.shape)}, the state's is "
                                f"{want.dtype}{list(want.shape)}")
        if _is_key(t):
            a = jax.random.wrap_key_data(a, impl=jax.random.key_impl(t))
        if isinstance(t, jax.Array):
            a = jax.device_put(a, t.sharding)
        elif isinstance(t, jax.ShapeDtypeStruct):
            a = jax.numpy.asarray(a)
        elif not hasattr(t, "shape"):   # a Python number: given back as one
            a = a.item()
        out.append(a)
    return jax.tree_util.tree_unflatten(treedef, out)


def _read_state(path: str, target: Any) -> Any:
    """The state saved under ``path``, shaped as ``target`` (whose leaves' shapes, dtypes and
    placements it takes); a ValueError if the file does not hold such a state."""
    file = os.path.join(path, LEAVES)
    if not os.path.exists(file):   # written by orbax (before the .npz format)
        import orbax.checkpoint as ocp
        abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, target)
        return ocp.StandardCheckpointer().restore(os.path.abspath(path), abstract)
    return _read_leaves(file, target)
