"""Data pools: a whole dataset in memory, read from tensorflow-datasets or the bundled demo set.

* :func:`load_pool` reads a dataset into one in-memory *pool*: the official train split followed by the
  official test split, as ``uint8`` images ``[N, H, W, C]`` and ``int32`` labels.  MNIST, Fashion-MNIST,
  CIFAR-10 and CIFAR-100 (fine labels) are read with ``tensorflow_datasets.data_source`` from a prepared
  ArrayRecord data directory, without TensorFlow and without downloading anything.  Decoded arrays are
  cached as a compressed ``.npz`` file outside the data directory, keyed by the dataset's metadata (so a
  copied cache is found elsewhere, and read without tfds).  ``"digits"`` is a small offline demo pool
  built from scikit-learn's bundled 8x8 digits, upscaled to 28x28x1.
* :func:`normalize` maps ``uint8`` pixels to ``[-1, 1]`` (method.md §2).

Everything here runs on the host with numpy.  Every invalid input and every missing-data situation
raises :class:`DataError`.  (Over 300 lines: the tfds reading, its error messages and the cache belong
together.)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
import warnings
from typing import Any, Callable

import numpy as np

from pfedkdh_jax.names import clashing_name


class DataError(ValueError):
    """Raised for every invalid data option and every missing or unreadable dataset."""


#: Dataset names accepted by :func:`load_pool`.  ``"digits"`` is an offline demo, ``"synthetic"`` a generated pool of any size
#: (``--synthetic-samples``), the others are tfds datasets.
DATASETS: tuple = ("digits", "mnist", "fashion_mnist", "cifar10", "cifar100", "synthetic")

# Number of classes of each dataset (CIFAR-100: the 100 fine labels, tfds feature "label").
_NUM_CLASSES = {"digits": 10, "mnist": 10, "fashion_mnist": 10, "cifar10": 10, "cifar100": 100, "synthetic": 10}
#: Samples of the ``"synthetic"`` pool unless asked otherwise (MNIST's count).
SYNTHETIC_SAMPLES = 70_000
# Name of the tfds feature holding the label used as the class.
_LABEL_KEY = "label"
# Official splits, in pool order.
_SPLITS = ("train", "test")
# Number of records decoded per ``__getitems__`` call.
_DECODE_BLOCK = 5000
# Bumped whenever the cached array layout changes, so stale cache files are not reused.
_CACHE_FORMAT = 1

_CACHE_ENV = "PFEDKDH_CACHE_DIR"
_DATA_DIR_ENV = "TFDS_DATA_DIR"


@dataclasses.dataclass(frozen=True)
class Pool:
    """A whole dataset held in memory: every sample a client, D_s or a test split may hold.

    Attributes:
        images: the inputs, ``[N, ...]`` of any per-sample shape: ``uint8`` pixels ``[N, H, W, C]`` (the
            tfds datasets: the official train split, then the official test split), or any float or
            integer features. Kept in their dtype (float data stay float).
        labels: ``int32`` array ``[N]`` with values in ``[0, num_classes)``.
        num_classes: number of classes.
        name: dataset name (one of :data:`DATASETS`, or a user's name for arrays).
        is_demo: ``True`` only for the offline ``"digits"`` demo pool and test pools.
        normalize: whether batches map ``uint8`` pixels to ``[-1, 1]`` (method.md §2); ``None``: exactly
            when the inputs are ``uint8``. Other inputs reach the model as they are (floats as float32).

    Building one checks the arrays and stops with one line (:class:`DataError`) on a wrong shape,
    dtype, label or a non-finite value.
    """

    images: np.ndarray
    labels: np.ndarray
    num_classes: int
    name: str
    is_demo: bool
    normalize: bool | None = None

    def __post_init__(self):
        x, y = self.images, self.labels
        if not isinstance(x, np.ndarray) or x.ndim < 2:
            raise DataError(f"inputs must be an array [N, ...] with one row per sample; got "
                            f"{type(x).__name__} of shape {getattr(x, 'shape', None)}")
        bf16 = x.dtype.name == "bfloat16"   # ml_dtypes' (numpy does not count it a number)
        if not (np.issubdtype(x.dtype, np.number) or x.dtype == bool or bf16) or np.issubdtype(x.dtype,
                                                                                              np.complexfloating):
            raise DataError(f"inputs must hold real numbers (float or integer); got dtype {x.dtype}")
        if (np.issubdtype(x.dtype, np.floating) or bf16) and not np.all(np.isfinite(x)):
            raise DataError("inputs hold non-finite values (nan or inf)")
        if not isinstance(y, np.ndarray) or y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
            raise DataError(f"labels must be a 1-D integer array; got {type(y).__name__} of dtype "
                            f"{getattr(y, 'dtype', None)} and shape {getattr(y, 'shape', None)}")
        if len(y) != len(x):
            raise DataError(f"inputs and labels must have one row per sample; got {len(x)} inputs and {len(y)} labels")
        if int(self.num_classes) < 2:
            raise DataError(f"num_classes must be >= 2; got {self.num_classes}")
        if y.size and (y.min() < 0 or y.max() >= self.num_classes):
            bad = int(y.min()) if y.min() < 0 else int(y.max())
            raise DataError(f"labels must be in [0, num_classes={self.num_classes}); got {bad}")
        if self.normalize and x.dtype != np.uint8:
            raise DataError(f"normalize=True maps uint8 pixels to [-1, 1]; the inputs are {x.dtype} "
                            "(pass normalize=False, or uint8 pixels)")
        if self.normalize is None:
            object.__setattr__(self, "normalize", x.dtype == np.uint8)


def pool_from_arrays(inputs, labels, *, num_classes: int | None = None, normalize: bool | None = None,
                     name: str = "arrays") -> Pool:
    """A :class:`Pool` of a user's arrays: ``inputs [N, ...]`` (any per-sample shape, float or integer;
    ``uint8`` pixels are normalised to [-1, 1] unless ``normalize=False``) and integer ``labels [N]``
    (``num_classes``: default ``max(labels) + 1``). Wrong shapes, dtypes or labels: one-line
    :class:`DataError`."""
    try:
        x, y = np.asarray(inputs), np.asarray(labels)
    except ValueError as e:   # a ragged list: numpy's "inhomogeneous shape"
        raise DataError(f"inputs and labels must be arrays of one shape per sample (a ragged list cannot be "
                        f"stacked: pad its rows to one length first): {str(e).splitlines()[0]}") from None
    if x.dtype == object:
        raise DataError("inputs must be a numeric array [N, ...] with one shape per sample; got an object array "
                        "(rows of different lengths?)")
    if x.ndim == 1:
        raise DataError(f"inputs must be [N, ...] with one row per sample (a feature vector is [N, D]); "
                        f"got shape {x.shape}")
    if y.ndim == 1 and np.issubdtype(y.dtype, np.integer):
        y = y.astype(np.int32)
        if num_classes is None:
            num_classes = int(y.max()) + 1 if y.size else 0
    return Pool(images=x, labels=y, num_classes=int(num_classes or 0), name=name, is_demo=False,
                normalize=normalize)



# --------------------------------------------------------------------------------------------------------------
# Loading pools
# --------------------------------------------------------------------------------------------------------------


def resolve_data_dir(data_dir: str | None) -> str | None:
    """Returns the tfds data directory to use.

    Precedence: the explicit ``data_dir`` argument (``--data-dir``), then the environment variable
    ``$TFDS_DATA_DIR``, then ``None`` (meaning tfds's default directory, ``~/tensorflow_datasets``).
    A leading ``~`` is expanded; empty strings count as unset.
    """
    for candidate in (data_dir, os.environ.get(_DATA_DIR_ENV)):
        if candidate:
            return os.path.expanduser(str(candidate))
    return None


# datasets of one's own (register_dataset): name -> a function returning its Pool, the pools loaded so far
# (once a process), each one's model or a function num_classes -> model, and its preset values
_REGISTERED: dict[str, Callable[[], Pool]] = {}
_LOADED: dict[str, Pool] = {}
_MODELS: dict[str, Any] = {}
_PRESETS: dict[str, dict[str, Any]] = {}


def register_dataset(name: str, load: Callable[[], Pool], *, model: Any = None,
                     preset: dict[str, Any] | None = None) -> None:
    """Make a dataset of your own a dataset of runs, sweeps and the command line (``--dataset name``,
    with ``--plugin`` naming the module that calls this). ``load()`` returns its :class:`Pool`
    (:func:`pool_from_arrays` of your arrays); it is called when a run loads the data, once a process.
    The run partitions it as any other (``--alpha``, ``--clients``, ``--aux-size``). ``model``: the
    model its runs train, a :class:`~pfedkdh_jax.engine.protocol.Model` or a function
    ``num_classes -> Model`` (needed for data the paper's CNN does not take: float features, images
    under 16×16); default the CNN. ``preset``: run options (``RunConfig`` field names) every preset
    takes for this dataset over its own, e.g. ``{"aux_size": 500, "num_clients": 10}`` for a pool too
    small for the presets' |D_s| of 5000 (an explicit option still wins; ``smoke`` still runs 2
    rounds). Registering a name again replaces one's own registration; the package's datasets cannot
    be replaced."""
    if not (isinstance(name, str) and name.isidentifier()):
        raise DataError(f"register_dataset: the name must be an identifier (a --dataset value); got {name!r}")
    if name in DATASETS:
        raise DataError(f"register_dataset: {name!r} is one of the package's datasets; choose another name")
    clash = clashing_name(name, [*DATASETS, *_REGISTERED])
    if clash is not None:
        raise DataError(f"register_dataset: {name!r} is read as {clash!r} (names are read regardless of case, "
                        "'-' and '_', and by their aliases); choose another name")
    if not callable(load):
        raise DataError(f"register_dataset({name!r}): load must be a function () -> Pool; got {type(load).__name__}")
    if preset is not None and not (isinstance(preset, dict) and all(isinstance(k, str) for k in preset)):
        raise DataError(f"register_dataset({name!r}): preset must be a dict of run options (RunConfig field names "
                        f"to values); got {type(preset).__name__}")
    _REGISTERED[name] = load
    _LOADED.pop(name, None)
    _PRESETS[name] = dict(preset or {})
    if model is None:
        _MODELS.pop(name, None)
    else:
        _MODELS[name] = model


def dataset_preset(name: str) -> dict[str, Any]:
    """The run options registered with dataset ``name`` (``{}``: none, or a package dataset)."""
    return dict(_PRESETS.get(name, {}))


def dataset_model(name: str | None, num_classes: int):
    """The model registered with dataset ``name`` (``None``: none was, the run's CNN)."""
    model = _MODELS.get(name)
    if model is not None and not all(callable(getattr(model, f, None)) for f in ("init", "features")):
        model = model(num_classes)   # a function of the number of classes
    return model


def _registered_pool(name: str) -> Pool:
    if name not in _LOADED:
        pool = _REGISTERED[name]()
        if not isinstance(pool, Pool):
            raise DataError(f"dataset {name!r}: its load() must return a pfedkdh_jax Pool (pool_from_arrays(inputs, "
                            f"labels)); got {type(pool).__name__}")
        _LOADED[name] = dataclasses.replace(pool, name=name)
    return _LOADED[name]


def dataset_names() -> tuple[str, ...]:
    """The package's datasets (:data:`DATASETS`), then those registered with :func:`register_dataset`."""
    return DATASETS + tuple(n for n in _REGISTERED if n not in DATASETS)


def load_pool(name: str, data_dir: str | None = None, cache_dir: str | None = None, *,
              samples: int | None = None) -> Pool:
    """Loads dataset ``name`` as a :class:`Pool` (official train split, then official test split).

    Args:
        name: one of :data:`DATASETS`, or a name given to :func:`register_dataset` (read regardless of
            case, "-" and "_", and by an alias: ``"MNIST"``, ``"fmnist"``).
        data_dir: tfds data directory holding the prepared dataset; resolved by :func:`resolve_data_dir`
            and, when still unset, tfds's default directory.  Ignored for ``"digits"`` and ``"synthetic"``.
        cache_dir: where decoded arrays are cached; defaults to ``$PFEDKDH_CACHE_DIR``, else
            ``~/.cache/pfedkdh_jax``.  Must not lie inside the data directory.  Ignored for ``"digits"``
            and ``"synthetic"``.
        samples: the size of the ``"synthetic"`` pool (default :data:`SYNTHETIC_SAMPLES`); ignored
            for the others.

    Raises:
        DataError: for an unknown name, or when the dataset is not prepared in ArrayRecord format (the
            message says how to prepare it).
    """
    from pfedkdh_jax.names import canonical_name
    name = canonical_name(name, dataset_names())   # "MNIST", "fmnist", "Fashion-MNIST" too
    if name in _REGISTERED:
        return _registered_pool(name)
    if name not in DATASETS:
        raise DataError(f"unknown dataset {name!r}; allowed values: {', '.join(dataset_names())}")
    if name == "digits":
        return _load_digits()
    if name == "synthetic":
        return synthetic_images(SYNTHETIC_SAMPLES if samples is None else samples)
    return _load_tfds_pool(name, data_dir, cache_dir)


def check_available(name: str, data_dir: str | None = None) -> None:
    """A :class:`DataError` (as :func:`load_pool` would raise it) when dataset ``name`` is unknown or not
    prepared under the data directory; reads no data (a sweep checks all its datasets before its
    first point)."""
    if name in _REGISTERED or name in ("digits", "synthetic"):
        return
    if name not in DATASETS:
        raise DataError(f"unknown dataset {name!r}; allowed values: {', '.join(dataset_names())}")
    _prepared(name, data_dir)


def synthetic_images(num_samples: int, shape: tuple[int, ...] = (28, 28, 1), num_classes: int = 10,
                     seed: int = 0) -> Pool:
    """A pool of any size for scale tests: ``uint8`` images of ``shape`` whose label decides their mean.

    Each class has a blocky random pattern (a 7×7 grid of uniform intensities, upsampled); a sample
    of class c is mid-grey plus its class's pattern at a random contrast in [0.05, 0.15], plus
    Gaussian pixel noise (σ = 64), clipped to [0, 255]. Classes overlap enough that accuracy is not
    trivial and differ enough that it means something: the nearest class mean of the pixels scores
    about 79 % (chance: 1 / num_classes).
    Labels are uniform. Built by :func:`pool_from_arrays`, like any user's arrays; the same
    ``seed`` gives the same pool. ``name``: ``"synthetic"``.
    """
    if int(num_samples) < 1:
        raise DataError(f"a synthetic pool needs >= 1 sample; got {num_samples}")
    if len(shape) != 3 or min(shape) < 1:
        raise DataError(f"synthetic images need a shape (H, W, C); got {shape}")
    h, w, c = shape
    rng = np.random.default_rng(seed)
    coarse = rng.uniform(0.0, 255.0, size=(num_classes, 7, 7, c))
    rows, cols = (np.arange(h) * 7) // h, (np.arange(w) * 7) // w
    means = coarse[:, rows][:, :, cols].astype(np.float32)          # [classes, H, W, C], blocky
    labels = rng.integers(0, num_classes, size=int(num_samples)).astype(np.int32)
    images = np.empty((int(num_samples), h, w, c), np.uint8)
    block = 20_000
    for i in range(0, int(num_samples), block):   # in blocks: no float copy of the whole pool
        y = labels[i:i + block]
        contrast = rng.uniform(0.05, 0.15, size=(len(y), 1, 1, 1)).astype(np.float32)
        noise = rng.normal(0.0, 64.0, size=(len(y), h, w, c)).astype(np.float32)
        images[i:i + block] = np.clip(127.5 + contrast * (means[y] - 127.5) + noise, 0, 255).astype(np.uint8)
    return pool_from_arrays(images, labels, num_classes=num_classes, name="synthetic")


def _load_digits() -> Pool:
    """Builds the demo pool from scikit-learn's bundled 8x8 digits (1797 images), upscaled to 28x28x1."""
    from PIL import Image
    from sklearn.datasets import load_digits

    bunch = load_digits()
    small = np.clip(np.rint(bunch.images * (255.0 / 16.0)), 0, 255).astype(np.uint8)  # values 0..16 -> 0..255
    resample = getattr(Image, "Resampling", Image).BILINEAR
    images = np.stack([np.asarray(Image.fromarray(img, mode="L").resize((28, 28), resample)) for img in small])
    return Pool(
        images=images[..., None].astype(np.uint8),
        labels=np.asarray(bunch.target, dtype=np.int32),
        num_classes=_NUM_CLASSES["digits"],
        name="digits",
        is_demo=True,
    )


def _default_tfds_dir() -> str:
    """tfds's own default data directory (``~/tensorflow_datasets`` unless tfds is configured otherwise)."""
    try:
        from tensorflow_datasets.core import constants

        return os.path.expanduser(str(constants.DATA_DIR))
    except Exception:  # pragma: no cover - only if tfds changes its layout
        return os.path.expanduser("~/tensorflow_datasets")


def _tfds():
    """The ``tensorflow_datasets`` module, or ``None`` where it is not installed."""
    try:
        import tensorflow_datasets as tfds
    except ImportError:
        return None
    return tfds


def _registered_version(name: str, root: str) -> str:
    """The dataset version to read for ``name`` (e.g. ``"3.0.1"`` for MNIST).

    With tfds installed: the version tfds builds by default. Without it (reading from the decoded-array
    cache only needs numpy): the one version prepared under ``root``.
    """
    tfds = _tfds()
    if tfds is not None:
        return str(tfds.builder_cls(name).VERSION)
    name_dir = os.path.join(root, name)
    versions = sorted(d for d in (os.listdir(name_dir) if os.path.isdir(name_dir) else [])
                      if os.path.isfile(os.path.join(name_dir, d, "dataset_info.json")))
    if len(versions) != 1:
        found = f"versions {', '.join(versions)}" if versions else "no prepared version"
        raise DataError(f"reading {name!r} needs the package tensorflow-datasets, which is not installed, to "
                        f"choose among {found} in {name_dir!r}; install it (pip install tensorflow-datasets)")
    return versions[0]


def _prepare_instructions(name: str, root: str) -> str:
    """The lines of a :class:`DataError` message that explain how to prepare ``name`` under ``root``."""
    builder = f"tfds.builder('{name}', data_dir='{os.path.abspath(root)}', file_format='array_record')"
    return (
        "Prepare it once (ArrayRecord format, which tfds.data_source reads without TensorFlow):\n"
        "  (a) online, with TensorFlow installed:\n"
        f'      python -c "import tensorflow_datasets as tfds; {builder}.download_and_prepare()"\n'
        "  (b) offline: put the original distribution files (named as in their download URLs) in a directory\n"
        "      MANUAL_DIR, then, with TensorFlow installed:\n"
        f'      python -c "import tensorflow_datasets as tfds; {builder}.download_and_prepare('
        "download_config=tfds.download.DownloadConfig(manual_dir='MANUAL_DIR'))\"\n"
        "  (c) then pass that data directory with --data-dir DIR or the environment variable TFDS_DATA_DIR."
    )


def _check_prepared(name: str, version: str, root: str) -> dict:
    """Checks that ``name``/``version`` is prepared in ArrayRecord format under ``root``.

    Returns the number of examples of each official split, read from ``dataset_info.json``.
    Raises :class:`DataError` with preparation instructions otherwise.
    """
    version_dir = os.path.join(root, name, version)
    info_path = os.path.join(version_dir, "dataset_info.json")
    if not os.path.isfile(info_path):
        if not os.path.isdir(root):   # a path that does not resolve here (a relative one read from elsewhere)
            raise DataError(f"data dir {root!r} does not exist (read from {os.getcwd()!r}"
                            + ("" if os.path.isabs(root) else ", a relative path") + "): give the directory "
                            "that holds the prepared datasets (--data-dir, or `pfedkdh resume RUN --data-dir DIR` "
                            "for a stored run).\n" + _prepare_instructions(name, root))
        present = ""
        name_dir = os.path.join(root, name)
        if os.path.isdir(name_dir):
            others = sorted(d for d in os.listdir(name_dir) if os.path.isdir(os.path.join(name_dir, d)))
            if others:
                present = f" (found only version(s) {', '.join(others)}; this program reads {version})"
        raise DataError(
            f"dataset {name!r} version {version} is not prepared in data dir {root!r}: "
            f"{info_path} does not exist{present}.\n" + _prepare_instructions(name, root)
        )
    try:
        with open(info_path, encoding="utf-8") as f:
            info = json.load(f)
    except (OSError, ValueError) as err:
        raise DataError(f"cannot read {info_path}: {err}\n" + _prepare_instructions(name, root)) from err
    file_format = str(info.get("fileFormat", "tfrecord")).lower()  # tfds writes TFRecord when unspecified
    if file_format != "array_record":
        raise DataError(
            f"dataset {name!r} in {version_dir} is prepared in {file_format!r} format, which tfds.data_source "
            "cannot read; it needs 'array_record'.\n" + _prepare_instructions(name, root)
        )
    counts = {}
    splits = {s.get("name"): s for s in info.get("splits", [])}
    for split in _SPLITS:
        if split not in splits:
            raise DataError(f"dataset {name!r} in {version_dir} has no {split!r} split.\n"
                            + _prepare_instructions(name, root))
        prefix = f"{name}-{split}.array_record-"
        if not any(f.startswith(prefix) for f in os.listdir(version_dir)):
            raise DataError(f"dataset {name!r} in {version_dir} lacks the files {prefix}*.\n"
                            + _prepare_instructions(name, root))
        counts[split] = int(sum(int(n) for n in splits[split].get("shardLengths", [])))
    return counts


def _cache_path(name: str, version: str, root: str, cache_dir: str | None) -> str:
    """Cache file for ``name``/``version`` prepared under data dir ``root``.

    Keyed by a hash of the prepared dataset's ``dataset_info.json`` (split sizes, byte counts), not of
    the data dir's path: a cache directory copied to another machine, or next to another copy of the
    same prepared dataset, is found there too (and read without tensorflow-datasets).
    """
    cache_root = cache_dir or os.environ.get(_CACHE_ENV) or os.path.join("~", ".cache", "pfedkdh_jax")
    cache_root = os.path.realpath(os.path.expanduser(str(cache_root)))
    real_root = os.path.realpath(root)
    if os.path.commonpath([cache_root, real_root]) == real_root:
        raise DataError(f"cache_dir {cache_root!r} lies inside the data dir {real_root!r}; choose another cache_dir")
    with open(os.path.join(real_root, name, version, "dataset_info.json"), "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    return os.path.join(cache_root, f"{name}-{version}-{digest}-v{_CACHE_FORMAT}.npz")


def _read_cache(path: str, expected: int) -> tuple | None:
    """Returns ``(images, labels)`` from a cache file, or ``None`` if absent, unreadable or inconsistent."""
    if not os.path.isfile(path):
        return None
    try:
        with np.load(path, allow_pickle=False) as npz:
            images, labels = npz["images"], npz["labels"]
    except Exception as err:  # a truncated or foreign file: decode again
        warnings.warn(f"ignoring unreadable cache file {path}: {err}")
        return None
    if images.dtype != np.uint8 or images.ndim != 4 or labels.shape != (expected,) or len(images) != expected:
        warnings.warn(f"ignoring inconsistent cache file {path}")
        return None
    return images, labels.astype(np.int32, copy=False)


def _write_cache(path: str, images: np.ndarray, labels: np.ndarray) -> None:
    """Writes the cache atomically (temporary file in the same directory, then ``os.replace``).

    A cache that cannot be written only costs decoding time next run, so failures become warnings.
    """
    tmp = None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=os.path.dirname(path))
        with os.fdopen(fd, "wb") as f:
            np.savez_compressed(f, images=images, labels=labels)
        os.replace(tmp, path)
        tmp = None
    except OSError as err:
        warnings.warn(f"could not write cache file {path}: {err}")
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)


