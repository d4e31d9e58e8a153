"""A whole federated run from a :class:`~pfedkdh_jax.run.config.RunConfig`: data, rounds, evaluation, files.

The run directory holds ``config.json``, ``metrics.jsonl`` (one line per round, appended and flushed
as the run goes, so nothing is lost if it is interrupted), ``summary.json`` and ``curves.png``.
This module is the thin host layer; the numerics are the pure functions of the other modules.
:func:`run_stacked` runs several such runs (other α values, data seeds or hyperparameter values) as
one program.
A run is :func:`_run_stacked`'s named steps: load the pool, partition each run, build the engine
(data on the device, layout, algorithms, pre-flight, mesh, runners), the groups of repetitions,
resume, open the run directories, train, finish.
(Over 300 lines: one host loop serves a run and stacked runs, with their checkpoints and resume.)
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
from pfedkdh_jax import model as model_lib
from pfedkdh_jax.data.device import build_federated_data, from_arrays, run_slice, stack_partitions
from pfedkdh_jax.engine.protocol import message_bytes
from pfedkdh_jax.engine.layout import Layout, Workload
from pfedkdh_jax.engine.local import tree_stack
from pfedkdh_jax.engine.runner import PhasedRunner, sample_schedule
from pfedkdh_jax.run.checkpoint import CheckpointError, Checkpoints, fingerprint
from pfedkdh_jax.run.lock import held_by_a_live_process, locked
from pfedkdh_jax.run.config import ConfigError, RunConfig, fused_steps, slot_granule, validate
from pfedkdh_jax.run import preflight, records


class DivergenceError(RuntimeError):
    """A non-finite loss or accuracy; the message names the round."""

    kind = "diverged"


class RowsExhaustedError(DivergenceError):
    """Clients trained without a row of their own (a method's ``personal_rows`` below the clients a run
    trains): the run stops, its numbers would be wrong; the message names the round."""

    kind = "stopped"


# Named, independent random streams derived from --seed (the partition uses --data-seed).
STREAM_INIT, STREAM_SAMPLING, STREAM_TRAIN, STREAM_EVAL = 0, 1, 2, 3


def streams(seed: int) -> dict[str, jax.Array]:
    root = jax.random.key(seed)
    return {"init": jax.random.fold_in(root, STREAM_INIT),
            "sampling": jax.random.fold_in(root, STREAM_SAMPLING),
            "train": jax.random.fold_in(root, STREAM_TRAIN),
            "eval": jax.random.fold_in(root, STREAM_EVAL)}


def prepare_data(cfg: RunConfig, pool: data_lib.Pool | None = None) -> tuple[data_lib.Pool, data_lib.Partition, dict]:
    """Pool (``pool``, or read), partition (with the validation carve-out if asked) and its summary."""
    if pool is None:
        pool = data_lib.load_pool(cfg.dataset, data_dir=cfg.data_dir, cache_dir=cfg.cache_dir,
                                  samples=cfg.synthetic_samples)
    if cfg.aux_size >= len(pool.labels):
        raise data_lib.DataError(f"--aux-size must be < the pool size {len(pool.labels)} of "
                                 f"{cfg.dataset}; got {cfg.aux_size}")
    if getattr(cfg, "partition", "dirichlet") == "shards":
        part = data_lib.shards_partition(
            pool.labels, num_clients=cfg.num_clients, shards_per_client=cfg.shards_per_client,
            aux_size=cfg.aux_size, train_fraction=cfg.train_fraction, seed=cfg.data_seed)
        smallest = min(len(a) + len(b) for a, b in zip(part.train_idx, part.test_idx))
        if smallest < cfg.min_client_samples:   # the shards are equal: every client holds about this many
            raise data_lib.DataError(
                f"--partition shards gives clients of {smallest} samples, fewer than --min-client-samples "
                f"{cfg.min_client_samples}: use fewer --clients or lower --min-client-samples")
    else:
        part = data_lib.make_partition(
            pool.labels, num_clients=cfg.num_clients, alpha=cfg.alpha, aux_size=cfg.aux_size,
            min_client_samples=cfg.min_client_samples, balance_cap=cfg.balance_cap,
            train_fraction=cfg.train_fraction, seed=cfg.data_seed, fill=getattr(cfg, "fill", "auto"))
    summary_extra = {}
    if cfg.validation_fraction > 0:
        part = data_lib.validation_partition(part, cfg.validation_fraction, cfg.data_seed)
        summary_extra["scored_split"] = "validation"   # what its "test" sizes are: the printed summary says so
    return pool, part, {**data_lib.partition_summary(part, pool.labels, pool.num_classes), **summary_extra}


def make_algorithm(cfg: RunConfig, num_classes: int, conv_form: str | None = None):
    """The algorithm of ``cfg.method`` (see :mod:`pfedkdh_jax.algorithms`); ``conv_form``: the
    resolved form of its model's convolutions (:func:`resolved_conv_form`; None: ``cfg``'s)."""
    return algorithms.build(dataclasses.replace(cfg, conv_form=conv_form) if conv_form else cfg, num_classes)


def default_out_dir(cfg: RunConfig) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return os.path.join("runs", f"{cfg.dataset}-{cfg.method}-a{cfg.alpha:g}-s{cfg.seed}-{stamp}")


@dataclasses.dataclass
class _Group:
    """Repetitions computed together: one (no repetition axis) or several (vmapped, ``[R, ...]``).

    ``members``: ``(run, seed)`` of each repetition, ``run`` indexing the stacked runs' configs;
    ``data``: what the group's rounds read (stacked partitions, one of their slices, or one partition).
    """

    members: list[tuple[int, int]]
    schedule: np.ndarray      # [T, C], or [R, T, C] when batched
    keys: dict                # stream keys, each [R] when batched
    batched: bool
    data: Any = None
    eval_data: Any = None     # what evaluations read, when not ``data`` (--eval-clients)

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
        return [records.plain({k: v[r] for k, v in host.items()}) for r in range(len(self.members))]


def _initial_state(algo, runner: PhasedRunner, data, seed: int):
    """Repetition ``seed``'s state before round 0: ``init``, then ``before_training`` of ``algo`` (its
    run's, with its own hyperparameter values)."""
    keys = streams(seed)
    return runner.prepare(algo.init(keys["init"], data), data, keys["init"], algo=algo)


