"""A whole federated run from a :class:`~pfedkdh_jax.run.config.RunConfig`: data, rounds, evaluation, files.

The run directory holds ``config.json``, ``metrics.jsonl`` (one line per round, appended and flushed
as the run goes, so nothing is lost if it is interrupted), ``summary.json`` and ``curves.png``.
This module is the thin host layer; the numerics are the pure functions of the other modules.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pfedkdh_jax import algorithms
from pfedkdh_jax import data as data_lib
from pfedkdh_jax.data.device import build_federated_data
from pfedkdh_jax.algorithms.base import message_bytes
from pfedkdh_jax.engine.layout import Layout
from pfedkdh_jax.engine.local import tree_stack
from pfedkdh_jax.engine.runner import PhasedRunner, sample_schedule
from pfedkdh_jax.run.checkpoint import CheckpointError, Checkpoints, fingerprint
from pfedkdh_jax.run.config import ConfigError, RunConfig, validate
from pfedkdh_jax.run import preflight, records


class DivergenceError(RuntimeError):
    """A non-finite loss or accuracy; the message names the round."""


# Named, independent random streams derived from --seed (the partition uses --data-seed).
STREAM_INIT, STREAM_SAMPLING, STREAM_TRAIN, STREAM_EVAL = 0, 1, 2, 3


def streams(seed: int) -> dict[str, jax.Array]:
    root = jax.random.key(seed)
    return {"init": jax.random.fold_in(root, STREAM_INIT),
            "sampling": jax.random.fold_in(root, STREAM_SAMPLING),
            "train": jax.random.fold_in(root, STREAM_TRAIN),
            "eval": jax.random.fold_in(root, STREAM_EVAL)}


def prepare_data(cfg: RunConfig) -> tuple[data_lib.Pool, data_lib.Partition, dict]:
    """Pool, partition (with the validation carve-out if asked) and its summary."""
    pool = data_lib.load_pool(cfg.dataset, data_dir=cfg.data_dir, cache_dir=cfg.cache_dir)
    if cfg.aux_size >= len(pool.labels):
        raise data_lib.DataError(f"--aux-size must be < the pool size {len(pool.labels)} of "
                                 f"{cfg.dataset}; got {cfg.aux_size}")
    part = data_lib.make_partition(
        pool.labels, num_clients=cfg.num_clients, alpha=cfg.alpha, aux_size=cfg.aux_size,
        min_client_samples=cfg.min_client_samples, balance_cap=cfg.balance_cap,
        train_fraction=cfg.train_fraction, seed=cfg.data_seed)
    if cfg.validation_fraction > 0:
        part = data_lib.validation_partition(part, cfg.validation_fraction, cfg.data_seed)
    return pool, part, data_lib.partition_summary(part, pool.labels, pool.num_classes)


def make_algorithm(cfg: RunConfig, num_classes: int):
    """The algorithm of ``cfg.method`` (see :mod:`pfedkdh_jax.algorithms`)."""
    return algorithms.build(cfg, num_classes)


def default_out_dir(cfg: RunConfig) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return os.path.join("runs", f"{cfg.dataset}-{cfg.method}-a{cfg.alpha:g}-s{cfg.seed}-{stamp}")


@dataclasses.dataclass
class _Group:
    """Repetitions computed together: one seed (no repetition axis) or several (vmapped, ``[R, ...]``)."""

    seeds: list[int]
    schedule: np.ndarray      # [T, C], or [R, T, C] when batched
    keys: dict                # stream keys, each [R] when batched
    batched: bool

    def round_key(self, stream: str, t: int) -> jax.Array:
        if self.batched:
            return jax.vmap(jax.random.fold_in, in_axes=(0, None))(self.keys[stream], t)
        return jax.random.fold_in(self.keys[stream], t)

    def selected(self, t: int) -> np.ndarray:
        return self.schedule[:, t] if self.batched else self.schedule[t]

    def split(self, metrics: dict) -> list[dict]:
        """Per-repetition host dicts from the group's device metrics."""
        host = records.host_arrays(metrics)
        if not self.batched:
            return [records.plain(host)]
        return [records.plain({k: v[r] for k, v in host.items()}) for r in range(len(self.seeds))]


def _initial_state(algo, runner: PhasedRunner, data, seed: int):
    """Repetition ``seed``'s state before round 0: ``init``, then the algorithm's ``before_training``."""
    keys = streams(seed)
    return runner.prepare(algo.init(keys["init"], data), data, keys["init"])


