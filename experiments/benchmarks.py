"""Regenerates the measured tables of BENCHMARKS.md (and prints them).

Sections (each can be run alone with --only):
  forms   samples/s and s/round of local training for every client-parallel layout, MNIST and CIFAR-10
          input shapes (synthetic pixels: the cost does not depend on them);
  floor   FLOPs per sample counted from the model, this machine's fp32 matmul rate, and the compute
          floor of a paper-preset MNIST round next to the measured round time (from --run-dir);
  reps    1, 2, 5 repetitions in one vmapped program vs one after another;
  devices 1, 2, 4, 8 fake CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=N): equal
          numbers, and time (no speed-up is expected on one CPU);
  memory  peak memory of each client-parallel layout, one fresh process per layout (process peak RSS
          on CPU; the allocator's peak bytes on a GPU/TPU);
  pooling samples/s of training steps and of forward passes with three forms of the same 2×2
          max-pooling (flax's, which the model uses off CPU; reshape + max; the custom-gradient form
          the model uses on CPU);
  convforms  a training step of 1 and 10 members with weights of their own, vmapped, with XLA's
          convolution (grouped once vmapped) and with the matmul over patches (batched once vmapped);
  convops each convolution of a training step alone (forward, input and weight gradients of both
          layers) with XLA and, when installed, PyTorch, and two rewrites of the gradients;
  methods accuracy and round times of pFedKDH and every baseline, read from finished MNIST
          paper-preset runs (``--runs-glob``; the runs themselves are listed in BENCHMARKS.md).

Run with nothing else busy on the machine:

    python experiments/benchmarks.py --run-dir runs/mnist-paper --write BENCHMARKS.generated.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pfedkdh_jax.algorithms.pfedkdh import PFedKDH, PFedKDHConfig
from pfedkdh_jax.data import Pool, make_partition
from pfedkdh_jax.data.device import build_federated_data
from pfedkdh_jax.engine.layout import Layout
from pfedkdh_jax.engine.local import tree_stack
from pfedkdh_jax.engine.runner import RoundRunner
from pfedkdh_jax.model import CNN, CONV_FORMS
from pfedkdh_jax.run.experiment import streams

FORMS = [("sequential", "unrolled", 8), ("sequential", "unrolled", 16), ("vmap", "unrolled", 8),
         ("sequential", "scan", None), ("vmap", "scan", None)]
SHAPES = {"MNIST": (28, 28, 1), "CIFAR-10": (32, 32, 3)}


def synthetic(shape, clients: int, steps: int, seed: int = 0):
    """Clients of exactly ``64·steps`` train samples (one epoch = ``steps`` batches of 64)."""
    per = 64 * steps
    n = clients * per * 2 + 64
    rng = np.random.default_rng(seed)
    pool = Pool(images=rng.integers(0, 256, (n, *shape), dtype=np.uint8),
                labels=rng.integers(0, 10, n).astype(np.int32), num_classes=10, name="synthetic", is_demo=True)
    part = make_partition(pool.labels, num_clients=clients, alpha=1e4, aux_size=64, seed=seed, train_fraction=0.5)
    # even sizes, so every layout does the same work
    train = tuple(t[:per] if len(t) >= per else t for t in part.train_idx)
    part = type(part)(aux_idx=part.aux_idx, train_idx=train, test_idx=part.test_idx, num_clients=clients)
    return build_federated_data(pool, part, eval_chunk=512)


def secs(t: float) -> str:
    """Seconds with 2 decimals, or 3 significant digits below 1 s (GPU rounds take milliseconds)."""
    return f"{t:.2f}" if t >= 1 else f"{t:.3g}"


def time_rounds(runner, state, data, selected, key_fn, repeats=3):
    t0 = time.perf_counter()
    state, _ = runner.round(state, data, selected, key_fn(0))
    jax.block_until_ready(state)
    first = time.perf_counter() - t0
    times = []
    for r in range(repeats):
        t0 = time.perf_counter()
        state, _ = runner.round(state, data, selected, key_fn(r + 1))
        jax.block_until_ready(state)
        times.append(time.perf_counter() - t0)
    return first, times


def algo_for(shape):
    """pFedKDH with distillation on (λ = 0.5): the full cost of the method, teacher forward included."""
    return PFedKDH(CNN(10), PFedKDHConfig(local_epochs=1, teacher_epochs=1, lam=0.5))


def bench_forms(clients=4, steps=16, repeats=3) -> str:
    lines = ["| input | clients | step loop | chunk | samples/s | s/round median (min–max) | first round |",
             "|---|---|---|---|---|---|---|"]
    for name, shape in SHAPES.items():
        data = synthetic(shape, clients, steps)
        samples = int(np.sum(np.asarray(data.train_n))) * 1
        for cp, sl, chunk in FORMS:
            algo = algo_for(shape)
            runner = RoundRunner(algo, data, Layout(cp, sl, chunk or 8))
            state = algo.init(jax.random.key(0), data)
            first, times = time_rounds(runner, state, data, np.arange(clients), jax.random.key, repeats)
            med = statistics.median(times)
            lines.append(f"| {name} | {cp} | {sl} | {chunk or '–'} | {samples / med:.0f} | "
                         f"{secs(med)} ({secs(min(times))}–{secs(max(times))}) | {first:.1f} s |")
            print(lines[-1], flush=True)
    return "\n".join(lines)


def _reshape_max_pool(x):
    """2×2 max-pooling as a reshape + ``max`` (gradient: compare-and-mask through ``jnp.max``)."""
    from pfedkdh_jax.model import _window_view
    return _window_view(x).max(axis=(-4, -2))


def bench_pooling(steps=8, repeats=10, batch=64, eval_batch=2048) -> str:
    """The model's training step and evaluation forward pass with three forms of the same pooling."""
    import optax

    from pfedkdh_jax.model import Backbone, Head, flax_max_pool_2x2, masked_max_pool_2x2
    pools = {"flax `nn.max_pool` (reduce_window; select_and_scatter gradient)": flax_max_pool_2x2,
             "reshape + max": _reshape_max_pool,
             "reduce_window + compare-and-mask gradient (custom VJP; the model's form on CPU)":
             masked_max_pool_2x2}
    lines = ["| input | pooling | training samples/s (fwd+bwd+SGD, batch 64) | forward samples/s (batch 2048) |",
             "|---|---|---|---|"]
    for name, shape in SHAPES.items():
        x = jax.random.normal(jax.random.key(1), (batch, *shape))
        xe = jax.random.normal(jax.random.key(2), (eval_batch, *shape))
        y = jnp.arange(batch) % 10
        for label, pool in pools.items():
            body, head = Backbone(pool=pool), Head(10)
            params = {"b": body.init(jax.random.key(0), x[:1])["params"],
                      "h": head.init(jax.random.key(0), jnp.zeros((1, 512)))["params"]}

            def loss(p, body=body, head=head):
                logits = head.apply({"params": p["h"]}, body.apply({"params": p["b"]}, x))
                return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

            @jax.jit
            def chunk(p, loss=loss):
                for _ in range(steps):
                    p = jax.tree_util.tree_map(lambda a, g: a - 0.01 * g, p, jax.grad(loss)(p))
                return p
            forward = jax.jit(lambda b, body=body: body.apply({"params": b}, xe))
            jax.block_until_ready((chunk(params), forward(params["b"])))
            t0 = time.perf_counter()
            p = params
            for _ in range(repeats):
                p = chunk(p)
            jax.block_until_ready(p)
            train = repeats * steps * batch / (time.perf_counter() - t0)
            t0 = time.perf_counter()
            for _ in range(repeats // 2):
                f = forward(params["b"])
            jax.block_until_ready(f)
            fwd = (repeats // 2) * eval_batch / (time.perf_counter() - t0)
            lines.append(f"| {name} | {label} | {train:.0f} | {fwd:.0f} |")
            print(lines[-1], flush=True)
    return "\n".join(lines)


def bench_conv_forms(members=(1, 10), steps=4, repeats=5, batch=64, forms=CONV_FORMS) -> str:
    """A training step of ``m`` members with weights of their own (vmapped: clients or repetitions), in
    each of the model's convolution forms: XLA's convolution (a grouped convolution once vmapped), the
    matmul over patches and Winograd's F(4×4, 5×5) for conv2 (both batched matmuls once vmapped);
    interleaved repeats, median samples/s. Compiled with the engine's options for local training (on
    CPU: YNNPACK for dots and reductions only)."""
    import optax

    from pfedkdh_jax.engine.layout import local_training_compiler_options

    lines = ["| input | members (vmapped) | " + " | ".join(f"`{f}`, samples/s" for f in forms) + " | "
             + " | ".join(f"{f} / lax" for f in forms if f != "lax") + " |",
             "|---|---|" + "---|" * (2 * len(forms) - 1)]
    for name, shape in SHAPES.items():
        for m in members:
            x = jax.random.normal(jax.random.key(1), (m, batch, *shape))
            y = jnp.arange(batch) % 10
            chunks, params = {}, {}
            for form in forms:
                model = CNN(10, conv_form=form)
                one = model.init(jax.random.key(0), shape)
                params[form] = jax.tree_util.tree_map(lambda a: jnp.stack([a] * m), one)

                def loss(p, xb, model=model):
                    return optax.softmax_cross_entropy_with_integer_labels(model.logits(p, xb), y).mean()

                def member_chunk(p, xb, loss=loss):
                    for _ in range(steps):
                        p = jax.tree_util.tree_map(lambda a, g: a - 0.01 * g, p, jax.grad(loss)(p, xb))
                    return p
                chunks[form] = jax.jit(jax.vmap(member_chunk), compiler_options=local_training_compiler_options())
                jax.block_until_ready(chunks[form](params[form], x))
            rates = {f: [] for f in forms}
            for _ in range(repeats):
                for form in forms:
                    t0 = time.perf_counter()
                    jax.block_until_ready(chunks[form](params[form], x))
                    rates[form].append(m * steps * batch / (time.perf_counter() - t0))
            med = {f: statistics.median(rates[f]) for f in forms}
            lines.append(f"| {name} | {m} | " + " | ".join(f"{med[f]:.0f}" for f in forms) + " | "
                         + " | ".join(f"{med[f] / med['lax']:.2f}×" for f in forms if f != "lax") + " |")
            print(lines[-1], flush=True)
    return "\n".join(lines)


def bench_conv_ops(repeats=15, batch=64) -> str:
    """Each convolution of one training step alone — forward, input gradient (``dgrad``), weight
    gradient (``wgrad``) of both layers, MNIST and CIFAR-10 shapes, batch 64 — as XLA computes it
    with the engine's local-training options, next to PyTorch's (NCHW, ``aten.convolution_backward``)
    when it is installed (``pip install -e '.[bench]'``), in the same process. Also two rewrites
    that XLA could run faster in principle: the input gradient as a forward convolution of the
    zero-padded output gradient with the flipped kernel (``flip``), and the weight gradient as a
    forward convolution with the channels as batch (``swap``). GFLOP/s counts the useful
    multiply-adds (×2): the input gradient of conv2 as XLA computes it also multiplies the padding
    zeros (14×14 instead of 10×10 windows on CIFAR-10). XLA's operations interleaved, PyTorch's (one
    intra-op thread per core) in blocks of their own; median of ``repeats``."""
    from jax import lax

    from pfedkdh_jax.engine.layout import local_training_compiler_options

    dn = ("NHWC", "HWIO", "NHWC")
    conv = lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "VALID", dimension_numbers=dn)  # noqa: E731
    forms = {
        "fwd": lambda x, w, g: conv(x, w),
        "dgrad": lambda x, w, g: jax.vjp(lambda a: conv(a, w), x)[1](g)[0],
        "dgrad flip": lambda x, w, g: lax.conv_general_dilated(
            jnp.pad(g, ((0, 0), (4, 4), (4, 4), (0, 0))), jnp.transpose(w[::-1, ::-1], (0, 1, 3, 2)),
            (1, 1), "VALID", dimension_numbers=dn),
        "wgrad": lambda x, w, g: jax.vjp(lambda v: conv(x, v), w)[1](g)[0],
        "wgrad swap": lambda x, w, g: jnp.transpose(
            conv(jnp.transpose(x, (3, 1, 2, 0)), jnp.transpose(g, (1, 2, 0, 3))), (1, 2, 0, 3)),
    }
    try:
        import torch
        torch.set_num_threads(os.cpu_count() or 1)
    except ImportError:
        torch = None
    options = local_training_compiler_options()
    lines = ["| input | layer | operation | XLA, ms | XLA, GFLOP/s | PyTorch, ms | XLA / PyTorch |",
             "|---|---|---|---|---|---|---|"]
    rng = np.random.default_rng(0)
    for name, (h, _, c) in SHAPES.items():
        h1 = h - 4
        layers = {"conv1": (h, c, 32), "conv2": (h1 // 2, 32, 64)}
        for layer, (size, cin, cout) in layers.items():
            out = size - 4
            x = rng.normal(size=(8, batch, size, size, cin)).astype(np.float32)
            kern = rng.normal(size=(5, 5, cin, cout)).astype(np.float32)
            g = rng.normal(size=(8, batch, out, out, cout)).astype(np.float32)
            flops = 2 * batch * out * out * cout * 25 * cin
            ops = [o for o in forms if layer == "conv2" or not o.startswith("dgrad")]  # conv1's input needs none
            fns = {}
            for op in ops:
                fn = forms[op]
                fns[op] = jax.jit(lambda x, w, g, fn=fn: [fn(x[i], w, g[i]) for i in range(8)],
                                  compiler_options=options)
                ref = forms[op.split()[0]](x[0], kern, g[0])
                got = fns[op](x, kern, g)[0]
                assert np.allclose(got, ref, rtol=1e-3, atol=1e-3 * float(np.abs(ref).max())), (name, layer, op)
            if torch is not None:
                tx = [torch.from_numpy(np.ascontiguousarray(a.transpose(0, 3, 1, 2))) for a in x]
                tg = [torch.from_numpy(np.ascontiguousarray(a.transpose(0, 3, 1, 2))) for a in g]
                tw = torch.from_numpy(np.ascontiguousarray(kern.transpose(3, 2, 0, 1)))
                mask = {"fwd": None, "dgrad": [True, False, False], "wgrad": [False, True, False]}

                def torch_op(op, tx=tx, tg=tg, tw=tw):
                    with torch.no_grad():
                        for i in range(8):
                            if mask[op] is None:
                                torch.nn.functional.conv2d(tx[i], tw)
                            else:
                                torch.ops.aten.convolution_backward(tg[i], tx[i], tw, None, [1, 1], [0, 0], [1, 1],
                                                                    False, [0, 0], 1, mask[op])
            times = {op: [] for op in ops}
            ttimes = {op: [] for op in ops if op in ("fwd", "dgrad", "wgrad")} if torch is not None else {}
            for op in ops:
                jax.block_until_ready(fns[op](x, kern, g))
                if op in ttimes:
                    torch_op(op)
            # XLA's repeats and PyTorch's in separate blocks: PyTorch's OpenMP threads keep spinning for
            # a while after an operation, which would slow an XLA call that follows at once
            for _ in range(3):
                for _ in range(repeats // 3):
                    for op in ops:
                        t0 = time.perf_counter()
                        jax.block_until_ready(fns[op](x, kern, g))
                        times[op].append((time.perf_counter() - t0) / 8)
                for _ in range(repeats // 3):
                    for op in ttimes:
                        t0 = time.perf_counter()
                        torch_op(op)
                        ttimes[op].append((time.perf_counter() - t0) / 8)
                time.sleep(0.5)   # let PyTorch's threads go idle before XLA's next block
            for op in ops:
                t = statistics.median(times[op])
                tt = statistics.median(ttimes[op]) if op in ttimes else None
                lines.append(f"| {name} | {layer} | {op} | {t * 1e3:.2f} | {flops / t / 1e9:.0f} | "
                             + (f"{tt * 1e3:.2f} | {t / tt:.2f}× |" if tt else "– | – |"))
                print(lines[-1], flush=True)
    return "\n".join(lines)


def model_flops(shape) -> dict[str, float]:
    """Multiply-adds ×2 of one forward pass, counted layer by layer."""
    h, w, c = shape
    h1, w1 = h - 4, w - 4
    conv1 = 2 * h1 * w1 * 32 * 25 * c
    h2, w2 = h1 // 2 - 4, w1 // 2 - 4
    conv2 = 2 * h2 * w2 * 64 * 25 * 32
    flat = (h2 // 2) * (w2 // 2) * 64
    fc = 2 * flat * 512
    head = 2 * 512 * 10
    fwd = conv1 + conv2 + fc + head
    return {"forward": fwd, "train": 3 * fwd, "pfedkdh_step": 4 * fwd}  # + teacher forward


def matmul_rate(n=2048, repeats=5) -> float:
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best


def bench_floor(run_dir: str | None) -> str:
    rate = matmul_rate()
    lines = [f"fp32 matmul rate (2048², best of 5): **{rate / 1e9:.1f} GFLOP/s**", "",
             "| input | forward MFLOP/sample | fwd+bwd MFLOP/sample | pFedKDH step (+ teacher fwd) |",
             "|---|---|---|---|"]
    for name, shape in SHAPES.items():
        f = model_flops(shape)
        lines.append(f"| {name} | {f['forward'] / 1e6:.2f} | {f['train'] / 1e6:.1f} | {f['pfedkdh_step'] / 1e6:.1f} |")
    # local training of the default pFedKDH (λ = 0: no teacher forward) in the CPU/GPU default layout
    clients, steps = 4, 16
    data = synthetic(SHAPES["MNIST"], clients, steps)
    algo = PFedKDH(CNN(10), PFedKDHConfig(local_epochs=1, teacher_epochs=1, lam=0.0))
    runner = RoundRunner(algo, data, Layout())
    _, times = time_rounds(runner, algo.init(jax.random.key(0), data), data, np.arange(clients), jax.random.key, 3)
    med = statistics.median(times)
    samples = clients * steps * 64
    achieved = samples * model_flops(SHAPES["MNIST"])["train"] / med
    lines += ["", f"Default pFedKDH (λ = 0), MNIST input, {clients} clients × {steps} steps of 64, default layout: "
              f"{samples / med:.0f} samples/s, {achieved / 1e9:.1f} GFLOP/s = {100 * achieved / rate:.0f} % of the "
              f"matmul rate → **{rate / achieved:.2f}× the floor** (round includes aggregation and the teacher refit)."]
    if run_dir:
        with open(os.path.join(run_dir, "summary.json")) as fh:
            s = json.load(fh)
        with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
            rows = [json.loads(line) for line in fh]
        sizes = np.asarray(s["partition"]["train_sizes"])
        with open(os.path.join(run_dir, "config.json")) as fh:
            cfg = json.load(fh)
        steps = [cfg["local_epochs"] * -(-int(sizes[k]) // cfg["batch_size"]) * cfg["batch_size"]
                 for r in rows[1:] for k in r["clients"]]
        samples = np.mean(steps) * len(rows[0]["clients"])  # padded-batch sample-steps per round
        f = model_flops((28, 28, 1))
        per_sample = f["pfedkdh_step"] if cfg.get("lam", 0) > 0 else f["train"]
        floor = samples * per_sample / rate
        spr = s["seconds_per_round"]
        lines += ["", f"MNIST paper preset ({os.path.basename(run_dir.rstrip('/'))}, λ = {cfg.get('lam')}): "
                  f"{samples:.0f} sample-steps per round (mean over rounds) × {per_sample / 1e6:.1f} MFLOP "
                  f"= floor {secs(floor)} s; measured {secs(spr)} s/round (training; evaluation "
                  f"{secs(s.get('eval_seconds_median', 0))} s median) → {spr / floor:.2f}× the floor "
                  f"({100 * floor / spr:.0f} % of the matmul rate)."]
    out = "\n".join(lines)
    print(out, flush=True)
    return out


def bench_reps(clients=4, steps=8, repeats=3) -> str:
    data = synthetic(SHAPES["MNIST"], clients, steps)
    algo = algo_for(SHAPES["MNIST"])
    lines = ["| repetitions | mode | s/round median (min–max) | × one repetition |", "|---|---|---|---|"]
    base = None
    for reps in (1, 2, 5):
        for mode in ("vmap", "sequential"):
            if reps == 1 and mode == "sequential":
                continue
            seeds = list(range(reps))
            keys = [streams(s) for s in seeds]
            if mode == "vmap":
                runner = RoundRunner(algo, data, Layout(), reps=reps)
                state = tree_stack([algo.init(k["init"], data) for k in keys])
                sel = np.tile(np.arange(clients), (reps, 1))
                _, times = time_rounds(runner, state, data, sel,
                                       lambda t: jnp.stack([jax.random.fold_in(k["train"], t) for k in keys]), repeats)
            else:
                runner = RoundRunner(algo, data, Layout())
                states = [algo.init(k["init"], data) for k in keys]
                time_rounds(runner, states[0], data, np.arange(clients), jax.random.key, 0)
                times = []
                for r in range(repeats):
                    t0 = time.perf_counter()
                    for i in range(reps):
                        states[i], _ = runner.round(states[i], data, np.arange(clients),
                                                    jax.random.fold_in(keys[i]["train"], r))
                    jax.block_until_ready(states)
                    times.append(time.perf_counter() - t0)
            med = statistics.median(times)
            base = base or med
            spread = f"{secs(min(times))}–{secs(max(times))}"
            lines.append(f"| {reps} | {mode} | {secs(med)} ({spread}) | {med / base:.2f} |")
            print(lines[-1], flush=True)
    return "\n".join(lines)


DEVICE_SCRIPT = r"""
import json, sys, time
import jax
from pfedkdh_jax.run.config import make_config
from pfedkdh_jax.run.experiment import run
cfg = make_config("smoke", out=sys.argv[1], reps=8, reps_mode="vmap", num_clients=8, rounds=3, local_epochs=1,
                  checkpoint_every=0)
t0 = time.time()
s = run(cfg, progress=False, log=lambda *_: None)
print(json.dumps({"devices": jax.device_count(), "acc": s["personalized_macro_accuracy"],
                  "loss": s["final_train_loss"], "spr": s["seconds_per_round"], "wall": time.time() - t0}))
"""


def bench_devices(tmp="runs/bench-devices") -> str:
    lines = ["| fake CPU devices | personalized macro acc. (8 reps, mean) | final train loss | s/round |",
             "|---|---|---|---|"]
    for n in (1, 2, 4, 8):
        env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={n}", "JAX_PLATFORMS": "cpu"}
        p = subprocess.run([sys.executable, "-c", DEVICE_SCRIPT, f"{tmp}/d{n}"], capture_output=True, text=True,
                           env=env)
        if p.returncode:
            lines.append(f"| {n} | failed: {p.stderr.strip().splitlines()[-1][:100]} | | |")
        else:
            r = json.loads(p.stdout.strip().splitlines()[-1])
            lines.append(f"| {r['devices']} | {100 * r['acc']:.4f} | {r['loss']:.6f} | {r['spr']:.2f} |")
        print(lines[-1], flush=True)
    return "\n".join(lines)


MEMORY_SCRIPT = r"""
import json, resource, sys
import jax
import numpy as np
sys.path.insert(0, "experiments")
from benchmarks import SHAPES, algo_for, synthetic
from pfedkdh_jax.engine.layout import Layout
from pfedkdh_jax.engine.runner import RoundRunner

shape, cp, sl = SHAPES[sys.argv[1]], sys.argv[2], sys.argv[3]
data = synthetic(shape, 4, 16)
algo = algo_for(shape)
state = algo.init(jax.random.key(0), data)
jax.block_until_ready(state)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
runner = RoundRunner(algo, data, Layout(cp, sl, 8))
for r in range(1):
    state, _ = runner.round(state, data, np.arange(4), jax.random.key(r))
    jax.block_until_ready(state)
stats = jax.devices()[0].memory_stats() or {}
print(json.dumps({"rss_before": before, "rss_peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "device_peak": stats.get("peak_bytes_in_use")}))
"""


def bench_memory() -> str:
    """Peak memory of each layout, each in a fresh process (peaks never go down within one)."""
    lines = ["| input | clients | step loop | process peak RSS | of which after set-up | device peak bytes |",
             "|---|---|---|---|---|---|"]
    for name in SHAPES:
        for cp, sl in [("sequential", "unrolled"), ("vmap", "unrolled"), ("sequential", "scan"), ("vmap", "scan")]:
            p = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, name, cp, sl], capture_output=True, text=True,
                               cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            if p.returncode:
                lines.append(f"| {name} | {cp} | {sl} | failed: {p.stderr.strip().splitlines()[-1][:80]} | | |")
            else:
                r = json.loads(p.stdout.strip().splitlines()[-1])
                dev = "–" if r["device_peak"] is None else f"{r['device_peak'] / 2**20:.0f} MiB"
                lines.append(f"| {name} | {cp} | {sl} | {r['rss_peak'] / 2**20:.0f} MiB | "
                             f"+{(r['rss_peak'] - r['rss_before']) / 2**20:.0f} MiB | {dev} |")
            print(lines[-1], flush=True)
    return "\n".join(lines)


# paper figures (method.md §5, MNIST α = 0.1; mean ± std) and the metric each method is scored by
PAPER = {"pfedkdh": (99.12, 0.09), "fedavg": (94.43, 2.01), "fedprox": (94.46, 1.96), "ditto": (96.02, 1.45),
         "pfedme": (98.76, 0.23), "fedper": (98.61, 0.13), "fedrep": (96.69, 1.89), "fedbabu": (98.49, 0.25),
         "fedproto": (97.98, 0.75), "fedala": (99.05, 0.25), "fedfed": (97.59, 0.74),
         "pfedsim": (float("nan"), float("nan"))}   # method.md §7 gives no pFedSim figure
GLOBAL_SCORED = ("fedavg", "fedprox", "fedfed")


def bench_methods(pattern: str) -> str:
    """One row per finished run directory matching ``pattern``: final accuracy against the paper,
    and round times (median and min–max over the rounds after the first)."""
    import glob
    lines = ["| method | scored by | final macro acc. | paper (mean ± std) | gap in σ | s/round median (min–max) | "
             "first round | eval s (median) | samples/s |", "|---|---|---|---|---|---|---|---|---|"]
    order = list(PAPER)

    def rank(run_dir):
        base = os.path.basename(run_dir.rstrip("/"))
        name = base.split("-")[1] if "-" in base else base
        return (order.index(name) if name in order else len(order), run_dir)
    for run_dir in sorted(glob.glob(pattern), key=rank):
        try:
            with open(os.path.join(run_dir, "summary.json")) as fh:
                s = json.load(fh)
            with open(os.path.join(run_dir, "config.json")) as fh:
                cfg = json.load(fh)
            with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
                rows = [json.loads(line) for line in fh]
        except (OSError, ValueError):
            continue  # not finished
        method = cfg["method"]
        key = "global_macro_accuracy" if method in GLOBAL_SCORED else "personalized_macro_accuracy"
        acc = 100 * rows[-1][key]
        times = [r["train_seconds"] for r in rows[1:]]
        if len(times) < 5:
            continue
        sizes = np.asarray(s["partition"]["train_sizes"])
        visited = statistics.mean(cfg["local_epochs"] * int(sizes[r["clients"]].sum()) for r in rows[1:])
        evals = [r["eval_seconds"] for r in rows if r.get(key) is not None]  # rounds with an evaluation
        paper, sd = PAPER.get(method, (float("nan"), float("nan")))
        med = statistics.median(times)
        base = os.path.basename(run_dir.rstrip("/"))
        label = method if base == f"mnist-{method}" else f"{method} ({base})"  # e.g. an ablation's run
        known = paper == paper   # not NaN: the paper gives a figure
        lines.append(f"| {label} | {key.split('_')[0]} | {acc:.2f} % | "
                     + (f"{paper:.2f} ± {sd:.2f} | {(acc - paper) / sd:+.1f} | " if known else "– | – | ")
                     + f"{med:.1f} ({min(times):.1f}–{max(times):.1f}) | "
                     f"{rows[0]['train_seconds']:.1f} s | {statistics.median(evals):.2f} | {visited / med:.0f} |")
        print(lines[-1], flush=True)
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="forms,pooling,floor,reps,devices,memory,methods")
    ap.add_argument("--run-dir", default=None, help="a finished MNIST paper-preset run, for the floor section")
    ap.add_argument("--runs-glob", default="runs/mnist-*", help="finished MNIST paper-preset runs (methods)")
    ap.add_argument("--write", default=None, help="write the tables to this markdown file")
    args = ap.parse_args()
    head = (f"backend {jax.default_backend()}, device {jax.devices()[0].device_kind}, "
            f"{os.cpu_count()} CPU cores, jax {jax.__version__}")
    print(head, flush=True)
    parts = [f"_Generated by `python experiments/benchmarks.py` — {head}._"]
    sections = {"forms": ("Client-parallel layouts (local training, 4 clients × 16 steps of 64)", bench_forms),
                "floor": ("Compute floor", lambda: bench_floor(args.run_dir)),
                "reps": ("Repetitions (4 clients × 8 steps of 64, the backend's default layout)", bench_reps),
                "devices": ("Fake CPU devices (digits, 8 clients, 8 repetitions in one program, CPU layout)",
                            bench_devices),
                "memory": ("Peak memory per layout (pFedKDH λ = 0.5, 4 clients × 16 steps of 64, 1 round)",
                           bench_memory),
                "pooling": ("Pooling form (the model's training step, batch 64, unrolled chunks of 8)",
                            bench_pooling),
                "convforms": ("Convolution form with per-member weights (training steps of 64, vmapped members)",
                              bench_conv_forms),
                "convops": ("Each convolution of a training step alone (batch 64), XLA next to PyTorch",
                            bench_conv_ops),
                "methods": ("Methods on MNIST, α = 0.1, paper preset (one repetition, seed 0)",
                            lambda: bench_methods(args.runs_glob))}
    for name in args.only.split(","):
        title, fn = sections[name]
        print(f"\n## {title}", flush=True)
        parts.append(f"## {title}\n\n{fn()}")
    if args.write:
        with open(args.write, "w") as f:
            f.write("\n\n".join(parts) + "\n")


if __name__ == "__main__":
    main()
