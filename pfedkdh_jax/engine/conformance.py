"""``check_method(algo, data)``: does a method keep the protocol's promises? For the author of a method.

The engine runs a method's pure pieces under several layouts (clients ``vmap``-ed or one after
another, steps in a ``lax.scan`` or unrolled), with repetitions ``vmap``-ed over a leading axis, and
from the host runner's compiled pieces; it may donate the state. All of that computes the same numbers
only if the method is pure and shape-static: no Python side effects, no value read on the host, no
client reading another client's values, no shape that depends on which clients were selected. A
method that breaks one of these may still run and give numbers that depend on the layout; this
check finds it on a few rounds of your data, with a message naming what differs and where.

Each check runs ``rounds`` jitted rounds (entering each later phase as a runner does) and compares:

=====================  ===================================================================================
``layouts``            the pure round under each layout gives the same states, losses and evaluation
``retrace``            nothing compiles again after a phase's first round
``repetitions``        two seeds vmapped over a leading axis give what each gives alone
``runner``             :class:`~pfedkdh_jax.engine.runner.PhasedRunner` (the command line's host loop)
                       gives what the pure round gives (compiled as the runner's steps are)
``evaluation``         the evaluation's metrics exist and accuracies lie in [0, 1]
=====================  ===================================================================================

Floating-point results are compared to ``tol`` (layouts reorder float32 sums: ~1e-5 after a few
rounds of small steps; an optimizer that normalises its steps, such as Adam, can turn that round-off
into steps of the learning rate's size, and statistics that follow them grow it further: FedFed's VAE, AdamW
and BatchNorm, reaches ~1e-2 in two rounds on some machines, above ``tol=3e-3``). Where a vmapped
repetition differs from its lone run beyond ``tol``, the pair runs again with the other repetition's seed and
clients changed, and the lone run traced again: a repetition that is then bitwise the same, beside a lone
run that is too, with every value finite, is independent of the other and nothing in it was fixed when
traced, which is what that check is for; the gap is a :class:`RoundOffWarning` (with its size), not a
failure. Otherwise a ``ProtocolError`` says which (the repetitions depend on each other, or a piece draws a
value when traced).

The runner compiles its step pieces with the local-training options
(:func:`~pfedkdh_jax.engine.layout.local_training_compiler_options`; on XLA:CPU another set of kernels), and
the pure round it is compared with is compiled with them too. Where the runner still differs beyond
``3·tol`` in float values only, the same pure round compiled with XLA's defaults shows how far the method
carries a change of compilation alone: where that differs beyond the tolerance too, and the runner's
largest gap is at most :data:`RUNNER_ROUND_OFF` times its largest, every value finite, the gap is a
:class:`RoundOffWarning` with both sizes; otherwise a ``ProtocolError``. (Where the options are XLA's
defaults, on other backends or with the option set in ``XLA_FLAGS``, there is no other compilation to
measure, and a gap is a ``ProtocolError``.)
FedFed is such a method: with its weights frozen (lr 0) its runner agrees with the pure round to 1e-6 over
rounds where clients take their VAE optimizer states back, but a relative change of 1e-6 in the VAE's
weights moves one round's summed gradients by 1.2 % of a leaf (one of 1e-7 by 1e-6: a jump, not a slope),
so that two compilations of a training round differ by ~1e-3 to 1e-2 (``experiments/fedfed_runner_check.py``).
A warned gap can hide a runner fault of its size: for such a method, a check with the weights frozen is the
conclusive one.

The test suite runs it over a method written outside the package
(``experiments/examples/own_method.py``) and over broken ones.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pfedkdh_jax.data.device import FederatedData
from pfedkdh_jax.engine.evaluate import make_evaluate
from pfedkdh_jax.engine.layout import Layout, local_training_compiler_options
from pfedkdh_jax.engine.local import tree_stack
from pfedkdh_jax.engine.protocol import Algorithm, ProtocolError, check_algorithm, check_pieces, state_change
from pfedkdh_jax.engine.round import check_state_clients, make_round, select_clients
from pfedkdh_jax.engine.runner import PhasedRunner, _phase_key, phase_at, phase_starts   # the runner's own phases

CHECKS = ("layouts", "retrace", "repetitions", "runner", "evaluation")


class RoundOffWarning(RuntimeWarning):
    """A vmapped repetition differs from its run alone beyond ``tol`` while it is bitwise the same
    whatever the other repetition holds, or the host runner differs from the pure round no more than
    the pure round compiled otherwise differs from itself: round-off the method amplifies, not a
    dependence or a piece the runner calls otherwise."""
LAYOUTS = (("vmap", "scan"), ("sequential", "unrolled"))


def _path(path) -> str:
    return jax.tree_util.keystr(path) or "(the whole value)"


def _gap_and_scale(x, y) -> tuple[float, float]:
    """The largest ``|x − y|`` of two float arrays and the largest ``|y|``, in float64."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return float(np.max(np.abs(x - y), initial=0.0)), float(np.max(np.abs(y), initial=0.0))