# What runs stacked in one program may differ in: their partitions (α, data seed) and directories,
# and the method's plain-number hyperparameters (MethodSpec.traced: lr, and pFedKDH's λ, T, μ; and
# MethodSpec.traced_args among its --method-arg options: FedProx's μ, say).
STACKABLE_FIELDS = ("alpha", "data_seed", "out")
PARTITION_FIELDS = ("alpha", "data_seed")


def stack_key(cfg: RunConfig) -> dict:
    """The config less :data:`STACKABLE_FIELDS` and the method's traced hyperparameters (run options
    and ``--method-arg`` options): runs with equal keys can stack (:func:`run_stacked`)."""
    spec = algorithms.METHODS[cfg.method]
    free = STACKABLE_FIELDS + spec.traced
    if cfg.eval_clients:   # a scored subset is one partition's: only runs on the same partition stack
        free = tuple(f for f in free if f not in PARTITION_FIELDS)
    key = {k: v for k, v in cfg.to_dict().items() if k not in free}
    if spec.traced_args and "method_args" in key:
        key["method_args"] = tuple(kv for kv in key["method_args"] if kv[0] not in spec.traced_args)
    return key


def _hparam_values(cfg: RunConfig) -> dict:
    """The values of the method's traced hyperparameters in ``cfg``: run options, then its own options
    (typed, their defaults where not given)."""
    spec = algorithms.METHODS[cfg.method]
    values = {f: getattr(cfg, f) for f in spec.traced}
    if spec.traced_args:
        own = algorithms.parse_method_args(cfg.method, cfg.method_args)
        values.update({f: own[f] for f in spec.traced_args})
    return values


def _varied(cfgs: list[RunConfig]) -> dict[str, list]:
    """The traced hyperparameters in which stacked runs differ: name -> each run's value."""
    values = [_hparam_values(c) for c in cfgs]
    return {f: [v[f] for v in values] for f in values[0] if len({v[f] for v in values}) > 1}


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
    return run_stacked([cfg], progress=progress, log=log, return_state=return_state, resume=resume)[0]


def run_stacked(cfgs: list[RunConfig], *, progress: bool = True, log=print, return_state: bool = False,
                resume: bool = False) -> list:
    """Runs of one method on several partitions of one pool — other α values or data seeds — and with
    other values of its plain-number hyperparameters (``MethodSpec.traced``: ``lr``, pFedKDH's
    ``lam``, ``temperature``, ``mu``; ``MethodSpec.traced_args``: FedProx's ``--method-arg mu``, say),
    each with its own ``out``, as one program: every run's
    repetitions are repetitions of one group, vmapped over stacked partitions
    (:func:`~pfedkdh_jax.data.device.stack_partitions`; one shared partition when they do not
    differ) and over each repetition's hyperparameter values (every piece rebuilds the algorithm
    from them inside the trace) with ``reps_mode`` vmap; or one after another over the stack's
    slices, which share one shape and so one set of compiled functions per hyperparameter value.
    Each run directory is written as by :func:`run` (its checkpoints hold its own repetitions), and
    each run's numbers are those of its solo run up to float rounding. Returns the summaries in the
    order of ``cfgs`` (with ``return_state``: one run only). Round times are the stacked program's.
    """
    if not cfgs:
        raise ConfigError("run_stacked needs at least one run")
    for c in cfgs:
        validate(c)
    cfgs = [dataclasses.replace(c, out=c.out or default_out_dir(c)) for c in cfgs]
    stacked = len(cfgs) > 1
    if stacked:
        _check_stackable(cfgs)
        if return_state:
            raise ConfigError("return_state takes one run")
    for c in cfgs:
        _check_writable(c.out)
        if not resume:
            _check_unused(c.out)
    with locked([c.out for c in cfgs]):
        return _run_stacked(cfgs, progress=progress, log=log, return_state=return_state, resume=resume)


