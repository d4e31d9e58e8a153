"""What a run writes: per-round rows (repetitions combined), summaries, divergence checks, the
environment, atomic files. Host-side Python only."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import threading
from typing import Any

import jax
import numpy as np

METRIC_KEYS = ("personalized_macro_accuracy", "personalized_micro_accuracy",
               "global_macro_accuracy", "global_micro_accuracy")


EA_KEYS = tuple(f"{k}_ea" for k in METRIC_KEYS[:2])


def host_arrays(metrics: dict) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in jax.device_get(metrics).items()}


def plain(arrays: dict) -> dict[str, Any]:
    """JSON-ready values: scalars as floats, arrays as lists; a per-client accuracy of a client not
    scored (NaN: no test samples in the evaluation, ``--eval-clients``) as ``None``."""
    def values(key, v):
        xs = [float(x) for x in np.ravel(v)]
        return [None if math.isnan(x) else x for x in xs] if "per_client_accuracy" in key else xs
    return {k: float(v) if np.ndim(v) == 0 else values(k, v) for k, v in arrays.items()}


def combine(rep_rows: list[dict]) -> dict[str, Any]:
    """One metrics row from the repetitions' rows: the mean under each key, ``<key>_std`` the std."""
    if len(rep_rows) == 1:
        return dict(rep_rows[0])
    row: dict[str, Any] = {"round": rep_rows[0]["round"]}
    for key, value in rep_rows[0].items():
        if isinstance(value, float):
            vals = np.array([r[key] for r in rep_rows], np.float64)
            row[key] = float(vals.mean())
            row[f"{key}_std"] = float(vals.std())
    row["reps"] = rep_rows
    return row


def divergence(row: dict, max_loss: float) -> str | None:
    """What went wrong in a round's row (non-finite or exploding values), naming the clients."""
    losses = row.get("client_loss")
    if isinstance(losses, list):
        bad = [c for c, v in zip(row["clients"], losses) if not math.isfinite(v)]
        if bad:
            return f"non-finite local loss of client(s) {', '.join(map(str, bad))}"
        big = [f"{c} ({v:.3g})" for c, v in zip(row["clients"], losses) if max_loss and v > max_loss]
        if big:
            return f"local loss above --divergence-loss {max_loss:g} for client(s) {', '.join(big)}"
    if row.get("finite_params", 1.0) != 1.0:
        return "non-finite global parameters"
    if row.get("rows_lost", 0.0) > 0:
        return (f"{row['rows_lost']:g} client(s) trained without a row of their own: the method's personal_rows "
                "is below the clients trained (leave it unset: a run keeps a row for every client it trains)")
    bad = [k for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)]
    return f"non-finite {', '.join(bad)}" if bad else None


def postfix(row: dict) -> dict:
    short = {"personalized_macro_accuracy": "pers", "global_macro_accuracy": "glob",
             "personalized_macro_accuracy_ea": "ea", "train_loss": "loss"}
    pf = {v: f"{row[k]:.4f}" for k, v in short.items() if k in row}
    pf["s/round"] = f"{row.get('train_seconds', row['seconds']):.1f}"   # training; an evaluation's apart
    if row.get("eval_seconds"):
        pf["s/eval"] = f"{row['eval_seconds']:.1f}"
    return pf


def progress(total: int, enabled: bool):
    from tqdm.auto import tqdm
    return tqdm(total=total, desc="rounds", unit="round", disable=not enabled, dynamic_ncols=True)


class CompileWatch:
    """JAX's compile events in this process while the watch is open (``with CompileWatch() as w``): how
    many (``events``) and their seconds (``seconds``: tracing, lowering to MLIR and the backend's
    compilation, as ``jax.monitoring`` reports them). A run reads it before and after each piece of a
    round, so its rows mark exactly the rounds that compiled something, a step width first met in round
    40 too. Compiles of other threads of the process count as well."""

    PREFIX = "/jax/core/compile/"

    def __init__(self):
        self.events, self.seconds = 0, 0.0
        self._lock = threading.Lock()
        self._open = False

    def _listen(self, name: str, seconds: float, **_) -> None:
        if self._open and name.startswith(self.PREFIX):
            with self._lock:
                self.events += 1
                self.seconds += seconds

    def reading(self) -> tuple[int, float]:
        with self._lock:
            return self.events, self.seconds

    def __enter__(self) -> "CompileWatch":
        self._open = True
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def __exit__(self, *exc) -> None:
        self._open = False   # a JAX without unregister keeps a listener that counts nothing more
        unregister = getattr(jax.monitoring, "unregister_event_duration_listener", None)
        if unregister is not None:
            unregister(self._listen)


def environment() -> dict[str, Any]:
    """Library versions, backend, devices and the git commit (if any), for reproducibility."""
    import platform
    import subprocess

    import flax
    import optax
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                                cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__,
            "numpy": np.__version__, "python": platform.python_version(),
            "backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
            "device_count": jax.local_device_count(), "process_count": jax.process_count(),
            "git_commit": commit}


