"""``pfedkdh sweep``: a grid of datasets × α × methods (× hyperparameter values) × seeds, and the
paper's tables from it.

A *point* of the grid is one dataset, one α, one method and one value of every ``--grid`` option that
method reads; its seeds run as the repetitions of one run (``--reps``: one vmapped program on a
GPU/TPU, one compiled set of functions reused on a CPU), in ``DIR/points/<point>/``, a run directory
like any other (``pfedkdh report`` and ``pfedkdh resume`` work on it). The sweep directory holds:

* ``sweep.json``: the grid and the run options (running the same command again continues the sweep;
  another grid in the same directory is an error);
* ``table.md`` / ``table.csv``: the paper's Table 2 layout — a row per method (pFedKDH as two, Fair and
  EA), a column per dataset × α, cells the final mean ± std over seeds of the method's table metric
  (personalized macro accuracy; the global model's for the shared-model methods), the best of each
  column in bold;
* ``costs.md``: seconds per round per point, its ratio to FedPer's on the same cell, and the bytes one
  selected client downloads and uploads per round (from the shapes of the method's ``messages``; the
  paper's O(|S_t|·P_b) argument);
* ``curves-<dataset>-a<alpha>.png``: accuracy vs round per cell, mean with a ± std band, one line
  per method (the paper's Figure 2).

With ``stack`` (``pfedkdh sweep --stack``) the points that differ only in α and in ``--grid`` values
of plain-number hyperparameters (``MethodSpec.traced``: ``lr``, pFedKDH's ``lam``, ``temperature``,
``mu``; and a method's own ones, ``MethodSpec.traced_args``: ``--grid fedprox:mu=0.01,0.1``) run as
one program (:func:`~pfedkdh_jax.run.experiment.run_stacked`: their partitions and values stacked
along the repetition axis, vmapped with ``--reps-mode vmap``; else one after another, on one set of
compiled functions per value); each keeps its own directory, and its numbers are its
solo run's up to float rounding. Methods whose shapes depend on the partition (FedFed) run point by
point, and so do grid values that change shapes or code (epochs, batch size, transfer forms); with
``eval_clients`` (a scored subset is one partition's) only the points of one α and data seed stack.

Under ``jax.distributed`` (``pfedkdh sweep --coordinator HOST:PORT --num-processes N --process-id I``,
one command per process, the sweep directory on a file system they share) the processes split the
sweep: point j in sweep order goes to process j mod N, so every stack is divided among them and each
process runs its part of it as one program on its own devices. The runs never exchange anything
(each is complete in itself), so no array spans processes; ``jax.distributed`` supplies the process
index and count and the barriers: all start once process 0 has written ``sweep.json``, and process 0
writes the tables once all have finished. Their numbers equal a one-process sweep's up to float
rounding (a stack's runs equal their solo runs).

Interrupted sweeps resume: a finished point is kept, a point with checkpoints resumes from the
newest (bit-identical to an uninterrupted run), a point killed before its first checkpoint starts
again; the tables are rebuilt from the run directories, so they equal an uninterrupted sweep's.
(Over 300 lines: the grid, the order its points run in and the three outputs belong together.)
"""

from __future__ import annotations

import csv
import dataclasses
import itertools
import json
import os
import shutil
from typing import Any, Callable

from pfedkdh_jax.algorithms import METHODS, method_arg_value
from pfedkdh_jax.data.sources import check_available, dataset_names
from pfedkdh_jax.run.config import ConfigError, RunConfig, canonical_name, make_config, plugins, under

# RunConfig fields that only some methods read (a --grid over one of them applies to those methods)
_METHOD_FIELDS = {o for spec in METHODS.values() for o in spec.run_options}
_AXES = ("dataset", "alpha", "method", "reps", "out")   # set by the sweep itself, per point


