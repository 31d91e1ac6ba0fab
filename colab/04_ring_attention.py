# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 04 · Ring attention on 8 virtual devices
#
# Ring attention (Liu et al. 2023) splits the *sequence* over the devices of one mesh
# axis. Each device keeps its chunk of queries; the K/V chunks travel around the ring
# (`lax.ppermute`), and at each of the `n` steps every device attends its queries to
# the block it holds with the tiled `blockwise_attention`, merging partial results
# through their log-sum-exp. No device ever holds the whole sequence's K/V or any
# `T x S` array. `tfjax.parallel.ring_attention` is that, under `jax.shard_map`.
#
# This notebook runs on a plain CPU: XLA is asked for 8 host devices *before* jax is
# imported, so the mesh, the collectives and the shardings are the real ones.

# %%
# Setup. In Colab: clone the repository (the package and its configs/) and install it.
import os
import subprocess
import sys
from pathlib import Path

if "google.colab" in sys.modules:
    if not Path("tfjax-repo").exists():
        subprocess.run(["git", "clone", "--depth=1", "https://github.com/tfjax/tfjax",
                        "tfjax-repo"], check=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "./tfjax-repo"], check=True)
    os.chdir("tfjax-repo")
# Work from the repository root: the presets in configs/ are code.
ROOT = next(p for p in (Path.cwd(), *Path.cwd().parents) if (p / "configs").is_dir())
os.chdir(ROOT)
sys.path.insert(0, str(ROOT))

# %%
# 8 simulated CPU devices: must be set before jax is imported (restart the kernel if
# jax was already imported). On a TPU / GPU runtime, the real devices are used.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

from tfjax.config import MeshConfig
from tfjax.ops import attention_reference, masks
from tfjax.parallel import ring_attention, unzigzag, zigzag
from tfjax.parallel.mesh import make_mesh

jax.config.update("jax_default_matmul_precision", "highest")  # exact fp32 comparisons
print(len(jax.devices()), "devices:", jax.devices()[0].platform)

# %% [markdown]
# ## A mesh with a `sequence` axis
#
# tfjax meshes always have the five axes `data, fsdp, sequence, tensor, expert` (size 1
# when unused), so the same rules table works whatever the parallelism. Here all 8
# devices go to `sequence`.

# %%
mesh = make_mesh(MeshConfig(data=1, sequence=-1))
n = mesh.shape["sequence"]
print(dict(mesh.shape))

B, T, N, K, H = 2, 256, 4, 2, 16  # GQA: 4 query heads share 2 kv heads
kq, kk, kv = jax.random.split(jax.random.key(0), 3)
q = jax.random.normal(kq, (B, T, N, H))
k = jax.random.normal(kk, (B, T, K, H))
v = jax.random.normal(kv, (B, T, K, H))

# %% [markdown]
# ## Same result as the reference
#
# `attention_reference` materialises the `T x S` logits on one device: the ground truth.
# Ring attention must match it for any mask: causal (with and without zig-zag load
# balancing), a causal mask within packed documents (the segment ids travel around the
# ring with K/V), and a sliding window.

# %%
doc_ids = jnp.asarray(np.repeat([[1, 2, 3, 4]], B, 0).repeat([40, 100, 60, 56], axis=1))
cases = {
    "causal": (masks.causal(), "none"),
    "causal, zig-zag": (masks.causal(), "zigzag"),
    "causal & segments, zig-zag": (masks.causal() & masks.segments(doc_ids), "zigzag"),
    "causal & sliding_window(48)": (masks.causal() & masks.sliding_window(48), "none"),
}
outs = {}
for name, (mask, balance) in cases.items():
    ref = attention_reference(q, k, v, mask)
    outs[name] = out = jax.jit(lambda q, k, v, m, b=balance: ring_attention(
        q, k, v, m, mesh=mesh, seq_axis="sequence", load_balance=b))(q, k, v, mask)
    err = float(jnp.max(jnp.abs(out - ref)))
    print(f"{name:30} max |ring - reference| = {err:.1e}")
    assert err < 1e-5, name

