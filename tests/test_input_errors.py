"""No silent wrong answers from the training helpers: label shapes, dtypes and ranges.

``cross_entropy`` and ``error_rate`` take integer class labels of the logits' batch shape.  A column
of labels ``(n, 1)`` is squeezed (and gives exactly the ``(n,)`` value, where ``error_rate`` used to
broadcast it to an ``(n, n)`` comparison); float labels and labels outside ``0 … C - 1`` are a
:class:`minigeo.GeometryError` when their values are concrete.  Values are compared with an
independent numpy computation, in float64 and float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import minigeo as mg
import minigeo.models as mm

DTYPES = [jnp.float64, jnp.float32]


def _data(dtype, n=7, classes=4, seed=0):
    r = np.random.default_rng(seed)
    logits = r.normal(size=(n, classes)) * 3.0
    labels = r.integers(0, classes, size=n)
    labels[0] = int(np.argmax(logits[0]))  # at least one right and (almost surely) some wrong
    return jnp.asarray(logits, dtype), jnp.asarray(labels)


def _np_cross_entropy(logits, labels):
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    return -np.mean(logp[np.arange(len(labels)), np.asarray(labels)])


def _np_error_rate(logits, labels):
    return np.mean(np.argmax(np.asarray(logits), axis=-1) != np.asarray(labels))


def _identity(params, x):
    return x


@pytest.mark.parametrize("dtype", DTYPES, ids=["float64", "float32"])
def test_cross_entropy_matches_numpy_for_flat_and_column_labels(dtype):
    logits, labels = _data(dtype)
    rtol = 1e-12 if dtype == jnp.float64 else 1e-5
    want = _np_cross_entropy(logits, labels)
    flat = mm.cross_entropy(logits, labels)
    column = mm.cross_entropy(logits, labels[:, None])
    assert flat.dtype == dtype and column.dtype == dtype
    np.testing.assert_allclose(flat, want, rtol=rtol)
    np.testing.assert_array_equal(column, flat)
    # and under jit (shapes are static, so the squeeze happens at trace time)
    np.testing.assert_array_equal(jax.jit(mm.cross_entropy)(logits, labels[:, None]), flat)


@pytest.mark.parametrize("dtype", DTYPES, ids=["float64", "float32"])
@pytest.mark.parametrize("batch_size", [1, 3, 512])
def test_error_rate_matches_numpy_for_flat_and_column_labels(dtype, batch_size):
    logits, labels = _data(dtype)
    want = _np_error_rate(logits, labels)
    assert 0 < want < 1
    flat = mm.error_rate(_identity, None, logits, labels, batch_size=batch_size)
    # (n, 1) labels used to broadcast against the (n,) predictions: an (n, n) comparison
    column = mm.error_rate(_identity, None, logits, labels[:, None], batch_size=batch_size)
    np.testing.assert_allclose(flat, want, rtol=1e-6)
    np.testing.assert_array_equal(column, flat)
    jitted = jax.jit(lambda x, y: mm.error_rate(_identity, None, x, y, batch_size=batch_size))
    np.testing.assert_array_equal(jitted(logits, labels[:, None]), flat)


def test_error_rate_on_a_linear_model_against_numpy():
    r = np.random.default_rng(3)
    X = jnp.asarray(r.normal(size=(50, 6)), jnp.float32)
    W = jnp.asarray(r.normal(size=(6, 5)), jnp.float32)
    y = jnp.asarray(r.integers(0, 5, size=50))
    want = np.mean(np.argmax(np.asarray(X) @ np.asarray(W), axis=-1) != np.asarray(y))
    got = mm.error_rate(lambda w, x: x @ w, W, X, y, batch_size=16)
    np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("bad", [4, 10, -1])
def test_out_of_range_labels_are_an_error(bad):
    logits, labels = _data(jnp.float32)
    labels = labels.at[2].set(bad)
    with pytest.raises(mg.GeometryError, match=r"label\(s\) lie outside 0 … 3.*4 classes"):
        mm.cross_entropy(logits, labels)
    with pytest.raises(mg.GeometryError, match=r"label\(s\) lie outside 0 … 3.*4 classes"):
        mm.error_rate(_identity, None, logits, labels)
    with pytest.raises(mg.GeometryError, match=r"outside 0 … 3"):
        mm.error_rate(_identity, None, logits, labels[:, None], batch_size=2)


def test_out_of_range_labels_are_not_checked_under_jit():
    # documented: values are tracers under jit, so only shapes and dtypes are checked there
    logits, labels = _data(jnp.float64)
    labels = labels.at[2].set(7)
    out = jax.jit(mm.cross_entropy)(logits, labels)
    assert out.shape == ()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64, jnp.bool_])
def test_non_integer_labels_are_an_error(dtype):
    logits, labels = _data(jnp.float32)
    labels = labels.astype(dtype)
    with pytest.raises(mg.GeometryError, match=r"labels must be integer class indices.*astype"):
        mm.cross_entropy(logits, labels)
    with pytest.raises(mg.GeometryError, match=r"labels must be integer class indices"):
        mm.error_rate(_identity, None, logits, labels)
    with pytest.raises(mg.GeometryError, match=r"labels must be integer class indices"):
        jax.jit(mm.cross_entropy)(logits, labels)  # a dtype is static: checked under jit too


def test_one_hot_and_mismatched_labels_are_an_error():
    logits, labels = _data(jnp.float32)
    one_hot = jax.nn.one_hot(labels, 4, dtype=jnp.int32)
    with pytest.raises(mg.GeometryError, match=r"disagree on the batch shape"):
        mm.cross_entropy(logits, one_hot)
    with pytest.raises(mg.GeometryError, match=r"images \(7, 4\) and labels \(7, 4\) disagree"):
        mm.error_rate(_identity, None, logits, one_hot)
    with pytest.raises(mg.GeometryError, match=r"disagree on the batch shape"):
        mm.error_rate(_identity, None, logits, labels[:5])
    with pytest.raises(mg.GeometryError, match=r"batch_size must be a positive integer"):
        mm.error_rate(_identity, None, logits, labels, batch_size=0)


def test_sequence_labels_and_numpy_integer_arguments():
    # logits (B, T, C) with labels (B, T) or (B, T, 1); numpy integer batch sizes
    r = np.random.default_rng(5)
    logits = jnp.asarray(r.normal(size=(3, 4, 6)), jnp.float32)
    labels = jnp.asarray(r.integers(0, 6, size=(3, 4)), jnp.int32)
    want = _np_cross_entropy(np.asarray(logits).reshape(12, 6), np.asarray(labels).reshape(12))
    np.testing.assert_allclose(mm.cross_entropy(logits, labels), want, rtol=1e-5)
    np.testing.assert_allclose(mm.cross_entropy(logits, labels[..., None]), want, rtol=1e-5)
    flat_logits, flat_labels = _data(jnp.float32)
    np.testing.assert_allclose(
        mm.error_rate(_identity, None, flat_logits, np.asarray(flat_labels), batch_size=np.int64(3)),
        _np_error_rate(flat_logits, flat_labels),
        rtol=1e-6,
    )