@dataclasses.dataclass(frozen=True)
class Sweep:
    datasets: tuple[str, ...]
    alphas: tuple[float, ...]
    methods: tuple[str, ...]
    seeds: int = 1                                   # repetitions per point: seeds seed, seed+1, ...
    grid: tuple[tuple[str, tuple], ...] = ()         # ((RunConfig field or METHOD:KEY, (values...)), ...)
    preset: str = "default"
    options: tuple[tuple[str, Any], ...] = ()        # other run options, shared by every point
    method_args: tuple[tuple[str, tuple], ...] = ()  # ((method, ((key, text), ...)), ...)
    stack: bool = False                              # points differing only in α and traced values: one program

    def to_json(self) -> dict:
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def from_json(cls, spec: dict) -> "Sweep":
        """The sweep a sweep.json holds (:meth:`to_json`'s lists back as tuples)."""
        pairs = lambda items: tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in items or [])  # noqa: E731
        return cls(datasets=tuple(spec["datasets"]), alphas=tuple(spec["alphas"]), methods=tuple(spec["methods"]),
                   seeds=spec.get("seeds", 1), grid=pairs(spec.get("grid")), preset=spec.get("preset", "default"),
                   options=pairs(spec.get("options")),
                   method_args=tuple((m, tuple(tuple(a) for a in args)) for m, args in spec.get("method_args") or []),
                   stack=bool(spec.get("stack")))


def make_sweep(datasets, alphas, methods, seeds=1, grid=None, preset="default", options=None,
               method_args=None, stack=False) -> Sweep:
    """A validated :class:`Sweep`: every point's config is built (and so checked) here."""
    def listed(name, values):
        values = tuple(values)
        if not values:
            raise ConfigError(f"--{name} needs at least one value")
        if len(set(values)) != len(values):
            raise ConfigError(f"--{name} lists a value twice: {', '.join(map(str, values))}")
        return values
    options = dict(options or {})
    if "plugins" in options:   # methods of one's own registered before the points are built
        options["plugins"] = plugins(options["plugins"])
    methods = [canonical_name(m, METHODS) for m in methods]   # FedAvg as fedavg, fmnist as fashion_mnist
    datasets = [canonical_name(d, dataset_names()) for d in datasets]
    merged: dict[str, list] = {}   # FedProx:... and fedprox:... are one method's
    for m, pairs in (method_args or {}).items():
        merged.setdefault(canonical_name(m, METHODS), []).extend(tuple(p) for p in pairs)
    method_args = merged
    for key in options:
        if key in _AXES:
            raise ConfigError(f"{key!r} is an axis of the sweep (--{key}s / --seeds), not a run option")
        if key not in RunConfig.__dataclass_fields__:
            raise ConfigError(f"{key!r} is not a run option")
    named, grid = grid or {}, {}
    for k, values in named.items():
        if _own_key(k) in grid:
            raise ConfigError(f"--grid {k}: given twice (as {next(g for g in named if _own_key(g) == _own_key(k))})")
        grid[_own_key(k)] = values
    for key, values in grid.items():
        m, own = _split_key(key)
        if m is not None:   # METHOD:KEY, a method's own option (its --method-arg), one method's points only
            if not m or not own:
                raise ConfigError(f"--grid {key}: name the method and its option, METHOD:KEY=V1,V2")
            if m not in methods:
                raise ConfigError(f"--grid {key}: {m} is not one of the sweep's --methods")
            spec = METHODS.get(m)
            if spec is not None and own not in spec.args:
                raise ConfigError(f"--grid {key}: {m} has no option {own!r} of its own"
                                  + (f" (its own: {', '.join(spec.args)})" if spec.args else
                                     f" (its options are run options: --grid {own}=V1,V2)"))
            if any(k == own for k, _ in (method_args.get(m) or ())):
                raise ConfigError(f"--grid {key} and --method-arg {m}:{own}=...: give one of them")
            if spec is not None:   # typed as the option is: 0.1 and 0.10 are one value
                try:
                    grid[key] = values = [method_arg_value(m, own, v) for v in values]
                except ValueError as e:
                    raise ConfigError(f"--grid {key}: {e}") from None
            listed(f"grid {key}", values)
            continue
        if key in _AXES or key not in RunConfig.__dataclass_fields__:
            raise ConfigError(f"--grid {key}: not a run option that a grid can vary")
        listed(f"grid {key}", values)
        if key in _METHOD_FIELDS and not any(key in METHODS[m].run_options for m in methods if m in METHODS):
            users = ", ".join(m for m, spec in METHODS.items() if key in spec.run_options)
            own = [m for m in methods if m in METHODS and key in METHODS[m].args]
            hint = f" ({own[0]}'s own {key}: --grid {own[0]}:{key}=V1,V2)" if own else ""
            raise ConfigError(f"--grid {key}: none of the sweep's methods reads it (an option of {users}){hint}")
    if not isinstance(seeds, int) or seeds < 1:
        raise ConfigError(f"--seeds must be >= 1; got {seeds}")
    alphas = tuple(alphas)
    if options.get("partition") == "shards" and len(alphas) > 1:   # one split under every α label
        raise ConfigError(f"--partition shards does not read α: --alphas {','.join(map(str, alphas))} would run "
                          "one partition under each label; give one α")
    sweep = Sweep(listed("datasets", datasets), tuple(float(a) for a in listed("alphas", alphas)),
                  listed("methods", methods), seeds, tuple((k, tuple(v)) for k, v in grid.items()), preset,
                  tuple(sorted(options.items())),
                  tuple((m, tuple(tuple(p) for p in pairs)) for m, pairs in method_args.items()),
                  bool(stack))
    for m, _ in sweep.method_args:
        if m not in sweep.methods:
            raise ConfigError(f"--method-arg {m}:...: {m} is not one of the sweep's --methods")
    points(sweep)  # builds (and validates) every point's config
    return sweep