def _run_stacked(cfgs: list[RunConfig], *, progress: bool, log, return_state: bool, resume: bool) -> list:
    """:func:`run_stacked` once its run directories are checked and locked: one run (or a stack of
    runs) as its named steps."""
    pool = _load_pool(cfgs[0], log)
    runs = _partition_runs(cfgs, pool, log)
    eng = _build_engine(cfgs, pool, runs, log)
    groups, states = _initial_groups(cfgs, eng)
    start, histories = 0, [[] for _ in cfgs]
    if resume:
        restored = _restore(runs.ckpts, cfgs, groups, states, eng.batched, log)
        if restored is not None:
            start, states, histories = restored
    metrics_paths = _open_run_dirs(cfgs, eng, histories, resume)
    t_start = time.perf_counter()
    _train(cfgs, runs, eng, groups, states, histories, metrics_paths, start, progress)
    summaries = _finish(cfgs, runs, eng, histories, start, time.perf_counter() - t_start, log)
    if return_state:
        return [(summaries[0], states[0], eng.data, eng.algo, eng.runner.runners[-1])]
    return summaries


@dataclasses.dataclass
class _Runs:
    """Each stacked run's partition, its summary and its checkpoints (in the order of the configs)."""

    parts: list
    summaries: list
    ckpts: list[Checkpoints]


@dataclasses.dataclass
class _Engine:
    """What the rounds run on: the data as the runners read it, the layout, the repetitions
    (``members``: ``(run, seed)``), the algorithm (and each run's, with its own hyperparameter values),
    the device mesh and the runners."""

    datas: list                   # each run's FederatedData
    data: Any                     # what a batched group reads (stacked partitions, or the one partition)
    member_data: list             # what each repetition reads alone
    eval_data: Any                # --eval-clients: the chosen clients' view, else None
    layout: Layout
    conv_form: str                # the model's convolutions (resolved_conv_form)
    members: list[tuple[int, int]]
    batched: bool
    algo: Any
    algos: list
    runner: PhasedRunner
    runners: list[PhasedRunner]   # each run's (one per hyperparameter value, run one after another)


def _load_pool(cfg: RunConfig, log) -> data_lib.Pool:
    pool = data_lib.load_pool(cfg.dataset, data_dir=cfg.data_dir, cache_dir=cfg.cache_dir,
                              samples=cfg.synthetic_samples)
    if pool.is_demo:
        log(f"NOTE: '{cfg.dataset}' is scikit-learn's bundled 8x8 digits upscaled to 28x28: a demo set "
            "for a quick offline run, not a dataset of the paper (use --dataset mnist --data-dir DIR).")
    return pool


def _partition_runs(cfgs: list[RunConfig], pool, log) -> _Runs:
    """Each run's partition (logged) and checkpoints."""
    stacked = len(cfgs) > 1
    runs = _Runs([], [], [])
    for c in cfgs:
        _, part, part_summary = prepare_data(c, pool)
        log((f"{c.out} (α = {c.alpha:g}, data seed {c.data_seed}):\n" if stacked else "")
            + data_lib.format_summary(part_summary))
        ck = Checkpoints(c.out, fingerprint(c.to_dict(), part), log=log)   # (a fresh run's: none, _check_unused)
        runs.parts.append(part)
        runs.summaries.append(part_summary)
        runs.ckpts.append(ck)
    c = cfgs[0]
    floor = ", at least 1" if int(round(c.participation * c.num_clients)) == 0 else ""
    log(f"{c.clients_per_round} of {c.num_clients} clients a round ("
        + ("--clients-per-round)" if c.per_round else
           f"--participation {c.participation:g} × {c.num_clients} clients, rounded{floor})"))
    return runs


