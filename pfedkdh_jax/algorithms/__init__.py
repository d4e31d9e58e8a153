"""The federated methods, one module each, and their registry (``--method NAME``).

=========  ==========================================================================================
pfedkdh    :mod:`.pfedkdh`: the paper's method (shared backbone, persistent heads, distillation from a
           refit teacher, EA)
fedavg     :mod:`.fedavg`: full model averaged; global-model evaluation
fedprox    :mod:`.fedprox`: FedAvg + μ/2‖w − w_g‖² locally
fedper     :mod:`.fedper`: base averaged, heads personal, trained together
fedrep     :mod:`.fedrep`: head epochs then body epochs, body averaged
fedbabu    :mod:`.fedbabu`: head frozen at φ⁰, body averaged; fine-tuned to evaluate
ditto      :mod:`.ditto`: FedAvg global model + personal models pulled towards it
pfedme     :mod:`.pfedme`: Moreau-envelope personal models, β-mixed server step
fedproto   :mod:`.fedproto`: class prototypes exchanged instead of weights
fedala     :mod:`.fedala`: adaptive local aggregation of the head
pfedsim    :mod:`.pfedsim`: FedAvg warm-up, then similarity-weighted mixing of the stored bodies
fedfed     :mod:`.fedfed`: feature distillation (a VAE's noisy sensitive features pooled), then FedAvg
=========  ==========================================================================================

The protocol every module implements is :mod:`pfedkdh_jax.engine.protocol`; their configurations
are :mod:`.configs` (each method's fields, defaults, help and checks, in one place); their shared
helpers are :mod:`.common`. This file is the registry of the command line: for each method, its
module (which defines ``from_config(cfg, num_classes, args)``), its config class (from which its
``--method-arg`` options, their types, defaults and checks are derived), and the run options
(``RunConfig`` fields beyond the shared budget) it reads. It imports no JAX, so the CLI validates
options before anything is compiled. In Python, every method is public by name
(``pfedkdh_jax.FedProx(model, FedProxConfig(mu=0.1))``). A method written outside the package joins
the registry with :func:`register_method` (the command line's ``--plugin`` imports the module that
calls it; experiments/examples/own_method.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from typing import Any, Callable

from pfedkdh_jax.algorithms import configs as _c
from pfedkdh_jax.algorithms.configs import KD_GATES, KD_TARGETS, OptionError  # noqa: F401  (re-exported)


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    """A method as the command line and the run see it. Its own options, their types, defaults and
    checks, its traceable fields and its smoke values all come from its config class (:mod:`.configs`)."""

    module: str                                   # e.g. "pfedkdh_jax.algorithms.fedavg"
    config: type                                  # its config class (configs.py)
    summary: str = ""
    run_options: tuple[str, ...] = ()             # RunConfig fields it reads beyond the shared budget
    # (args, run config) -> a one-line error or None: checks that relate its options to the run's
    run_check: Callable[[dict, Any], str | None] | None = None
    # the metric its row of a results table reports: personalized (the paper's), or the global
    # model's for the methods whose result is one shared model
    table_metric: str = "personalized_macro_accuracy"
    # whether its runs on other partitions of one pool stack into one program (run_stacked): its
    # state's and round's shapes do not depend on the partition beyond the padded tables
    stackable: bool = True
    # its options set with --method-arg (none for pFedKDH, whose options are run flags)
    method_args: bool = True
    # a method registered from outside the package (register_method): its class, and how a run builds it
    # ((cfg, num_classes, args) -> algorithm; None: the class over the run's CNN and its config)
    algorithm: type | None = None
    factory: Callable[[Any, int, dict], Any] | None = None

    @property
    def args(self) -> dict[str, Any]:
        """``--method-arg`` name -> default (its type is the type)."""
        if not self.method_args:
            return {}
        return {f.name: f.default for f in self.config.own_options()}

    @property
    def option_kinds(self) -> dict[str, list[str]]:
        """``--method-arg`` name -> the names its annotation allows (``["float", "None"]``)."""
        return {f.name: _c.annotation_names(f.type) for f in self.config.own_options()} if self.method_args else {}

    @property
    def traced(self) -> tuple[str, ...]:
        """RunConfig fields that stacked runs may differ in: the config's ``TRACEABLE`` less the method's
        own ``--method-arg`` options (those are :attr:`traced_args`)."""
        own = self.args
        return tuple(f for f in self.config.TRACEABLE if f not in own)

    @property
    def traced_args(self) -> tuple[str, ...]:
        """The method's own ``--method-arg`` options that stacked runs may differ in (its config's
        ``TRACEABLE`` ones: FedProx's ``mu``, say)."""
        own = self.args
        return tuple(f for f in self.config.TRACEABLE if f in own)

    @property
    def smoke(self) -> dict[str, Any]:
        return dict(self.config.SMOKE)

    @property
    def class_name(self) -> str:
        """The method's class, e.g. ``FedProx`` (the config class less ``Config``)."""
        return self.algorithm.__name__ if self.algorithm is not None else self.config.__name__[: -len("Config")]

    def algorithm_class(self) -> type:
        """The method's class (imports its module, and JAX, for a built-in one)."""
        return self.algorithm or getattr(importlib.import_module(self.module), self.class_name)