def _split_key(key: str) -> tuple[str | None, str]:
    """A grid key as ``(method, option)``: ``METHOD:KEY`` a method's own option, else ``(None, key)``."""
    m, colon, own = key.partition(":")
    return (m, own) if colon else (None, key)


def _own_key(key: str) -> str:
    """A grid key ``METHOD:KEY`` with the method's name as registered (``FedProx:mu`` → ``fedprox:mu``)."""
    m, own = _split_key(key)
    return key if m is None else f"{canonical_name(m, METHODS)}:{own}"


def _grid_for(sweep: Sweep, method: str) -> list[tuple[str, tuple]]:
    """The grid options ``method`` reads: shared options, the method-only ones it uses, and its own
    (``METHOD:KEY``, named here by ``KEY`` alone)."""
    return [(own, v) for (m, own), v in ((_split_key(k), v) for k, v in sweep.grid)
            if (m == method if m is not None else own not in _METHOD_FIELDS or own in METHODS[method].run_options)]


def _own_options(sweep: Sweep, method: str) -> set[str]:
    """The keys of ``method``'s own options the grid varies."""
    return {own for m, own in (_split_key(k) for k, _ in sweep.grid) if m == method}


def _fmt(v) -> str:
    return str(v).replace("/", "_")


def points(sweep: Sweep, out: str = "sweep") -> list[tuple[str, RunConfig]]:
    """``[(point name, its RunConfig), ...]`` in table order."""
    margs = dict(sweep.method_args)
    result = []
    for dataset, alpha, method in itertools.product(sweep.datasets, sweep.alphas, sweep.methods):
        grid, own = _grid_for(sweep, method), _own_options(sweep, method)
        for values in itertools.product(*[v for _, v in grid]):
            chosen = dict(zip([k for k, _ in grid], values))
            name = f"{dataset}-a{_fmt(alpha)}-{method}" + "".join(f"-{k}{_fmt(v)}" for k, v in chosen.items())
            options = {k: v for k, v in chosen.items() if k not in own}
            fixed = under(dict(sweep.options), options)   # a grid's count of clients (or share) wins
            args = tuple(margs.get(method, ())) + tuple((k, str(v)) for k, v in chosen.items() if k in own)
            try:
                cfg = make_config(sweep.preset, **{**fixed, **options}, dataset=dataset,
                                  alpha=alpha, method=method, reps=sweep.seeds, method_args=args,
                                  out=os.path.join(out, "points", name))
            except ConfigError as e:
                # a method's run option (--lam) given to a sweep of several methods: --grid gives it only to those
                # that use it
                kept = sorted(k for k in fixed if f"--{k.replace('_', '-')} is an option of" in str(e))
                hint = (f" (a sweep's --grid {kept[0]}=V gives it to the methods that use it only)"
                        if kept and len(sweep.methods) > 1 else "")
                raise ConfigError(f"sweep point {name}: {e}{hint}") from None
            result.append((name, cfg))
    return result


def _status(run_dir: str) -> str:
    """completed | ended (diverged, or stopped: run again, it would end so again) | checkpointed | started | new"""
    from pfedkdh_jax.run.experiment import ended, has_checkpoints, stored_summary   # (JAX: imported by a sweep's run)
    held = stored_summary(run_dir)
    if (held or {}).get("status") == "completed":
        return "completed"
    if ended(held):
        return "ended"
    if has_checkpoints(run_dir):
        return "checkpointed"
    return "started" if os.path.exists(run_dir) else "new"


def _grid_of(spec: dict) -> dict:
    return {k: v for k, v in spec.items() if k != "stack"}