def _build_engine(cfgs: list[RunConfig], pool, runs: _Runs, log) -> _Engine:
    """The data on the device, the layout, the algorithms, the memory pre-flight, the mesh and the runners."""
    cfg = cfgs[0]
    datas = [from_arrays(pool.images, pool.labels, partition=part, num_classes=pool.num_classes,
                         normalize=pool.normalize, eval_chunk=cfg.eval_chunk) for part in runs.parts]
    layout = engine_layout(cfg)
    members = [(i, c.seed + r) for i, c in enumerate(cfgs) for r in range(c.reps)]
    batched = len(members) > 1 and resolved_reps_mode(cfg) == "vmap"
    conv_form = resolved_conv_form(cfg, layout)
    algo = make_algorithm(cfg, pool.num_classes, conv_form)
    varied = _varied(cfgs)
    # the algorithm of each run (its own hyperparameter values) and, batched, the values per repetition
    algos = [make_algorithm(c, pool.num_classes, conv_form) for c in cfgs] if varied else [algo] * len(cfgs)
    hparams = ({f: jnp.asarray([run_values[i] for i, _ in members], jnp.float32) for f, run_values in varied.items()}
               if varied and batched else None)
    if len({(c.alpha, c.data_seed) for c in cfgs}) > 1:   # one partition per repetition, padded to one shape
        data = stack_partitions([datas[i] for i, _ in members])
        member_data = [run_slice(data, m) for m in range(len(members))]
    else:
        data, member_data = datas[0], [datas[0]] * len(members)
    runner_data = data if batched else member_data[0]
    eval_data = None   # --eval-clients: what evaluations read (the chosen clients' samples only)
    if cfg.eval_clients:   # (runs of other partitions do not stack with it: _check_stackable)
        chosen = data_lib.evaluation_clients(cfg.num_clients, cfg.eval_clients, cfg.data_seed)
        eval_data = build_federated_data(pool, data_lib.evaluation_view(runs.parts[0], chosen),
                                         eval_chunk=cfg.eval_chunk)
        empty = sum(1 for k in chosen if len(runs.parts[0].test_idx[k]) == 0)
        log(f"evaluations score {len(chosen)} of the {cfg.num_clients} clients (a fixed random subset, data seed "
            f"{cfg.data_seed})" + (f"; {empty} of them hold no scored sample, so {len(chosen) - empty} count"
                                   if empty else ""))
    preflight.check(dataclasses.replace(cfg, reps=len(members)), algo, runner_data, layout, batched)
    # Auto axes: XLA's sharding propagation places everything from the inputs' shardings.
    # A mesh takes the devices where it splits work evenly: the repetition axis, or the clients of a
    # one-call round (otherwise every device would compute everything); sequential clients of a lone
    # run are spread over the devices instead (Layout.client_devices). Lanes pack a round's work on
    # one device: no mesh.
    # (this process's devices: under jax.distributed each process runs its own share of a sweep)
    n_dev = jax.local_device_count()
    fused = (layout.client_parallel, layout.step_loop) == ("vmap", "scan")
    splits = layout.lanes is None and (len(members) % n_dev == 0 if batched
                                       else fused and cfg.clients_per_round % n_dev == 0)
    mesh = (jax.make_mesh((n_dev,), ("devices",), axis_types=(jax.sharding.AxisType.Auto,),
                          devices=jax.local_devices())
            if n_dev > 1 and splits else None)
    if mesh is not None:
        put = lambda d: jax.device_put(d, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))  # noqa: E731
        data, member_data = put(data), [put(d) for d in member_data]
        eval_data = None if eval_data is None else put(eval_data)
        runner_data = data if batched else member_data[0]

    # One runner (per phase of the method) for all groups: sequential repetitions reuse the same
    # compiled functions (one set per hyperparameter value).
    workload = run_workload(cfg, 1 if batched else len(members))
    # the loop drops each round's input state: its buffers are donated to the round
    runner = PhasedRunner(algo, runner_data, layout, reps=len(members) if batched else None, mesh=mesh,
                          hparams=hparams, workload=workload, donate_state=True)
    runners = [runner] * len(cfgs)
    if varied and not batched:
        by_values: dict[tuple, PhasedRunner] = {}
        for i, c in enumerate(cfgs):
            values = tuple(run_values[i] for run_values in varied.values())
            if values not in by_values:
                by_values[values] = (runner if i == 0 else
                                     PhasedRunner(algos[i], runner_data, layout, reps=None, mesh=mesh,
                                                  workload=workload, donate_state=True))
            runners[i] = by_values[values]
    spread = runner.runners[0].spread
    if spread is not None or mesh is not None:
        log(f"{len(spread.devices) if spread else n_dev} {jax.default_backend()} devices: "
            + ("sequential clients spread over them" if spread else
               "repetitions split over them" if batched else "each round's clients split over them"))
    if spread is not None and jax.default_backend() == "cpu":
        from pfedkdh_jax.engine.cpu_devices import oversubscribed
        note = oversubscribed(len(spread.devices))
        if note:
            log(f"note: {note}")
    return _Engine(datas, data, member_data, eval_data, layout, conv_form, members, batched, algo, algos, runner,
                   runners)