def run(cfg: RunConfig, *, progress: bool = True, log=print, return_state: bool = False,
        resume: bool = False):
    """Run the experiment described by ``cfg``; write and return the summary.

    ``cfg.reps`` Monte Carlo repetitions use seeds ``cfg.seed + r`` (init, sampling, batch order; the
    partition stays fixed by ``cfg.data_seed``); ``cfg.reps_mode`` says whether they run as one
    vmapped program or one after another — the numbers are the same. With ``resume`` the run continues
    from the newest good checkpoint in ``cfg.out``. With ``return_state`` the result is
    ``(summary, state, data, algo, runner)`` (state and runner of the first group), for scripts that
    evaluate the final model further (e.g. the hyperparameter sweep).
    """
    validate(cfg)
    out_dir = cfg.out or default_out_dir(cfg)
    cfg = dataclasses.replace(cfg, out=out_dir)
    _check_writable(out_dir)
    pool, part, part_summary = prepare_data(cfg)
    if pool.is_demo:
        log(f"NOTE: '{cfg.dataset}' is scikit-learn's bundled 8x8 digits upscaled to 28x28: a demo set "
            "for a quick offline run, not a dataset of the paper (use --dataset mnist --data-dir DIR).")
    log(data_lib.format_summary(part_summary))
    ckpts = Checkpoints(out_dir, fingerprint(cfg.to_dict(), part), log=log)
    if not resume and ckpts.rounds():
        raise CheckpointError(f"{out_dir} already holds checkpoints of a run; continue it with "
                              f"`pfedkdh resume {out_dir}` or choose another --out")
    data = build_federated_data(pool, part, eval_chunk=cfg.eval_chunk)
    algo = make_algorithm(cfg, pool.num_classes)
    layout = engine_layout(cfg)
    seeds = [cfg.seed + r for r in range(cfg.reps)]
    batched = cfg.reps > 1 and resolved_reps_mode(cfg) == "vmap"
    preflight.check(cfg, algo, data, layout, batched)   # one line, before anything is initialised
    # Auto axes: XLA's sharding propagation places everything from the inputs' shardings.
    mesh = (jax.make_mesh((jax.device_count(),), ("devices",), axis_types=(jax.sharding.AxisType.Auto,))
            if jax.device_count() > 1 else None)
    if mesh is not None:
        data = jax.device_put(data, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))

    # One runner (per phase of the method) for all groups: sequential repetitions reuse the same
    # compiled functions.
    runner = PhasedRunner(algo, data, layout, reps=len(seeds) if batched else None, mesh=mesh)
    groups, states = [], []
    for members in ([seeds] if batched else [[s] for s in seeds]):
        ks = [streams(s) for s in members]
        sched = [sample_schedule(k["sampling"], cfg.rounds, cfg.num_clients, cfg.clients_per_round) for k in ks]
        st = [_initial_state(algo, runner, data, s) for s in members]
        if batched:
            keys = {name: jnp.stack([k[name] for k in ks]) for name in ks[0]}
            state = tree_stack(st)
            state = runner.place(state)
            groups.append(_Group(members, np.stack(sched), keys, True))
        else:
            state = st[0]
            groups.append(_Group(members, sched[0], ks[0], False))
        states.append(state)

    start, history = 0, []
    if resume:
        restored = ckpts.restore_latest(states)
        if restored is None:
            log(f"no usable checkpoint in {out_dir}: starting from round 0")
        else:
            start, states, history = restored
            log(f"resuming {out_dir} after round {start}")
    _make_dir(out_dir)
    if not resume or not os.path.exists(os.path.join(out_dir, "config.json")):
        records.write_json(os.path.join(out_dir, "config.json"), {
            **cfg.to_dict(), "engine": dataclasses.asdict(layout), "reps_batched": batched,
            "environment": records.environment()})
    metrics_path = os.path.join(out_dir, "metrics.jsonl")
    records.write_text(metrics_path, "".join(json.dumps(r) + "\n" for r in history))

    bar = records.progress(cfg.rounds, progress)
    bar.update(start)
    t_start = time.perf_counter()
    for t in range(start, cfg.rounds):
        last = t == cfg.rounds - 1
        do_eval = last or (t + 1) % cfg.eval_every == 0
        do_ea = do_eval and (cfg.ea_steps > 0 or cfg.ea_epochs > 0) and (last or (t + 1) % cfg.ea_every == 0)
        t0 = time.perf_counter()
        rep_rows, train_s, eval_s = [], 0.0, 0.0
        for g, group in enumerate(groups):
            t1 = time.perf_counter()
            states[g], train_m = runner.round(states[g], data, group.selected(t), group.round_key("train", t), t)
            jax.block_until_ready(states[g])
            t2 = time.perf_counter()
            eval_m = (runner.evaluate(states[g], data, group.round_key("eval", t), t, personalize=do_ea)
                      if do_eval else {})
            per_rep = group.split({**train_m, **eval_m})
            t3 = time.perf_counter()
            train_s, eval_s = train_s + t2 - t1, eval_s + t3 - t2
            sel = np.asarray(group.selected(t)).reshape(len(group.seeds), -1)
            for r, (seed, row) in enumerate(zip(group.seeds, per_rep)):
                rep_rows.append({"round": t + 1, "seed": seed, **row, "clients": [int(k) for k in sel[r]]})
        row = records.combine(rep_rows)
        row.update(train_seconds=train_s, eval_seconds=eval_s, seconds=time.perf_counter() - t0)
        history.append(row)
        with open(metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        for rep in rep_rows:
            problem = records.divergence(rep, cfg.divergence_loss)
            if problem:
                summary = records.summary(cfg, history, part_summary, runner,
                                   status=f"diverged at round {t + 1}")
                records.write_json(os.path.join(out_dir, "summary.json"), summary)
                who = f" in repetition {rep['seed'] - cfg.seed} (seed {rep['seed']})" if cfg.reps > 1 else ""
                raise DivergenceError(f"{problem}{who} at round {t + 1} (try a smaller --lr); "
                                      f"everything up to it is in {out_dir}")
        if cfg.checkpoint_every and ((t + 1) % cfg.checkpoint_every == 0 or last):
            ckpts.save(t + 1, states, history)
        bar.update(1)
        bar.set_postfix(records.postfix(row))
    bar.close()
    summary = records.summary(cfg, history, part_summary, runner, status="completed")
    summary["bytes_per_client_round"] = message_bytes(algo, data, streams(cfg.seed)["init"])
    summary["total_seconds"] = time.perf_counter() - t_start
    records.write_json(os.path.join(out_dir, "summary.json"), summary)
    try:
        from pfedkdh_jax.run.plots import plot_curves
        plot_curves(history, os.path.join(out_dir, "curves.png"),
                    title=f"{cfg.method} on {cfg.dataset}, α={cfg.alpha:g}"
                          + (f", {cfg.reps} repetitions (mean ± std)" if cfg.reps > 1 else ""))
    except Exception as e:  # a plot must never lose a finished run
        log(f"warning: curves.png not written: {e}")
    summary["out"] = out_dir
    if return_state:
        return summary, states[0], data, algo, runner.runners[-1]
    return summary


def _check_writable(out_dir: str) -> None:
    """Whether the run directory can be created (or written, if it exists), checked before anything
    is loaded and without creating anything; else one line (ConfigError) says why."""
    probe = os.path.abspath(out_dir)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise ConfigError(f"--out {out_dir}: {probe} is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"--out {out_dir}: no permission to write in {probe}")


def _make_dir(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--out {path}: cannot create it ({e.strerror or e})") from None


def engine_layout(cfg: RunConfig) -> Layout:
    """The run's resolved layout; a layout that cannot be (``--lanes`` without vmap + scan) is one
    line (ConfigError)."""
    layout = Layout(cfg.client_parallel, cfg.step_loop, cfg.chunk_steps).resolved()
    try:
        return dataclasses.replace(layout, lanes=cfg.lanes).resolved()
    except ValueError:   # validate() checked --lanes >= 1: the layout is what cannot take lanes
        raise ConfigError(f"--lanes {cfg.lanes} needs --client-parallel vmap --step-loop scan (this run has "
                          f"{layout.client_parallel} + {layout.step_loop}, the {jax.default_backend()} default "
                          "where not given)") from None


def resolved_reps_mode(cfg: RunConfig) -> str:
    """``vmap`` or ``sequential`` for the repetitions (auto: sequential on CPU, see BENCHMARKS.md)."""
    if cfg.reps_mode != "auto":
        return cfg.reps_mode
    return "sequential" if jax.default_backend() == "cpu" else "vmap"


def resume(run_dir: str, *, progress: bool = True, log=print, **overrides) -> dict[str, Any]:
    """Continue the run in ``run_dir`` with the config stored there."""
    path = os.path.join(run_dir, "config.json")
    if not os.path.exists(path):
        raise CheckpointError(f"{run_dir} is not a run directory (no config.json)")
    with open(path) as f:
        stored = json.load(f)
    fields = {f.name for f in dataclasses.fields(RunConfig)}
    values = {k: v for k, v in stored.items() if k in fields}
    values["method_args"] = tuple(tuple(p) for p in values.get("method_args", ()))
    values.update(overrides, out=run_dir)
    return run(RunConfig(**values), progress=progress, log=log, resume=True)