# %% [markdown]
# ## Why zig-zag: the causal work per device
#
# With the natural layout, device `i` holds positions `[i T/n, (i+1) T/n)`. Under a
# causal mask, its queries need the K/V blocks of devices `0..i` only: device 0 does 1
# block of work and waits, device 7 does 8. Ring attention skips the empty blocks
# (`lax.cond` on the mask's block view), but the ring is as slow as its busiest device.
#
# Zig-zag cuts the sequence into `2n` chunks and gives device `i` chunks `i` and
# `2n-1-i`: an early and a late one, so every device does the same work. We count
# it from the mask's own block view at chunk granularity (`2n x 2n` tiles of
# `T/2n`): a FULL tile is one unit of work, a PARTIAL (diagonal) tile half of one.

# %%
c = T // (2 * n)
tiles = np.asarray(masks.causal().blocks(T, T, c, c))[0]  # [2n, 2n] EMPTY/PARTIAL/FULL
work_of_chunk = (tiles == masks.FULL).sum(1) + 0.5 * (tiles == masks.PARTIAL).sum(1)
layouts = {
    "natural": [(2 * i, 2 * i + 1) for i in range(n)],
    "zig-zag": [(i, 2 * n - 1 - i) for i in range(n)],
}
work = {name: np.asarray([work_of_chunk[list(ch)].sum() for ch in chunks])
        for name, chunks in layouts.items()}
for name, w in work.items():
    print(f"{name:8} chunks per device {layouts[name]}\n         work per device {w.tolist()} "
          f"(max / mean = {w.max() / w.mean():.2f})")

fig, axes = plt.subplots(1, 3, figsize=(13, 3.4))
owner = {name: np.zeros(2 * n, int) for name in layouts}
for name, chunks in layouts.items():
    for d, ch in enumerate(chunks):
        owner[name][list(ch)] = d
for ax, name in zip(axes[:2], layouts):
    img = np.where(tiles[:, :] == masks.EMPTY, np.nan, owner[name][:, None] * np.ones(2 * n))
    ax.imshow(img, cmap="tab10", vmin=0, vmax=9, interpolation="nearest")
    ax.set(title=f"{name}: causal tiles coloured by the device\nholding their queries",
           xlabel="key chunk", ylabel="query chunk")
x = np.arange(n)
axes[2].bar(x - 0.2, work["natural"], 0.4, label="natural")
axes[2].bar(x + 0.2, work["zig-zag"], 0.4, label="zig-zag")
axes[2].set(xlabel="device", ylabel="work (chunk x chunk tiles)", title="causal work per device")
axes[2].legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# Natural layout: from 2 units (device 0) to 30 (device 7); the busiest device does 15x
# the work of the least busy one, and the ring waits for it. Zig-zag: 16 units each. `ring_attention(..., load_balance="zigzag")` takes natural
# order and re-lays out q/k/v on device (half-chunk `ppermute`s, no gather), or
# zig-zag order directly with `natural_order=False` when the data pipeline already
# produced it. `zigzag` / `unzigzag` (`tfjax/parallel/zigzag.py`) do that reordering on a
# global array:

# %%
pos = jnp.arange(T)[None]
zz = np.asarray(zigzag(pos, n))[0].reshape(n, 2, -1)  # [device, chunk, position]
for d in (0, 1, n - 1):
    print(f"device {d} holds positions", [f"{a[0]}..{a[-1]}" for a in zz[d]])
assert (unzigzag(zigzag(pos, n), n) == pos).all()
qz, kz, vz = (zigzag(x, n) for x in (q, k, v))
out_z = jax.jit(lambda q, k, v: ring_attention(q, k, v, masks.causal(), mesh=mesh,
                                               load_balance="zigzag", natural_order=False))(qz, kz, vz)
print("zig-zag order in and out, max error:",
      float(jnp.max(jnp.abs(unzigzag(out_z, n) - attention_reference(q, k, v, masks.causal())))))

# %% [markdown]
# ## Where the output lives
#
# The output is a global `[B, T, N, H]` array sharded over `sequence` on its length
# axis: each device holds its `T/n` positions, nothing was gathered.

# %%
out = outs["causal, zig-zag"]  # computed above: causal mask, load_balance="zigzag"
print("sharding:", out.sharding)
for shard in out.addressable_shards:
    print(f"  {shard.device}: rows {shard.index[1].start:>3}..{shard.index[1].stop - 1:>3}, "
          f"shape {shard.data.shape}")

# %% [markdown]
# Gradients flow through the ring too (`ppermute` transposes to the reverse
# permutation, so dK/dV travel back to their owners); `tests/parallel` checks them
# against the reference. In a model, ring attention is picked with
# `model.attention.context_parallel="ring"` and a mesh whose `sequence` axis is > 1.