def _initial_groups(cfgs: list[RunConfig], eng: _Engine) -> tuple[list[_Group], list]:
    """The groups of repetitions computed together (all of them batched, else one each), with their
    client schedules, keys and states before round 0."""
    cfg, members = cfgs[0], eng.members
    groups, states = [], []
    for group in ([list(range(len(members)))] if eng.batched else [[m] for m in range(len(members))]):
        ks = [streams(members[m][1]) for m in group]
        sched = [sample_schedule(k["sampling"], cfg.rounds, cfg.num_clients, cfg.clients_per_round) for k in ks]
        st = [_initial_state(eng.algos[members[m][0]], eng.runner, eng.member_data[m], members[m][1]) for m in group]
        if eng.batched:
            keys = {name: jnp.stack([k[name] for k in ks]) for name in ks[0]}
            groups.append(_Group([members[m] for m in group], np.stack(sched), keys, True, eng.data, eng.eval_data))
            states.append(eng.runner.place(tree_stack(st)))
        else:
            groups.append(_Group([members[group[0]]], sched[0], ks[0], False, eng.member_data[group[0]], eng.eval_data))
            states.append(st[0])
    return groups, states


def _open_run_dirs(cfgs: list[RunConfig], eng: _Engine, histories: list, resume: bool) -> list[str]:
    """Each run directory with its config.json (kept on a resume) and its metrics.jsonl rewritten to
    the rows of the rounds already done; returns the metrics paths."""
    for c in cfgs:
        _make_dir(c.out)
        if not resume or not os.path.exists(os.path.join(c.out, "config.json")):
            records.write_json(os.path.join(c.out, "config.json"), {
                **c.to_dict(), "engine": {**dataclasses.asdict(eng.layout), "conv_form": eng.conv_form},
                "reps_batched": eng.batched,
                "stacked_runs": len(cfgs), "environment": records.environment()})
    metrics_paths = [os.path.join(c.out, "metrics.jsonl") for c in cfgs]
    for path, history in zip(metrics_paths, histories):
        records.write_text(path, "".join(json.dumps(r) + "\n" for r in history))
    return metrics_paths


def _train(cfgs: list[RunConfig], runs: _Runs, eng: _Engine, groups: list[_Group], states: list,
           histories: list, metrics_paths: list[str], start: int, progress: bool) -> None:
    """Rounds ``start`` … ``rounds − 1`` of every group (``states`` updated in place): train, evaluate
    when due, append each run's row, stop on divergence, checkpoint when due."""
    cfg = cfgs[0]
    # the rounds whose training (evaluation) compiled something say so ("compiles", "eval_compiles",
    # with JAX's compile seconds), and the summary's medians leave them out (records.summary): a
    # session's first round, a phase's first, each phase's first evaluation and EA, and any round whose
    # clients first need a new step width or plan
    with records.progress(cfg.rounds, progress) as bar, records.CompileWatch() as watch:
        bar.update(start)   # the bar is closed (drawn once more) before a Ctrl-C's line
        for t in range(start, cfg.rounds):
            last = t == cfg.rounds - 1
            do_eval = last or (t + 1) % cfg.eval_every == 0
            do_ea = (do_eval and (cfg.ea_steps > 0 or cfg.ea_epochs > 0) and (last or (t + 1) % cfg.ea_every == 0)
                     and eng.runner.personalizes_at(t))   # EA where round t's phase has one
            t0 = time.perf_counter()
            rep_rows, train_s, eval_s = [[] for _ in cfgs], 0.0, 0.0
            before, eval_c = watch.reading(), 0   # compile events: the round's, in evaluation
            for g, group in enumerate(groups):
                t1 = time.perf_counter()
                runner_g = eng.runners[group.members[0][0]]   # batched: the one runner of every run
                states[g], train_m = runner_g.round(states[g], group.data, group.selected(t), group.round_key("train", t), t)
                jax.block_until_ready(states[g])
                t2 = time.perf_counter()
                c2 = watch.reading()
                eval_m = (runner_g.evaluate(states[g], group.data if group.eval_data is None else group.eval_data,
                                            group.round_key("eval", t), t, personalize=do_ea)
                          if do_eval else {})
                per_rep = group.split({**train_m, **eval_m})
                t3 = time.perf_counter()
                c3 = watch.reading()
                train_s, eval_s = train_s + t2 - t1, eval_s + t3 - t2
                eval_c += c3[0] - c2[0]
                sel = np.asarray(group.selected(t)).reshape(len(group.members), -1)
                for r, ((i, seed), row) in enumerate(zip(group.members, per_rep)):
                    rep_rows[i].append({"round": t + 1, "seed": seed, **row, "clients": [int(k) for k in sel[r]]})
            seconds = time.perf_counter() - t0
            after = watch.reading()   # a compile outside the evaluations counts as the training's
            flags = ({"compiles": True} if after[0] - before[0] > eval_c else {}) | (
                {"eval_compiles": True} if eval_c else {}) | (
                {"compile_seconds": after[1] - before[1]} if after[0] > before[0] else {})
            for i, c in enumerate(cfgs):
                row = records.combine(rep_rows[i])
                row.update(train_seconds=train_s, eval_seconds=eval_s, seconds=seconds, **flags)
                histories[i].append(row)
                with open(metrics_paths[i], "a") as f:
                    f.write(json.dumps(row) + "\n")
            _stop_on_divergence(cfgs, runs, eng, histories, rep_rows, t)
            if cfg.checkpoint_every and ((t + 1) % cfg.checkpoint_every == 0 or last):
                for i, ck in enumerate(runs.ckpts):
                    ck.save(t + 1, _run_states(i, groups, states, eng.batched), histories[i])
            bar.update(1)
            bar.set_postfix(records.postfix(histories[0][-1]))


