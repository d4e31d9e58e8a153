"""Many small clients: steps of a client smaller than a batch compute only its size (rounded up to
``Layout.slot_granule``), with the numbers of full-batch steps."""

import dataclasses

import jax
import numpy as np
import pytest

from pfedkdh_jax import algorithms
from pfedkdh_jax.engine.layout import Layout
from pfedkdh_jax.engine.local import slot_width, step_widths, width_runs
from pfedkdh_jax.engine.protocol import splits_uploads
from pfedkdh_jax.engine.runner import RoundRunner
from pfedkdh_jax.run.config import make_config


def test_slot_width_rounds_a_batch_up_to_the_granule_or_keeps_a_smaller_one():
    assert [slot_width(n, 64) for n in (1, 7, 8, 9, 40, 63, 64, 65, 5000)] == [1, 7, 8, 16, 40, 64, 64, 64, 64]
    assert slot_width(7, 64, granule=1) == 7 and slot_width(7, 6) == 6   # never above the batch
    assert slot_width(0, 64) == 1


def test_a_partial_last_batch_computes_its_own_size():
    """A 100-sample client's epoch is a batch of 64 and one of 36 (40 slots); clients stepping
    together take the widest width any of them needs at a step; a step cap ends the list."""
    assert step_widths([100], 2, 64, 8) == [None, 40, None, 40]
    assert step_widths([100, 20], 2, 64, 8) == [None, 40, None, 40]       # 20 fits in 24 < 64
    assert step_widths([100, 150], 2, 64, 8) == [None] * 5 + [24]   # lockstep: only the last step narrows
    assert step_widths([7], 3, 64, 8, max_steps=2) == [7, 7]
    assert step_widths([100], 1, 64, None) == [None, None]
    assert width_runs([None, None, 40, None, 8, 8]) == [(None, 2), (40, 1), (None, 1), (8, 2)]


def test_only_the_widths_whose_saving_pays_for_their_compile_are_kept():
    """A width is kept when visits × steps × (1 − w/B) covers its pieces' compile (a single step: 44
    full steps; a chunk of 2: 58); the others round up to the next kept width, or a full batch."""
    from pfedkdh_jax.engine.local import compile_cost, paying_widths
    # 10 clients of 40 (one step of 40 slots an epoch, 2 epochs: a chunk of 2) and 2 of 100 (64 + 40)
    sizes = [40] * 10 + [100] * 2
    saving_40 = 10 * 2 * (1 - 40 / 64) + 2 * 2 * (1 - 40 / 64)       # per visit, in full steps
    cost_40 = compile_cost(2) + compile_cost(1)                        # the clients of 40: a chunk; of 100: single steps
    enough = cost_40 / saving_40
    assert paying_widths(sizes, enough * 1.01, 2, 64, 8, None, 2) == {40}
    assert paying_widths(sizes, enough * 0.99, 2, 64, 8, None, 2) == frozenset()
    # a width left out computes the next wider one kept, or a full batch
    assert step_widths([20, 40], 1, 64, 8, kept=frozenset({40})) == [40]
    assert step_widths([20], 1, 64, 8, kept=frozenset({40})) == [40]
    assert step_widths([50], 1, 64, 8, kept=frozenset({40})) == [None]


def test_a_runner_told_a_short_run_compiles_no_narrow_width(tiny):
    """Two rounds of two clients cannot pay for a width's compile: full batches only (the run's
    --slot-granule auto); a long run of the same clients narrows; a runner told no workload computes
    full batches."""
    from pfedkdh_jax.engine.layout import Workload
    _, _, data = tiny
    algo = algorithms.build(make_config("smoke", method="fedavg", rounds=2), data.num_classes)
    layout = Layout("sequential", "unrolled", chunk_steps=2)   # slot_granule="auto"
    for workload, narrows in ((Workload(2, 2), False), (Workload(100_000, 2), True), (None, False)):
        runner = RoundRunner(algo, data, layout, workload=workload)
        runner.round(algo.init(jax.random.key(0), data), data, np.array([0, 1]), jax.random.key(1))
        assert any("@" in k for k in runner.traces) == narrows, runner.traces
        # the clients of a long run (2 steps each) also run as one call each (Layout.fused_steps auto),
        # adding into the round's running sum (client_whole_mean@)
        assert any(k.startswith("client_whole_mean@") for k in runner.traces) == narrows, runner.traces


