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
from pfedkdh_jax.config import RunConfig, validate
from pfedkdh_jax.engine import EngineConfig, LocalTrainer
from pfedkdh_jax.federated_data import FederatedData, build_federated_data, gather_inputs
from pfedkdh_jax.losses import cross_entropy, masked_mean
from pfedkdh_jax.model import CNN
from pfedkdh_jax.pfedkdh import PFedKDH
from pfedkdh_jax.rounds import RoundRunner, sample_schedule

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
    if eng.step_loop == "scan":
        ls = jax.jit(lambda s, d: trainer.run_scan(s, None, d.aux_idx, d, steps))(ls, data)
    else:
        chunk = jax.jit(lambda s, d: trainer.run_unrolled(s, None, d.aux_idx, d, eng.chunk_steps))
        for _ in range(math.ceil(steps / eng.chunk_steps)):
            ls = chunk(ls, data)
    head = ls.params["head"]
    heads = jax.tree_util.tree_map(lambda h, x: jnp.broadcast_to(x, h.shape), state.heads, head)
    return state.replace(backbone=ls.params["backbone"], teacher_head=head, heads=heads)


def default_out_dir(cfg: RunConfig) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return os.path.join("runs", f"{cfg.dataset}-{cfg.method}-a{cfg.alpha:g}-s{cfg.seed}-{stamp}")


def _host(metrics: dict) -> dict[str, Any]:
    out = {}
    for k, v in jax.device_get(metrics).items():
        v = np.asarray(v)
        out[k] = float(v) if v.ndim == 0 else [float(x) for x in v]
    return out