def _stop_on_divergence(cfgs, runs: _Runs, eng: _Engine, histories, rep_rows, t: int) -> None:
    """A repetition's non-finite (or too large) loss or accuracy, or clients a ClientRows could not
    place, ends the run: its summary says so."""
    for i, c in enumerate(cfgs):
        for rep in rep_rows[i]:
            problem = records.divergence(rep, c.divergence_loss)
            if problem:
                error = RowsExhaustedError if rep.get("rows_lost", 0) > 0 else DivergenceError
                summary = records.summary(c, histories[i], runs.summaries[i], eng.runners[i],
                                          status=f"{error.kind} at round {t + 1}")
                records.write_json(os.path.join(c.out, "summary.json"), summary)
                who = f" in repetition {rep['seed'] - c.seed} (seed {rep['seed']})" if c.reps > 1 else ""
                hint = "" if error is RowsExhaustedError else " (try a smaller --lr)"
                raise error(f"{problem}{who} at round {t + 1}{hint}; everything up to it is in {c.out}")


def _plot_curves(c: RunConfig, history: list[dict], log) -> None:
    """The run's curves.png (a failure is a warning: a plot must never lose a finished run)."""
    try:
        from pfedkdh_jax.run.plots import plot_curves
        plot_curves(history, os.path.join(c.out, "curves.png"),
                    title=f"{c.method} on {c.dataset}, α={c.alpha:g}"
                          + (f", {c.reps} repetitions (mean ± std)" if c.reps > 1 else ""))
    except Exception as e:
        log(f"warning: curves.png not written: {e}")


def _finish(cfgs: list[RunConfig], runs: _Runs, eng: _Engine, histories: list, start: int, seconds: float,
            log) -> list[dict]:
    """Each run's summary.json (with its message bytes) and curves.png; returns the summaries.
    ``seconds``: this session's rounds ``start`` … ``rounds − 1``; the rounds of earlier sessions (a
    resumed run) count by their metrics rows."""
    summaries = []
    for i, c in enumerate(cfgs):
        summary = records.summary(c, histories[i], runs.summaries[i], eng.runners[i], status="completed")
        summary["bytes_per_client_round"] = message_bytes(eng.algo, eng.datas[i], streams(c.seed)["init"])
        summary["total_seconds"] = sum(r.get("seconds", 0.0) for r in histories[i][:start]) + seconds
        summary["session_seconds"] = seconds
        if len(cfgs) > 1:
            summary["stacked_runs"] = [o.out for o in cfgs]   # its round times are the whole stack's
        records.write_json(os.path.join(c.out, "summary.json"), summary)
        _plot_curves(c, histories[i], log)
        summary["out"] = c.out
        summaries.append(summary)
    return summaries


def _check_stackable(cfgs: list[RunConfig]) -> None:
    base = stack_key(cfgs[0])
    for c in cfgs[1:]:
        diff = sorted(k for k, v in stack_key(c).items() if base.get(k) != v)
        if c.eval_clients and set(diff) & set(PARTITION_FIELDS):
            raise ConfigError("--eval-clients scores one partition's clients: it cannot stack runs of other "
                              "α or data seeds (run them apart)")
        if diff:
            spec = algorithms.METHODS[c.method]
            free = STACKABLE_FIELDS + spec.traced + tuple(f"--method-arg {a}" for a in spec.traced_args)
            raise ConfigError(f"stacked runs may differ only in {', '.join(free)}; "
                              f"{c.out} also differs in {', '.join(diff)}")
    outs = [c.out for c in cfgs]
    if len(set(outs)) != len(outs):
        raise ConfigError("stacked runs need one --out each; " + ", ".join(sorted({o for o in outs if outs.count(o) > 1}))
                          + " is given twice")
    if not algorithms.METHODS[cfgs[0].method].stackable:
        raise ConfigError(f"{cfgs[0].method}'s runs do not stack (its shapes depend on the partition): "
                          "run them one by one")


def _run_states(i: int, groups: list[_Group], states: list, batched: bool) -> list:
    """Run ``i``'s states in the layout of its solo run (so ``pfedkdh resume`` of its directory alone
    works too): one batched group sliced to its repetitions (a lone repetition without the axis, as
    a solo run of one repetition keeps it), or its repetitions' groups."""
    if batched:
        take = np.asarray([m for m, (run_, _) in enumerate(groups[0].members) if run_ == i])
        if len(take) == 1:
            return [jax.tree_util.tree_map(lambda a: a[take[0]], states[0])]
        return [jax.tree_util.tree_map(lambda a: a[take], states[0])]
    return [s for g, s in zip(groups, states) if g.members[0][0] == i]