def _module(name: str) -> str:
    return f"pfedkdh_jax.algorithms.{name}"


# RunConfig fields only pFedKDH reads: its config's own fields that are run flags (the others are
# every method's budget or the run's own).
PFEDKDH_OPTIONS = tuple(f.name for f in _c.PFedKDHConfig.own_options())

METHODS: dict[str, MethodSpec] = {
    "pfedkdh": MethodSpec(_module("pfedkdh"), _c.PFedKDHConfig,
                          "pFedKDH (its options are run flags: --lam, --kd-target, ...)",
                          run_options=PFEDKDH_OPTIONS, method_args=False),
    # Baselines (method.md §5); defaults and their sources are in each module's docstring.
    "fedavg": MethodSpec(_module("fedavg"), _c.FedAvgConfig, "FedAvg (McMahan et al. 2017), global model",
                         table_metric="global_macro_accuracy"),
    "fedprox": MethodSpec(_module("fedprox"), _c.FedProxConfig,
                          "FedProx (Li et al. 2020), global model; μ via --method-arg mu=, not --mu",
                          table_metric="global_macro_accuracy"),
    "fedper": MethodSpec(_module("fedper"), _c.FedPerConfig, "FedPer (Arivazhagan et al. 2019)"),
    "fedrep": MethodSpec(_module("fedrep"), _c.FedRepConfig,
                         "FedRep (Collins et al. 2021): head epochs, then --local-epochs body epochs"),
    "fedbabu": MethodSpec(_module("fedbabu"), _c.FedBABUConfig,
                          "FedBABU (Oh et al. 2022): frozen head; evaluated after fine-tuning"),
    "ditto": MethodSpec(_module("ditto"), _c.DittoConfig,
                        "Ditto (Li et al., ICML 2021): FedAvg global model + personal models with λ/2‖v − w‖²"),
    "pfedme": MethodSpec(_module("pfedme"), _c.PFedMeConfig,
                         "pFedMe (Dinh et al., NeurIPS 2020): Moreau-envelope personalized models"),
    "fedproto": MethodSpec(_module("fedproto"), _c.FedProtoConfig,
                           "FedProto (Tan et al., AAAI 2022): class prototypes instead of weights"),
    "fedala": MethodSpec(_module("fedala"), _c.FedALAConfig,
                         "FedALA (Zhang et al., AAAI 2023): adaptive local aggregation of the head"),
    "pfedsim": MethodSpec(
        _module("pfedsim"), _c.PFedSimConfig,
        "pFedSim (Tan et al. 2023): FedAvg warm-up, then similarity-weighted bodies, personal classifiers"),
    "fedfed": MethodSpec(
        _module("fedfed"), _c.FedFedConfig,
        "FedFed (Yang et al., NeurIPS 2023): feature distillation rounds, then FedAvg with a shared pool",
        run_check=lambda a, cfg: (None if a["feature_rounds"] < cfg.rounds else
                                  f"--method-arg feature_rounds must be below --rounds {cfg.rounds} for fedfed "
                                  f"(phase A's rounds count in the run's); got {a['feature_rounds']}"),
        table_metric="global_macro_accuracy", stackable=False),   # the pool's size is the partition's
}


def _parse_option(key: str, text, kinds: list[str]):
    """A ``--method-arg`` value from its text, by the field's annotation (``kinds``: the names it
    allows, e.g. ``["float", "None"]``); a value that is not text is taken as it is."""
    if not isinstance(text, str):
        return text
    if "None" in kinds and text.lower() == "none":
        return None
    for kind in kinds:
        try:
            if kind == "bool":
                if text.lower() in ("1", "0", "true", "false", "yes", "no"):
                    return text.lower() in ("1", "true", "yes")
            elif kind in ("int", "float", "str"):
                return {"int": int, "float": float, "str": str}[kind](text)
        except ValueError:
            continue
    if not any(k in ("bool", "int", "float", "str") for k in kinds):
        return text
    raise ValueError(f"--method-arg {key}={text!r}: expected {' or '.join(kinds)}")