def run(cfg: RunConfig, *, progress: bool = True, log=print, return_state: bool = False):
    """Run the experiment described by ``cfg``; write and return the summary.

    With ``return_state`` the result is ``(summary, state, data, algo, runner)``, for scripts that
    evaluate the final model further (e.g. the hyperparameter sweep).
    """
    validate(cfg)
    out_dir = cfg.out or default_out_dir(cfg)
    pool, part, part_summary = prepare_data(cfg)
    if pool.is_demo:
        log(f"NOTE: '{cfg.dataset}' is scikit-learn's bundled 8x8 digits upscaled to 28x28: a demo set "
            "for a quick offline run, not a dataset of the paper (use --dataset mnist --data-dir DIR).")
    log(data_lib.format_summary(part_summary))
    data = build_federated_data(pool, part, eval_chunk=cfg.eval_chunk)
    algo = make_algorithm(cfg, pool.num_classes)
    engine = EngineConfig(cfg.client_parallel, cfg.step_loop, cfg.chunk_steps).resolved()
    runner = RoundRunner(algo, data, engine, eval_chunk=cfg.eval_chunk, ea_steps=cfg.ea_steps,
                         ea_lr=cfg.lr, batch_size=cfg.batch_size)
    keys = streams(cfg.seed)

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump({**cfg.to_dict(), "out": out_dir,
                   "engine": dataclasses.asdict(engine), "backend": jax.default_backend(),
                   "device_kind": jax.devices()[0].device_kind,
                   "versions": _versions()}, f, indent=2, sort_keys=True)
    metrics_path = os.path.join(out_dir, "metrics.jsonl")
    open(metrics_path, "w").close()

    state = algo.init(keys["init"], data)
    if cfg.warmup_epochs > 0:
        state = warmup(algo, state, data, jax.random.fold_in(keys["init"], 1), engine)
    before = getattr(algo, "before_training", None)  # optional hook (see pfedkdh_jax.rounds)
    if before is not None:
        state = before(state, data, jax.random.fold_in(keys["init"], 2))
    schedule = sample_schedule(keys["sampling"], cfg.rounds, cfg.num_clients, cfg.clients_per_round)

    history: list[dict] = []
    bar = _progress(cfg.rounds, progress)
    t_start = time.perf_counter()
    for t in range(cfg.rounds):
        t0 = time.perf_counter()
        state, train_m = runner.round(state, data, schedule[t], jax.random.fold_in(keys["train"], t))
        jax.block_until_ready(state)
        t1 = time.perf_counter()
        last = t == cfg.rounds - 1
        eval_m = {}
        if last or (t + 1) % cfg.eval_every == 0:
            ea = cfg.ea_steps > 0 and (last or (t + 1) % cfg.ea_every == 0)
            eval_m = runner.evaluate(state, data, jax.random.fold_in(keys["eval"], t), ea=ea)
        row = {"round": t + 1, **_host({**train_m, **eval_m})}
        t2 = time.perf_counter()
        row.update(train_seconds=t1 - t0, eval_seconds=t2 - t1, seconds=t2 - t0,
                   clients=[int(k) for k in schedule[t]])
        bad = [k for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)]
        history.append(row)
        with open(metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if bad:
            summary = _summary(cfg, history, part_summary, runner, status=f"diverged at round {t + 1}")
            _write_summary(out_dir, summary)
            raise DivergenceError(f"non-finite {', '.join(bad)} at round {t + 1} (try a smaller --lr); "
                                  f"metrics so far are in {out_dir}")
        bar.update(1)
        bar.set_postfix(_postfix(row))
    bar.close()
    summary = _summary(cfg, history, part_summary, runner, status="completed")
    summary["total_seconds"] = time.perf_counter() - t_start
    _write_summary(out_dir, summary)
    try:
        from pfedkdh_jax.plots import plot_curves
        plot_curves(history, os.path.join(out_dir, "curves.png"), title=f"{cfg.method} on {cfg.dataset}, α={cfg.alpha:g}")
    except Exception as e:  # a plot must never lose a finished run
        log(f"warning: curves.png not written: {e}")
    summary["out"] = out_dir
    if return_state:
        return summary, state, data, algo, runner
    return summary


def _postfix(row: dict) -> dict:
    short = {"personalized_macro_accuracy": "pers", "global_macro_accuracy": "glob",
             "personalized_macro_accuracy_ea": "ea", "train_loss": "loss"}
    pf = {v: f"{row[k]:.4f}" for k, v in short.items() if k in row}
    pf["s/round"] = f"{row['seconds']:.1f}"
    return pf


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm
    return tqdm(total=total, desc="rounds", unit="round", disable=not enabled, dynamic_ncols=True)


def _versions() -> dict[str, str]:
    import flax
    import optax
    return {"jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__,
            "numpy": np.__version__}


def _summary(cfg: RunConfig, history: list[dict], part_summary: dict, runner: RoundRunner,
             status: str) -> dict[str, Any]:
    summary: dict[str, Any] = {"method": cfg.method, "dataset": cfg.dataset, "alpha": cfg.alpha,
                               "seed": cfg.seed, "data_seed": cfg.data_seed, "status": status,
                               "rounds_completed": len(history)}
    evaluated = [r for r in history if "personalized_macro_accuracy" in r]
    for key in METRIC_KEYS + EA_KEYS:
        rows = [r for r in evaluated if key in r and math.isfinite(r[key])]
        if rows:
            summary[key] = rows[-1][key]
            summary[f"best_{key}"] = max(r[key] for r in rows)
            summary[f"best_{key}_round"] = max(rows, key=lambda r: r[key])["round"]
    if evaluated:
        final = evaluated[-1]
        summary["per_client_personalized_accuracy"] = final.get("personalized_per_client_accuracy")
        if "personalized_per_client_accuracy_ea" in final:
            summary["per_client_personalized_accuracy_ea"] = final["personalized_per_client_accuracy_ea"]
        summary["final_train_loss"] = history[-1].get("train_loss")
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


def _write_summary(out_dir: str, summary: dict) -> None:
    tmp = os.path.join(out_dir, "summary.json.tmp")
    with open(tmp, "w") as f:
        json.dump(summary, f, indent=2)
    os.replace(tmp, os.path.join(out_dir, "summary.json"))
