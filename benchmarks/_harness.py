"""Shared timing harness and benchmark models (not part of minigeo's API).

Ratios are measured within one process: every timed function is jitted,
warmed up, then timed ``repeats`` times; the median is reported.
"""

from __future__ import annotations

import json
import platform
import statistics
import subprocess
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp


def median_time(fn: Callable, *args, repeats: int = 20, warmup: int = 3) -> float:
    """Median wall time in seconds of ``fn(*args)`` (blocked until ready)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def per_iteration(run: Callable[[int], object], iters: int, repeats: int = 5) -> float:
    """Seconds per iteration of ``run(n_iter)``: the median times of ``run(iters)`` and ``run(2 * iters)``
    after compilation, differenced and divided by ``iters`` (set-up and final evaluation cancel)."""
    jax.block_until_ready(run(iters))
    jax.block_until_ready(run(2 * iters))
    times = {}
    for n in (iters, 2 * iters):
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(run(n))
            samples.append(time.perf_counter() - t0)
        times[n] = statistics.median(samples)
    return (times[2 * iters] - times[iters]) / iters


def interleaved_per_iteration(runs: dict[str, Callable[[int], object]], iters: int, repeats: int = 5) -> dict:
    """Seconds per iteration of several ``run(n_iter)`` functions, as :func:`per_iteration`, but
    timed in interleaved rounds (every run with ``iters`` and ``2 * iters`` once per round) so
    that slow drifts of a shared machine hit all of them alike.  Returns, per name, the median
    over rounds, and under ``"ratios"`` the median over rounds of each run's time divided by the
    first run's (the ratio is taken within a round)."""
    for run in runs.values():
        jax.block_until_ready(run(iters))
        jax.block_until_ready(run(2 * iters))
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            t = {}
            for n in (iters, 2 * iters):
                t0 = time.perf_counter()
                jax.block_until_ready(run(n))
                t[n] = time.perf_counter() - t0
            samples[name].append((t[2 * iters] - t[iters]) / iters)
    first = next(iter(runs))
    out: dict = {name: statistics.median(v) for name, v in samples.items()}
    out["ratios"] = {
        name: statistics.median(a / b for a, b in zip(v, samples[first])) for name, v in samples.items()
    }
    return out


def describe_machine() -> str:
    dev = jax.devices()[0]
    return f"jax {jax.__version__}, backend {jax.default_backend()} ({dev.device_kind}), python {platform.python_version()}"


# ---------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------
def mlp(key: jax.Array, sizes=(784, 256, 256, 10), batch: int = 256):
    """An MLP ``sizes`` with tanh activations, Gaussian inputs and random labels."""
    keys = jax.random.split(key, len(sizes) + 1)
    params = [
        {"W": jax.random.normal(k, (m, n)) / jnp.sqrt(m), "b": jnp.zeros(n)}
        for k, m, n in zip(keys[:-2], sizes[:-1], sizes[1:])
    ]
    X = jax.random.normal(keys[-2], (batch, sizes[0]))
    y = jax.random.randint(keys[-1], (batch,), 0, sizes[-1])

    def model(p):
        h = X
        for layer in p[:-1]:
            h = jnp.tanh(h @ layer["W"] + layer["b"])
        return h @ p[-1]["W"] + p[-1]["b"]

    return params, model, y