_GROWING = ("datasets", "alphas", "methods")


def _added(old: dict, new: dict) -> str:
    """What ``new`` (a sweep.json) adds to ``old`` when it only grows it — more datasets, α values or
    methods (with their own args and ``METHOD:KEY`` grids), every other field (seeds, grid, preset,
    options, the old methods' own args) the same — as text (``"+ methods fedavg"``); ``""`` otherwise."""
    if any(old.get(k) != new.get(k) for k in set(old) | set(new) if k not in _GROWING + ("method_args", "grid")):
        return ""
    if any(not set(old.get(k, ())) <= set(new.get(k, ())) for k in _GROWING):
        return ""
    old_args, new_args = (dict(map(tuple, spec.get("method_args") or [])) for spec in (old, new))
    if any(new_args.get(m) != old_args.get(m) for m in old.get("methods", ())):
        return ""
    old_grid, new_grid = (dict(map(tuple, spec.get("grid") or [])) for spec in (old, new))
    added_methods = set(new.get("methods", ())) - set(old.get("methods", ()))
    if any(new_grid.get(k) != v for k, v in old_grid.items()) or any(
            _split_key(k)[0] not in added_methods for k in set(new_grid) - set(old_grid)):
        return ""
    return ", ".join(f"+ {k} {','.join(map(str, [v for v in new[k] if v not in old[k]]))}" for k in _GROWING
                     if set(new[k]) - set(old[k]))


def _in_stored_order(sweep: Sweep, stored: dict) -> Sweep:
    """``sweep`` with its datasets, α values, methods and grid (keys and values) in the order a stored
    sweep.json lists them where it holds the same ones, the new ones after: a grid given in another
    order is the same grid (its points, their names and the table's order stay the stored ones)."""
    def ordered(mine, theirs):
        theirs = [t for t in theirs if t in mine]
        return tuple(theirs + [m for m in mine if m not in theirs]) if len(theirs) == len(set(theirs)) else mine
    changes = {k: ordered(getattr(sweep, k), stored.get(k) or []) for k in _GROWING}
    grid, theirs = dict(sweep.grid), [(k, list(v)) for k, v in stored.get("grid") or []]
    if all(k in grid for k, _ in theirs):
        same = lambda a, b: len(a) == len(b) and all(x in b for x in a)   # noqa: E731  (values may be lists)
        new = [(k, ordered(grid[k], v) if same(grid[k], v) else grid[k]) for k, v in theirs]
        changes["grid"] = tuple(new + [(k, v) for k, v in sweep.grid if k not in dict(theirs)])
    return dataclasses.replace(sweep, **changes)


def _in_other_words(stored: dict, sweep: Sweep, out: str) -> str | None:
    """``sweep`` against the sweep stored as ``stored`` (a sweep.json) where their options or preset
    are written differently (a flag given now at the value the preset gave before): ``""`` when they
    have the same points, each with the same run config; what ``sweep`` adds (as :func:`_added` says
    it) when it holds every stored point with the same config and grows by datasets, α or methods
    only; ``None`` otherwise (another sweep)."""
    def config_of(s):
        return {name: {k: v for k, v in cfg.to_dict().items() if k != "out"} for name, cfg in points(s, out)}
    try:
        before, now = config_of(Sweep.from_json(stored)), config_of(sweep)
    except (ConfigError, KeyError, TypeError, ValueError):   # a stored grid this code cannot rebuild: not the same
        return None
    if any(now.get(name) != cfg for name, cfg in before.items()):
        return None
    if before.keys() == now.keys():
        return ""
    loose = {"options": None, "preset": None}   # compared through the points' configs above
    return _added({**_grid_of(stored), **loose}, {**_grid_of(sweep.to_json()), **loose}) or None


def _spec_value(value) -> str:
    """A sweep.json field as one short line."""
    if isinstance(value, list) and all(isinstance(v, (str, int, float)) for v in value):
        return ",".join(map(str, value)) or "none"
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


ORDERS = ("table", "methods")


