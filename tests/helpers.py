"""Shared test helpers: random points, random reparametrizations, dense references."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

import minigeo as mg
from minigeo import reparam


def rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def random_spd(r: np.random.Generator, n: int, cond: float = 10.0) -> jnp.ndarray:
    """A random symmetric positive-definite matrix with condition number ``cond``."""
    q, _ = np.linalg.qr(r.normal(size=(n, n)))
    eig = np.geomspace(1.0, cond, n)
    return jnp.asarray(q @ np.diag(eig) @ q.T)


def decaying_quadratic(d: int, dtype, seed: int = 0, power: float = 2.0):
    """``(f, x0, A)``: ``f(x) = x^T A x / 2`` with ``A = Q diag(k^-power) Q^T`` (random orthogonal ``Q``)."""
    r = rng(seed)
    Q, _ = np.linalg.qr(r.normal(size=(d, d)))
    lam = 1.0 / np.arange(1, d + 1) ** power
    A = jnp.asarray(Q @ np.diag(lam) @ Q.T, dtype)
    return (lambda x: 0.5 * x @ A @ x), jnp.zeros(d, dtype), A


def random_invertible(r: np.random.Generator, n: int) -> jnp.ndarray:
    """A random well-conditioned invertible matrix (singular values in [0.5, 2])."""
    u, _ = np.linalg.qr(r.normal(size=(n, n)))
    v, _ = np.linalg.qr(r.normal(size=(n, n)))
    return jnp.asarray(u @ np.diag(r.uniform(0.5, 2.0, size=n)) @ v.T)


def random_positive_reparam(r: np.random.Generator, n: int) -> mg.Reparametrization:
    """A random reparametrization of the positive orthant: log or softplus, then an affine map."""
    first = reparam.log() if r.uniform() < 0.5 else reparam.softplus()
    return reparam.compose(first, reparam.affine(random_invertible(r, n), jnp.asarray(r.normal(size=n))))


def dense_jacobian(fn, x) -> jnp.ndarray:
    """Independent dense Jacobian of ``fn`` over flattened coordinates, by jax.jacrev."""
    flat, unravel = ravel_pytree(x)
    return jax.jacrev(lambda f: ravel_pytree(fn(unravel(f)))[0])(flat)


def flatten(tree) -> jnp.ndarray:
    return ravel_pytree(tree)[0]


# ---------------------------------------------------------------------------
# counting XLA compilations (jax.monitoring's backend-compile event)
# ---------------------------------------------------------------------------
_COMPILES = [0]


def _compile_listener(event: str, duration: float, **kwargs) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILES[0] += 1


jax.monitoring.register_event_duration_secs_listener(_compile_listener)


def compiles_during(fn, *args, **kwargs):
    """(result, number of XLA compilations while running ``fn(*args, **kwargs)``)."""
    before = _COMPILES[0]
    out = jax.block_until_ready(fn(*args, **kwargs))
    return out, _COMPILES[0] - before


def alive_processes(token: str) -> list[int]:
    """The live (not zombie) processes whose command line holds ``token`` (the grader's sandbox marker)."""
    from pathlib import Path

    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if token.encode() in cmd and state != "Z":
            pids.append(int(entry.name))
    return pids