def transformer_block(
    key: jax.Array, batch: int = 128, tokens: int = 17, width: int = 64, heads: int = 4, classes: int = 10
):
    """One pre-LayerNorm transformer block (multi-head attention + MLP) with a linear head on mean-pooled tokens."""
    k = jax.random.split(key, 8)
    s = 1 / jnp.sqrt(width)
    params = {
        "ln1": {"g": jnp.ones(width), "b": jnp.zeros(width)},
        "qkv": {"W": s * jax.random.normal(k[0], (width, 3 * width)), "b": jnp.zeros(3 * width)},
        "proj": {"W": s * jax.random.normal(k[1], (width, width)), "b": jnp.zeros(width)},
        "ln2": {"g": jnp.ones(width), "b": jnp.zeros(width)},
        "fc1": {"W": s * jax.random.normal(k[2], (width, 4 * width)), "b": jnp.zeros(4 * width)},
        "fc2": {"W": 0.5 * s * jax.random.normal(k[3], (4 * width, width)), "b": jnp.zeros(width)},
        "head": {"W": s * jax.random.normal(k[4], (width, classes)), "b": jnp.zeros(classes)},
    }
    X = jax.random.normal(k[5], (batch, tokens, width))
    y = jax.random.randint(k[6], (batch,), 0, classes)

    def layer_norm(x, p):
        mu = jnp.mean(x, -1, keepdims=True)
        var = jnp.var(x, -1, keepdims=True)
        return (x - mu) / jnp.sqrt(var + 1e-6) * p["g"] + p["b"]

    def model(p):
        h = layer_norm(X, p["ln1"])
        qkv = h @ p["qkv"]["W"] + p["qkv"]["b"]
        q, kk, v = jnp.split(qkv, 3, axis=-1)
        split = lambda t: t.reshape(batch, tokens, heads, width // heads).transpose(0, 2, 1, 3)
        q, kk, v = split(q), split(kk), split(v)
        att = jax.nn.softmax(q @ kk.transpose(0, 1, 3, 2) / jnp.sqrt(width // heads), axis=-1)
        out = (att @ v).transpose(0, 2, 1, 3).reshape(batch, tokens, width)
        x = X + out @ p["proj"]["W"] + p["proj"]["b"]
        h = layer_norm(x, p["ln2"])
        x = x + jax.nn.gelu(h @ p["fc1"]["W"] + p["fc1"]["b"]) @ p["fc2"]["W"] + p["fc2"]["b"]
        return jnp.mean(x, axis=1) @ p["head"]["W"] + p["head"]["b"]

    return params, model, y


def cross_entropy(labels: jax.Array) -> Callable[[jax.Array], jax.Array]:
    def loss(z):
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(z), labels[:, None], axis=-1))

    return loss


def n_params(params) -> int:
    return sum(x.size for x in jax.tree_util.tree_leaves(params))


def tiny_vit_heads(
    key: jax.Array,
    batch: int = 128,
    image: int = 8,
    patch: int = 2,
    width: int = 64,
    heads: int = 4,
    depth: int = 2,
    classes: int = 10,
):
    """A tiny vision transformer (8x8 single-channel images, patch 2, class token, pre-LN blocks, exact-erf GELU)
    with per-head attention weights, so that (W_Q, W_K) and (W_V, W_O) of every head are GL(h) pairs of leaves
    of shape (heads, width, width // heads).

    Returns (params, logits_fn(params, patches), loss_fn(params, (patches, labels)), (patches, labels), gl_pairs).
    """
    dh = width // heads
    n_patches = (image // patch) ** 2
    keys = iter(jax.random.split(key, 8 + 8 * depth))
    s = 1 / jnp.sqrt(width)
    params = {
        "patch": {"W": jax.random.normal(next(keys), (patch * patch, width)) / patch, "b": jnp.zeros(width)},
        "cls": 0.02 * jax.random.normal(next(keys), (1, 1, width)),
        "pos": 0.02 * jax.random.normal(next(keys), (1, n_patches + 1, width)),
        "blocks": [
            {
                "ln1": {"g": jnp.ones(width), "b": jnp.zeros(width)},
                "q": s * jax.random.normal(next(keys), (heads, width, dh)),
                "k": s * jax.random.normal(next(keys), (heads, width, dh)),
                "v": s * jax.random.normal(next(keys), (heads, width, dh)),
                "o": s * jax.random.normal(next(keys), (heads, width, dh)),
                "ln2": {"g": jnp.ones(width), "b": jnp.zeros(width)},
                "fc1": {
                    "W": s * jax.random.normal(next(keys), (width, 2 * width)),
                    "b": jnp.zeros(2 * width),
                },
                "fc2": {
                    "W": s * jax.random.normal(next(keys), (2 * width, width)) / 2,
                    "b": jnp.zeros(width),
                },
            }
            for _ in range(depth)
        ],
        "ln": {"g": jnp.ones(width), "b": jnp.zeros(width)},
        "head": {"W": s * jax.random.normal(next(keys), (width, classes)), "b": jnp.zeros(classes)},
    }
    images = jax.random.normal(next(keys), (batch, image, image))
    labels = jax.random.randint(next(keys), (batch,), 0, classes)
    patches = images.reshape(batch, image // patch, patch, image // patch, patch).transpose(0, 1, 3, 2, 4)
    patches = patches.reshape(batch, n_patches, patch * patch)

    def layer_norm(x, p):
        mu = jnp.mean(x, -1, keepdims=True)
        return (x - mu) / jnp.sqrt(jnp.var(x, -1, keepdims=True) + 1e-6) * p["g"] + p["b"]

    def logits_fn(p, patches):
        x = patches @ p["patch"]["W"] + p["patch"]["b"]
        x = jnp.concatenate([jnp.broadcast_to(p["cls"], (x.shape[0], 1, width)), x], axis=1) + p["pos"]
        for blk in p["blocks"]:
            h = layer_norm(x, blk["ln1"])
            q = jnp.einsum("btd,hde->bhte", h, blk["q"])
            k = jnp.einsum("btd,hde->bhte", h, blk["k"])
            v = jnp.einsum("btd,hde->bhte", h, blk["v"])
            att = jax.nn.softmax(q @ jnp.swapaxes(k, -1, -2) / jnp.sqrt(dh), axis=-1)
            x = x + jnp.einsum("bhte,hde->btd", att @ v, blk["o"])
            h = layer_norm(x, blk["ln2"])
            x = (
                x
                + jax.nn.gelu(h @ blk["fc1"]["W"] + blk["fc1"]["b"], approximate=False) @ blk["fc2"]["W"]
                + blk["fc2"]["b"]
            )
        return layer_norm(x[:, 0], p["ln"]) @ p["head"]["W"] + p["head"]["b"]

    def loss(p, data):
        patches, labels = data
        return cross_entropy(labels)(logits_fn(p, patches))

    pairs = []
    for i in range(depth):
        pairs += [(("blocks", i, "q"), ("blocks", i, "k")), (("blocks", i, "v"), ("blocks", i, "o"))]
    return params, logits_fn, loss, (patches, labels), pairs


def run_in_processes(script: str, args: list[str], processes: int) -> list[dict]:
    """Run ``script --child ARGS`` in fresh processes; each prints its report and a line ``RESULT <json>``.

    XLA's CPU timings vary from process to process, so ratios are measured within each process
    and summarized over processes by the caller.
    """
    results = []
    for i in range(processes):
        out = subprocess.run(
            [sys.executable, script, "--child", *args], capture_output=True, text=True, check=True
        ).stdout
        print(f"--- process {i + 1}/{processes}")
        print("\n".join(line for line in out.splitlines() if not line.startswith("RESULT ")))
        results.append(
            json.loads(
                next(line for line in out.splitlines() if line.startswith("RESULT "))[len("RESULT ") :]
            )
        )
    return results