def _decode_split(source: Any, count: int) -> tuple:
    """Decodes every record of one tfds data source, ``_DECODE_BLOCK`` records per call."""
    images = labels = None
    for start in range(0, count, _DECODE_BLOCK):
        records = source.__getitems__(list(range(start, min(start + _DECODE_BLOCK, count))))
        if images is None:
            first = np.asarray(records[0]["image"])
            images = np.empty((count,) + first.shape, dtype=np.uint8)
            labels = np.empty((count,), dtype=np.int32)
        for offset, record in enumerate(records):
            images[start + offset] = record["image"]
            labels[start + offset] = record[_LABEL_KEY]
    if images is None:
        raise DataError("a split of the dataset is empty")
    return images, labels


def _prepared(name: str, data_dir: str | None) -> tuple[str, str, dict]:
    """``(root, version, counts per split)`` of tfds dataset ``name`` prepared under the data directory
    (:func:`_check_prepared`'s DataError otherwise)."""
    root = resolve_data_dir(data_dir) or _default_tfds_dir()
    version = _registered_version(name, root)
    return root, version, _check_prepared(name, version, root)


def _load_tfds_pool(name: str, data_dir: str | None, cache_dir: str | None) -> Pool:
    """Loads a prepared tfds dataset through ``tfds.data_source``, using the decoded-array cache."""
    root, version, counts = _prepared(name, data_dir)
    total = sum(counts.values())
    path = _cache_path(name, version, root, cache_dir)

    cached = _read_cache(path, total)
    if cached is not None:
        images, labels = cached
    else:
        tfds = _tfds()
        if tfds is None:
            raise DataError(f"decoding {name!r} from {root!r} needs the package tensorflow-datasets, which is not "
                            f"installed (pip install tensorflow-datasets); without it only a decoded-array cache "
                            f"can be read, and there is none at {path!r}")
        try:
            sources = tfds.data_source(f"{name}:{version}", data_dir=root, download=False)
        except NotImplementedError as err:  # e.g. a TFRecord dataset that slipped through the checks
            raise DataError(f"tfds cannot read {name!r} from {root!r}: {err}\n"
                            + _prepare_instructions(name, root)) from err
        except Exception as err:
            raise DataError(f"cannot open {name!r} in {root!r}: {err}\n"
                            + _prepare_instructions(name, root)) from err
        parts = [_decode_split(sources[split], len(sources[split])) for split in _SPLITS]
        images = np.concatenate([p[0] for p in parts])
        labels = np.concatenate([p[1] for p in parts])
        _write_cache(path, images, labels)

    num_classes = _NUM_CLASSES[name]
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise DataError(f"labels of {name!r} fall outside [0, {num_classes}); the prepared data is not as expected")
    return Pool(images=images, labels=labels, num_classes=num_classes, name=name, is_demo=False)



def normalize(images_uint8):
    """Maps pixels in ``[0, 255]`` to ``float32`` in ``[-1, 1]``: ``(x / 255 - 0.5) / 0.5``.

    Works on numpy arrays and on jax arrays (the result keeps the input's array type).
    """
    x = images_uint8 if hasattr(images_uint8, "astype") else np.asarray(images_uint8)
    return (x.astype(np.float32) / 255.0 - 0.5) / 0.5