def _compare(what: str, a, b, tol: float, hint: str) -> None:
    """``ProtocolError`` at the first leaf of ``a`` and ``b`` (same structure) that differ beyond ``tol``."""
    sa, sb = jax.tree_util.tree_structure(a), jax.tree_util.tree_structure(b)
    if sa != sb:
        raise ProtocolError(f"{what}: the results differ in structure ({sa} against {sb}); {hint}")
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        if x.shape != y.shape:
            raise ProtocolError(f"{what}: {_path(path)} has shape {x.shape} against {y.shape}; {hint}")
        if jnp.issubdtype(x.dtype, jnp.inexact):   # bfloat16 too (numpy's floating does not take it)
            gap, scale = _gap_and_scale(x, y)
            if not gap <= tol * max(1.0, scale):
                raise ProtocolError(f"{what}: {_path(path)} differs by {gap:.3g} (tolerance {tol:g}); {hint}")
        elif not np.array_equal(x, y):
            raise ProtocolError(f"{what}: {_path(path)} differs; {hint}")


@dataclasses.dataclass
class _Run:
    state: Any
    metrics: list
    traces: dict
    change: str | None = None   # the first way a round's state differed from the one it was given


def _round_phases(algo: Algorithm, n: int) -> list[tuple[int, bool]]:
    """For each of ``n`` rounds: its phase, and whether the phase is entered there (as the runner does)."""
    starts = phase_starts(algo.phases)
    return [(i, i > 0 and t == starts[i]) for t, i in ((t, phase_at(starts, t)) for t in range(n))]


def _pure_rounds(algo: Algorithm, data: FederatedData, layout, schedule, keys, seed: int, options=None) -> _Run:
    """Jitted rounds of each phase's pure round function, entering later phases as a runner does
    (``options``: the rounds' ``compiler_options``)."""
    traces: dict[int, int] = {}
    steps: dict[int, Any] = {}
    state = algo.init(jax.random.key(seed), data)
    metrics, change = [], None
    for t, (i, enters) in enumerate(_round_phases(algo, len(schedule))):
        phase = algo.phases[i]
        if i not in steps:
            def counted(*args, fn=make_round(phase.algorithm, Layout(*layout, chunk_steps=2)), i=i):
                traces[i] = traces.get(i, 0) + 1
                return fn(*args)
            steps[i] = jax.jit(counted, compiler_options=options)
        if enters and phase.enter is not None:
            state = jax.jit(phase.enter)(state, data, _phase_key(keys[t], i))
        given = state
        try:
            state, m = steps[i](state, data, jnp.asarray(schedule[t]), keys[t])
        except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError) as e:
            first = str(e).strip().splitlines()[0]
            raise ProtocolError(f"check_method({type(phase.algorithm).__name__}): a piece of the round reads a "
                                f"traced value on the host (float(), int(), bool(), np.asarray or an `if` on an "
                                f"array; JAX: {first}); every piece must stay in jax.numpy") from e
        change = change or state_change(given, state)
        metrics.append(m)
    return _Run(state, metrics, traces, change)