def summary(cfg, history: list[dict], part_summary: dict, runner,
             status: str) -> dict[str, Any]:
    """Final and best of every metric; with repetitions, their mean (``<key>_std``: std) and the
    per-repetition summaries under ``repetitions``."""
    summary: dict[str, Any] = {"method": cfg.method, "dataset": cfg.dataset, "alpha": cfg.alpha,
                               "seed": cfg.seed, "data_seed": cfg.data_seed, "reps": cfg.reps,
                               "status": status, "rounds_completed": len(history),
                               # the split the accuracies come from (--validation-fraction > 0: validation)
                               "scored_split": "validation" if cfg.validation_fraction > 0 else "test",
                               # shards: alpha above is not read (the split is label-sorted shards)
                               **({"partition": f"shards ({cfg.shards_per_client} a client)"}
                                  if getattr(cfg, "partition", "dirichlet") == "shards" else {})}
    if history and "reps" in history[0]:
        per_rep = [metric_summary([row["reps"][r] for row in history]) for r in range(len(history[0]["reps"]))]
        for key in per_rep[0]:
            vals = [p[key] for p in per_rep if isinstance(p.get(key), float)]
            if vals and not key.endswith("_round"):
                summary[key] = float(np.mean(vals))
                summary[f"{key}_std"] = float(np.std(vals))
        summary["repetitions"] = [{"seed": cfg.seed + r, **p} for r, p in enumerate(per_rep)]
    else:
        summary.update(metric_summary(history))
    # the rounds that compiled (rows marked "compiles": round 1, a resumed session's first round, a
    # phase's first, any round that met a new program; rows from before the mark: round 1) are left out
    secs = [r["train_seconds"] for r in history]
    spr, steady = _steady_median(history, "train_seconds", "compiles")
    summary["seconds_per_round"] = spr
    summary["train_seconds_per_round"] = spr
    # over the rounds that evaluated (not every round does, with --eval-every); those whose evaluation
    # compiled ("eval_compiles": a session's first evaluation and first EA in a phase, ...; before the
    # mark: the first evaluation) count only when there are no others
    evals = [r for r in history if evaluated(r)]
    summary["eval_seconds_median"] = _steady_median(evals, "eval_seconds", "eval_compiles")[0] if evals else 0.0
    summary["evaluations"] = len(evals)
    summary["first_round_seconds"] = secs[0] if secs else None
    # the seconds JAX reported compiling, summed over the rows (every session's); a compiling row from
    # before the measurement (round 1, or marked, without compile_seconds: a run resumed across the
    # change) counts as its train seconds less the median; with no steady round, unknown (None), and
    # seconds_per_round is the compiling rounds' median, compilation included
    measured = [r["compile_seconds"] for r in history if "compile_seconds" in r]
    older = [r["train_seconds"] for i, r in enumerate(history)
             if "compile_seconds" not in r and (i == 0 or r.get("compiles"))]
    estimated = sum(max(0.0, s - spr) for s in older) if steady else None
    summary["compile_seconds"] = (None if (estimated is None and older) or not (measured or older) else
                                  float(sum(measured)) + (estimated or 0.0))
    summary["seconds_per_round_includes_compile"] = bool(secs) and not steady
    summary["engine"] = dataclasses.asdict(runner.layout)
    packed = [(r.get("reps") or [r])[0] for r in history]
    if packed and "packing_computed_steps" in packed[0]:
        # useful / computed local sample-steps of the packed rounds (every repetition at once)
        summary["useful_fraction"] = (sum(r["packing_useful_steps"] for r in packed)
                                      / max(1, sum(r["packing_computed_steps"] for r in packed)))
    summary["traces"] = dict(runner.traces)
    summary["partition"] = part_summary
    return summary


def _steady_median(rows: list[dict], key: str, mark: str) -> tuple[float | None, bool]:
    """The median of ``key`` over the rows that did not compile (the first row, and rows marked
    ``mark``, left out), and whether there were any; with none, over every row."""
    steady = [r[key] for i, r in enumerate(rows) if i > 0 and not r.get(mark)]
    every = [r[key] for r in rows]
    return (statistics.median(steady or every) if every else None), bool(steady)


def evaluated(row: dict) -> bool:
    """Whether a metrics row comes from a round that evaluated (not every round does: --eval-every)."""
    return "personalized_macro_accuracy" in row


def metric_summary(history: list[dict]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    rows_evaluated = [r for r in history if evaluated(r)]
    for key in METRIC_KEYS + EA_KEYS:
        rows = [r for r in rows_evaluated if key in r and math.isfinite(r[key])]
        if rows:
            out[key] = rows[-1][key]
            out[f"best_{key}"] = max(r[key] for r in rows)
            out[f"best_{key}_round"] = max(rows, key=lambda r: r[key])["round"]
    if rows_evaluated:
        final = rows_evaluated[-1]
        out["per_client_personalized_accuracy"] = final.get("personalized_per_client_accuracy")
        if "personalized_per_client_accuracy_ea" in final:
            out["per_client_personalized_accuracy_ea"] = final["personalized_per_client_accuracy_ea"]
    if history:
        out["final_train_loss"] = history[-1].get("train_loss")
    return out


def write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically (temporary file + rename)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def write_json(path: str, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str))
