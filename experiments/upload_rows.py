"""The server step's input at many clients: C uploads of the MNIST backbone (2.3 MB each) stacked inside
the server program from a list, summed as a Python sum of products, or written row by row into a donated
[C, ...] buffer and averaged (the engine's form since 2026-12-04; BENCHMARKS.md, "Widths that pay,
uploads written in place").

    python experiments/upload_rows.py 1000
"""
import time, jax, jax.numpy as jnp
from pfedkdh_jax.engine.local import tree_stack
from pfedkdh_jax.algorithms.common import weighted_average
C = int(__import__("sys").argv[1])
def up(i):
    return {"conv1": {"kernel": jnp.full((5,5,1,32), i, jnp.float32), "bias": jnp.zeros(32)},
            "conv2": {"kernel": jnp.full((5,5,32,64), i, jnp.float32), "bias": jnp.zeros(64)},
            "fc": {"kernel": jnp.full((1024,512), i, jnp.float32), "bias": jnp.zeros(512)}}
ups = [up(i) for i in range(C)]; jax.block_until_ready(ups)
w = jnp.arange(1, C + 1, dtype=jnp.float32)
f1 = jax.jit(lambda ups, w: weighted_average(tree_stack(ups, axis=0), w))
def sumform(ups, w):
    wn = w / w.sum()
    return jax.tree_util.tree_map(lambda *xs: sum(wn[i] * x for i, x in enumerate(xs)), *ups)
f2 = jax.jit(sumform)
setk = jax.jit(lambda buf, x, i: jax.tree_util.tree_map(lambda b, a: b.at[i].set(a), buf, x), donate_argnums=0)
f3 = jax.jit(weighted_average)
for name, f in (("stack in program", lambda: f1(ups, w)), ("sum of products", lambda: f2(ups, w))):
    for rep in range(3):
        t0 = time.perf_counter(); jax.block_until_ready(f()); print(name, rep, f"{time.perf_counter()-t0:.3f}", flush=True)
buf = jax.tree_util.tree_map(lambda a: jnp.zeros((C,) + a.shape, a.dtype), ups[0])
for rep in range(3):
    t0 = time.perf_counter()
    for i, u in enumerate(ups):
        buf = setk(buf, u, i)
    jax.block_until_ready(buf); t1 = time.perf_counter()
    out = f3(buf, w); jax.block_until_ready(out)
    print("set rows + average", rep, f"{t1-t0:.3f} + {time.perf_counter()-t1:.3f}", flush=True)
