"""One frozen configuration object for a run, its presets and its validation.

Every option has a default and a meaning here; the CLI maps its flags onto :class:`RunConfig`
(``pfedkdh run --help``). :func:`validate` fails with one line naming the option and what is
allowed, before any data is loaded or anything is compiled.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
from typing import Any

from pfedkdh_jax.algorithms import METHODS, PFEDKDH_OPTIONS, load_plugins, parse_method_args
from pfedkdh_jax.algorithms.configs import OPTIMIZERS, LocalConfig, OptionError, PFedKDHConfig
from pfedkdh_jax.data.sources import dataset_names, dataset_preset
from pfedkdh_jax.names import canonical_name
PRESETS = ("default", "paper", "smoke")

# method.md Table 1: rounds and local epochs per dataset.
PAPER_SCHEDULE = {"mnist": (50, 2), "fashion_mnist": (50, 2), "cifar10": (50, 3), "cifar100": (70, 5)}


_KDH = PFedKDHConfig()   # the defaults of pFedKDH's run options


class ConfigError(ValueError):
    """An invalid option; the message is one line naming the option and the allowed values."""


@dataclasses.dataclass(frozen=True)
class RunConfig:
    # --- what to run
    method: str = "pfedkdh"            # federated algorithm (pfedkdh_jax.algorithms.METHODS)
    method_args: tuple = ()            # ((key, value-text), ...): the method's own options (--method-arg)
    plugins: tuple = ()                # modules (dotted names, or .py paths) that register methods or datasets
                                       # of one's own (register_method, register_dataset), imported first
    dataset: str = "digits"            # digits (offline demo set) | mnist | fashion_mnist | cifar10 | cifar100
                                       # | synthetic (images of any count: --synthetic-samples)
    synthetic_samples: int = 70_000    # the pool size of --dataset synthetic
    data_dir: str | None = None        # tfds data dir; else $TFDS_DATA_DIR; else tfds's default
    cache_dir: str | None = None       # decoded-array cache; else $PFEDKDH_CACHE_DIR; else ~/.cache/pfedkdh_jax
    out: str | None = None             # run directory; default runs/<dataset>-<method>-a<alpha>-s<seed>-<time>
    # --- data protocol (method.md §2)
    alpha: float = 0.1                 # Dirichlet concentration of the label skew
    num_clients: int = 20              # K
    aux_size: int = 5000               # |D_s|, drawn from the pool first
    min_client_samples: int = 10       # every client holds at least this many (see fill)
    balance_cap: bool = False          # PFLlib's capped Dirichlet variant
    partition: str = "dirichlet"       # dirichlet (method.md §2) | shards (label-sorted shards, FedAvg's)
    shards_per_client: int = 2         # with --partition shards
    fill: str = "auto"                 # Dirichlet minimum: redraw the split | top_up from the largest |
                                       # auto (redraw up to 100 clients, top_up above)
    train_fraction: float = 0.75       # per-client train share; the rest is the client's test split
    validation_fraction: float = 0.0   # >0: score on a split of client *train* data instead (sweeps)
    data_seed: int = 0                 # partition and D_s
    # --- federated training (method.md §3, Table 1)
    rounds: int = 20
    participation: float = 0.5         # ρ: clients per round = round(ρ·K) (Python's: halves to even), at least 1
    per_round: int = 0                 # > 0: exactly this many clients a round (instead of --participation)
    local_epochs: int = 2              # E
    batch_size: int = 64
    lr: float = 0.015                  # client learning rate (SGD, no momentum, as the paper)
    optimizer: str = "sgd"             # the client optimizer: sgd | momentum | adam | adamw
    momentum: float | None = None      # with --optimizer momentum (None: 0.9)
    weight_decay: float | None = None  # L2 added to the gradient (sgd, momentum, adam) or AdamW's decoupled
                                       # decay (None: 0, AdamW 1e-4)
    dropout: float = 0.0               # backbone dropout rate (the model's, every method)
    seed: int = 0                      # model init, client sampling, batch order and dropout
    reps: int = 1                      # Monte Carlo repetitions, seeds seed, seed+1, ...
    reps_mode: str = "auto"            # vmap (one program) | sequential | auto (sequential on CPU)
    # --- pFedKDH: run flags of the command line. Their defaults, meaning and checks live in one place,
    # pfedkdh_jax.algorithms.configs.PFedKDHConfig (λ, T, μ, EA scored on validation data: SWEEP.md)
    lam: float = _KDH.lam
    temperature: float = _KDH.temperature
    mu: float = _KDH.mu
    teacher_epochs: int = _KDH.teacher_epochs
    teacher_warm_start: bool = _KDH.teacher_warm_start
    teacher_refit_at_start: bool = _KDH.teacher_refit_at_start
    persistent_heads: bool = _KDH.persistent_heads
    warmup_epochs: int = _KDH.warmup_epochs
    ea_steps: int = _KDH.ea_steps
    ea_lr: float | None = _KDH.ea_lr
    ea_epochs: int = _KDH.ea_epochs
    kd_target: str = _KDH.kd_target
    kd_gate: str = _KDH.kd_gate
    # --- evaluation
    eval_every: int = 1                # Fair evaluation of all clients every N rounds (and the last)
    eval_clients: int = 0              # > 0: evaluations score this fixed random subset of the clients
    ea_every: int = 10                 # EA at evaluated rounds that are multiples of N (and the last)
    # --- engine (None = the backend's measured default; see BENCHMARKS.md)
    client_parallel: str | None = None  # vmap | sequential
    step_loop: str | None = None       # scan | unrolled
    chunk_steps: int = 8               # local steps per compiled chunk (step_loop = unrolled)
    slot_granule: int | str = "auto"   # unrolled steps compute their batch's size rounded up to this
                                       # multiple, exactly below it (0: a full batch every step; auto:
                                       # 8, for the widths whose saving over the run pays their compile)
    fused_steps: int | str = "auto"    # sequential clients of at most this many steps run as one compiled
                                       # call (0: never; auto: up to --chunk-steps, the plans that pay)
    lanes: int | None = None           # pack each round's local work into this many lanes (vmap + scan)
    client_devices: int | None = None  # sequential clients spread over this many local devices (None: all;
                                       # the CLI makes one XLA:CPU device per core, up to 2)
    eval_chunk: int = 2048             # samples per feature chunk in evaluation
    conv_form: str = "auto"            # lax | patches | winograd | auto (on a CPU winograd, patches where the
                                       # steps are scanned; elsewhere lax: experiment.resolved_conv_form)
    # --- run management
    checkpoint_every: int = 5          # save the whole state every N rounds and at the end (0 = off)
    divergence_loss: float = 1e6       # a local loss above this (or non-finite) stops the run (0 = only non-finite)

    @property
    def clients_per_round(self) -> int:
        if self.per_round > 0:
            return self.per_round
        return max(1, int(round(self.participation * self.num_clients)))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


def _auto_or_count(value) -> bool:
    if value == "auto":
        return True
    try:
        return int(value) >= 0 and float(value) == int(value)
    except (TypeError, ValueError):
        return False


def slot_granule(cfg: RunConfig) -> int | str | None:
    """``--slot-granule`` as ``Layout.slot_granule``: ``"auto"``, a granule, or ``None`` (0: full batches)."""
    if cfg.slot_granule == "auto":
        return "auto"
    return int(cfg.slot_granule) or None


def fused_steps(cfg: RunConfig) -> int | str:
    """``--fused-steps`` as ``Layout.fused_steps``: ``"auto"`` or a step count (0: none)."""
    return "auto" if cfg.fused_steps == "auto" else int(cfg.fused_steps)


def preset(name: str, dataset: str) -> dict[str, Any]:
    """Option values of a preset for a dataset (overridden by any explicit option)."""
    if name not in PRESETS:
        raise ConfigError(f"--preset must be one of {', '.join(PRESETS)}; got {name!r}")
    if dataset == "digits":
        # The embedded demo set (1797 images): fewer clients and a small D_s; under a minute on a 2-core CPU.
        values = dict(num_clients=10, aux_size=300, rounds=20, local_epochs=2, alpha=0.5, ea_every=5)
    else:
        rounds, epochs = PAPER_SCHEDULE.get(dataset, (50, 2))
        values = dict(num_clients=20, participation=0.5, aux_size=5000, rounds=rounds,
                      local_epochs=epochs, batch_size=64, lr=0.015, teacher_epochs=3, warmup_epochs=0)
    own = dataset_preset(dataset)   # a registered dataset's own values (register_dataset(preset=))
    unknown = sorted(set(own) - {f.name for f in dataclasses.fields(RunConfig)})
    if unknown:
        raise ConfigError(f"dataset {dataset!r}: its preset (register_dataset(preset=)) has no run option "
                          f"{unknown[0]!r}; the options are RunConfig's fields")
    values.update(own)
    if name == "smoke":   # and each method's own phase lengths (METHODS[m].smoke, in make_config)
        values.update(rounds=2, ea_every=1)
    return values


def under(base: dict, over: dict) -> dict:
    """``base``'s options to be overridden by ``over``'s, less the one ``over``'s count of clients takes
    the place of: an explicit ``participation`` replaces a ``per_round`` count (which would otherwise win
    over it), a ``per_round`` count a ``participation``. For every merge of option sources: a preset
    under explicit options, a ``--config`` file under flags, a sweep's shared options under a point's."""
    base = dict(base)
    if over.get("participation") is not None and not over.get("per_round"):
        base.pop("per_round", None)
    if over.get("per_round"):
        base.pop("participation", None)
    return base


# the command line's flags whose RunConfig field is named otherwise (--clients sets num_clients)
_FIELD_OF_FLAG = {"clients": "num_clients", "clients_per_round": "per_round"}


def method_arg_pairs(margs, where: str = "method_args") -> tuple:
    """A method's own options, ``{key: value}`` or ``[(key, value), ...]``, as the ``((key, text), ...)``
    pairs of ``--method-arg``; anything else is a ConfigError naming ``where``."""
    items = margs.items() if isinstance(margs, dict) else margs
    try:
        return tuple((str(k), str(v)) for k, v in items)
    except (TypeError, ValueError):
        raise ConfigError(f"{where} must be {{key: value}} or [[key, value], ...]; got {margs!r}") from None


def make_config(preset_name: str = "default", **overrides) -> RunConfig:
    """``RunConfig`` from a preset (``preset_name``, or ``preset=``) for ``overrides['dataset']`` plus
    explicit overrides (``method_args``: ``((key, text), ...)`` as on the command line, or a dict)."""
    if "preset" in overrides:   # the preset's name, given by keyword
        preset_name = overrides.pop("preset")
    if isinstance(overrides.get("method_args"), dict):   # {key: value} as the (key, text) pairs of --method-arg
        overrides["method_args"] = method_arg_pairs(overrides["method_args"])
    if overrides.get("plugins") is not None:   # first: a plugin may register the dataset and its preset
        overrides["plugins"] = plugins(overrides["plugins"])
    if "method" in overrides:   # names as the registries spell them, case aside
        overrides["method"] = canonical_name(overrides["method"], METHODS)
    if "dataset" in overrides:
        overrides["dataset"] = canonical_name(overrides["dataset"], dataset_names())
    if overrides.get("method_args"):   # fedprox:mu=... in a fedprox run: the sweep's form, read as mu=...
        method = overrides.get("method", RunConfig.method)
        overrides["method_args"] = tuple(
            (k.split(":", 1)[1], v) if ":" in k and canonical_name(k.split(":", 1)[0], METHODS) == method else (k, v)
            for k, v in overrides["method_args"])
    if overrides.get("participation") is not None and overrides.get("per_round"):
        raise ConfigError(f"give participation ({overrides['participation']:g}) or per_round "
                          f"({overrides['per_round']}), not both: the count would win")
    dataset = overrides.get("dataset", RunConfig.dataset)
    values = under(preset(preset_name, dataset), overrides)   # a preset's count gives way to a participation
    values.update({k: v for k, v in overrides.items() if v is not None})
    method = values.get("method", RunConfig.method)
    if preset_name == "smoke" and method in METHODS:   # the method's own phases scaled down too
        given = {k for k, _ in values.get("method_args", ())}
        values["method_args"] = tuple((k, str(v)) for k, v in METHODS[method].smoke.items()
                                      if k not in given) + tuple(values.get("method_args", ()))
    fields = [f.name for f in dataclasses.fields(RunConfig)]
    unknown = sorted(set(values) - set(fields))
    if unknown:
        first = unknown[0]
        near = _FIELD_OF_FLAG.get(first) or next(iter(difflib.get_close_matches(first, fields, n=1)), None)
        hint = f"; did you mean {near!r}?" if near else ""
        raise ConfigError(f"unknown option(s): {', '.join(unknown)}{hint} (the options are RunConfig's fields)")
    cfg = RunConfig(**values)
    validate(cfg)
    return cfg


def plugins(names) -> tuple[str, ...]:
    """``--plugin`` values imported (:func:`~pfedkdh_jax.algorithms.load_plugins`), a file's path made
    absolute (a run's config.json then resumes from any directory)."""
    names = (names,) if isinstance(names, str) else tuple(names)
    names = tuple(os.path.abspath(x) if str(x).endswith(".py") else x for x in names)
    _load_plugins(names)
    return names


def _load_plugins(names) -> None:
    try:
        load_plugins(tuple(names))
    except ValueError as e:
        raise ConfigError(str(e)) from None


# names read regardless of case, '-' and '_', and by a dataset's alias: pfedkdh_jax.names


def _nearest(value, names) -> str:
    """``; did you mean 'x'?`` for the name closest to a mistyped ``value`` (case ignored), else ``""``."""
    if not isinstance(value, str):
        return ""
    named = canonical_name(value, names)   # a case, separator or alias variant (given to validate directly)
    if named != value:
        return f"; did you mean {named!r}?"
    lower = {n.lower(): n for n in names}
    near = difflib.get_close_matches(value.lower(), list(lower), n=1, cutoff=0.75)
    return f"; did you mean {lower[near[0]]!r}?" if near else ""


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def _check_method_options(cfg: RunConfig) -> None:
    """A method-specific run option set away from its default with a method that does not read it."""
    defaults = RunConfig()
    for name in sorted({o for spec in METHODS.values() for o in spec.run_options}):
        if getattr(cfg, name) != getattr(defaults, name) and name not in METHODS[cfg.method].run_options:
            users = ", ".join(m for m, spec in METHODS.items() if name in spec.run_options)
            flag = "--average-heads" if name == "persistent_heads" else "--" + name.replace("_", "-")
            own = (f" (its own {name}: --method-arg {cfg.method}:{name}={getattr(cfg, name)}, in a run or a sweep)"
                   if name in METHODS[cfg.method].args else "")
            raise ConfigError(f"{flag} is an option of {users}; --method {cfg.method} does not use it{own}")


def _check_method_config(cfg: RunConfig) -> None:
    """The shared budget and pFedKDH's options through their config classes (the one place their
    checks live), worded as flags; the client optimizer's options."""
    try:
        LocalConfig(lr=cfg.lr, batch_size=cfg.batch_size, local_epochs=cfg.local_epochs)
        PFedKDHConfig(**{name: getattr(cfg, name) for name in PFEDKDH_OPTIONS})
    except OptionError as e:
        raise ConfigError(f"--{e.field.replace('_', '-')} must be {e.allowed}; got {e.value!r}") from None
    _check(cfg.optimizer in OPTIMIZERS, f"--optimizer must be one of {', '.join(OPTIMIZERS)}; got {cfg.optimizer!r}")
    _check(cfg.momentum is None or cfg.optimizer == "momentum",
           f"--momentum is an option of --optimizer momentum; got --optimizer {cfg.optimizer}")
    _check(cfg.momentum is None or 0 <= cfg.momentum < 1, f"--momentum must be in [0, 1); got {cfg.momentum}")
    _check(cfg.weight_decay is None or cfg.weight_decay >= 0,
           f"--weight-decay must be >= 0; got {cfg.weight_decay}")


def validate(cfg: RunConfig) -> RunConfig:
    """Raise :class:`ConfigError` for the first invalid option; return ``cfg`` otherwise."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"--{f.name.replace('_', '-')} must be a finite number; got {value}")
    _load_plugins(cfg.plugins)
    _check(cfg.method in METHODS, f"--method must be one of {', '.join(METHODS)}; got {cfg.method!r}"
           + _nearest(cfg.method, METHODS)
           + ("" if cfg.plugins else " (a method of one's own: register_method in a module given by --plugin)"))
    try:
        parse_method_args(cfg.method, cfg.method_args, cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    names = dataset_names()
    _check(cfg.dataset in names, f"--dataset must be one of {', '.join(names)}; got {cfg.dataset!r}"
           + _nearest(cfg.dataset, names)
           + ("" if cfg.plugins else " (a dataset of one's own: register_dataset in a module given by --plugin)"))
    _check(cfg.alpha > 0, f"--alpha must be > 0; got {cfg.alpha}")
    _check(cfg.num_clients >= 2, f"--clients must be >= 2; got {cfg.num_clients}")
    _check(0 < cfg.participation <= 1, f"--participation must be in (0, 1]; got {cfg.participation}")
    _check(0 <= cfg.per_round <= cfg.num_clients,
           f"--clients-per-round must be between 1 and --clients {cfg.num_clients} (0: --participation); "
           f"got {cfg.per_round}")
    _check(cfg.synthetic_samples >= 2, f"--synthetic-samples must be >= 2; got {cfg.synthetic_samples}")
    _check(cfg.rounds >= 1, f"--rounds must be >= 1; got {cfg.rounds}")
    _check(cfg.data_seed >= 0, f"--data-seed must be >= 0 (it seeds numpy's partition); got {cfg.data_seed}")
    _check(cfg.reps >= 1, f"--reps must be >= 1; got {cfg.reps}")
    _check(cfg.reps_mode in ("auto", "vmap", "sequential"),
           f"--reps-mode must be auto, vmap or sequential; got {cfg.reps_mode!r}")
    _check(cfg.aux_size >= 1, f"--aux-size must be >= 1; got {cfg.aux_size}")
    _check(cfg.min_client_samples >= 2, f"--min-client-samples must be >= 2; got {cfg.min_client_samples}")
    _check(cfg.partition in ("dirichlet", "shards"), f"--partition must be dirichlet or shards; got {cfg.partition!r}")
    _check(cfg.shards_per_client >= 1, f"--shards-per-client must be >= 1; got {cfg.shards_per_client}")
    _check(cfg.fill in ("auto", "redraw", "top_up"), f"--fill must be auto, redraw or top_up; got {cfg.fill!r}")
    defaults = RunConfig.__dataclass_fields__
    if cfg.partition == "shards":   # the Dirichlet draw's own options would be ignored without a word
        unread = ([f"--fill {cfg.fill}"] * (cfg.fill != defaults["fill"].default)
                  + ["--balance-cap"] * bool(cfg.balance_cap))
        _check(not unread, f"--partition shards does not read {' or '.join(unread)} (options of the Dirichlet "
                           "draw); leave them out")
    else:
        _check(cfg.shards_per_client == defaults["shards_per_client"].default,
               f"--shards-per-client {cfg.shards_per_client} is read with --partition shards only")
    _check(0 < cfg.train_fraction < 1, f"--train-fraction must be in (0, 1); got {cfg.train_fraction}")
    _check(0 <= cfg.validation_fraction < 1,
           f"--validation-fraction must be in [0, 1); got {cfg.validation_fraction}")
    _check(0 <= cfg.dropout < 1, f"--dropout must be in [0, 1); got {cfg.dropout}")
    _check_method_config(cfg)
    _check_method_options(cfg)
    _check(cfg.eval_every >= 1, f"--eval-every must be >= 1; got {cfg.eval_every}")
    _check(0 <= cfg.eval_clients <= cfg.num_clients,
           f"--eval-clients must be between 0 (all) and --clients {cfg.num_clients}; got {cfg.eval_clients}")
    _check(cfg.ea_every >= 1, f"--ea-every must be >= 1; got {cfg.ea_every}")
    _check(cfg.client_parallel in (None, "vmap", "sequential"),
           f"--client-parallel must be vmap or sequential; got {cfg.client_parallel!r}")
    _check(cfg.step_loop in (None, "scan", "unrolled"),
           f"--step-loop must be scan or unrolled; got {cfg.step_loop!r}")
    _check(cfg.chunk_steps >= 1, f"--chunk-steps must be >= 1; got {cfg.chunk_steps}")
    _check(_auto_or_count(cfg.slot_granule),
           f"--slot-granule must be auto or an integer >= 0 (0: a full batch every step); got {cfg.slot_granule!r}")
    _check(_auto_or_count(cfg.fused_steps),
           f"--fused-steps must be auto or an integer >= 0 (0: never); got {cfg.fused_steps!r}")
    _check(cfg.client_devices is None or cfg.client_devices >= 1,
           f"--client-devices must be >= 1; got {cfg.client_devices}")
    _check(cfg.lanes is None or cfg.lanes >= 1, f"--lanes must be >= 1; got {cfg.lanes}")
    _check(cfg.checkpoint_every >= 0, f"--checkpoint-every must be >= 0; got {cfg.checkpoint_every}")
    _check(cfg.divergence_loss >= 0, f"--divergence-loss must be >= 0; got {cfg.divergence_loss}")
    _check(cfg.eval_chunk >= 1, f"--eval-chunk must be >= 1; got {cfg.eval_chunk}")
    _check(cfg.conv_form in ("auto", "lax", "patches", "winograd"),
           f"--conv-form must be auto, lax, patches or winograd; got {cfg.conv_form!r}")
    return cfg