def method_arg_value(method: str, key: str, value):
    """One ``--method-arg`` value of ``method``'s option ``key``, typed as the option is (text is parsed,
    a number or bool taken as it is). Raises ValueError (one line) for an unknown key or a bad value."""
    return parse_method_args(method, [(key, value)])[key]


def parse_method_args(method: str, pairs, cfg=None) -> dict[str, Any]:
    """``[(key, text), ...]`` -> typed dict over the method's defaults (checked against the run
    config ``cfg`` too when given). Raises ValueError (one line)."""
    spec = METHODS[method]
    out = dict(spec.args)
    pairs = list(pairs)
    for key, _ in pairs:
        if key not in spec.args:
            allowed = (f"its own options: {', '.join(sorted(spec.args))}" if spec.args else
                       "it takes no --method-arg; its options are the run's flags: pfedkdh run --help")
            hint = f"; this run's method is {method}" if ":" in key else ""
            raise ValueError(f"--method-arg {key!r} is not an option of {method} ({allowed}){hint}")
    for key in dict(pairs):   # one option twice: named (the last would win without a word)
        values = [str(v) for k, v in pairs if k == key]
        if len(values) > 1:
            raise ValueError(f"--method-arg {key} is given {len(values)} times ({', '.join(values)}): give it once")
    for key, text in pairs:
        out[key] = _parse_option(key, text, spec.option_kinds[key])
    fields = {f.name: f for f in spec.config.own_options()}
    for key, value in out.items():
        check = fields[key].metadata.get("check")
        if check is not None and not check(value):
            raise ValueError(f"--method-arg {key} must be {fields[key].metadata['allowed']} for {method}; got {value!r}")
    problem = spec.run_check(out, cfg) if spec.run_check is not None and cfg is not None else None
    if problem:
        raise ValueError(problem)
    return out


def build(cfg, num_classes: int):
    """The algorithm object for ``cfg.method`` (imports its module, and JAX, only now)."""
    spec, args = METHODS[cfg.method], parse_method_args(cfg.method, cfg.method_args, cfg)
    if spec.factory is not None:
        return spec.factory(cfg, num_classes, args)
    if spec.algorithm is not None:   # a registered class over the run's model and budget
        from pfedkdh_jax.algorithms import common
        return spec.algorithm(common.run_model(cfg, num_classes), spec.config(**common.local_config(cfg), **args))
    return importlib.import_module(spec.module).from_config(cfg, num_classes, args)


BUILT_IN = tuple(METHODS)   # the package's twelve (register_method adds to METHODS, never replaces these)
TABLE_METRICS = ("personalized_macro_accuracy", "global_macro_accuracy")