def check_method(algo: Algorithm, data: FederatedData, *, rounds: int = 2, clients_per_round: int = 2,
                 checks=CHECKS, tol: float = 1e-4, seed: int = 0) -> dict:
    """Run ``algo`` for ``rounds`` rounds of ``clients_per_round`` clients on ``data`` in every way the
    engine runs a method and check they agree (module docstring); ``checks`` picks some of
    :data:`CHECKS`. Returns the evaluation of the reference run (layout vmap + scan); raises
    :class:`ProtocolError` naming the first promise broken. Small data and few steps keep it quick
    (each check compiles the round again)."""
    check_algorithm(algo, "check_method(algo, data)")
    checks = (checks,) if isinstance(checks, str) else tuple(checks)   # one check's name alone
    unknown = sorted(set(checks) - set(CHECKS))
    if unknown:
        raise ValueError(f"check_method: no check {unknown[0]!r}; the checks: {', '.join(CHECKS)}")
    k = data.num_clients
    if not 1 <= clients_per_round <= k:
        raise ValueError(f"check_method: clients_per_round must be in [1, {k}]; got {clients_per_round}")
    name = type(algo).__name__
    check_pieces(algo, f"check_method({name})")
    base = jax.random.key(seed + 1)
    schedule = [np.asarray(select_clients(jax.random.fold_in(base, t), k, clients_per_round)) for t in range(rounds)]
    keys = [jax.random.fold_in(jax.random.key(seed + 2), t) for t in range(rounds)]
    try:   # the evaluation's heads [K, ...] and its backbone's per_client flag, against the model's shapes
        check_state_clients(algo, algo.init(jax.random.key(seed), data), data, f"check_method({name})")
    except ValueError as e:
        raise ProtocolError(str(e)) from e
    last = algo.phases[-1].algorithm

    ref = _pure_rounds(algo, data, LAYOUTS[0], schedule, keys, seed)
    evaluate = jax.jit(make_evaluate(last, Layout(*LAYOUTS[0], chunk_steps=2)), static_argnums=3)
    try:
        scores = evaluate(ref.state, data, jax.random.key(seed + 3), last.personalization is not None)
    except Exception as e:   # a wrongly shaped EvalModels fails deep in the model's code: say what to look at
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ProtocolError(f"check_method({name}): the evaluation failed ({type(e).__name__}: {first}); "
                            "eval_models must give heads [K, ...], and per_client=True when the backbone is "
                            "per client ([K, ...] or a ClientRows)") from e
    if "retrace" in checks and set(ref.traces.values()) != {1}:
        raise ProtocolError(f"check_method({name}): a round compiled again (traces per phase {ref.traces}): its "
                            "state's structure, shapes or dtypes change from round to round, or a static "
                            "field does" + (f" ({ref.change})" if ref.change else ""))
    if "evaluation" in checks:
        for key in ("personalized_macro_accuracy", "personalized_micro_accuracy"):
            if key not in scores:
                raise ProtocolError(f"check_method({name}): the evaluation has no {key} (eval_models must give "
                                    "heads [K, ...] to score each client's test split)")
        for key, value in scores.items():
            value = np.asarray(value, np.float64)
            if key.endswith("accuracy") and not (np.nanmin(value, initial=0.0) >= 0.0
                                                 and np.nanmax(value, initial=1.0) <= 1.0):
                raise ProtocolError(f"check_method({name}): {key} = {value} is not in [0, 1]")
        for t, m in enumerate(ref.metrics):
            if "train_loss" not in m:
                raise ProtocolError(f"check_method({name}): round {t}'s metrics have no train_loss")
    runs = {LAYOUTS[0]: ref}   # each layout's pure rounds, run once for the checks that compare with them
    if "layouts" in checks:
        for layout in LAYOUTS[1:]:
            other = runs[layout] = _pure_rounds(algo, data, layout, schedule, keys, seed)
            hint = ("its clients' work depends on how they are laid out (a Python side effect, a value read "
                    "on the host, or a client reading another client's values?)")
            where = f"check_method({name}): Layout{layout} against Layout{LAYOUTS[0]}"
            _compare(where + ", the state", other.state, ref.state, tol, hint)
            _compare(where + ", the round's metrics", other.metrics, ref.metrics, tol, hint)
            if "retrace" in checks and set(other.traces.values()) != {1}:
                raise ProtocolError(f"check_method({name}): a round compiled again under Layout{layout} "
                                    f"(traces per phase {other.traces})")
    if "repetitions" in checks:
        _check_repetitions(algo, data, schedule, keys, seed, tol, name)
    if "runner" in checks:
        # the runner compiles its step pieces with the local-training options (on XLA:CPU another set of
        # kernels; its other pieces with XLA's defaults): the pure round it is compared with is compiled
        # with them too, so that the two programs' step kernels are the same
        layout, options = LAYOUTS[1], local_training_compiler_options()
        pure = (runs.get(layout) if options is None else None) or _pure_rounds(algo, data, layout, schedule, keys,
                                                                                seed, options=options)
        runner = PhasedRunner(algo, data, Layout(*layout, chunk_steps=2))
        state = algo.init(jax.random.key(seed), data)
        for t, sel in enumerate(schedule):
            state, _ = runner.round(state, data, sel, keys[t], t)
        what = f"check_method({name}): the host runner (PhasedRunner) against the pure round, the state"
        hint = ("the runner calls the pieces one by one: a piece that is not pure, or a round_start whose result "
                "server_update needs?")
        if options is None:   # compiled alike: nothing measures what another compilation would move
            _compare(what, state, pure.state, tol * 3, hint)
        else:
            try:
                _compare(what, state, pure.state, tol * 3, hint)
            except ProtocolError:
                # the same pure round compiled with XLA's default kernels: how far the method carries a
                # change of compilation alone
                probe = runs.get(layout) or _pure_rounds(algo, data, layout, schedule, keys, seed)
                _runner_round_off(what, hint, state, pure.state, probe.state, tol * 3)
    return scores


