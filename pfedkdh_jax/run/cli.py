"""``pfedkdh`` command line: a thin layer over :func:`pfedkdh_jax.run.experiment.run`."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import re
import signal
import sys

from pfedkdh_jax.run.config import METHODS, PRESETS, ConfigError, RunConfig, make_config, method_arg_pairs, under
from pfedkdh_jax.data import DATASETS, DataError
from pfedkdh_jax.names import canonical_name

def _pfedkdh_flags() -> list[tuple]:
    """pFedKDH's options as flags, from its config class (their one source: help and checks); its
    boolean options are the switches below."""
    import dataclasses

    from pfedkdh_jax.algorithms import PFEDKDH_OPTIONS
    from pfedkdh_jax.algorithms.configs import PFedKDHConfig

    fields = {f.name: f for f in dataclasses.fields(PFedKDHConfig)}
    types = {"float": float, "int": int, "str": str, "float | None": float}
    return [("--" + name.replace("_", "-"), name, types[fields[name].type], fields[name].metadata["help"])
            for name in PFEDKDH_OPTIONS if fields[name].type != "bool"]


# flag -> (RunConfig field, type, help). Defaults come from the preset, then RunConfig.
_FLAGS = [
    ("--method", "method", str, f"algorithm: {', '.join(METHODS)}"),
    ("--dataset", "dataset", str, f"{', '.join(DATASETS)} (digits: offline demo set, not a paper dataset)"),
    ("--synthetic-samples", "synthetic_samples", int, "pool size of --dataset synthetic (default 70,000: "
                                                      "28x28 images whose class sets their mean)"),
    ("--data-dir", "data_dir", str, "tfds data dir with prepared datasets (else $TFDS_DATA_DIR, else tfds default)"),
    ("--cache-dir", "cache_dir", str, "decoded-array cache (else $PFEDKDH_CACHE_DIR, else ~/.cache/pfedkdh_jax)"),
    ("--out", "out", str, "run directory (default runs/<dataset>-<method>-a<alpha>-s<seed>-<time>)"),
    ("--alpha", "alpha", float, "Dirichlet concentration of the label skew (> 0)"),
    ("--clients", "num_clients", int, "number of clients K (>= 2)"),
    ("--participation", "participation", float,
     "fraction of clients per round, in (0, 1] (ρ × K clients, rounded to the nearest, halves to even, at least 1)"),
    ("--clients-per-round", "per_round", int, "exactly this many clients a round, instead of --participation"),
    ("--rounds", "rounds", int, "federated rounds"),
    ("--local-epochs", "local_epochs", int, "local epochs E"),
    ("--batch-size", "batch_size", int, "minibatch size"),
    ("--lr", "lr", float, "client learning rate (of --optimizer)"),
    ("--seed", "seed", int, "seed of init, client sampling, batch order and dropout"),
    ("--reps", "reps", int, "Monte Carlo repetitions (seeds --seed + r), reported as mean ± std"),
    ("--reps-mode", "reps_mode", str, "vmap: repetitions in one program; sequential; auto: per backend"),
    ("--data-seed", "data_seed", int, "seed of the partition and D_s (default 0)"),
    ("--aux-size", "aux_size", int, "|D_s|, the server's auxiliary set"),
    ("--min-client-samples", "min_client_samples", int, "every client holds at least this many (see --fill)"),
    ("--partition", "partition", str, "dirichlet (method.md §2, default) | shards (each client --shards-per-client "
                                      "label-sorted shards, FedAvg's pathological split)"),
    ("--shards-per-client", "shards_per_client", int, "shards a client gets with --partition shards (default 2)"),
    ("--fill", "fill", str, "how a Dirichlet split meets --min-client-samples: redraw the whole split | top_up "
                            "(one draw, small clients topped up from the largest) | auto (default: redraw up to "
                            "100 clients, top_up above)"),
    ("--train-fraction", "train_fraction", float, "per-client train share (rest = client test split)"),
    ("--validation-fraction", "validation_fraction", float,
     "> 0: score on this share of client train data instead of the test split (for sweeps)"),
    ("--dropout", "dropout", float, "backbone dropout rate"),
    ("--optimizer", "optimizer", str, "the client optimizer: sgd (the paper's) | momentum | adam | adamw"),
    ("--momentum", "momentum", float, "with --optimizer momentum (default 0.9)"),
    ("--weight-decay", "weight_decay", float, "L2 weight decay added to the gradient (sgd, momentum, adam) or "
                                              "AdamW's decoupled decay (default 0; AdamW 1e-4)"),
    *_pfedkdh_flags(),
    ("--eval-every", "eval_every", int, "evaluate every N rounds (and the last)"),
    ("--eval-clients", "eval_clients", int, "score a fixed random subset of N clients (drawn from --data-seed) "
                                            "instead of all; 0: all (default)"),
    ("--ea-every", "ea_every", int, "EA evaluation at the evaluated rounds (--eval-every) that are multiples of N, and the last (a method with an adapted evaluation: pFedKDH's EA, FedBABU's fine-tuning; the others have none)"),
    ("--client-parallel", "client_parallel", str, "vmap | sequential (default: per backend)"),
    ("--step-loop", "step_loop", str, "scan | unrolled (default: per backend)"),
    ("--chunk-steps", "chunk_steps", int, "local steps per compiled chunk when unrolled"),
    ("--slot-granule", "slot_granule", str, "unrolled steps compute their batch's size rounded up to this multiple "
                                            "(exactly below it); 0: a full batch every step; auto (default): 8, "
                                            "only for the widths whose saving over the run pays their compile"),
    ("--fused-steps", "fused_steps", str, "sequential clients of at most this many local steps run start to "
                                          "finish as one compiled call; 0: never; auto (default): up to "
                                          "--chunk-steps, for the step plans whose saving over the run pays"),
    ("--lanes", "lanes", int, "pack each round's (repetition, client) local work into this many lanes "
                              "(needs --client-parallel vmap --step-loop scan; default: off)"),
    ("--client-devices", "client_devices", int, "spread sequential clients over this many local devices "
                                                "(default: all; the CLI makes one XLA:CPU device per core, up to 2)"),
    ("--eval-chunk", "eval_chunk", int, "samples per feature chunk in evaluation"),
    ("--conv-form", "conv_form", str, "the convolutions: lax (XLA's) | patches (a matmul over patches) | winograd "
                                      "(conv2 by Winograd's F(4x4, 5x5)) | auto (default: on a CPU winograd, or patches "
                                      "where local steps are scanned; elsewhere lax)"),
    ("--divergence-loss", "divergence_loss", float, "stop when a local loss exceeds this (0: only non-finite)"),
    ("--checkpoint-every", "checkpoint_every", int, "save the whole state every N rounds and at the end (0: off)"),
]
_SWITCHES = [
    ("--balance-cap", "balance_cap", True, "PFLlib's balance-capped Dirichlet partition"),
    ("--teacher-cold-start", "teacher_warm_start", False, "refit the teacher head from φ_g⁰ each round"),
    ("--teacher-refit-at-start", "teacher_refit_at_start", True, "refit the teacher head once before round 0"),
    ("--average-heads", "persistent_heads", False,
     "ablation: no persistent heads; the selected heads are averaged like the backbone and given to every client"),
]


_PLUGIN_HELP = ("a module (dotted name, or a .py file) that registers methods or datasets of your own "
                "(pfedkdh_jax.register_method, register_dataset), imported before the methods and datasets are "
                "checked; repeatable, and kept in each run's config.json for resume")

_PRESET_FIELDS = {"num_clients", "participation", "aux_size", "rounds", "local_epochs", "batch_size", "lr",
                  "alpha", "ea_every", "teacher_epochs", "warmup_epochs"}


def _preset_note(field: str) -> str:
    return ", or the preset's" if field in _PRESET_FIELDS else ""


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose errors are one line (naming the command's --help), not the usage too,
    and that takes a flag only by its whole name (``--round 1`` is not ``--rounds 1``: a prefix that a
    later flag could share would change meaning silently)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the options)\n")


def _with_default(hlp: str, default, field: str) -> str:
    """A flag's help with its default, unless the help already says it (or there is none to say)."""
    if "default" in hlp or (default is None and not _preset_note(field)):
        return hlp
    return f"{hlp} (default: {default}{_preset_note(field)})"