@pytest.mark.parametrize("name", ["pfedkdh", pytest.param("fedbabu", marks=pytest.mark.slow)])
def test_clients_of_a_few_steps_as_one_call_compute_the_pieces_round(tiny, name):
    """With fused_steps, a client whose plan has at most that many steps runs start to finish in one
    call, one compiled per plan (named by its widths): the rounds (and a personalization on images,
    FedBABU's fine-tuning) agree with the piece-by-piece ones to float32 rounding, nothing retraces,
    and a plan longer than fused_steps still runs in pieces."""
    _, _, data = tiny
    cfg = (make_config("smoke", method=name, local_epochs=2, rounds=2) if name == "pfedkdh" else
           make_config("smoke", method=name, local_epochs=2, rounds=2, method_args=(("finetune_epochs", "1"),)))
    algo = algorithms.build(cfg, data.num_classes)
    results = []
    for fused in (0, 8, 1):
        runner = RoundRunner(algo, data, Layout("sequential", "unrolled", chunk_steps=2, slot_granule=8,
                                                fused_steps=fused))
        state = algo.init(jax.random.key(0), data)
        for t, sel in enumerate([np.array([0, 1]), np.array([2, 3]), np.array([0, 3])]):
            state, metrics = runner.round(state, data, sel, jax.random.key(10 + t))
        ev = runner.evaluate(state, data, jax.random.key(5), personalize=True)
        results.append((state, metrics, ev))
        # both methods' one-call clients add their backbones into the round's running sum (client_whole_mean@)
        whole = {k for k in runner.traces if "client_whole@" in k or "client_whole_mean@" in k}
        assert all(v == 1 for v in runner.traces.values()), runner.traces
        sizes = {slot_width(int(n), 64) for n in np.asarray(data.train_n)}   # each client: 2 steps of its width
        form = "client_whole_mean" if splits_uploads(algo) else "client_whole"
        if fused == 8:
            assert {k for k in whole if k.startswith("client_whole")} == {f"{form}@{w}x2" for w in sizes}
            assert not any(k.startswith("train_") for k in runner.traces), runner.traces
            if name == "fedbabu":   # the fine-tuning of every client: its own one-call pieces
                assert any(k.startswith("personalize_client_whole@") for k in whole), runner.traces
        elif fused == 1:        # the round's plans have 2 steps, over the limit (a 1-epoch fine-tuning has 1)
            assert not any(k.startswith("client_whole") for k in whole), runner.traces
        else:
            assert not whole
    for other in results[1:]:
        for a, b in zip(jax.tree_util.tree_leaves(results[0]), jax.tree_util.tree_leaves(other)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["pfedkdh", pytest.param("fedavg", marks=pytest.mark.slow)])