# a runner's largest gap no larger than this many times the pure round's own under another compilation
# (itself beyond the tolerance) is round-off the method amplifies (a RoundOffWarning)
RUNNER_ROUND_OFF = 10.0


def _float_gaps(a, b) -> list[tuple[str, float]]:
    """Each float leaf's largest gap between ``a`` and ``b`` (same structure and shapes), scaled as
    :func:`_compare` scales it (``inf`` where a value is not finite), with its path."""
    out = []
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves(b)):
        if jnp.issubdtype(x.dtype, jnp.inexact):
            gap, scale = _gap_and_scale(x, y)
            out.append((_path(path), gap / max(1.0, scale) if np.isfinite(gap) and np.isfinite(scale) else float("inf")))
    return out


def _same_but_floats(a, b) -> bool:
    """The same structure and shapes, and every leaf that is not a float equal."""
    if jax.tree_util.tree_structure(a) != jax.tree_util.tree_structure(b):
        return False
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        if x.shape != y.shape or (not jnp.issubdtype(x.dtype, jnp.inexact) and not np.array_equal(x, y)):
            return False
    return True


def _runner_round_off(what: str, hint: str, state, pure, probe, tol: float) -> None:
    """The runner's ``state`` differs from the ``pure`` round's beyond ``tol``. Where only float values
    differ, every value is finite, the pure round compiled otherwise (``probe``) differs from itself beyond
    ``tol`` too (the method amplifies a change of compilation), and the runner's largest gap is at most ten
    times the probe's, the gap is round-off the method amplifies: each compilation computes its own
    round-off, and a method whose gradients jump with the last bits of a weight (FedFed's VAE: a relative
    change of 1e-6 in its weights moved one round's summed gradients by 1.2 % of a leaf) carries that into
    its state; a :class:`RoundOffWarning` with both sizes. Otherwise the ``ProtocolError``. The largest gaps
    are compared, not each leaf's: two compilations' gaps in one leaf differed by up to 33× for FedFed
    (BENCHMARKS.md). Such a gap can hide a runner fault of its size: for such a method only a check with
    its weights frozen (lr 0) is conclusive."""
    if not _same_but_floats(state, pure):
        _compare(what, state, pure, tol, hint)   # a structure, a shape or an integer: the ProtocolError
    gap, where = max(((g, w) for w, g in _float_gaps(state, pure)), default=(0.0, ""))
    floor, there = max(((g, w) for w, g in _float_gaps(probe, pure)), default=(0.0, ""))
    if not (tol < floor < float("inf") and gap <= RUNNER_ROUND_OFF * floor):
        _compare(what, state, pure, tol, hint + f" (the pure round compiled otherwise differs from itself by "
                 f"{floor:.3g})")
    warnings.warn(f"{what}: {where} differs by {gap:.3g} (tolerance {tol:g}); yet the pure round compiled "
                  f"otherwise differs from itself by {floor:.3g} (in {there}): round-off between compilations, "
                  "which the method amplifies (its gradients jump with a weight's last bits), not a piece the "
                  "runner calls otherwise; a runner fault of that size would not show (weights frozen, lr 0, "
                  "the check is conclusive)", RoundOffWarning, stacklevel=3)