def _restore(ckpts, cfgs, groups, states, batched, log):
    """Every run's newest checkpoint of one common round, reassembled into the groups' states;
    ``None`` (start from round 0) if there is none."""
    newest = [max(ck.rounds(), default=0) for ck in ckpts]
    common = min(newest)
    restored = []
    for i, ck in enumerate(ckpts):
        got = ck.restore_latest(_run_states(i, groups, states, batched), upto=common) if common else None
        if got is None or (restored and got[0] != restored[0][0]):
            log(f"no usable checkpoint {'of one round in all of' if len(cfgs) > 1 else 'in'} "
                f"{', '.join(c.out for c in cfgs)}: starting from round 0")
            return None
        restored.append(got)
    start = restored[0][0]
    if batched:
        counts = [c.reps for c in cfgs]   # each run's repetitions, in member order (a lone one without the axis)
        parts = [r[1][0] if n > 1 else jax.tree_util.tree_map(lambda a: a[None], r[1][0])
                 for r, n in zip(restored, counts)]
        merged = [jax.tree_util.tree_map(lambda *xs: jnp.concatenate(xs), *parts)]
    else:
        merged = [s for r in restored for s in r[1]]
    for c in cfgs:
        log(f"resuming {c.out} after round {start}")
    return start, merged, [r[2] for r in restored]


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


def _check_unused(out_dir: str) -> None:
    """A fresh run's directory must not hold a sweep, a run's results or its checkpoints (a ConfigError
    says what it holds, before anything loads): a run killed before its first checkpoint, with nothing
    to keep, may start again there."""
    if os.path.exists(os.path.join(out_dir, "sweep.json")):
        raise ConfigError(f"--out {out_dir} holds a sweep (sweep.json): give the run a directory of its own")
    held = stored_summary(out_dir)
    if held is None:
        if has_checkpoints(out_dir):
            raise ConfigError(f"{out_dir} already holds checkpoints of a run; continue it with "
                              f"`pfedkdh resume {out_dir}` or choose another --out")
        return
    status = held.get("status", "finished")
    if ended(held):   # resuming would replay the same options to the same end
        raise ConfigError(f"--out {out_dir} already holds a {held.get('method', '')} run that {status} "
                          f"({held.get('rounds_completed', '?')} rounds kept): choose another --out, or remove it to "
                          "start over (with other options: resuming it would end so again)".replace("a  run", "a run"))
    what = f"a {status} {held.get('method', '')} run".replace("  ", " ")
    more = ("" if status == "completed" else   # a finished run has nothing to continue
            f", or continue it with `pfedkdh resume {out_dir}`")
    raise ConfigError(f"--out {out_dir} already holds {what} ({held.get('rounds_completed', '?')} rounds): choose "
                      f"another --out or remove it to start over{more}")


def ended(summary: dict | None) -> bool:
    """A run that stopped itself (diverged, or ran out of a method's rows): its options, replayed by a
    resume, would end it the same way."""
    return str((summary or {}).get("status", "")).startswith((DivergenceError.kind, RowsExhaustedError.kind))


