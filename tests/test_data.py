"""Tests for pfedkdh_jax.data: pools, the federated partition protocol, summaries and array layout."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from pfedkdh_jax import data
from pfedkdh_jax.data import DataError, make_partition

NUM_CLASSES = 10
SHARED_TFDS = Path(__file__).resolve().parents[2] / "shared" / "data" / "tfds"


def _labels(n: int = 3000, seed: int = 123) -> np.ndarray:
    """Synthetic pool labels: n samples, NUM_CLASSES roughly balanced classes."""
    return np.random.default_rng(seed).integers(0, NUM_CLASSES, size=n).astype(np.int32)


def _partition(labels=None, **overrides) -> data.Partition:
    kwargs = dict(num_clients=20, alpha=0.3, aux_size=500, seed=0)
    kwargs.update(overrides)
    return data.make_partition(_labels() if labels is None else labels, **kwargs)


def _client_sizes(p: data.Partition) -> np.ndarray:
    return np.array([len(a) + len(b) for a, b in zip(p.train_idx, p.test_idx)])


def _real_data_dir() -> Path | None:
    """$TFDS_DATA_DIR or the shared folder next to the repository, when it holds prepared MNIST."""
    for candidate in (os.environ.get("TFDS_DATA_DIR"), SHARED_TFDS):
        if candidate and (Path(candidate) / "mnist").is_dir():
            return Path(candidate)
    return None


# ---------------------------------------------------------------------------------------------------- partition


def test_partition_covers_every_non_aux_sample_once():
    labels = _labels()
    p = _partition(labels)
    assert p.num_clients == 20 and len(p.train_idx) == len(p.test_idx) == 20
    assert p.aux_idx.dtype == np.int64 and len(p.aux_idx) == 500
    assert len(np.unique(p.aux_idx)) == 500
    clients = np.concatenate([np.concatenate([a, b]) for a, b in zip(p.train_idx, p.test_idx)])
    assert len(clients) == len(np.unique(clients)) == len(labels) - 500  # each sample in exactly one split
    assert not np.intersect1d(clients, p.aux_idx).size  # D_s disjoint from every client
    assert np.array_equal(np.sort(np.concatenate([clients, p.aux_idx])), np.arange(len(labels)))
    for train, test in zip(p.train_idx, p.test_idx):
        assert train.dtype == np.int64 and test.dtype == np.int64
        assert not np.intersect1d(train, test).size


def test_partition_respects_min_client_samples_and_train_fraction():
    p = _partition(alpha=0.1, min_client_samples=30)
    sizes = _client_sizes(p)
    assert sizes.min() >= 30
    for train, test in zip(p.train_idx, p.test_idx):
        n = len(train) + len(test)
        assert len(train) == max(1, min(n - 1, int(np.floor(0.75 * n))))
        assert len(test) >= 1
    total_train = sum(len(t) for t in p.train_idx)
    assert abs(total_train / sizes.sum() - 0.75) < 0.02


def test_tiny_clients_still_get_one_train_and_one_test_sample():
    p = data.make_partition(np.arange(6) % 2, num_clients=2, alpha=100.0, aux_size=0, min_client_samples=2,
                            train_fraction=0.1, seed=3)
    for train, test in zip(p.train_idx, p.test_idx):
        assert len(train) >= 1 and len(test) >= 1


def test_partition_is_deterministic_in_seed():
    a, b, c = _partition(seed=7), _partition(seed=7), _partition(seed=8)
    assert np.array_equal(a.aux_idx, b.aux_idx)
    assert all(np.array_equal(x, y) for x, y in zip(a.train_idx, b.train_idx))
    assert all(np.array_equal(x, y) for x, y in zip(a.test_idx, b.test_idx))
    assert not np.array_equal(a.aux_idx, c.aux_idx)
    assert not all(np.array_equal(x, y) for x, y in zip(a.train_idx, c.train_idx))


def test_small_alpha_gives_fewer_classes_per_client():
    labels = _labels()

    def mean_classes(alpha):
        summary = data.partition_summary(_partition(labels, alpha=alpha), labels, NUM_CLASSES)
        return np.mean(summary["classes_per_client"])

    skewed, near_iid = mean_classes(0.05), mean_classes(100.0)
    assert skewed < 5 and near_iid > 9.5 and skewed < near_iid


def test_balance_cap_bounds_client_size():
    """With the cap a client only receives data while below N/K, so it ends below N/K + the largest class."""
    labels = _labels()
    aux = 500
    cap = (len(labels) - aux) / 20
    largest_class = np.bincount(labels).max()
    max_capped, max_free = [], []
    for seed in range(4):
        capped = _client_sizes(_partition(labels, alpha=0.1, balance_cap=True, seed=seed))
        free = _client_sizes(_partition(labels, alpha=0.1, balance_cap=False, seed=seed))
        assert capped.max() < cap + largest_class
        assert capped.sum() == free.sum() == len(labels) - aux
        max_capped.append(capped.max())
        max_free.append(free.max())
    assert np.mean(max_capped) < np.mean(max_free)


def test_unreachable_min_client_samples_raises():
    with pytest.raises(DataError, match="min_client_samples"):
        _partition(alpha=0.01, min_client_samples=120, max_redraws=3)


@pytest.mark.parametrize(
    "overrides, option",
    [
        (dict(alpha=0.0), "alpha"),
        (dict(alpha=-1.0), "alpha"),
        (dict(num_clients=1), "num_clients"),
        (dict(aux_size=-1), "aux_size"),
        (dict(aux_size=3000), "aux_size"),
        (dict(min_client_samples=1), "min_client_samples"),
        (dict(train_fraction=0.0), "train_fraction"),
        (dict(train_fraction=1.0), "train_fraction"),
        (dict(num_clients=50, min_client_samples=60), "num_clients \\* min_client_samples"),
        (dict(max_redraws=0), "max_redraws"),
    ],
)
def test_invalid_partition_options_raise(overrides, option):
    with pytest.raises(DataError, match=option):
        _partition(**overrides)


def test_invalid_labels_raise():
    # aux_size defaults to 0, as from_arrays's (before: a TypeError for the missing argument)
    assert data.make_partition(np.repeat(np.arange(3), 40), num_clients=3, alpha=1.0).aux_idx.size == 0
    with pytest.raises(DataError):
        data.make_partition(np.zeros((3, 3), int), num_clients=2, alpha=1.0, aux_size=0)
    with pytest.raises(DataError):
        data.make_partition(np.array([0.5, 1.0]), num_clients=2, alpha=1.0, aux_size=0)


def test_summary_is_json_and_consistent():
    labels = _labels()
    p = _partition(labels)
    s = data.partition_summary(p, labels, NUM_CLASSES)
    assert json.loads(json.dumps(s)) == s
    assert s["num_clients"] == 20 and s["aux_size"] == 500
    assert s["train_sizes"] == [len(t) for t in p.train_idx]
    assert s["test_sizes"] == [len(t) for t in p.test_idx]
    hist = np.array(s["label_histogram"])
    assert hist.shape == (20, NUM_CLASSES)
    assert np.array_equal(hist.sum(1), _client_sizes(p))
    assert s["classes_per_client"] == [int((row > 0).sum()) for row in hist]
    assert s["min_train"] == min(s["train_sizes"]) and s["max_train"] == max(s["train_sizes"])
    assert s["mean_train"] == pytest.approx(np.mean(s["train_sizes"]))
    text = data.format_summary(s)
    assert len(text.splitlines()) == 20 + 3 and "train" in text
    short = data.format_summary(s, max_clients=6).splitlines()   # 1,000 clients need not print 1,000 lines
    assert [line.split()[0] for line in short[2:-1]] == ["0", "1", "2", "...", "17", "18", "19"]
    assert "(14 clients not listed)" in short[5]


# ------------------------------------------------------------------------------------------------------- layout


def test_padded_index_table():
    table, sizes = data.padded_index_table([[3, 1], [], [7, 8, 9]])
    assert table.dtype == np.int32 and sizes.dtype == np.int32
    assert table.tolist() == [[3, 1, 0], [0, 0, 0], [7, 8, 9]]
    assert sizes.tolist() == [2, 0, 3]
    wide, _ = data.padded_index_table([np.array([5])], pad_to=4)
    assert wide.tolist() == [[5, 0, 0, 0]]
    with pytest.raises(DataError, match="pad_to"):
        data.padded_index_table([[1, 2, 3]], pad_to=2)


def test_normalize_range_and_dtype():
    x = np.array([0, 127, 255], dtype=np.uint8)
    y = data.normalize(x)
    assert y.dtype == np.float32
    assert y[0] == -1.0 and y[2] == 1.0 and abs(y[1]) < 0.01
    full = data.normalize(np.arange(256, dtype=np.uint8))
    assert full.min() >= -1.0 and full.max() <= 1.0


# -------------------------------------------------------------------------------------------------------- pools


def test_digits_pool():
    pool = data.load_pool("digits")
    assert pool.images.shape == (1797, 28, 28, 1) and pool.images.dtype == np.uint8
    assert pool.labels.shape == (1797,) and pool.labels.dtype == np.int32
    assert set(np.unique(pool.labels).tolist()) == set(range(10))
    assert pool.num_classes == 10 and pool.is_demo and pool.name == "digits"
    assert pool.images.max() > 200  # scaled from 0..16 to the full 0..255 range
    assert data.load_pool("Digits").name == "digits"   # names read as --dataset reads them
    with pytest.raises(DataError, match="unknown dataset 'digitz'"):
        data.load_pool("digitz")


def test_unknown_dataset_names_allowed_values():
    with pytest.raises(DataError, match="mnist.*cifar100"):
        data.load_pool("svhn")


def test_resolve_data_dir(monkeypatch):
    monkeypatch.setenv("TFDS_DATA_DIR", "dir_from_env")
    assert data.resolve_data_dir("given") == "given"
    assert data.resolve_data_dir(None) == "dir_from_env"
    monkeypatch.delenv("TFDS_DATA_DIR")
    assert data.resolve_data_dir(None) is None


def test_missing_dataset_explains_how_to_prepare(tmp_path):
    with pytest.raises(DataError, match="download_and_prepare") as err:
        data.load_pool("cifar10", data_dir=str(tmp_path / "empty"), cache_dir=str(tmp_path / "cache"))
    message = str(err.value)
    assert "array_record" in message and "manual_dir" in message
    assert "--data-dir" in message and "TFDS_DATA_DIR" in message
    assert not (tmp_path / "cache").exists()


@pytest.mark.skipif(not SHARED_TFDS.is_dir(), reason="shared tfds folder not available")
def test_dataset_absent_from_shared_dir(tmp_path):
    """A dataset the shared data dir does not hold (today CIFAR-100) stops with the prepare message."""
    absent = [d for d in data.DATASETS if d != "digits" and not (SHARED_TFDS / d).exists()]
    if not absent:
        pytest.skip("every dataset is prepared in the shared data dir")
    with pytest.raises(DataError, match="download_and_prepare"):
        data.load_pool(absent[0], data_dir=str(SHARED_TFDS), cache_dir=str(tmp_path))


def _fake_prepared(root: Path, file_format: str, counts=(60000, 10000), version="3.0.1") -> None:
    """A dataset_info.json (and empty shard files) that look like a prepared MNIST in ``file_format``."""
    version_dir = root / "mnist" / version
    version_dir.mkdir(parents=True)
    splits = [{"name": s, "shardLengths": [str(n)]} for s, n in zip(("train", "test"), counts)]
    (version_dir / "dataset_info.json").write_text(
        json.dumps({"name": "mnist", "version": "3.0.1", "fileFormat": file_format, "splits": splits}))
    for split in ("train", "test"):
        (version_dir / f"mnist-{split}.{file_format}-00000-of-00001").write_bytes(b"")


def test_tfrecord_dataset_is_rejected(tmp_path):
    _fake_prepared(tmp_path / "tfds", "tfrecord")
    with pytest.raises(DataError, match="tfrecord.*array_record"):
        data.load_pool("mnist", data_dir=str(tmp_path / "tfds"), cache_dir=str(tmp_path / "cache"))


def test_cache_dir_inside_data_dir_is_rejected(tmp_path):
    _fake_prepared(tmp_path / "tfds", "array_record")
    with pytest.raises(DataError, match="cache_dir"):
        data.load_pool("mnist", data_dir=str(tmp_path / "tfds"), cache_dir=str(tmp_path / "tfds" / "cache"))


def test_cache_is_read_without_tfds(tmp_path, monkeypatch):
    monkeypatch.setattr(data.sources, "_tfds", lambda: None)
    root, cache = tmp_path / "tfds", tmp_path / "cache"
    _fake_prepared(root, "array_record", counts=(6, 4))
    with pytest.raises(DataError, match="needs the package tensorflow-datasets.*there is none"):
        data.load_pool("mnist", data_dir=str(root), cache_dir=str(cache))
    images = np.arange(10 * 28 * 28, dtype=np.int64).reshape(10, 28, 28, 1).astype(np.uint8)
    labels = np.arange(10, dtype=np.int32)[::-1]
    data.sources._write_cache(data.sources._cache_path("mnist", "3.0.1", str(root), str(cache)), images, labels)
    pool = data.load_pool("mnist", data_dir=str(root), cache_dir=str(cache))
    assert np.array_equal(pool.images, images) and np.array_equal(pool.labels, labels)
    # the cache is keyed by the dataset's metadata, not the data dir's path: another copy finds it
    shutil.copytree(root, tmp_path / "elsewhere")
    again = data.load_pool("mnist", data_dir=str(tmp_path / "elsewhere"), cache_dir=str(cache))
    assert np.array_equal(again.images, images)
    # ... and another prepared dataset (other split sizes) does not
    shutil.rmtree(tmp_path / "elsewhere")
    _fake_prepared(tmp_path / "elsewhere", "array_record", counts=(7, 3))
    with pytest.raises(DataError, match="there is none"):
        data.load_pool("mnist", data_dir=str(tmp_path / "elsewhere"), cache_dir=str(cache))


def test_two_prepared_versions_without_tfds_raise(tmp_path, monkeypatch):
    monkeypatch.setattr(data.sources, "_tfds", lambda: None)
    _fake_prepared(tmp_path / "tfds", "array_record", counts=(6, 4), version="3.0.1")
    _fake_prepared(tmp_path / "tfds", "array_record", counts=(6, 4), version="3.0.2")
    with pytest.raises(DataError, match="3.0.1, 3.0.2.*pip install tensorflow-datasets"):
        data.load_pool("mnist", data_dir=str(tmp_path / "tfds"), cache_dir=str(tmp_path / "cache"))


def test_real_mnist_pool_and_cache(tmp_path):
    root = _real_data_dir()
    if root is None:
        pytest.skip("no prepared MNIST in $TFDS_DATA_DIR or ../shared/data/tfds")
    before = sorted(str(p) for p in (root / "mnist").rglob("*"))
    cache = tmp_path / "cache"

    start = time.perf_counter()
    pool = data.load_pool("mnist", data_dir=str(root), cache_dir=str(cache))
    first = time.perf_counter() - start
    assert pool.images.shape == (70000, 28, 28, 1) and pool.images.dtype == np.uint8
    assert pool.labels.shape == (70000,) and pool.labels.dtype == np.int32
    assert set(np.unique(pool.labels).tolist()) == set(range(10))
    assert pool.num_classes == 10 and not pool.is_demo
    cached_files = list(cache.glob("*.npz"))
    assert len(cached_files) == 1 and not list(cache.glob("*.tmp"))

    start = time.perf_counter()
    again = data.load_pool("mnist", data_dir=str(root), cache_dir=str(cache))
    second = time.perf_counter() - start
    assert second < first
    assert np.array_equal(again.images, pool.images) and np.array_equal(again.labels, pool.labels)
    assert sorted(str(p) for p in (root / "mnist").rglob("*")) == before  # nothing written in the data dir
    shutil.rmtree(cache)


# ------------------------------------------------------------------ many clients: top-up fill, shards
def test_top_up_fill_partitions_a_thousand_clients_that_no_redraw_can():
    labels = np.random.default_rng(0).integers(0, 10, 20000)
    with pytest.raises(DataError, match="fill='top_up'"):
        make_partition(labels, num_clients=1000, alpha=0.1, aux_size=500, min_client_samples=5, max_redraws=3,
                       fill="redraw")
    part = make_partition(labels, num_clients=1000, alpha=0.1, aux_size=500, min_client_samples=5)   # auto: top_up
    sizes = np.array([len(a) + len(b) for a, b in zip(part.train_idx, part.test_idx)])
    assert sizes.min() == 5 and sizes.sum() == 19500          # everyone at the minimum, nothing lost
    every = np.concatenate([part.aux_idx, *part.train_idx, *part.test_idx])
    assert len(np.unique(every)) == len(labels)               # each sample exactly once
    # the same arguments, the same partition; the skew of the draw stays (few classes a client)
    again = make_partition(labels, num_clients=1000, alpha=0.1, aux_size=500, min_client_samples=5, fill="top_up")
    assert all(np.array_equal(a, b) for a, b in zip(part.train_idx, again.train_idx))
    assert all(np.array_equal(a, b) for a, b in zip(part.train_idx, again.train_idx))
    classes = [len(np.unique(labels[np.concatenate([a, b])])) for a, b in zip(part.train_idx, part.test_idx)]
    assert np.median(classes) <= 3
    # where the first draw already satisfies the minimum, top_up is the draw itself (no sample moved)
    a = make_partition(labels, num_clients=5, alpha=1.0, aux_size=0, min_client_samples=2, fill="top_up", seed=3)
    b = make_partition(labels, num_clients=5, alpha=1.0, aux_size=0, min_client_samples=2, seed=3)
    assert all(np.array_equal(x, y) for x, y in zip(a.train_idx, b.train_idx))
    with pytest.raises(DataError, match="fill must be one of"):
        make_partition(labels, num_clients=5, alpha=1.0, aux_size=0, fill="more")


def test_shards_give_each_client_its_shards_of_sorted_labels():
    from pfedkdh_jax.data import shards_partition
    labels = np.repeat(np.arange(10), 100)
    part = shards_partition(labels, num_clients=50, shards_per_client=2, aux_size=0, seed=1)
    held = [np.concatenate([a, b]) for a, b in zip(part.train_idx, part.test_idx)]
    assert [len(h) for h in held] == [20] * 50
    assert max(len(np.unique(labels[h])) for h in held) <= 2   # one class per shard of 10 here
    assert len(np.unique(np.concatenate(held))) == 1000
    with pytest.raises(DataError, match="fewer than 2 samples"):
        shards_partition(labels, num_clients=600, shards_per_client=1, aux_size=0)


def test_run_config_chooses_the_partition():
    from pfedkdh_jax.run.config import ConfigError, make_config
    from pfedkdh_jax.run.experiment import prepare_data
    _, part, _ = prepare_data(make_config("smoke", partition="shards", shards_per_client=1, num_clients=10,
                                          aux_size=100))
    pool = data.load_pool("digits")
    assert part.num_clients == 10 and max(
        len(np.unique(pool.labels[np.concatenate([a, b])])) for a, b in zip(part.train_idx, part.test_idx)) <= 2
    for bad, match in [(dict(partition="iid"), "--partition"), (dict(fill="some"), "--fill"),
                       (dict(shards_per_client=0), "--shards-per-client")]:
        with pytest.raises(ConfigError, match=match):
            make_config(**bad)


def test_synthetic_images_are_learnable_and_reproducible():
    """The synthetic pool of any size: uint8 images whose class sets the mean, so a nearest-class-mean
    rule on the pixels (fitted on one half, scored on the other) is far above chance; the same seed
    gives the same pool."""
    pool = data.synthetic_images(2000)
    assert pool.images.shape == (2000, 28, 28, 1) and pool.images.dtype == np.uint8 and pool.normalize
    assert pool.name == "synthetic" and set(np.unique(pool.labels)) == set(range(10))
    x, y = pool.images.reshape(2000, -1).astype(np.float32), pool.labels
    means = np.stack([x[:1000][y[:1000] == c].mean(0) for c in range(10)])
    guess = ((x[1000:, None, :] - means[None]) ** 2).sum(-1).argmin(1)
    assert 0.5 < (guess == y[1000:]).mean() < 0.95   # chance is 0.1; not a trivial set either
    np.testing.assert_array_equal(data.synthetic_images(300).images, data.synthetic_images(300).images)
    assert data.load_pool("synthetic", samples=300).images.shape[0] == 300
    with pytest.raises(data.DataError, match="synthetic"):
        data.synthetic_images(0)


def test_owner_chunks_fit_the_clients_test_sizes_and_stack_at_the_largest():
    from conftest import synthetic_pool
    from pfedkdh_jax.data.device import build_federated_data, owner_chunk_size, stack_partitions

    assert owner_chunk_size([2] * 10000) == 8                    # chunks of 256 would be 99 % padding
    assert owner_chunk_size([900] * 20) >= 128
    assert owner_chunk_size([900] * 20, limit=64) == 64
    pool = synthetic_pool(400)
    parts = [make_partition(pool.labels, num_clients=40, alpha=0.5, aux_size=0, min_client_samples=2, seed=s)
             for s in (0, 1)]
    datas = [build_federated_data(pool, p, eval_chunk=64, owner_chunk=c) for p, c in zip(parts, (8, 32))]
    assert [d.owned_idx.shape[-1] for d in datas] == [8, 32]
    stacked = stack_partitions(datas)
    assert stacked.owned_idx.shape[-1] == 32
    for r, p in enumerate(parts):    # every run's chunks hold exactly its clients' test samples, by owner
        idx, slot = np.asarray(stacked.owned_idx[r]).ravel(), np.asarray(stacked.owned_slot[r])
        for k in range(40):
            assert sorted(idx[slot == k]) == sorted(p.test_idx[k])


def test_a_partition_of_ones_own_is_checked_before_anything_runs():
    """from_arrays(partition=...): a client count that is not the lists', an index outside the arrays, a
    client without train samples (a round of such clients averaged nothing into NaN models) and test
    samples among a client's train samples are one line each, in the partition's terms."""
    from pfedkdh_jax.data import from_arrays
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(60, 4)).astype(np.float32), rng.integers(0, 3, 60)
    split = lambda lo: (np.arange(lo, lo + 8), np.arange(lo + 8, lo + 10))  # noqa: E731
    trains, tests = zip(*(split(10 * k) for k in range(5)))
    good = data.Partition(aux_idx=np.arange(50, 60), train_idx=trains, test_idx=tests, num_clients=5)
    assert int(from_arrays(x, y, partition=good).train_n.sum()) == 40
    cases = [
        (dataclasses.replace(good, num_clients=6), "num_clients is 6 but it holds 5 train_idx and 5 test_idx"),
        (dataclasses.replace(good, aux_idx=np.array([-1, 55])), "aux_idx holds index -1: indices must be in 0 … 59"),
        (dataclasses.replace(good, test_idx=(*tests[:4], np.array([60]))), r"test_idx\[4\] holds index 60"),
        (dataclasses.replace(good, train_idx=(np.zeros(0, np.int64), *trains[1:])), r"client\(s\) 0 hold no train"),
        (dataclasses.replace(good, test_idx=(np.array([3, 8]), *tests[1:])), "client 0's train_idx and test_idx share"),
        (dataclasses.replace(good, aux_idx=np.array([50.0])), "must hold integer sample indices"),
        (dataclasses.replace(good, train_idx=(np.array([0, 1, 1, 2]), *trains[1:])),
         r"train_idx\[0\] holds index 1 more than once"),
        (dataclasses.replace(good, test_idx=(tests[0].reshape(1, 2), *tests[1:])), r"test_idx\[0\] must be a 1-D"),
    ]
    for bad, message in cases:
        with pytest.raises(data.DataError, match=message):
            from_arrays(x, y, partition=bad)
    # options a ready partition (or a natural one) does not read are refused, not dropped
    with pytest.raises(data.DataError, match=r"from_arrays\(partition=...\) does not read aux_size, train_fraction"):
        from_arrays(x, y, partition=good, aux_size=5, train_fraction=0.5)
    with pytest.raises(data.DataError, match=r"from_arrays\(client_ids=...\) does not read balance_cap"):
        from_arrays(x, y, client_ids=np.arange(60) % 3, balance_cap=True)


def test_what_a_review_of_the_data_layer_found_is_named():
    """Each was silent or a bare traceback before (a review of the data layer)."""
    from pfedkdh_jax.data.partition import evaluation_view, format_summary, partition_summary, validation_partition
    from pfedkdh_jax.run.config import ConfigError, make_config
    from pfedkdh_jax.run.experiment import prepare_data
    from pfedkdh_jax.run.sweep import make_sweep
    # shards: the Dirichlet draw's options are refused, not ignored; a client under the minimum is named
    with pytest.raises(ConfigError, match="--partition shards does not read --fill top_up"):
        make_config("smoke", partition="shards", fill="top_up")
    with pytest.raises(ConfigError, match="--shards-per-client 3 is read with --partition shards only"):
        make_config("smoke", shards_per_client=3)
    with pytest.raises(ConfigError, match="--partition shards does not read α"):
        make_sweep(["digits"], [0.1, 0.5], ["fedavg"], 1, {}, "smoke", {"partition": "shards"})
    with pytest.raises(DataError, match="--partition shards gives clients of 6 samples, fewer than "
                                        "--min-client-samples 10"):
        prepare_data(make_config("smoke", partition="shards", num_clients=200))
    # a client of one train sample has no validation split: the printed summary says it is not scored
    labels = _labels(300)
    part = validation_partition(data.natural_partition(np.repeat(np.arange(3), [2, 150, 148]), seed=0), 0.2, 0)
    text = format_summary({**partition_summary(part, labels, 10), "scored_split": "validation"})
    assert "1 client(s) hold no validation sample (one train sample: none to carve): they are not scored" in text
    # names read as the package's (case, alias) are not a dataset's of one's own
    for name in ("Mnist", "fmnist"):
        with pytest.raises(DataError, match=f"{name!r} is read as"):
            data.register_dataset(name, lambda: None)
    # ids out of range, a minimum of 0, a federation of one
    with pytest.raises(DataError, match=r"clients must be ids in 0 … 2 \(or a mask of 3\); got \[-1\]"):
        evaluation_view(part, [-1])
    assert evaluation_view(part, []).test_idx[0].size == 0   # none, and a mask: as ids
    masked, listed = evaluation_view(part, np.array([True, False, True])), evaluation_view(part, [0, 2])
    assert all(np.array_equal(a, b) for a, b in zip(masked.test_idx + masked.train_idx,
                                                    listed.test_idx + listed.train_idx))
    with pytest.raises(DataError, match="min_client_samples must be >= 2"):
        data.from_arrays(np.zeros((20, 3), np.float32), np.arange(20) % 2, client_ids=np.arange(20) % 2,
                         min_client_samples=0)
    one = dataclasses.replace(part, num_clients=1, train_idx=part.train_idx[:1], test_idx=part.test_idx[:1])
    with pytest.raises(DataError, match=r"num_clients must be an int >= 2 \(a federation\); got 1"):
        data.check_partition(one, 300)
