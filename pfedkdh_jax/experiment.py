"""A whole federated run from a :class:`~pfedkdh_jax.config.RunConfig`: data, rounds, evaluation, files.

The run directory holds ``config.json``, ``metrics.jsonl`` (one line per round, appended and flushed
as the run goes, so nothing is lost if it is interrupted), ``summary.json`` and ``curves.png``.
This module is the thin host layer; the numerics are the pure functions of the other modules.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pfedkdh_jax import data as data_lib
from pfedkdh_jax.checkpoint import CheckpointError, Checkpoints, fingerprint
from pfedkdh_jax.config import ConfigError, RunConfig, validate
from pfedkdh_jax.engine import EngineConfig, LocalTrainer, local_training_compiler_options, tree_stack
from pfedkdh_jax.federated_data import FederatedData, build_federated_data, gather_inputs
from pfedkdh_jax.losses import cross_entropy, masked_mean
from pfedkdh_jax.model import CNN
from pfedkdh_jax.pfedkdh import PFedKDH
from pfedkdh_jax.rounds import RoundRunner, sample_schedule, supports_rep_axis

METRIC_KEYS = ("personalized_macro_accuracy", "personalized_micro_accuracy",
               "global_macro_accuracy", "global_micro_accuracy")
EA_KEYS = tuple(f"{k}_ea" for k in METRIC_KEYS[:2])


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
        part = validation_partition(part, cfg.validation_fraction, cfg.data_seed)
    return pool, part, data_lib.partition_summary(part, pool.labels, pool.num_classes)


def validation_partition(part: data_lib.Partition, fraction: float, seed: int) -> data_lib.Partition:
    """Replace every client's test split by a random ``fraction`` of its train split (sweeps only:
    the real test split is then never looked at)."""
    rng = np.random.default_rng([seed, 1])
    train, val = [], []
    for idx in part.train_idx:
        idx = rng.permutation(idx)
        n_val = min(max(1, int(math.floor(len(idx) * fraction))), len(idx) - 1)
        val.append(np.sort(idx[:n_val]))
        train.append(np.sort(idx[n_val:]))
    return dataclasses.replace(part, train_idx=tuple(train), test_idx=tuple(val))


def make_algorithm(cfg: RunConfig, num_classes: int):
    """The algorithm of ``cfg.method`` (see :mod:`pfedkdh_jax.methods`)."""
    from pfedkdh_jax import methods
    return methods.build(cfg, num_classes)


def warmup(algo: PFedKDH, state, data: FederatedData, key: jax.Array, engine: EngineConfig):
    """E_w epochs of plain CE training of (θ_g, φ_g) on D_s before round 0; heads start from φ_g."""
    model = algo.model

    def ce(params, ctx, x, y, mask, rng):
        return masked_mean(cross_entropy(model.logits(params, x, rng=rng), y), mask)

    import optax
    trainer = LocalTrainer(loss_fn=ce, tx=optax.sgd(algo.config.lr), gather=gather_inputs,
                           epochs=algo.config.warmup_epochs, batch_size=algo.config.batch_size)
    n = int(data.aux_idx.shape[0])
    steps = trainer.num_steps(n)
    params = {"backbone": state.backbone, "head": state.teacher_head}
    ls = trainer.init(params, key, jnp.asarray(n), n)
    eng = engine.resolved()
    opts = local_training_compiler_options()
    if eng.step_loop == "scan":
        ls = jax.jit(lambda s, d: trainer.run_scan(s, None, d.aux_idx, d, steps), compiler_options=opts)(ls, data)
    else:
        chunk = jax.jit(lambda s, d: trainer.run_unrolled(s, None, d.aux_idx, d, eng.chunk_steps),
                        compiler_options=opts)
        for _ in range(math.ceil(steps / eng.chunk_steps)):
            ls = chunk(ls, data)
    head = ls.params["head"]
    heads = jax.tree_util.tree_map(lambda h, x: jnp.broadcast_to(x, h.shape), state.heads, head)
    return state.replace(backbone=ls.params["backbone"], teacher_head=head, heads=heads)


def default_out_dir(cfg: RunConfig) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return os.path.join("runs", f"{cfg.dataset}-{cfg.method}-a{cfg.alpha:g}-s{cfg.seed}-{stamp}")


@dataclasses.dataclass
class _Group:
    """Repetitions computed together: one seed (no repetition axis) or several (vmapped, ``[R, ...]``)."""

    seeds: list[int]
    runner: RoundRunner
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
        host = _host_arrays(metrics)
        if not self.batched:
            return [_plain(host)]
        return [_plain({k: v[r] for k, v in host.items()}) for r in range(len(self.seeds))]


def _host_arrays(metrics: dict) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in jax.device_get(metrics).items()}


def _plain(arrays: dict) -> dict[str, Any]:
    return {k: float(v) if np.ndim(v) == 0 else [float(x) for x in np.ravel(v)] for k, v in arrays.items()}


def _initial_state(algo, data, seed: int, engine: EngineConfig):
    keys = streams(seed)
    state = algo.init(keys["init"], data)
    if getattr(algo.config, "warmup_epochs", 0) > 0:
        state = warmup(algo, state, data, jax.random.fold_in(keys["init"], 1), engine)
    before = getattr(algo, "before_training", None)  # optional hook (see pfedkdh_jax.rounds)
    return state if before is None else before(state, data, jax.random.fold_in(keys["init"], 2))


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
    engine = EngineConfig(cfg.client_parallel, cfg.step_loop, cfg.chunk_steps).resolved()
    seeds = [cfg.seed + r for r in range(cfg.reps)]
    batched = cfg.reps > 1 and resolved_reps_mode(cfg) == "vmap"
    if batched and not supports_rep_axis(algo):
        log(f"note: {cfg.method} has pieces without a repetition axis; its repetitions run one after "
            "another (same numbers)")
        batched = False
    # Auto axes: XLA's sharding propagation places everything from the inputs' shardings.
    mesh = (jax.make_mesh((jax.device_count(),), ("devices",), axis_types=(jax.sharding.AxisType.Auto,))
            if jax.device_count() > 1 else None)
    if mesh is not None:
        data = jax.device_put(data, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))

    # One runner for all groups: sequential repetitions reuse the same compiled functions.
    runner = RoundRunner(algo, data, engine, eval_chunk=cfg.eval_chunk, ea_steps=cfg.ea_steps,
                         ea_lr=cfg.ea_lr or cfg.lr, ea_epochs=cfg.ea_epochs, batch_size=cfg.batch_size,
                         reps=len(seeds) if batched else None,
                         mesh=mesh)
    groups, states = [], []
    for members in ([seeds] if batched else [[s] for s in seeds]):
        ks = [streams(s) for s in members]
        sched = [sample_schedule(k["sampling"], cfg.rounds, cfg.num_clients, cfg.clients_per_round) for k in ks]
        st = [_initial_state(algo, data, s, engine) for s in members]
        if batched:
            keys = {name: jnp.stack([k[name] for k in ks]) for name in ks[0]}
            state = tree_stack(st)
            state = runner.place(state)
            groups.append(_Group(members, runner, np.stack(sched), keys, True))
        else:
            state = st[0]
            groups.append(_Group(members, runner, sched[0], ks[0], False))
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
        _write_json(os.path.join(out_dir, "config.json"), {
            **cfg.to_dict(), "engine": dataclasses.asdict(engine), "reps_batched": batched,
            "environment": environment()})
    metrics_path = os.path.join(out_dir, "metrics.jsonl")
    _write_text(metrics_path, "".join(json.dumps(r) + "\n" for r in history))

    bar = _progress(cfg.rounds, progress)
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
            states[g], train_m = group.runner.round(states[g], data, group.selected(t),
                                                    group.round_key("train", t))
            jax.block_until_ready(states[g])
            t2 = time.perf_counter()
            eval_m = (group.runner.evaluate(states[g], data, group.round_key("eval", t), ea=do_ea)
                      if do_eval else {})
            per_rep = group.split({**train_m, **eval_m})
            t3 = time.perf_counter()
            train_s, eval_s = train_s + t2 - t1, eval_s + t3 - t2
            sel = np.asarray(group.selected(t)).reshape(len(group.seeds), -1)
            for r, (seed, row) in enumerate(zip(group.seeds, per_rep)):
                rep_rows.append({"round": t + 1, "seed": seed, **row, "clients": [int(k) for k in sel[r]]})
        row = _combine(rep_rows)
        row.update(train_seconds=train_s, eval_seconds=eval_s, seconds=time.perf_counter() - t0)
        history.append(row)
        with open(metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        for rep in rep_rows:
            problem = _divergence(rep, cfg.divergence_loss)
            if problem:
                summary = _summary(cfg, history, part_summary, groups[0].runner,
                                   status=f"diverged at round {t + 1}")
                _write_json(os.path.join(out_dir, "summary.json"), summary)
                who = f" in repetition {rep['seed'] - cfg.seed} (seed {rep['seed']})" if cfg.reps > 1 else ""
                raise DivergenceError(f"{problem}{who} at round {t + 1} (try a smaller --lr); "
                                      f"everything up to it is in {out_dir}")
        if cfg.checkpoint_every and ((t + 1) % cfg.checkpoint_every == 0 or last):
            ckpts.save(t + 1, states, history)
        bar.update(1)
        bar.set_postfix(_postfix(row))
    bar.close()
    summary = _summary(cfg, history, part_summary, groups[0].runner, status="completed")
    summary["total_seconds"] = time.perf_counter() - t_start
    _write_json(os.path.join(out_dir, "summary.json"), summary)
    try:
        from pfedkdh_jax.plots import plot_curves
        plot_curves(history, os.path.join(out_dir, "curves.png"),
                    title=f"{cfg.method} on {cfg.dataset}, α={cfg.alpha:g}"
                          + (f", {cfg.reps} repetitions (mean ± std)" if cfg.reps > 1 else ""))
    except Exception as e:  # a plot must never lose a finished run
        log(f"warning: curves.png not written: {e}")
    summary["out"] = out_dir
    if return_state:
        return summary, states[0], data, algo, groups[0].runner
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


def resolved_reps_mode(cfg: RunConfig) -> str:
    """``vmap`` or ``sequential`` for the repetitions (auto: sequential on CPU, see BENCHMARKS.md)."""
    if cfg.reps_mode != "auto":
        return cfg.reps_mode
    return "sequential" if jax.default_backend() == "cpu" else "vmap"


def _combine(rep_rows: list[dict]) -> dict[str, Any]:
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


def _divergence(row: dict, max_loss: float) -> str | None:
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
    bad = [k for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)]
    return f"non-finite {', '.join(bad)}" if bad else None


def _postfix(row: dict) -> dict:
    short = {"personalized_macro_accuracy": "pers", "global_macro_accuracy": "glob",
             "personalized_macro_accuracy_ea": "ea", "train_loss": "loss"}
    pf = {v: f"{row[k]:.4f}" for k, v in short.items() if k in row}
    pf["s/round"] = f"{row['seconds']:.1f}"
    return pf


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm
    return tqdm(total=total, desc="rounds", unit="round", disable=not enabled, dynamic_ncols=True)


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
            "device_count": jax.device_count(), "git_commit": commit}


def _summary(cfg: RunConfig, history: list[dict], part_summary: dict, runner: RoundRunner,
             status: str) -> dict[str, Any]:
    """Final and best of every metric; with repetitions, their mean (``<key>_std``: std) and the
    per-repetition summaries under ``repetitions``."""
    summary: dict[str, Any] = {"method": cfg.method, "dataset": cfg.dataset, "alpha": cfg.alpha,
                               "seed": cfg.seed, "data_seed": cfg.data_seed, "reps": cfg.reps,
                               "status": status, "rounds_completed": len(history)}
    if history and "reps" in history[0]:
        per_rep = [_metric_summary([row["reps"][r] for row in history]) for r in range(len(history[0]["reps"]))]
        for key in per_rep[0]:
            vals = [p[key] for p in per_rep if isinstance(p.get(key), float)]
            if vals and not key.endswith("_round"):
                summary[key] = float(np.mean(vals))
                summary[f"{key}_std"] = float(np.std(vals))
        summary["repetitions"] = [{"seed": cfg.seed + r, **p} for r, p in enumerate(per_rep)]
    else:
        summary.update(_metric_summary(history))
    secs = [r["train_seconds"] for r in history]
    later = secs[1:] or secs
    summary["seconds_per_round"] = statistics.median(later) if later else None
    summary["train_seconds_per_round"] = summary["seconds_per_round"]
    summary["eval_seconds_median"] = statistics.median([r["eval_seconds"] for r in history[1:]] or [0.0])
    summary["first_round_seconds"] = secs[0] if secs else None
    summary["compile_seconds"] = max(0.0, secs[0] - summary["seconds_per_round"]) if secs else None
    summary["engine"] = dataclasses.asdict(runner.engine)
    summary["traces"] = dict(runner.traces)
    summary["partition"] = part_summary
    return summary


def _metric_summary(history: list[dict]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    evaluated = [r for r in history if "personalized_macro_accuracy" in r]
    for key in METRIC_KEYS + EA_KEYS:
        rows = [r for r in evaluated if key in r and math.isfinite(r[key])]
        if rows:
            out[key] = rows[-1][key]
            out[f"best_{key}"] = max(r[key] for r in rows)
            out[f"best_{key}_round"] = max(rows, key=lambda r: r[key])["round"]
    if evaluated:
        final = evaluated[-1]
        out["per_client_personalized_accuracy"] = final.get("personalized_per_client_accuracy")
        if "personalized_per_client_accuracy_ea" in final:
            out["per_client_personalized_accuracy_ea"] = final["personalized_per_client_accuracy_ea"]
    if history:
        out["final_train_loss"] = history[-1].get("train_loss")
    return out


def _write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically (temporary file + rename)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _write_json(path: str, obj: Any) -> None:
    _write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str))