def _bitwise_equal(a, b) -> bool:
    return all(np.array_equal(np.asarray(x), np.asarray(y), equal_nan=jnp.issubdtype(x.dtype, jnp.inexact))
               for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


def _check_repetitions(algo, data, schedule, keys, seed, tol, name) -> None:
    """Two seeds as repetitions vmapped over a leading axis, against each one alone. Where one differs,
    the pair is run again with the other repetition's seed and clients changed, and the lone run traced
    again: if the first is then unchanged, the repetitions are independent; if the second is unchanged
    too (and every value finite), nothing was fixed when traced, and the gap is round-off between the
    vmapped and the lone program (FedFed's VAE, trained with AdamW, grows it to ~1e-2 in two rounds): a
    warning. Otherwise a ProtocolError saying which."""
    seeds = (seed, seed + 5)
    other = [np.roll(s, 1) for s in schedule]                  # the second repetition's own clients
    plans = {seeds[0]: schedule, seeds[1]: other}
    batched: dict[int, Any] = {}

    def vmapped(pair, moved=None):   # the pair's state after the rounds, repetition r on plans[seeds[r]]
        # (the repetition ``moved``, if given, on other clients: each selected id + 1)
        state = tree_stack([algo.init(jax.random.key(s), data) for s in pair])
        for t, (i, enters) in enumerate(_round_phases(algo, len(schedule))):
            phase = algo.phases[i]
            if i not in batched:
                batched[i] = jax.jit(jax.vmap(make_round(phase.algorithm, Layout(*LAYOUTS[1], chunk_steps=2)),
                                              in_axes=(0, None, 0, 0)))
            rep_keys = jnp.stack([jax.random.fold_in(keys[t], s) for s in pair])
            if enters and phase.enter is not None:
                state = jax.jit(jax.vmap(phase.enter, in_axes=(0, None, 0)))(state, data, _phase_key(rep_keys, i))
            sel = jnp.asarray(np.stack([(plans[s][t] + (j == moved)) % data.num_clients for j, s in enumerate(seeds)]))
            state, _ = batched[i](state, data, sel, rep_keys)
        return state
    state = vmapped(seeds)
    for r, s in enumerate(seeds):
        alone = _pure_rounds(algo, data, LAYOUTS[1], plans[s], [jax.random.fold_in(k, s) for k in keys], s)
        what = f"check_method({name}): repetition {r} of two vmapped against its run alone, the state"
        mine = jax.tree_util.tree_map(lambda x: x[r], state)
        try:
            _compare(what, mine, alone.state, tol, "")
        except ProtocolError:
            partner = tuple(x if i == r else x + 11 for i, x in enumerate(seeds))   # the other one's seed changed
            moved = jax.tree_util.tree_map(lambda x: x[r], vmapped(partner, moved=1 - r))   # and its clients
            independent = _bitwise_equal(mine, moved)
            if not independent:
                _compare(what, mine, alone.state, tol,
                         "a repetition's round depends on the other's (a reduction over the leading axis?)")
            again = _pure_rounds(algo, data, LAYOUTS[1], plans[s], [jax.random.fold_in(k, s) for k in keys], s)
            if not _bitwise_equal(again.state, alone.state):   # traced anew, the same program computes other numbers
                _compare(what, mine, alone.state, tol, "and its run alone, traced again, gives other numbers: a piece "
                         "draws or reads a value when traced (numpy, Python's random, a global), so each program "
                         "holds its own")
            if not all(np.isfinite(np.asarray(x, np.float64)).all() for x in jax.tree_util.tree_leaves((mine, alone.state))
                       if jnp.issubdtype(x.dtype, jnp.inexact)):
                _compare(what, mine, alone.state, tol, "a value is not finite")
            try:
                _compare(what, mine, alone.state, tol, "")
            except ProtocolError as e:   # what the check is for holds: a warning, not a failure
                warnings.warn(f"{str(e).rstrip('; ')}; yet it is bitwise the same whatever the other repetition "
                              "holds: the repetitions are independent (and the lone run, traced again, is the same: "
                              "nothing fixed when traced), and the gap is round-off between the vmapped and the lone "
                              "program, which the method amplifies", RoundOffWarning, stacklevel=3)