def run_sweep(sweep: Sweep, out: str, *, progress: bool = False, log: Callable = print,
              order: str = "table") -> dict:
    """Run (or continue) every point of ``sweep`` under ``out``, then write the tables and figures.

    ``order`` is the order the points run in (how, not what: it may change between calls): ``table``
    cell by cell (dataset, α, then the methods as listed), ``methods`` method by method over every
    cell (list the cheapest methods first and whole rows of the table fill first).

    Under ``jax.distributed`` this process runs its share of the points (:func:`share`) and only
    process 0 writes the outputs; the other processes return ``{"out": out, "table": None, ...}``."""
    import jax

    from pfedkdh_jax.run.experiment import run_stacked

    index, count = jax.process_index(), jax.process_count()
    if count > 1:
        log = _prefixed(log, f"[process {index}/{count}] ")
    for dataset, data_dir in dict.fromkeys((c.dataset, c.data_dir) for _, c in points(sweep, out)):
        check_available(dataset, data_dir)   # every dataset before the first point, not hours into the sweep
    spec_path = os.path.join(out, "sweep.json")
    run_files = [f for f in ("config.json", "run.lock") if os.path.exists(os.path.join(out, f))]
    if run_files and not os.path.exists(spec_path):   # a run's directory (finished, or running now)
        raise ConfigError(f"--out {out} holds a run ({run_files[0]}): give the sweep a directory of its own")
    os.makedirs(out, exist_ok=True)

    def write_spec():   # whole, by a rename
        with open(spec_path + ".tmp", "w") as f:
            json.dump(sweep.to_json(), f, indent=2)
        os.replace(spec_path + ".tmp", spec_path)

    def check_spec() -> bool:
        """Whether the stored grid is this one (True) or one this grows (False: more datasets, α or
        methods, everything else the same); another grid is a ConfigError naming what differs."""
        with open(spec_path) as f:
            stored = json.load(f)
        # the same grid (whether its points stack is how, not what: it may change between calls)
        old, new = _grid_of(stored), _grid_of(sweep.to_json())
        if old == new:
            return True
        added = _added(old, new)
        if added:
            log(f"the sweep grows: {added}; its finished points are kept")
            return False
        said = _in_other_words(stored, sweep, out)   # e.g. a flag at the value the preset gave before
        if said == "":
            return True
        if said:
            log(f"the sweep grows: {said}; its finished points are kept")
            return False
        key = next(k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k))
        was, now = old.get(key), new.get(key)
        if key == "options":   # name the run option that differs
            was, now = dict(map(tuple, was or [])), dict(map(tuple, now or []))
            key = next(k for k in sorted(set(was) | set(now)) if was.get(k) != now.get(k))
            was, now = was.get(key, "unset"), now.get(key, "unset")
        raise ConfigError(f"{out} holds another sweep (its {key} {_spec_value(was)}, this one's "
                          f"{_spec_value(now)}); a sweep directory holds one grid, which may only grow by "
                          "datasets, α or methods: choose another --out (its points stay usable by `pfedkdh "
                          "report`)")
    # process 0 checks or writes the spec (whole, by a rename); the others read it after the barrier,
    # never while it is being written
    if os.path.exists(spec_path):   # the stored order where the lists are the same
        with open(spec_path) as f:
            sweep = _in_stored_order(sweep, json.load(f))
    if index == 0 and not (os.path.exists(spec_path) and check_spec()):
        write_spec()   # a new sweep, or one grown by datasets, α or methods
    _barrier("pfedkdh-sweep-start", count)
    if index != 0:
        check_spec()
    if order not in ORDERS:
        raise ConfigError(f"--order must be one of {', '.join(ORDERS)}; got {order!r}")
    todo = points(sweep, out)
    if order == "methods":   # a stable sort: within a method, the table's order
        todo.sort(key=lambda p: sweep.methods.index(p[1].method))
    number = {name: i + 1 for i, (name, _) in enumerate(todo)}
    for group in share(_stacks(sweep, todo), index, count):   # one point, or points run as one program
        resumed, fresh, names = [], [], []
        for name, cfg in group:
            status = _status(cfg.out)
            log(f"[{number[name]}/{len(todo)}] {name}: " + {"completed": "done already", "checkpointed": "resuming",
                                                            "ended": "ended already (its summary says how; its "
                                                                     "options would end it so again)",
                                                            "started": "restarting (no checkpoint yet)",
                                                            "new": "running"}[status])
            if status == "started":
                shutil.rmtree(cfg.out)   # a point killed before its first checkpoint: nothing to keep
            if status not in ("completed", "ended"):
                (resumed if status == "checkpointed" else fresh).append(cfg)
                names.append(name)
        if len(group) > 1 and names:
            log(f"stacked: {', '.join(names)}")
        if resumed:
            run_stacked(resumed, progress=progress, log=log, resume=True)
        if fresh:
            run_stacked(fresh, progress=progress, log=log)
    _barrier("pfedkdh-sweep-done", count)
    if index != 0:
        log("this process's points are done; process 0 writes the tables")
        return {"table": None, "columns": [], "rows": [], "figures": [], "out": out}
    return write_outputs(sweep, out)