def _method_arg_help() -> str:
    own = "; ".join(f"{m}: {', '.join(spec.args)}" for m, spec in METHODS.items() if spec.args)
    return f"a method's own option, repeatable ({own})"


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="pfedkdh", description="pFedKDH in JAX: personalized federated "
                                "learning with global knowledge distillation and local head adaptation.")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run one federated experiment",
                       description="Run one experiment; flags override the preset's values.",
                       epilog="Presets: 'default' and 'paper' use method.md Table 1 for paper datasets "
                              "(digits: 10 clients, |D_s| 300, 20 rounds, α 0.5); 'smoke' = 2 rounds. Methods: "
                              + " | ".join(f"{m} = {spec.summary}" for m, spec in METHODS.items()) + ".")
    r.add_argument("--preset", default=None, choices=PRESETS,
                   help="default and paper (the same): method.md Table 1 on the paper's datasets, a demo "
                        "schedule on digits (EA every 5 rounds); smoke: 2 rounds, EA every round, and a method's own "
                        "phases and inner loops shortened ("
                        + ", ".join(f"{m}: {k}={v}" for m, spec in METHODS.items() for k, v in spec.smoke.items())
                        + ") (default: default, or a --config file's preset)")
    for flag, field, typ, hlp in _FLAGS:
        default = RunConfig.__dataclass_fields__[field].default
        r.add_argument(flag, dest=field, type=typ, default=None,
                       help=_with_default(hlp, default, field))
    for flag, field, value, hlp in _SWITCHES:
        r.add_argument(flag, dest=field, action="store_const", const=value, default=None, help=hlp)
    r.add_argument("--method-arg", dest="method_args", action="append", default=None, metavar="KEY=VALUE",
                   help=_method_arg_help())
    r.add_argument("--plugin", dest="plugins", action="append", default=None, metavar="MODULE",
                   help=_PLUGIN_HELP)
    r.add_argument("--config", default=None, metavar="FILE",
                   help="options from a JSON file or a Python file with get_config(smoke=False) "
                        "(experiments/configs/); the preset < this file < flags")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    res = sub.add_parser("resume", help="continue an interrupted run from its newest good checkpoint")
    res.add_argument("run_dir")
    res.add_argument("--plugin", dest="plugins", action="append", default=None, metavar="MODULE",
                     help="the modules registering the run's method or dataset, when its config.json does not "
                          "name them (a run started from Python) or they moved; replaces the stored ones")
    res.add_argument("--data-dir", default=None,
                     help="where the run's dataset is prepared, when the stored --data-dir does not resolve here "
                          "(a relative path read from another directory, another machine); replaces the stored one")
    res.add_argument("--cache-dir", default=None, help="the decoded-array cache, likewise; replaces the stored one")
    res.add_argument("--no-progress", action="store_true", help="no progress bar")
    sw = sub.add_parser("sweep", help="a grid of datasets × α × methods × seeds: the paper's tables",
                        description="Run every point of a grid (each point's seeds as one run's repetitions) "
                                    "and write table.md/csv, costs.md and a convergence figure per cell. "
                                    "Running the same command again continues an interrupted sweep.")
    sw.add_argument("--datasets", default=None, help="comma-separated (default: digits)")
    sw.add_argument("--alphas", default=None, help="comma-separated Dirichlet α values (default: 0.1)")
    sw.add_argument("--methods", default=None, help=f"comma-separated, of: {', '.join(METHODS)} (default: pfedkdh)")
    sw.add_argument("--seeds", type=int, default=None,
                    help="how many seeds per point (--seed, --seed + 1, ...), run as one run's repetitions (default: 1)")
    sw.add_argument("--grid", action="append", default=None, metavar="OPTION=V1,V2",
                    help="run option values to sweep, repeatable (e.g. lam=0,0.5); applied to the methods "
                         "that read the option; METHOD:KEY=V1,V2 sweeps a method's own option "
                         "(e.g. fedprox:mu=0.01,0.1)")
    sw.add_argument("--method-arg", dest="sweep_method_args", action="append", default=None,
                    metavar="METHOD:KEY=VALUE", help="a method's own option, repeatable")
    sw.add_argument("--preset", default=None, choices=PRESETS, help="as for run (default: default)")
    sw.add_argument("--plugin", dest="plugins", action="append", default=None, metavar="MODULE", help=_PLUGIN_HELP)
    sw.add_argument("--config", default=None, metavar="FILE",
                    help="the sweep from a JSON or Python file (get_config() -> dict with datasets, alphas, "
                         "methods, seeds, grid, preset, method_args and run options); flags override it")
    sw.add_argument("--out", dest="sweep_out", default=None, help="sweep directory (default runs/sweep-<time>)")
    sw.add_argument("--no-progress", action="store_true", help="no progress bars")
    sw.add_argument("--stack", action="store_true", default=None,
                    help="run the points that differ only in α and in --grid values of lr (pfedkdh: also lam, "
                         "temperature, mu; a method's own fedprox:mu, ditto:lam, fedproto:lam, pfedme:lam / "
                         "personal_lr / beta, fedala:eta) as one program (partitions and values stacked along the "
                         "repetition axis; vmapped with --reps-mode vmap); with --eval-clients, per α and data seed; "
                         "not for fedfed")
    sw.add_argument("--order", default="table", choices=("table", "methods"),
                    help="the order the points run in: table (cell by cell, the methods as listed) or methods "
                         "(each method over every cell, in the order of --methods: list the cheapest first and "
                         "whole rows fill first); may change when an interrupted sweep is continued (default: table)")
    sw.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                    help="run the sweep as one process of a jax.distributed job whose process 0 listens at "
                         "HOST:PORT (with --num-processes, --process-id; one command per process, the sweep "
                         "directory on a shared file system): the processes split the points, process 0 "
                         "writes the tables")
    sw.add_argument("--num-processes", type=int, default=None, help="processes of the jax.distributed job")
    sw.add_argument("--process-id", type=int, default=None, help="this process's index, 0 … num-processes − 1")
    for flag, field, typ, hlp in _FLAGS:
        if field not in ("method", "dataset", "alpha", "out", "reps"):
            sw.add_argument(flag, dest=field, type=typ, default=None,
                            help=_with_default(hlp, RunConfig.__dataclass_fields__[field].default, field))
    for flag, field, value, hlp in _SWITCHES:
        sw.add_argument(flag, dest=field, action="store_const", const=value, default=None, help=hlp)
    rep = sub.add_parser("report", help="compare finished runs: a table and a figure")
    rep.add_argument("run_dirs", nargs="+")
    rep.add_argument("--out", default=None, help="directory for every figure: comparison.png and clients-RUN.png "
                                                 "per run (default: comparison.png into the first run dir and "
                                                 "clients.png into each run dir)")
    p.commands = {"run": r, "resume": res, "sweep": sw, "report": rep}
    return p