@pytest.mark.parametrize("batch", [64, 16])
def test_narrow_steps_compute_the_full_batch_round(tiny, name, batch):
    """The tiny federation's clients hold fewer train samples than a batch of 64, under a batch of 64: with the granule
    each computes its size rounded up to 8 (on pieces named by their width), without it 64 slots; the
    two rounds agree to float32 rounding, and each width compiles once."""
    _, _, data = tiny
    sizes = np.asarray(data.train_n)
    assert sizes.max() < 64 and (batch == 64 or (sizes % batch).min() > 0)   # batch 16: partial last batches
    cfg = make_config("smoke", method=name, batch_size=batch, local_epochs=2, rounds=2)
    algo = algorithms.build(cfg, data.num_classes)
    states = []
    for granule in (8, None):
        runner = RoundRunner(algo, data, Layout("sequential", "unrolled", chunk_steps=2, slot_granule=granule))
        state = algo.init(jax.random.key(0), data)
        for t, sel in enumerate([np.array([0, 1]), np.array([2, 3]), np.array([0, 3])]):
            state, _ = runner.round(state, data, sel, jax.random.key(10 + t))
        states.append(state)
        narrow = {k for k in runner.traces if "@" in k}
        assert all(v == 1 for v in runner.traces.values()), runner.traces
        if granule is None:
            assert not narrow
        elif batch == 64:   # the widths of the clients met (2 epochs of one step each: one chunk of 2 steps)
            widths = {slot_width(int(n), 64) for n in sizes}
            assert narrow == {f"train_chunk@{w}" for w in widths if w < 64} and len(narrow) >= 2
        else:               # full batches of 16, then each client's last one alone on its own width
            widths = {slot_width(int(n) % 16, 16) for n in sizes}
            assert narrow == {f"train_step@{w}" for w in widths if w < 16} and len(narrow) >= 1
    for a, b in zip(jax.tree_util.tree_leaves(states[0]), jax.tree_util.tree_leaves(states[1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_many_clients_score_each_sample_with_its_own_head_only():
    """Above ALL_HEADS_UP_TO clients a test sample's logits come from its own head, gathered in
    chunks (no [T, K, classes] array): the same accuracies as every sample under every head."""
    from pfedkdh_jax.engine import scoring
    from pfedkdh_jax.model import CNN
    k, t, d = 300, 2500, 512   # T not a multiple of the chunk: the padded tail is cut off
    rng = np.random.default_rng(0)
    model = CNN(10)
    heads = {"out": {"kernel": rng.normal(size=(k, d, 10)).astype(np.float32),
                     "bias": rng.normal(size=(k, 10)).astype(np.float32)}}
    feats = rng.normal(size=(t, d)).astype(np.float32)
    owner = rng.integers(0, k + 1, t)              # k marks padding
    owner[owner == 7] = k                          # client 7 has no test sample here
    labels = rng.integers(0, 10, t)
    got = jax.jit(scoring.score, static_argnums=(0, 6))(model, feats, labels, owner, heads, None, k)
    safe = np.minimum(owner, k - 1)
    logits = np.einsum("td,tdc->tc", feats, heads["out"]["kernel"][safe]) + heads["out"]["bias"][safe]
    correct = (logits.argmax(-1) == labels) & (owner < k)
    n = np.bincount(owner, minlength=k + 1)[:k]
    per_client = np.bincount(owner, weights=correct, minlength=k + 1)[:k] / np.maximum(n, 1)
    per_client[n == 0] = np.nan                    # a client without test samples is not scored
    np.testing.assert_allclose(got["personalized_per_client_accuracy"], per_client, atol=1e-6)
    assert (n == 0).any() and np.isnan(got["personalized_per_client_accuracy"][n == 0]).all()
    assert k > scoring.ALL_HEADS_UP_TO


@pytest.mark.parametrize("name", ["pfedkdh", pytest.param("fedbabu", marks=pytest.mark.slow)])   # EA on features; fine-tuning on images
def test_an_evaluation_of_some_clients_scores_them_as_the_full_evaluation_does(tiny, name):
    """--eval-clients: the evaluation view keeps the chosen clients' samples only, and personalizes
    only them; their per-client accuracies are the full evaluation's, the macro accuracy their mean."""
    from pfedkdh_jax.data import build_federated_data, evaluation_clients, evaluation_view
    pool, part, data = tiny
    chosen = evaluation_clients(part.num_clients, 2, seed=0)
    view = build_federated_data(pool, evaluation_view(part, chosen), eval_chunk=64)
    assert int(view.test_n.sum()) == sum(len(part.test_idx[k]) for k in chosen)
    cfg = (make_config("smoke", method=name, rounds=1, ea_steps=2) if name == "pfedkdh" else
           make_config("smoke", method=name, rounds=1, method_args=(("finetune_epochs", "1"),)))
    algo = algorithms.build(cfg, data.num_classes)
    runner = RoundRunner(algo, data, Layout("sequential", "unrolled", chunk_steps=2))
    state, _ = runner.round(algo.init(jax.random.key(0), data), data, np.array([0, 1]), jax.random.key(1))
    full = runner.evaluate(state, data, jax.random.key(2), personalize=True)
    some = runner.evaluate(state, view, jax.random.key(2), personalize=True)
    keys = [k for k in full if "per_client_accuracy" in k and not k.startswith("global")]
    assert keys == ["personalized_per_client_accuracy"] + (["personalized_per_client_accuracy_ea"] if name == "pfedkdh" else [])
    for key in keys:
        per = np.asarray(full[key])
        np.testing.assert_allclose(np.asarray(some[key])[chosen], per[chosen], atol=1e-6)
        others = np.setdiff1d(np.arange(part.num_clients), chosen)
        assert np.isnan(np.asarray(some[key])[others]).all()   # not scored: NaN, not 0
        macro = key.replace("per_client", "macro")
        assert float(some[macro]) == pytest.approx(per[chosen].mean(), abs=1e-6)
    with pytest.raises(Exception, match="count must be between 1 and the 4 clients"):
        evaluation_clients(4, 5, seed=0)


@pytest.mark.slow   # 12 methods × their compiles (~4 min); the default run covers the paths with pFedKDH
@pytest.mark.parametrize("name", list(algorithms.METHODS))
def test_every_method_runs_many_small_clients_scoring_some(name, tmp_path, capsys):
    """100 clients of ~11 train samples on the digits set, 5 a round, 10 scored: narrow steps, clients
    of a few steps as one call each, and the evaluation view under every method (a smoke run of 2
    rounds would not pay for the narrow pieces: the granule and the fused steps are given)."""
    import json

    from pfedkdh_jax.run import cli
    out = tmp_path / name
    rc = cli.main(["run", "--method", name, "--preset", "smoke", "--clients", "100", "--participation", "0.05",
                   "--min-client-samples", "5", "--eval-clients", "10", "--slot-granule", "8", "--fused-steps", "8",
                   "--out", str(out), "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and 0.0 <= summary["personalized_macro_accuracy"] <= 1.0
    # one-call clients ran (adding into the round's running sum where the method averages its uploads)
    assert any("client_whole@" in k or "client_whole_mean@" in k for k in summary["traces"]), summary["traces"]


def test_a_synthetic_set_of_many_clients_runs_a_fixed_number_a_round(tmp_path, capsys):
    """--dataset synthetic of a chosen size, 300 clients, exactly 3 a round (--clients-per-round); the
    10 scored clients (--eval-clients) have an accuracy in the records, the 290 others null (not 0)."""
    import json

    from pfedkdh_jax.run import cli
    out = tmp_path / "run"
    rc = cli.main(["run", "--method", "fedavg", "--preset", "smoke", "--dataset", "synthetic", "--synthetic-samples",
                   "3000", "--aux-size", "100", "--clients", "300", "--clients-per-round", "3",
                   "--min-client-samples", "5", "--rounds", "1", "--eval-clients", "10", "--out", str(out),
                   "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    config = json.loads((out / "config.json").read_text())
    assert config["per_round"] == 3 and config["dataset"] == "synthetic"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed"
    for acc in (summary["per_client_personalized_accuracy"],
                json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["global_per_client_accuracy"]):
        scored = [a for a in acc if a is not None]
        assert len(acc) == 300 and len(scored) == 10 and all(0 <= a <= 1 for a in scored)
    assert "clients not listed" in capsys.readouterr().out   # 300 clients: the partition's table is cut short


def test_a_round_keeps_its_outputs_when_the_next_round_reuses_the_upload_buffer(tiny):
    """Sequential uploads are written into one buffer that the next round overwrites in place: what a
    round returned (FedAvg's metrics hand the clients' losses on as they came) keeps its values."""
    _, _, data = tiny
    algo = algorithms.build(make_config("smoke", method="fedavg", rounds=2), data.num_classes)
    runner = RoundRunner(algo, data, Layout("sequential", "unrolled", chunk_steps=2))
    state = algo.init(jax.random.key(0), data)
    state, first = runner.round(state, data, np.array([0, 1]), jax.random.key(1))
    kept = np.array(first["client_loss"])
    buffer = runner._rows._buf
    _, second = runner.round(state, data, np.array([2, 3]), jax.random.key(2))
    jax.block_until_ready(second)
    assert all(x.is_deleted() for x in jax.tree_util.tree_leaves(buffer))   # donated: written in place
    np.testing.assert_array_equal(np.asarray(first["client_loss"]), kept)
    assert not np.array_equal(np.asarray(second["client_loss"]), kept)


def test_a_personalization_on_features_adapts_small_clients_on_narrow_widths_as_on_full_batches(monkeypatch):
    """pFedKDH-EA's head steps on features: clients grouped by the slots their batches need (8, 16, 32,
    a full batch), and a group's clients a chunk at a time, give the heads that every client on a full
    batch of 64, all at once, gives."""
    from conftest import synthetic_pool

    from pfedkdh_jax.data import build_federated_data, make_partition
    from pfedkdh_jax.engine import evaluate
    pool = synthetic_pool(600)
    part = make_partition(pool.labels, num_clients=12, alpha=0.3, aux_size=40, min_client_samples=3, seed=1)
    data = build_federated_data(pool, part, eval_chunk=64)     # train sizes 3 … 92
    algo = algorithms.build(make_config("smoke", method="pfedkdh", ea_steps=3), data.num_classes)
    state = algo.init(jax.random.key(0), data)
    groups = evaluate.feature_groups(algo.personalization.trainer, data, None)
    assert [w for _, w in groups] == [8, 16, 32, None]
    assert sorted(np.concatenate([ids for ids, _ in groups]).tolist()) == list(range(12))
    pieces = evaluate.make_evaluate(algo)
    feats = pieces.features(algo.eval_models(state).backbone, data, data.train_flat)

    def adapt():
        return jax.jit(pieces.adapt_on_features)(state, data, jax.random.key(1), feats)
    grouped = adapt()
    monkeypatch.setattr(evaluate, "FEATURE_CHUNK", 2)           # groups of 3+ clients, 2 at a time
    monkeypatch.setattr(evaluate, "FEATURE_CHUNK_FROM", 2)      # (the last chunk padded)
    assert any(len(ids) > 2 and len(ids) % 2 for ids, _ in groups)
    chunked = adapt()
    monkeypatch.setattr(evaluate, "FEATURE_WIDTHS", ())        # every client on a full batch, all at once
    monkeypatch.setattr(evaluate, "FEATURE_CHUNK_FROM", 100)
    assert [w for _, w in evaluate.feature_groups(algo.personalization.trainer, data, None)] == [None]
    full = adapt()
    for got in (grouped, chunked):
        jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, full)
    # the steps moved every client's head (the comparison is not of untouched heads)
    start = jax.vmap(lambda k: algo.personalization.start(state, data, k, jax.random.key(1)).params)(np.arange(12))
    moved = jax.tree_util.tree_map(lambda a, b: np.abs(np.asarray(a) - np.asarray(b)).reshape(12, -1).max(1),
                                   grouped, start)
    assert all((m > 1e-4).all() for m in jax.tree_util.tree_leaves(moved))


# FedPer's summed uploads with --runslow: pFedKDH's take the same path, then refit the teacher
@pytest.mark.parametrize("name", [pytest.param("fedper", marks=pytest.mark.slow), "pfedkdh"])
def test_uploads_summed_as_they_come_give_the_stacked_rounds(tiny, name, monkeypatch):
    """A method that splits its uploads (``mean_upload``) runs its sequential rounds on a running sum
    per device: the rounds equal those of the same method given the stacked updates (its own
    ``server_update``) to float32 rounding, also with the clients spread over two devices (here one
    device twice), with a round of one client, where a device has none, and with every client in one
    call that adds into the sum itself; only the rests (heads, losses) are stacked."""
    from pfedkdh_jax.engine import runner as runner_module
    from pfedkdh_jax.engine.protocol import Algorithm
    _, _, data = tiny
    algo = algorithms.build(make_config("smoke", method=name, rounds=2), data.num_classes)

    class Stacked(type(algo)):
        def server_update(self, *args):   # a server step of its own: the runner stacks the updates
            return Algorithm.server_update(self, *args)
    stacked = Stacked(**{f.name: getattr(algo, f.name) for f in dataclasses.fields(algo)})
    assert splits_uploads(algo) and not splits_uploads(stacked)
    monkeypatch.setattr(runner_module.jax, "local_devices", lambda **kw: jax.devices()[:1] * 2)
    results = []
    for a, devices, fused in ((stacked, 1, 0), (algo, 1, 0), (algo, 2, 0), (algo, 2, 8)):
        runner = RoundRunner(a, data, Layout("sequential", "unrolled", chunk_steps=2, client_devices=devices,
                                             fused_steps=fused))
        state = a.init(jax.random.key(0), data)
        for t, sel in enumerate([np.array([0, 1, 3]), np.array([2]), np.array([3, 1])]):
            state, metrics = runner.round(state, data, sel, jax.random.key(10 + t))
        results.append((state, metrics))
        summed = {k for k in runner.traces if k.startswith(("mean_add", "client_whole_mean@"))}
        assert bool(summed) == (a is algo), runner.traces
        if a is algo:   # each piece one program whatever the round's number of clients
            assert all(runner.traces[k] == 1 for k in summed | {"mean_shapes"}), runner.traces
            assert any(k.startswith("client_whole_mean@") for k in summed) == bool(fused), runner.traces
            rows = jax.tree_util.tree_leaves(runner._rows._buf)   # the rests only: no backbone rows
            assert sum(x.size for x in rows) < 0.1 * sum(x.size for x in jax.tree_util.tree_leaves(state.backbone))
    for other in results[1:]:
        for x, y in zip(jax.tree_util.tree_leaves(results[0]), jax.tree_util.tree_leaves(other)):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)


def test_a_method_weighs_its_uploads_its_own_way(tiny):
    """``upload_weight``: FedPer whose clients weigh equally in the backbone's mean. The host loop's
    running sums (sequential clients) and the one-call round (the default ``server_update``) give the
    rounds of a server step that takes the plain mean of the stacked uploads itself, and those differ
    from the sample-weighted rounds (the tiny clients' sizes differ). A weight that is not a scalar is
    named."""
    import jax.numpy as jnp

    from pfedkdh_jax.engine.protocol import ProtocolError
    _, _, data = tiny
    base = algorithms.build(make_config("smoke", method="fedper", rounds=2), data.num_classes)
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}

    class Equal(type(base)):
        def upload_weight(self, data, client, update):
            return 1.0

    class PlainMean(type(base)):   # its own server step: the stacked uploads' unweighted mean
        def server_update(self, state, data, selected, updates, key):
            averaged, rest = jax.vmap(self.mean_upload)(updates)
            return self.server_update_from_mean(state, data, selected,
                                                jax.tree_util.tree_map(lambda x: x.mean(0), averaged), rest, key)

    class Rows(type(base)):
        def upload_weight(self, data, client, update):
            return jnp.ones(2)
    assert np.unique(np.asarray(data.train_n)[[0, 1, 3]]).size > 1
    results = []
    for cls, layout in ((PlainMean, Layout("sequential", "unrolled", chunk_steps=2)),
                        (Equal, Layout("sequential", "unrolled", chunk_steps=2)), (Equal, Layout("vmap", "scan")),
                        (type(base), Layout("sequential", "unrolled", chunk_steps=2))):
        a = cls(**fields)
        assert splits_uploads(a) == (cls is not PlainMean)
        runner = RoundRunner(a, data, layout)
        state = a.init(jax.random.key(0), data)
        for t, sel in enumerate([np.array([0, 1, 3]), np.array([2, 0])]):
            state, _ = runner.round(state, data, sel, jax.random.key(10 + t))
        results.append(jax.tree_util.tree_leaves(state.backbone))
    for other in results[1:3]:
        for x, y in zip(results[0], other):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)
    assert max(float(np.abs(np.asarray(x) - np.asarray(y)).max()) for x, y in zip(results[0], results[3])) > 1e-4
    rows = Rows(**fields)
    with pytest.raises(ProtocolError, match=r"Rows.upload_weight must give one client's weight as a scalar; "
                                            r"got shape \(2,\)"):
        RoundRunner(rows, data, Layout("vmap", "scan")).round(rows.init(jax.random.key(0), data), data,
                                                             np.array([0, 1]), jax.random.key(1))
