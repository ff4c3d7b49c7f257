"""Every bad input to the coordinate layer raises a GeometryError that says what is wrong."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import random_spd, rng

import minigeo as mg
from minigeo import reparam


def test_geometry_error_is_value_error():
    assert issubclass(mg.GeometryError, ValueError)


# -- domains and invertibility ----------------------------------------------


def test_log_outside_domain():
    with pytest.raises(mg.GeometryError, match=r"theta > 0"):
        reparam.log().forward(jnp.array([1.0, -0.5]))
    with pytest.raises(mg.GeometryError, match=r"outside"):
        mg.transform_vector(reparam.log(), jnp.array([0.0]), jnp.array([1.0]))


def test_softplus_outside_domain():
    with pytest.raises(mg.GeometryError, match=r"theta > 0"):
        mg.transform_covector(reparam.softplus(), jnp.array([-1.0]), jnp.array([1.0]))


def test_polar_at_origin_and_wrong_shape():
    with pytest.raises(mg.GeometryError, match=r"origin"):
        reparam.polar().jacobian(jnp.zeros(2))
    with pytest.raises(mg.GeometryError, match=r"r > 0"):
        reparam.polar().inverse(jnp.array([-1.0, 0.0]))
    with pytest.raises(mg.GeometryError, match=r"shape \(2,\)"):
        reparam.polar().forward(jnp.ones(3))


def test_affine_singular_and_bad_shapes():
    with pytest.raises(mg.GeometryError, match=r"singular"):
        reparam.affine(jnp.array([[1.0, 2.0], [2.0, 4.0]]))
    with pytest.raises(mg.GeometryError, match=r"square"):
        reparam.affine(jnp.ones((2, 3)))
    with pytest.raises(mg.GeometryError, match=r"b must have shape \(2,\)"):
        reparam.affine(jnp.eye(2), jnp.ones(3))
    with pytest.raises(mg.GeometryError, match=r"non-finite"):
        reparam.affine(jnp.array([[1.0, jnp.nan], [0.0, 1.0]]))
    with pytest.raises(mg.GeometryError, match=r"acts on points with 2 coordinates; this point has 3"):
        reparam.affine(jnp.eye(2)).forward(jnp.ones(3))


def test_scale_by_zero():
    with pytest.raises(mg.GeometryError, match=r"zero"):
        reparam.scale(0.0)
    with pytest.raises(mg.GeometryError, match=r"zero"):
        reparam.scale({"a": jnp.array([1.0, 0.0])})


def test_user_map_with_singular_jacobian():
    cube = mg.Reparametrization(lambda t: t**3, jnp.cbrt, name="cube")
    with pytest.raises(mg.GeometryError, match=r"singular"):
        cube.jacobian(jnp.array([0.0, 1.0]))
    with pytest.raises(mg.GeometryError, match=r"not invertible"):
        mg.transform_vector(cube, jnp.array([0.0]), jnp.array([1.0]))
    with pytest.raises(mg.GeometryError, match=r"not invertible"):
        mg.transform_covector(cube, jnp.array([0.0]), jnp.array([1.0]))
    # away from 0 it works
    np.testing.assert_allclose(mg.transform_vector(cube, jnp.array([2.0]), jnp.array([1.0])), [12.0])


def test_non_square_jacobian():
    lift = mg.Reparametrization(lambda t: jnp.concatenate([t, t]), lambda p: p[:2], name="lift")
    with pytest.raises(mg.GeometryError, match=r"maps 2 coordinates to 4"):
        lift.jacobian(jnp.ones(2))


def test_wrong_inverse_detected():
    bad = mg.Reparametrization(lambda t: 2 * t, lambda p: p / 3, name="bad")
    with pytest.raises(mg.GeometryError, match=r"not the inverse of forward"):
        bad.check_inverse(jnp.array([1.0]))


def test_constructor_and_compose_errors():
    with pytest.raises(mg.GeometryError, match=r"two callables"):
        mg.Reparametrization(jnp.log, None)
    with pytest.raises(mg.GeometryError, match=r"at least one"):
        reparam.compose()
    with pytest.raises(mg.GeometryError, match=r"Reparametrization objects"):
        reparam.compose(reparam.log(), jnp.log)


# -- shapes and structures ---------------------------------------------------


def test_mismatched_shapes():
    phi = reparam.log()
    with pytest.raises(mg.GeometryError, match=r"shape \(3,\).*theta has shape \(2,\)"):
        mg.transform_vector(phi, jnp.ones(2), jnp.ones(3))
    with pytest.raises(mg.GeometryError, match=r"covector omega has shape"):
        mg.transform_covector(phi, jnp.ones(2), jnp.ones(3))
    with pytest.raises(mg.GeometryError, match=r"2x2 matrix is needed"):
        mg.transform_metric(phi, jnp.ones(2), jnp.eye(3))
    with pytest.raises(mg.GeometryError, match=r"square 2-D matrix"):
        mg.transform_bilinear(phi, jnp.ones(2), jnp.ones((2, 3)))
    with pytest.raises(mg.GeometryError, match=r"2x2 matrix is needed"):
        mg.sharp(jnp.eye(3), jnp.ones(2))
    with pytest.raises(mg.GeometryError, match=r"has shape"):
        mg.pair(jnp.ones(2), jnp.ones(3))


def test_mismatched_pytree_structure():
    theta = {"w": jnp.ones((2, 2)), "b": jnp.ones(2)}
    with pytest.raises(mg.GeometryError, match=r"pytree structure"):
        mg.transform_vector(reparam.log(), theta, {"w": jnp.ones((2, 2))})
    with pytest.raises(mg.GeometryError, match=r"\['b'\]"):
        mg.transform_covector(reparam.log(), theta, {"w": jnp.ones((2, 2)), "b": jnp.ones(3)})
    with pytest.raises(mg.GeometryError, match=r"f\(x\)"):
        mg.pullback_covector(lambda w: w["w"] @ w["b"], theta, jnp.ones(3))
    with pytest.raises(mg.GeometryError, match=r"pytree structure"):
        mg.pushforward(lambda w: w["b"], theta, jnp.ones(2))


# -- non-finite values --------------------------------------------------------


def test_non_finite_inputs():
    phi = reparam.log()
    with pytest.raises(mg.GeometryError, match=r"non-finite.*NaN"):
        phi.forward(jnp.array([1.0, jnp.nan]))
    with pytest.raises(mg.GeometryError, match=r"vector v.*non-finite.*infinite"):
        mg.transform_vector(phi, jnp.ones(2), jnp.array([1.0, jnp.inf]))
    with pytest.raises(mg.GeometryError, match=r"covector omega.*non-finite"):
        mg.transform_covector(phi, jnp.ones(2), jnp.array([jnp.nan, 1.0]))
    with pytest.raises(mg.GeometryError, match=r"metric G.*non-finite"):
        mg.transform_metric(phi, jnp.ones(2), jnp.array([[1.0, 0.0], [0.0, jnp.inf]]))
    with pytest.raises(mg.GeometryError, match=r"non-finite"):
        mg.sharp(jnp.eye(2), jnp.array([jnp.nan, 0.0]))
    with pytest.raises(mg.GeometryError, match=r"non-finite"):
        mg.transform_endomorphism(phi, jnp.ones(2), jnp.array([[jnp.nan, 0.0], [0.0, 1.0]]))


# -- metrics that are not symmetric positive definite --------------------------


def test_metric_not_spd():
    phi = reparam.log()
    theta = jnp.ones(2)
    with pytest.raises(mg.GeometryError, match=r"indefinite.*damping"):
        mg.transform_metric(phi, theta, jnp.diag(jnp.array([1.0, -1.0])))
    with pytest.raises(mg.GeometryError, match=r"not symmetric"):
        mg.transform_metric(phi, theta, jnp.array([[1.0, 0.5], [0.0, 1.0]]))
    with pytest.raises(mg.GeometryError, match=r"singular.*damping"):
        mg.sharp(jnp.diag(jnp.array([1.0, 0.0])), jnp.ones(2))
    # bilinear forms need not be definite
    mg.transform_bilinear(phi, theta, jnp.diag(jnp.array([1.0, -1.0])))


def test_sharp_matrix_free_reports_non_convergence():
    G = jnp.diag(jnp.array([1.0, 0.0, 2.0]))
    with pytest.raises(mg.GeometryError, match=r"did not converge.*damping"):
        mg.sharp(lambda u: G @ u, jnp.ones(3))
    indefinite = jnp.array([[0.0, 1.0], [1.0, 0.0]])  # zero curvature along the first CG direction
    with pytest.raises(mg.GeometryError, match=r"singular or indefinite"):
        mg.sharp(lambda u: indefinite @ u, jnp.array([1.0, 0.0]))
    with pytest.raises(mg.GeometryError, match=r"damping must be >= 0"):
        mg.sharp(jnp.eye(2), jnp.ones(2), damping=-1.0)
    with pytest.raises(mg.GeometryError, match=r"dense square matrix or a callable"):
        mg.flat("not a metric", jnp.ones(2))


def test_dense_size_limit():
    theta = jnp.ones(50)
    with pytest.raises(mg.GeometryError, match=r"max_size=10"):
        reparam.log().jacobian(theta, max_size=10)
    assert reparam.log().jacobian(theta, max_size=50).shape == (50, 50)


def test_random_spd_helper_is_spd():
    # guards the helper the other tests rely on
    G = np.asarray(random_spd(rng(0), 5, cond=50.0))
    np.testing.assert_allclose(G, G.T)
    eig = np.linalg.eigvalsh(G)
    np.testing.assert_allclose(eig.max() / eig.min(), 50.0, rtol=1e-8)


def test_sharp_and_flat_refuse_indefinite_and_asymmetric():
    indefinite = jnp.diag(jnp.array([3.0, -1.0]))
    b = jnp.array([1.0, 0.1])  # x^T A x > 0 at the solution: the old post-hoc check returned a number
    with pytest.raises(mg.GeometryError, match=r"not positive definite: add damping"):
        mg.sharp(lambda u: indefinite @ u, b)
    with pytest.raises(mg.GeometryError, match=r"indefinite.*damping"):
        mg.sharp(indefinite, b)
    asym = jnp.array([[1.0, 0.5], [0.0, 1.0]])
    for call in (lambda: mg.flat(asym, b), lambda: mg.inner(asym, b, b), lambda: mg.sharp(asym, b)):
        with pytest.raises(mg.GeometryError, match=r"not symmetric"):
            call()
    # a round-off asymmetry in float32 is accepted (tolerance relative to eps of the dtype)
    r = rng(0).normal(size=(40, 40))
    G32 = jnp.asarray(r @ r.T / 40 + np.eye(40), dtype=jnp.float32)
    G32 = G32 + jnp.asarray(np.triu(np.full((40, 40), 2e-7)), dtype=jnp.float32) * G32.max()
    assert mg.sharp(G32, jnp.ones(40, dtype=jnp.float32)).dtype == jnp.float32
    # nested lists are matrices and vectors
    np.testing.assert_allclose(mg.sharp([[2.0, 0.0], [0.0, 4.0]], [2.0, 4.0]), [1.0, 1.0])