def load_config_file(path: str, smoke: bool = False) -> dict:
    """Options from a JSON file or a Python file defining ``get_config(smoke=False) -> dict``
    (``smoke``: ``--preset smoke`` was given; a ``get_config()`` without the parameter is called
    without it)."""
    import os
    if not os.path.exists(path):
        raise ConfigError(f"--config file {path!r} does not exist")
    if path.endswith(".json"):
        try:
            with open(path) as f:
                values = json.load(f)
        except ValueError as e:
            raise ConfigError(f"--config {path}: not valid JSON ({e})") from None
    elif path.endswith(".py"):
        import importlib.util
        spec = importlib.util.spec_from_file_location("_pfedkdh_config", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        if not hasattr(module, "get_config"):
            raise ConfigError(f"--config {path}: defines no get_config()")
        import inspect
        takes_smoke = "smoke" in inspect.signature(module.get_config).parameters
        values = dict(module.get_config(smoke=smoke) if takes_smoke else module.get_config())
    else:
        raise ConfigError(f"--config must be a .json or .py file; got {path!r}")
    if not isinstance(values, dict):
        raise ConfigError(f"--config {path}: expected a mapping of options")
    return values


def _sweep_method_args(margs) -> dict:
    """A sweep file's method options, ``{method: {key: value} or [[key, value], ...]}`` or
    ``[[method, [[key, value], ...]], ...]`` (sweep.json's form), as ``{method: [(key, text), ...]}``."""
    items = margs.items() if isinstance(margs, dict) else margs
    try:
        return {str(m): list(method_arg_pairs(pairs, f"--config: method_args of {m}")) for m, pairs in items}
    except ConfigError:   # one method's options, named
        raise
    except (TypeError, ValueError):
        raise ConfigError(f"--config: a sweep's method_args must be {{method: {{key: value}}}}; got {margs!r}") from None


def _config_file(args) -> dict:
    """``--config``'s options, its ``get_config`` told whether the preset is smoke: by ``--preset``, or,
    without the flag, by the file's own ``"preset"`` (it is then read again with ``smoke=True``)."""
    spec = load_config_file(args.config, smoke=args.preset == "smoke")
    if args.preset is None and spec.get("preset") == "smoke" and args.config.endswith(".py"):
        spec = load_config_file(args.config, smoke=True)
    return spec


# one option under another name in the other command: a run's repetitions are a sweep's seeds per point
_OTHER_NAME = {("sweep", "--reps"): "--seeds", ("run", "--seeds"): "--reps"}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:   # named by the command's parser, with the nearest option (or the other command's name for it)
        command = parser.commands[args.command]
        flag = extra[0].split("=")[0]
        near = ([_OTHER_NAME[args.command, flag]] if (args.command, flag) in _OTHER_NAME else
                difflib.get_close_matches(flag, command._option_string_actions, n=1, cutoff=0.7))
        command.error(f"unrecognized arguments: {' '.join(extra)}" + (f"; did you mean {near[0]}?" if near else ""))
    _request_devices(args)
    terminated = []

    def on_terminate(signum, frame):   # a kill or a `timeout`: stop as Ctrl-C does (locks released, one line)
        terminated.append(signum)
        raise KeyboardInterrupt
    try:
        previous = signal.signal(signal.SIGTERM, on_terminate)
    except ValueError:   # not the main thread: signals stay as they are
        previous = None
    try:
        return _command(args)
    except KeyboardInterrupt:   # Ctrl-C: one line on how to continue, not JAX's traceback
        hint = _ON_INTERRUPT.get(args.command, "nothing was lost")
        print(f"\npfedkdh: {'terminated' if terminated else 'interrupted'}; "
              f"{hint() if callable(hint) else hint}", file=sys.stderr)
        return 143 if terminated else 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


# what a Ctrl-C leaves and how to go on, per command (a run's line is set once its directory is known)
_ON_INTERRUPT = {"sweep": "run the same command again to continue the sweep (finished points are kept, the others "
                          "resume from their last checkpoints)"}


def _command(args) -> int:
    if args.command == "resume":
        return _resume(args)
    if args.command == "report":
        from pfedkdh_jax.run.report import main as report_main
        return report_main(args.run_dirs, args.out)
    if args.command == "sweep":
        return _sweep(args)
    values = {k: tuple(v) if k == "plugins" else v for k, v in vars(args).items()
              if k in RunConfig.__dataclass_fields__ and v is not None}
    try:
        _one_count_of_clients(args)
        preset_name, file_margs = args.preset, ()
        if args.config:
            spec = _file_under_flags(_config_file(args), args)
            file_preset = spec.pop("preset", None)
            preset_name = preset_name or file_preset   # a --preset flag wins over the file's
            file_margs = method_arg_pairs(spec.pop("method_args", None) or (), "--config: method_args")
            values = {**spec, **values, **({"method_args": file_margs} if file_margs else {})}
        if args.method_args:
            bad = [a for a in args.method_args if "=" not in a]
            if bad:
                raise ConfigError(f"--method-arg must be KEY=VALUE; got {bad[0]!r}")
            values["method_args"] = _flags_over_file(file_margs, [tuple(a.split("=", 1)) for a in args.method_args])
        cfg = make_config(preset_name or "default", **values)
        from pfedkdh_jax.run.experiment import default_out_dir, run  # jax imported only now
        cfg = dataclasses.replace(cfg, out=cfg.out or default_out_dir(cfg))
        _ON_INTERRUPT["run"] = lambda: _resume_hint(cfg.out, cfg.checkpoint_every)   # read when it is needed
        return _guarded(lambda: run(cfg, progress=not args.no_progress))
    except (ConfigError, DataError) as e:
        return _error(e)


def _request_devices(args) -> None:
    """One XLA:CPU device per core (up to 2, or --client-devices), before JAX starts its backends:
    sequential clients are spread over them (engine/layout.py). The user's XLA_FLAGS win."""
    if args.command not in ("run", "sweep", "resume"):
        return
    from pfedkdh_jax.engine.cpu_devices import request_for_client_devices
    request_for_client_devices(getattr(args, "client_devices", None))


def _field_type(field: str):
    for _, f, typ, _ in _FLAGS:
        if f == field:
            return typ
    if field in RunConfig.__dataclass_fields__ and isinstance(getattr(RunConfig, field, None), bool):
        return lambda t: {"true": True, "1": True, "false": False, "0": False}[t.lower()]
    raise ConfigError(f"--grid {field}: not a run option (e.g. lam, mu, lr, local_epochs)")


def _sweep(args) -> int:
    import time

    try:
        _one_count_of_clients(args)
        spec = _config_file(args) if args.config else {}
        spec = _file_under_flags(spec, args)
        axes = {k: spec.pop(k) for k in ("datasets", "alphas", "methods", "seeds", "grid", "preset",
                                         "method_args", "stack") if k in spec}
        options = {**spec, **{k: tuple(v) if k == "plugins" else v for k, v in vars(args).items()
                              if k in RunConfig.__dataclass_fields__ and v is not None}}
        given = lambda flag, value, default: _split(value, flag) if value is not None else default  # noqa: E731
        datasets = given("--datasets", args.datasets, axes.get("datasets", ["digits"]))
        methods = given("--methods", args.methods, axes.get("methods", ["pfedkdh"]))
        alphas = given("--alphas", args.alphas, axes.get("alphas", [0.1]))
        try:
            alphas = [float(a) for a in alphas]
        except ValueError:
            raise ConfigError(f"--alphas must be comma-separated numbers; got {args.alphas!r}") from None
        grid, flagged = dict(axes.get("grid", {})), set()
        for item in args.grid or []:
            if "=" not in item:
                raise ConfigError(f"--grid must be OPTION=V1,V2,...; got {item!r}")
            key, values = item.split("=", 1)
            if key.lower().replace("-", "_") in flagged:
                raise ConfigError(f"--grid {key} is given twice: give its values once, comma-separated")
            flagged.add(key.lower().replace("-", "_"))
            if ":" in key:   # METHOD:KEY, a method's own option: its values stay text, as --method-arg's
                grid[key] = _split(values, f"--grid {key}")
                continue
            key = key.replace("-", "_")
            typ = _field_type(key)
            items = _split(values, f"--grid {key}")
            try:
                grid[key] = [typ(v) for v in items]
            except (ValueError, KeyError):
                raise ConfigError(f"--grid {key}: values must be {getattr(typ, '__name__', 'true/false')}; "
                                  f"got {values!r}") from None
        margs = {canonical_name(m, METHODS): pairs
                 for m, pairs in _sweep_method_args(axes.get("method_args") or {}).items()}
        flags: dict[str, list] = {}
        for item in args.sweep_method_args or []:
            if ":" not in item or "=" not in item.split(":", 1)[1]:
                raise ConfigError(f"--method-arg must be METHOD:KEY=VALUE in a sweep; got {item!r}")
            m, pair = item.split(":", 1)
            if "," in pair.split("=", 1)[1]:
                raise ConfigError(f"--method-arg {item}: one value a sweep; for several, --grid {item}")
            flags.setdefault(canonical_name(m, METHODS), []).append(tuple(pair.split("=", 1)))   # FedProx: fedprox
        margs.update({m: _flags_over_file(margs.get(m, ()), pairs) for m, pairs in flags.items()})
        from pfedkdh_jax.run.sweep import make_sweep, run_sweep
        sweep = make_sweep(datasets, alphas, methods,
                           args.seeds if args.seeds is not None else axes.get("seeds", 1), grid,
                           args.preset or axes.get("preset", "default"), options, margs,
                           stack=args.stack if args.stack is not None else axes.get("stack", False))
        out = args.sweep_out or os.path.join("runs", "sweep-" + time.strftime("%Y%m%d-%H%M%S"))
        if args.coordinator is not None or args.num_processes is not None or args.process_id is not None:
            if args.sweep_out is None:
                raise ConfigError("--coordinator needs --out: every process must name the same sweep directory")
            _start_distributed(args.coordinator, args.num_processes, args.process_id)
        result = _guarded_sweep(lambda: run_sweep(sweep, out, progress=not args.no_progress,
                                                    order=args.order))
    except (ConfigError, DataError) as e:
        return _error(e)
    if isinstance(result, int):
        return result
    if result["table"] is None:   # not process 0 of a distributed sweep
        print(f"sweep directory: {out} (this process's points done; process 0 writes the tables)")
        return 0
    print(result["table"])
    if result.get("note"):
        print(result["note"])
    print(f"sweep directory: {out} (table.md, table.csv, costs.md, {len(result['figures'])} figure(s))")
    return 0


def _in_flags(message: str) -> str:
    """A data error of the library (Python's parameter names: ``num_clients``, ``aux_size=300``,
    ``fill='top_up'``) in the command line's terms (``--clients``, ``--aux-size 300``, ``--fill top_up``);
    its first line only (what follows may be instructions with Python code to copy)."""
    first, nl, rest = message.partition("\n")
    for flag, field, *_ in _FLAGS:
        if "_" in field or field in ("alpha", "fill"):
            first = re.sub(rf"\b{field}=(['\"]?)([^\s'\",;)]+)\1", rf"{flag} \2", first)
            first = re.sub(rf"(?<![-\w]){field}\b", flag, first)
    return first + nl + rest


def _one_count_of_clients(args) -> None:
    """--participation and --clients-per-round both given: one would be ignored (the count wins), so neither is."""
    if args.participation is not None and args.per_round:
        raise ConfigError(f"give --participation ({args.participation:g}) or --clients-per-round ({args.per_round}), "
                          "not both: the count would win")


def _file_under_flags(spec: dict, args) -> dict:
    """A --config file's options under the command line's count of clients (:func:`config.under`)."""
    return under(spec, {"participation": args.participation, "per_round": args.per_round})


def _flags_over_file(file_pairs, flag_pairs) -> tuple:
    """A method's own options from a --config file with the --method-arg flags over them (a flag replaces
    the file's value of its key); one key given twice among the flags stays twice (parse_method_args
    names it, after an unknown key)."""
    def key(k):   # "fedprox:mu" and "mu" name one option
        return k.split(":", 1)[1] if ":" in k else k
    flagged = {key(k) for k, _ in flag_pairs}
    return tuple(tuple(p) for p in file_pairs if key(p[0]) not in flagged) + tuple(tuple(p) for p in flag_pairs)


def _error(e: Exception) -> int:
    """A known failure as one line (a data error in the flags' names); exit code 2."""
    print(f"pfedkdh: error: {_in_flags(str(e)) if isinstance(e, DataError) else e}", file=sys.stderr)
    return 2


def _split(text: str, flag: str) -> list[str]:
    """A comma-separated list of a sweep's flag; an empty list or an empty item is a ConfigError."""
    items = [x.strip() for x in text.split(",")]
    if not any(items):
        raise ConfigError(f"{flag} needs at least one value; got {text!r}")
    if not all(items):
        raise ConfigError(f"{flag}: an empty value in {text!r} (comma-separated, e.g. 0.05,0.1)")
    return items


def _start_distributed(coordinator: str | None, num_processes: int | None, process_id: int | None) -> None:
    """``jax.distributed.initialize`` from the sweep's flags, after checking them (one-line errors)."""
    if coordinator is None or num_processes is None or process_id is None:
        raise ConfigError("a distributed sweep needs all three of --coordinator HOST:PORT, --num-processes N "
                          "and --process-id I")
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"--coordinator must be HOST:PORT; got {coordinator!r}")
    if num_processes < 1:
        raise ConfigError(f"--num-processes must be at least 1; got {num_processes}")
    if not 0 <= process_id < num_processes:
        raise ConfigError(f"--process-id must be in 0 … {num_processes - 1}; got {process_id}")
    import jax
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id)