def share(groups: list[list], index: int, count: int) -> list[list]:
    """Process ``index``'s part of ``groups`` (lists of points, in sweep order) among ``count``
    processes: point j (counted over all groups) goes to process j mod count, so the points are
    balanced and a stack is divided among the processes, each running its part as one stack."""
    mine, j = [], 0
    for group in groups:
        part = [p for i, p in enumerate(group) if (j + i) % count == index]
        j += len(group)
        if part:
            mine.append(part)
    return mine


def _barrier(name: str, count: int) -> None:
    """Every process of a jax.distributed job reaches this point before any goes on."""
    if count > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)


def _prefixed(log: Callable, prefix: str) -> Callable:
    return lambda *a, **k: log(prefix + " ".join(str(x) for x in a), **k)


def _stacks(sweep: Sweep, todo: list[tuple[str, RunConfig]]) -> list[list[tuple[str, RunConfig]]]:
    """The points run together: with ``sweep.stack``, those that differ only in α and traced
    hyperparameter values (of a method whose runs stack); else one by one."""
    from pfedkdh_jax.run.experiment import stack_key

    if not sweep.stack:
        return [[p] for p in todo]
    groups: dict[str, list] = {}
    for name, cfg in todo:
        key = json.dumps(stack_key(cfg), sort_keys=True, default=str) if METHODS[cfg.method].stackable else name
        groups.setdefault(key, []).append((name, cfg))
    return list(groups.values())


# ------------------------------------------------------------------------------------------ tables
def _load(sweep: Sweep, out: str) -> list[dict]:
    from pfedkdh_jax.run.report import load_run

    found = []
    for name, cfg in points(sweep, out):
        run = load_run(cfg.out) if os.path.exists(os.path.join(cfg.out, "config.json")) else None
        found.append({"name": name, "cfg": cfg, "run": run})
    return found


def _label(cfg: RunConfig, sweep: Sweep) -> str:
    grid, own, args = _grid_for(sweep, cfg.method), _own_options(sweep, cfg.method), dict(cfg.method_args)
    return cfg.method + "".join(f" {k}={args[k] if k in own else getattr(cfg, k)}" for k, values in grid
                                if len(values) > 1)


def table_rows(sweep: Sweep, out: str) -> tuple[list[str], list[dict]]:
    """(column names, rows): a row per method (and EA row where a method reports one), a cell per
    dataset × α with the final mean, std and number of seeds of the method's table metric."""
    columns = [f"{d} α={a:g}" for d in sweep.datasets for a in sweep.alphas]
    rows: dict[str, dict] = {}
    for item in _load(sweep, out):
        cfg, run = item["cfg"], item["run"]
        col = f"{cfg.dataset} α={cfg.alpha:g}"
        label = _label(cfg, sweep)
        metric = METHODS[cfg.method].table_metric
        summary = (run or {}).get("summary") or {}
        for suffix, row_label in (("", label), ("_ea", f"{label} (EA)")):
            key = metric + suffix
            if suffix and key not in summary:
                continue
            row = rows.setdefault(row_label, {"row": row_label, "method": cfg.method, "metric": metric + suffix,
                                              "cells": {}})
            if key in summary:
                row["cells"][col] = {"mean": summary[key], "std": summary.get(f"{key}_std", 0.0),
                                     "seeds": summary.get("reps", 1), "status": summary.get("status"),
                                     "rounds": summary.get("rounds_completed")}
        if cfg.method == "pfedkdh" and label in rows:
            rows[label]["row"] = label + " (Fair)"
        elif metric.startswith("global") and label in rows:   # a shared-model method: its global model's
            rows[label]["row"] = label + " (global)"
    return columns, list(rows.values())


