"""What FedFed's rounds cost next to FedAvg's: seconds per round of each phase, the one-off pool build,
and the process's peak memory, each method in a fresh process on the same partition.

FedFed runs ``--rounds R`` with ``--method-arg feature_rounds=A`` (A phase-A rounds, then R − A of phase
B; the first phase-B round also builds the shared pool); FedAvg runs the same preset for ``--fedavg-rounds``.
Evaluation is off except at the last round (``--eval-every R``), so round times are training only.

    python experiments/fedfed_cost.py --data-dir ../shared/data/tfds [--dataset mnist] [--preset paper] \
        [--rounds 6] [--feature-rounds 3] [--fedavg-rounds 4] [--write runs/fedfed_cost.md]

Timings are benchmark output; run it with nothing else busy.

``--memory`` instead breaks the device memory down, from the shapes of the arrays and XLA's own
accounting of the compiled local step (``memory_analysis()`` of a chunk of ``--chunk-steps`` steps of
the largest client, compiled with the engine's local-training options), for FedAvg and each FedFed
phase (phase B's state after its entry, which builds the shared pool):

    python experiments/fedfed_cost.py --data-dir ../shared/data/tfds --memory [--write runs/fedfed_memory.md]

``--step`` times one phase-A step (a batch of 32 in three passes) and its parts, each compiled alone with
the engine's local-training options on random inputs, next to a FedAvg step of batch 64 (no data read):

    python experiments/fedfed_cost.py --step [--write runs/fedfed_step.md]

(the step also with flax's ConvTranspose in the VAE's decoder, in turns with the VAE's own form).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

SCRIPT = """
import json, resource, sys, time
from pfedkdh_jax.run.config import make_config
from pfedkdh_jax.run.experiment import run
method, dataset, preset, data_dir, rounds, feature_rounds, out = sys.argv[1:8]
args = (("feature_rounds", feature_rounds),) if method == "fedfed" else ()
cfg = make_config(preset, method=method, dataset=dataset, data_dir=data_dir or None, rounds=int(rounds),
                  eval_every=int(rounds), checkpoint_every=0, method_args=args, out=out)