def register_method(name: str, algorithm: type, config: type, *, summary: str = "",
                    table_metric: str = "personalized_macro_accuracy", stackable: bool = True,
                    factory: Callable[[Any, int, dict], Any] | None = None) -> MethodSpec:
    """Make a method of your own a method of runs, sweeps and the command line (``--method name``, with
    ``--plugin`` naming the module that calls this), next to the twelve.

    ``algorithm``: the class (an :class:`~pfedkdh_jax.engine.protocol.Algorithm`); ``config``: its config,
    a frozen dataclass deriving from :class:`~pfedkdh_jax.algorithms.configs.LocalConfig` whose own fields
    are declared with :func:`~pfedkdh_jax.algorithms.configs.option` (they become its ``--method-arg``
    options, checked as the config checks them). A run builds ``algorithm(model, config(budget of the run,
    **method args))`` over the run's model (the paper's CNN, or the one registered with its dataset), or
    calls ``factory(run_config, num_classes, method_args)`` when given.
    ``table_metric``: the metric of its row in a sweep's table (its personalized models', or its global
    model's); ``stackable``: whether runs on other partitions of one pool may share one program (its
    shapes depend on the partition only through the padded tables). Registering a name again replaces
    one's own registration; the package's methods cannot be replaced."""
    if not (isinstance(name, str) and name.isidentifier() and name == name.lower()):
        raise ValueError(f"register_method: the name must be a lower-case identifier (a --method value); got {name!r}")
    if name in BUILT_IN:
        raise ValueError(f"register_method: {name!r} is one of the package's methods; choose another name")
    from pfedkdh_jax.names import clashing_name
    clash = clashing_name(name, METHODS)
    if clash is not None:
        raise ValueError(f"register_method: {name!r} is read as {clash!r} (names are read regardless of case, '-' "
                         "and '_'); choose another name")
    from pfedkdh_jax.engine.protocol import Algorithm, check_pieces   # (a method's module imports JAX anyway)
    if not (isinstance(algorithm, type) and issubclass(algorithm, Algorithm)):
        raise TypeError(f"register_method({name!r}): algorithm must be a class deriving from pfedkdh_jax.Algorithm; "
                        f"got {algorithm!r}")
    if factory is None:
        try:
            inspect.signature(algorithm).bind(None, None)
        except (TypeError, ValueError):
            raise TypeError(f"register_method({name!r}): a run builds {algorithm.__name__}(model, config), which its "
                            f"signature {inspect.signature(algorithm)} does not take: give it fields model and "
                            f"config, or pass factory=(run_config, num_classes, method_args) -> algorithm") from None
    if not (isinstance(config, type) and issubclass(config, _c.LocalConfig) and dataclasses.is_dataclass(config)):
        raise TypeError(f"register_method({name!r}): config must be a dataclass deriving from "
                        f"pfedkdh_jax.LocalConfig (its fields declared with pfedkdh_jax.option); got {config!r}")
    if table_metric not in TABLE_METRICS:
        raise ValueError(f"register_method({name!r}): table_metric must be one of {', '.join(TABLE_METRICS)}; "
                         f"got {table_metric!r}")
    if factory is not None and not callable(factory):
        raise TypeError(f"register_method({name!r}): factory must be a function (run_config, num_classes, "
                        f"method_args) -> algorithm")
    check_pieces(algorithm, f"register_method({name!r})")
    spec = MethodSpec(algorithm.__module__, config, summary or f"{algorithm.__name__} (registered)",
                      table_metric=table_metric, stackable=stackable, algorithm=algorithm, factory=factory)
    METHODS[name] = spec
    return spec


def load_plugins(names) -> None:
    """Import each of ``names`` (a module's dotted name, or a ``.py`` file's path) once: modules that
    register methods or datasets (:func:`register_method`, :func:`~pfedkdh_jax.data.register_dataset`).
    A ``ValueError`` names the one that cannot be imported."""
    for name in names:
        if name.endswith(".py"):
            path = os.path.abspath(name)
            key = f"pfedkdh_plugin_{os.path.splitext(os.path.basename(name))[0]}"
            if key in sys.modules and getattr(sys.modules[key], "__file__", None) != path:
                key += "_" + hashlib.sha1(path.encode()).hexdigest()[:8]   # another folder's file of this name
            if key in sys.modules and getattr(sys.modules[key], "__file__", None) == path:
                continue
            if not os.path.exists(name):
                raise ValueError(f"--plugin {name}: no such file")
            spec = importlib.util.spec_from_file_location(key, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[key] = module        # (dataclasses look their module up while it runs)
            try:
                spec.loader.exec_module(module)
            except Exception as e:
                del sys.modules[key]
                raise ValueError(f"--plugin {name}: importing it failed: {type(e).__name__}: {e}") from None
        else:
            try:
                importlib.import_module(name)
            except (ImportError, TypeError, ValueError) as e:
                raise ValueError(f"--plugin {name}: cannot import it ({e}); give a module on the Python path "
                                 f"(PYTHONPATH) by its dotted name, or a .py file's path") from None
            except Exception as e:
                raise ValueError(f"--plugin {name}: importing it failed: {type(e).__name__}: {e}") from None


def make_method(name: str, model, **options):
    """The method registered as ``name`` (the command line's ``--method``, e.g. ``"fedprox"``) over
    ``model`` (any :class:`~pfedkdh_jax.engine.protocol.Model`), its config built from ``options`` (the
    fields of ``<Method>Config``, checked as that class checks them): ``make_method("fedprox", model,
    mu=0.1)`` is ``FedProx(model, FedProxConfig(mu=0.1))``. An unknown name or field is a
    ``ValueError`` naming it and what is allowed. The name reads as on the command line, regardless of
    case, '-' and '_' (``"FedProx"``)."""
    from pfedkdh_jax.names import canonical_name
    name = canonical_name(name, METHODS)
    if name not in METHODS:
        raise ValueError(f"make_method: no method {name!r}; registered: {', '.join(METHODS)}")
    spec = METHODS[name]
    fields = {f.name for f in dataclasses.fields(spec.config)}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise ValueError(f"make_method({name!r}): {spec.config.__name__} has no field {unknown[0]!r}; its fields: "
                         f"{', '.join(sorted(fields))}")
    return spec.algorithm_class()(model, spec.config(**options))