def table_markdown(columns: list[str], rows: list[dict]) -> str:
    best = {c: max((r["cells"][c]["mean"] for r in rows if c in r["cells"]), default=None) for c in columns}
    lines = ["| method | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for r in rows:
        cells = []
        for c in columns:
            cell = r["cells"].get(c)
            if cell is None:
                cells.append("–")
                continue
            text = (f"{100 * cell['mean']:.2f} ± {100 * cell['std']:.2f}" if cell.get("seeds", 1) > 1
                    else f"{100 * cell['mean']:.2f}")   # one seed: no spread to show
            if cell["status"] != "completed":
                text += f" ({cell['status']}, {cell['rounds']} rounds)"
            cells.append(f"**{text}**" if cell["mean"] == best[c] else text)
        lines.append(f"| {r['row']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def costs_markdown(sweep: Sweep, out: str) -> str:
    items = _load(sweep, out)
    fedper = {(i["cfg"].dataset, i["cfg"].alpha): ((i["run"] or {}).get("summary") or {}).get("seconds_per_round")
              for i in items if i["cfg"].method == "fedper"}
    lines = ["| point | seconds per round (training, median) | ÷ FedPer's on the cell | evaluation (s, median) "
             "| MB down / up per selected client and round |", "|---|---|---|---|---|"]
    compiled = {(i["cfg"].dataset, i["cfg"].alpha) for i in items
                if (((i["run"] or {}).get("summary") or {}).get("seconds_per_round_includes_compile"))}
    for i in items:
        s = (i["run"] or {}).get("summary") or {}
        spr, ref = s.get("seconds_per_round"), fedper.get((i["cfg"].dataset, i["cfg"].alpha))
        # a one-round point's figure is mostly compiling (marked †), and no ratio is read from one
        ratio = f"{spr / ref:.2f}" if spr and ref and (i["cfg"].dataset, i["cfg"].alpha) not in compiled else "–"
        mark = " †" if s.get("seconds_per_round_includes_compile") else ""
        ev = s.get("eval_seconds_median")
        lines.append(f"| {i['name']} | {'–' if spr is None else f'{spr:.3f}{mark}'} | {ratio} | "
                     f"{'–' if ev is None else f'{ev:.3f}'} | {_traffic(s.get('bytes_per_client_round'))} |")
    if compiled:
        lines.append("\n† a point whose every round compiled (one round, say): its seconds per round include "
                     "compiling, and its cell gives no ratio")
    return "\n".join(lines)


def _traffic(counted) -> str:
    """``{"download": b, "upload": b}`` (or one such per phase) as MB."""
    if not counted:
        return "–"
    if "download" in counted:
        return f"{counted['download'] / 1e6:.3f} / {counted['upload'] / 1e6:.3f}"
    return "; ".join(f"{phase}: {_traffic(c)}" for phase, c in counted.items())


def write_outputs(sweep: Sweep, out: str) -> dict:
    """table.md, table.csv, costs.md and the per-cell figures from the point directories."""
    from pfedkdh_jax.run.report import comparison_figure

    columns, rows = table_rows(sweep, out)
    text = table_markdown(columns, rows)
    fraction = dict(sweep.options).get("validation_fraction", 0) or 0
    split = "validation" if fraction > 0 else "test"
    note = (f"Scored on a validation split ({fraction:g} of each client's train data, --validation-fraction), "
            "not on the clients' test splits." if fraction > 0 else "")
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write((f"Final mean ± std over {sweep.seeds} seeds, %" if sweep.seeds > 1 else "Final value, one seed, %")
                + "; best of each column in bold."
                + (f" {note}" if note else "") + f"\n\n{text}\n")
    with open(os.path.join(out, "table.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["row", "method", "metric", "cell", "mean", "std", "seeds", "status", "rounds", "split"])
        for r in rows:
            for c in columns:
                if c in r["cells"]:
                    cell = r["cells"][c]
                    w.writerow([r["row"], r["method"], r["metric"], c, cell["mean"], cell["std"], cell["seeds"],
                                cell["status"], cell["rounds"], split])
    with open(os.path.join(out, "costs.md"), "w") as f:
        f.write(costs_markdown(sweep, out) + "\n")
    figures = []
    items = _load(sweep, out)
    for d, a in itertools.product(sweep.datasets, sweep.alphas):
        runs = [dict(i["run"], label=_label(i["cfg"], sweep)) for i in items
                if i["run"] is not None and i["cfg"].dataset == d and i["cfg"].alpha == a]
        if runs:
            path = os.path.join(out, f"curves-{d}-a{_fmt(a)}.png")
            comparison_figure(runs, path, title=f"{d}, α = {a:g}")
            figures.append(path)
    return {"table": text, "columns": columns, "rows": rows, "figures": figures, "out": out, "note": note}