run(cfg, progress=False, log=lambda *_: None)
rows = [json.loads(line) for line in open(out + "/metrics.jsonl")]
print(json.dumps({"train_seconds": [r["train_seconds"] for r in rows],
                  "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


MEMORY_SCRIPT = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
from pfedkdh_jax.data.device import build_federated_data
from pfedkdh_jax.engine.layout import local_training_compiler_options
from pfedkdh_jax.engine.round import make_round
from pfedkdh_jax.run.config import make_config
from pfedkdh_jax.run.experiment import engine_layout, make_algorithm, prepare_data
method, dataset, preset, data_dir = sys.argv[1:5]
cfg = make_config(preset, method=method, dataset=dataset, data_dir=data_dir or None)
pool, part, _ = prepare_data(cfg)
data = build_federated_data(pool, part, eval_chunk=cfg.eval_chunk)
algo, layout = make_algorithm(cfg, pool.num_classes), engine_layout(cfg)
size = lambda t: int(sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(t) if hasattr(x, "dtype")))
key = jax.random.key(0)
state = algo.init(key, data)
largest = jnp.int32(int(np.argmax(data.train_sizes)))
rows = []
for i, phase in enumerate(algo.phases):
    if phase.enter is not None:
        state = jax.jit(phase.enter)(state, data, key)
    a = phase.algorithm
    problem = make_round(a, layout).problem
    local = jax.jit(problem.start)(state, data, largest, key)
    ctx = jax.jit(a.context)(state)
    chunk = jax.jit(lambda s, c, d, k: problem.train(s, c, d, k, layout.chunk_steps),
                    compiler_options=local_training_compiler_options()).lower(local, ctx, data, largest).compile()
    m = chunk.memory_analysis()
    rows.append({"phase": i + 1, "state": size(state), "data": size(data), "local": size(local), "ctx": size(ctx),
                 "params": size(local.params), "opt_state": size(local.opt_state),
                 "temp": int(m.temp_size_in_bytes),
                 "state_parts": {k: size(v) for k, v in vars(state).items() if not k.startswith("_")}})
print(json.dumps({"chunk_steps": layout.chunk_steps, "batch": cfg.batch_size, "phases": rows}))
"""


STEP_SCRIPT = """
import json, sys, time
import flax.linen as nn
import jax, jax.numpy as jnp, numpy as np, optax
from pfedkdh_jax import losses
from pfedkdh_jax.algorithms import common as C
from pfedkdh_jax.algorithms.vae import VAE, UpConv
from pfedkdh_jax.engine.layout import local_training_compiler_options
from pfedkdh_jax.run.config import make_config
from pfedkdh_jax.run.experiment import make_algorithm, resolved_conv_form, engine_layout
method, dataset, preset = sys.argv[1:4]
cfg = make_config(preset, method="fedfed", dataset=dataset)
shape = {"cifar10": (32, 32, 3)}.get(dataset, (28, 28, 1))
form = resolved_conv_form(cfg, engine_layout(cfg))
algo = make_algorithm(cfg, 10, form)
model, c = algo.model, algo.config
rng = np.random.default_rng(0)
def batch(b):
    return (jnp.asarray(rng.uniform(-1, 1, (b,) + shape).astype(np.float32)),
            jnp.asarray(rng.integers(0, 10, b).astype(np.int32)), jnp.ones(b, bool))
x, y, mask = batch(c.vae_batch_size)
x01, key = (x + 1) / 2, jax.random.key(3)
f = model.init(jax.random.key(0), shape)
vae = VAE(shape[-1], c.vae_width).init(jax.random.key(1), jnp.zeros((1,) + shape))
vp, bs = vae["params"], vae["batch_stats"]
sgd, adamw = algo.optimizers()
opts = local_training_compiler_options()
def ms(fn, *args, n=20):
    g = jax.jit(fn, compiler_options=opts)
    jax.block_until_ready(g(*args))
    t0 = time.perf_counter()
    for _ in range(n):
        out = g(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / n * 1e3
def ce_grad(f, xb, yb):
    return jax.grad(lambda f: jnp.mean(losses.cross_entropy(C.logits(model, f, xb, rng=key), yb)))(f)
recon = lambda vp: algo.recon_terms(*(lambda r: (r[0], x01, r[1], r[2], mask))(algo._vae_apply(vp, bs, x01, key, mask, shape[-1])))
g1 = jax.tree.map(jnp.ones_like, vp)
x64, y64, _ = batch(64)
x3, y3 = jnp.concatenate([x, x, x]), jnp.concatenate([y, y, y])
step_args = ({"f": f, "vae": vp, "bs": bs}, {"f": sgd.init(f), "vae": adamw.init(vp)})
def compiled_step():
    g = jax.jit(lambda p, o: algo.three_passes(p, o, None, x, y, mask, key)[1], compiler_options=opts)
    jax.block_until_ready(g(*step_args))   # traced and compiled now
    return g
import pfedkdh_jax.algorithms.vae as vae_module
upconv = vae_module.UpConv
vae_module.UpConv = lambda features, name: nn.ConvTranspose(features, (4, 4), strides=(2, 2), name=name)
flax_step = compiled_step()            # the VAE's decoder with flax's ConvTranspose
vae_module.UpConv = upconv
up_step = compiled_step()
paired = {"flax": [], "up": []}
for _ in range(5):                     # the two in turns, 10 calls each (the machine's speed drifts)
    for name, g in (("flax", flax_step), ("up", up_step)):
        t0 = time.perf_counter()
        for _ in range(10):
            out = g(*step_args)
        jax.block_until_ready(out)
        paired[name].append((time.perf_counter() - t0) / 10 * 1e3)
rows = {
  "phase-A step (three passes)": float(np.median(paired["up"])),
  "phase-A step, the decoder's transposed convs as flax's ConvTranspose (in turns with the above)":
      float(np.median(paired["flax"])),
  "(1) classifier gradient, 32 samples": ms(lambda f: ce_grad(f, x, y), f),
  "(2) VAE forward alone": ms(lambda vp: algo._vae_apply(vp, bs, x01, key, mask, shape[-1])[0], vp),
  "(2) VAE reconstruction gradient": ms(lambda vp: jax.grad(recon)(vp), vp),
  "(2, 3) AdamW update of the VAE, each": ms(lambda g, o, p: optax.apply_updates(p, adamw.update(g, o, p)[0]),
                                             g1, adamw.init(vp), vp),
  "(3) joint gradient (classifier and VAE)": ms(lambda f, vp: jax.grad(
      lambda f, vp: algo._joint(f, vp, bs, x, y, mask, key)[0], argnums=(0, 1))(f, vp), f, vp),
  "(3) of which: classifier gradient, 96 samples": ms(lambda f: ce_grad(f, x3, y3), f),
  "FedAvg step's gradient, 64 samples": ms(lambda f: ce_grad(f, x64, y64), f),
}
# single layers of the VAE at its shapes (batch 32): forward, and forward + both gradients
side, width = shape[0] // 4, c.vae_width
layers = {"dense F -> F (the VAE has three)": (nn.Dense(side * side * width), (side * side * width,)),
          "transposed conv 4x4/2, width -> width/2 (decoder)": (nn.ConvTranspose(width // 2, (4, 4), strides=(2, 2)),
                                                                 (side, side, width)),
          "the same as the VAE computes it (vae.UpConv: a 3x3 conv, then depth-to-space)": (UpConv(width // 2),
                                                                                            (side, side, width)),
          "transposed conv 4x4/2, width/2 -> channels (decoder)": (nn.ConvTranspose(shape[-1], (4, 4), strides=(2, 2)),
                                                                    (2 * side, 2 * side, width // 2)),
          "the same as vae.UpConv": (UpConv(shape[-1]), (2 * side, 2 * side, width // 2)),
          "conv 4x4/2, width/2 -> width (encoder)": (nn.Conv(width, (4, 4), strides=(2, 2)),
                                                     (2 * side, 2 * side, width // 2))}
for name, (mod, s_in) in layers.items():
    xin = jnp.asarray(rng.normal(size=(c.vae_batch_size,) + s_in).astype(np.float32))
    p = mod.init(jax.random.key(0), xin)
    rows[name + ": forward"] = ms(lambda p, xin: mod.apply(p, xin), p, xin)
    rows[name + ": forward + gradients"] = ms(jax.grad(lambda p, xin: jnp.sum(jnp.square(mod.apply(p, xin))),
                                                       argnums=(0, 1)), p, xin)
print(json.dumps({"conv_form": form, "paired_ms": paired,
                  "vae_params": int(sum(v.size for v in jax.tree.leaves(vp))), "ms": rows}))
"""


def step_table(args) -> str:
    got = child("fedfed", STEP_SCRIPT, args.dataset, args.preset)
    step = got["ms"]["phase-A step (three passes)"]
    lines = [f"{args.dataset}, preset {args.preset}: one phase-A step and its parts, ms (each compiled alone, "
             f"mean of 20 calls; VAE {got['vae_params'] / 1e6:.1f} M parameters; the classifier's conv form "
             f"{got['conv_form']})", "",
             "| | ms | ÷ the whole step |", "|---|---|---|"]
    lines += [f"| {name} | {t:.1f} | {t / step:.2f} |" for name, t in got["ms"].items()]
    lines += ["", "the two steps in turns, ms (10 calls each): " + "; ".join(
        f"{k}: {', '.join(f'{t:.1f}' for t in v)}" for k, v in got["paired_ms"].items())]
    return "\n".join(lines)


def child(method: str, script: str, *argv: str) -> dict:
    """``script`` in a fresh Python process (its own peak memory); its last line of output, as JSON."""
    p = subprocess.run([sys.executable, "-c", script, method, *argv], capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"{method} failed: {p.stderr.strip().splitlines()[-1] if p.stderr.strip() else p.returncode}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def memory(method: str, args) -> dict:
    return child(method, MEMORY_SCRIPT, args.dataset, args.preset, args.data_dir or "")


def memory_table(args) -> str:
    mib = lambda b: f"{b / 2 ** 20:.1f}"  # noqa: E731
    got = {m: memory(m, args) for m in ("fedavg", "fedfed")}
    lines = [f"{args.dataset}, preset {args.preset}: device bytes (MiB) of the arrays a round holds, and XLA's "
             f"temporary buffers of one compiled chunk of {got['fedavg']['chunk_steps']} local steps "
             f"(batch {got['fedavg']['batch']}) of the largest client", "",
             "| | algorithm state | of which | data (images, index tables) | a client's local state "
             "(params + optimizer) | context sent | chunk temporaries |", "|---|---|---|---|---|---|---|"]
    for m, g in got.items():
        for r in g["phases"]:
            name = "FedAvg" if m == "fedavg" else f"FedFed phase {'AB'[r['phase'] - 1]}"
            parts = ", ".join(f"{k} {mib(v)}" for k, v in r["state_parts"].items() if v >= 2 ** 16)
            lines.append(f"| {name} | {mib(r['state'])} | {parts} | {mib(r['data'])} | {mib(r['local'])} "
                         f"({mib(r['params'])} + {mib(r['opt_state'])}) | {mib(r['ctx'])} | {mib(r['temp'])} |")
    return "\n".join(lines)


def measure(method: str, args, rounds: int, tmp: str) -> dict:
    return child(method, SCRIPT, args.dataset, args.preset, args.data_dir or "", str(rounds),
                 str(args.feature_rounds), os.path.join(tmp, method))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", default=os.environ.get("TFDS_DATA_DIR"))
    ap.add_argument("--dataset", default="mnist")
    ap.add_argument("--preset", default="paper")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--feature-rounds", type=int, default=3)
    ap.add_argument("--fedavg-rounds", type=int, default=4)
    ap.add_argument("--write", default=None, help="also write the table to this file")
    ap.add_argument("--memory", action="store_true", help="the device-memory breakdown instead of the timings")
    ap.add_argument("--step", action="store_true", help="one phase-A step's parts instead of the round timings")
    args = ap.parse_args()
    if args.memory or args.step:
        text = memory_table(args) if args.memory else step_table(args)
        print(text)
        if args.write:
            with open(args.write, "w") as f:
                f.write(text + "\n")
        return
    if not 2 <= args.feature_rounds <= args.rounds - 2:
        raise SystemExit("--feature-rounds must leave 2 rounds of each phase (2 <= A <= rounds - 2)")
    with tempfile.TemporaryDirectory() as tmp:
        fedavg = measure("fedavg", args, args.fedavg_rounds, tmp)
        fedfed = measure("fedfed", args, args.rounds, tmp)
    a = args.feature_rounds
    avg = statistics.median(fedavg["train_seconds"][1:])
    phase_a = statistics.median(fedfed["train_seconds"][1:a])       # after the first (compiling) round
    phase_b = statistics.median(fedfed["train_seconds"][a + 1:])     # after the pool's round
    entry = fedfed["train_seconds"][a]
    mib = lambda b: f"{b / 2 ** 20:.0f} MiB"  # noqa: E731
    lines = [f"{args.dataset}, preset {args.preset}: FedAvg {args.fedavg_rounds} rounds; FedFed {args.rounds} "
             f"rounds ({a} of phase A); seconds of training per round (median after each phase's first round)",
             "", "| | s/round | ÷ FedAvg's | first round (compiles) | process peak RSS |", "|---|---|---|---|---|",
             f"| FedAvg | {avg:.1f} | 1.00 | {fedavg['train_seconds'][0]:.1f} s | {mib(fedavg['peak_rss'])} |",
             f"| FedFed phase A | {phase_a:.1f} | {phase_a / avg:.2f} | {fedfed['train_seconds'][0]:.1f} s | "
             f"{mib(fedfed['peak_rss'])} (whole run) |",
             f"| FedFed phase B | {phase_b:.1f} | {phase_b / avg:.2f} | {entry:.1f} s (phase B's compile and the "
             f"pool's build: {entry - phase_b:.1f} s more than a later round) | |",
             "", f"all rounds: FedAvg {[round(t, 1) for t in fedavg['train_seconds']]}, "
             f"FedFed {[round(t, 1) for t in fedfed['train_seconds']]}"]
    text = "\n".join(lines)
    print(text)
    if args.write:
        with open(args.write, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