def stored_summary(run_dir: str) -> dict | None:
    """The summary.json a run wrote in ``run_dir``; ``None`` where there is none (or none whole)."""
    try:
        with open(os.path.join(run_dir, "summary.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def has_checkpoints(run_dir: str) -> bool:
    ckpt = os.path.join(run_dir, "checkpoints")
    return os.path.isdir(ckpt) and bool(os.listdir(ckpt))


def _make_dir(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--out {path}: cannot create it ({e.strerror or e})") from None


def run_workload(cfg: RunConfig, passes: int = 1) -> Workload:
    """What the run asks of its runner, which then compiles only the narrow step widths that pay for
    it (``--slot-granule auto``; :func:`~pfedkdh_jax.engine.local.paying_widths`): ``passes`` runs
    of ``--rounds`` rounds (sequential repetitions reuse one runner), ``--clients-per-round``
    clients each, and every evaluation (a fine-tuning method personalizes every client at each)."""
    evaluations = sum(1 for t in range(cfg.rounds) if t == cfg.rounds - 1 or (t + 1) % cfg.eval_every == 0)
    return Workload(cfg.rounds * passes, cfg.clients_per_round, evaluations * passes)


def engine_layout(cfg: RunConfig) -> Layout:
    """The run's resolved layout; a layout that cannot be (``--lanes`` without vmap + scan) is one
    line (ConfigError)."""
    try:
        layout = Layout(cfg.client_parallel, cfg.step_loop, cfg.chunk_steps, client_devices=cfg.client_devices,
                        slot_granule=slot_granule(cfg), fused_steps=fused_steps(cfg)).resolved()
    except ValueError as e:   # --client-devices beyond the local devices, or without sequential clients
        raise ConfigError(f"--client-devices: {e}") from None
    try:
        return dataclasses.replace(layout, lanes=cfg.lanes).resolved()
    except ValueError:   # validate() checked --lanes >= 1: the layout is what cannot take lanes
        raise ConfigError(f"--lanes {cfg.lanes} needs --client-parallel vmap --step-loop scan (this run has "
                          f"{layout.client_parallel} + {layout.step_loop}, the {jax.default_backend()} default "
                          "where not given)") from None


def resolved_conv_form(cfg: RunConfig, layout: Layout) -> str:
    """``lax``, ``patches`` or ``winograd`` for the model's convolutions. auto: the model's own choice for
    the backend (:func:`~pfedkdh_jax.model.auto_conv_form`: ``winograd`` on a CPU, whose training step ran
    1.4–1.6× as fast as with XLA's convolution on one member and 1.25× on ten vmapped members with weights
    of their own, where the matmul over patches ran 0.66× and 0.98×: MNIST, BENCHMARKS.md, "Winograd"),
    except inside a loop on a CPU: a run whose local steps are a ``lax.scan`` takes the patches, as XLA:CPU
    runs a convolution (conv1, in the Winograd form) inside a loop about 25× slower than outside one and
    the matmul at its usual speed (``experiments/conv_in_loop.py``)."""
    if cfg.conv_form != "auto":
        return cfg.conv_form
    form = model_lib.auto_conv_form()
    return "patches" if form == "winograd" and layout.step_loop == "scan" else form


def resolved_reps_mode(cfg: RunConfig) -> str:
    """``vmap`` or ``sequential`` for the repetitions (auto: sequential on CPU, see BENCHMARKS.md)."""
    if cfg.reps_mode != "auto":
        return cfg.reps_mode
    return "sequential" if jax.default_backend() == "cpu" else "vmap"


def load_run_config(run_dir: str, **overrides) -> RunConfig:
    """The :class:`RunConfig` stored in ``run_dir``/config.json (with ``overrides``; ``out`` = ``run_dir``)."""
    path = os.path.join(run_dir, "config.json")
    if not os.path.exists(path):
        hint = (": it holds a sweep; its runs are its points/* (to continue the sweep, run its command again)"
                if os.path.exists(os.path.join(run_dir, "sweep.json")) else
                " (no config.json yet: the run there is starting now; its run.lock names the process)"
                if held_by_a_live_process(run_dir) else
                " (no config.json: the run there stopped before it started; run its command again)"
                if os.path.exists(os.path.join(run_dir, "run.lock")) else " (no config.json)")
        raise CheckpointError(f"{run_dir} is not a run directory{hint}")
    with open(path) as f:
        stored = json.load(f)
    fields = {f.name for f in dataclasses.fields(RunConfig)}
    values = {k: v for k, v in stored.items() if k in fields}
    values["method_args"] = tuple(tuple(p) for p in values.get("method_args", ()))
    values["plugins"] = tuple(values.get("plugins", ()))
    values.update(overrides, out=run_dir)
    return RunConfig(**values)


def resume(run_dir: str, *, progress: bool = True, log=print, **overrides) -> dict[str, Any]:
    """Continue the run in ``run_dir`` with the config stored there (and ``overrides``). A run already
    complete is left as it is (its summary is returned), but for what a process killed in its last writes
    left undone: its curves.png is drawn, its lock removed."""
    cfg = validate(load_run_config(run_dir, **overrides))   # its method and dataset found (plugins), its options
    done = stored_summary(run_dir)
    if done and ended(done):
        raise ConfigError(f"{run_dir}: the run {done['status']}; resuming it replays its stored options to the same "
                          "end: start a new run with other options (a lower --lr where it diverged, more of the "
                          "method's rows where it stopped) and another --out")
    if done and done.get("status") == "completed" and done.get("rounds_completed") == cfg.rounds:
        curves, lock = (os.path.join(run_dir, f) for f in ("curves.png", "run.lock"))
        if not os.path.exists(curves) or (os.path.exists(lock) and not held_by_a_live_process(run_dir)):
            try:   # a dead process's lock is taken over, and removed with this one
                with locked([run_dir]):
                    if not os.path.exists(curves):
                        from pfedkdh_jax.run.report import read_rows
                        _plot_curves(dataclasses.replace(cfg, out=run_dir), read_rows(run_dir), log)
                        if os.path.exists(curves):
                            log(f"{run_dir}: curves.png drawn (the run was stopped after its summary)")
            except (OSError, ConfigError) as e:   # a read-only directory, a live process's lock: left as it is
                log(f"warning: {run_dir} left as it is ({e})")
        log(f"{run_dir}: already complete ({cfg.rounds} rounds); nothing to resume")
        return {**done, "out": run_dir}
    return run(cfg, progress=progress, log=log, resume=True)