def _guarded_sweep(job):
    from pfedkdh_jax.engine.protocol import ProtocolError
    from pfedkdh_jax.run.checkpoint import CheckpointError
    from pfedkdh_jax.run.experiment import DivergenceError
    try:
        return job()
    except (CheckpointError, ProtocolError) as e:
        return _error(e)
    except DivergenceError as e:
        print(f"pfedkdh: {e.kind}: {e}", file=sys.stderr)
        return 3


def _resume_hint(run_dir: str, every: int | None) -> str:
    """What a Ctrl-C leaves of a run in ``run_dir`` and how to go on (read when the interrupt comes:
    before the run wrote its config.json there is nothing to resume)."""
    if not os.path.exists(os.path.join(run_dir, "config.json")):
        return f"the run stopped before it started ({run_dir} holds nothing to resume): run the same command again"
    if every == 0:
        return f"the run kept no checkpoints (--checkpoint-every 0): {run_dir} holds its rounds so far"
    return f"`pfedkdh resume {run_dir}` continues the run from its last checkpoint"


def _resume(args) -> int:
    from pfedkdh_jax.run.config import plugins
    from pfedkdh_jax.run.experiment import resume
    _ON_INTERRUPT["resume"] = _resume_hint(args.run_dir, None)
    try:
        given = {} if args.plugins is None else {"plugins": plugins(args.plugins)}
    except ConfigError as e:
        return _error(e)
    given.update({k: v for k, v in (("data_dir", args.data_dir), ("cache_dir", args.cache_dir)) if v is not None})
    return _guarded(lambda: resume(args.run_dir, progress=not args.no_progress, **given))


def _guarded(job) -> int:
    """Run ``job`` and print its summary; known failures become one line and an exit code."""
    from pfedkdh_jax.engine.protocol import ProtocolError
    from pfedkdh_jax.run.checkpoint import CheckpointError
    from pfedkdh_jax.run.experiment import DivergenceError
    try:
        summary = job()
    except (ConfigError, DataError, CheckpointError, ProtocolError) as e:   # a method of one's own: what it broke
        return _error(e)
    except DivergenceError as e:
        print(f"pfedkdh: {e.kind}: {e}", file=sys.stderr)
        return 3
    keys = ["personalized_macro_accuracy", "personalized_macro_accuracy_ea", "global_macro_accuracy",
            "best_personalized_macro_accuracy", "seconds_per_round", "compile_seconds"]
    if summary.get("seconds_per_round_includes_compile"):   # every round compiled (one round, say)
        keys.append("seconds_per_round_includes_compile")
    if (summary.get("reps") or 1) > 1:   # the means, each with its std over the repetitions
        keys = [k for key in keys for k in ((key, key + "_std") if "accuracy" in key else (key,))]
    print(json.dumps({k: summary[k] for k in keys if summary.get(k) is not None}, indent=2))   # what it has
    print(f"run directory: {summary['out']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
