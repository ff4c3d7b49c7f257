"""Deliberately wrong submissions of the assignments, shared by tests/test_assignments.py and
benchmarks/bench_grading.py."""

# Deliberately wrong submissions: each solution with a typical mistake in one task, made here from
# the solution notebook (so they never go stale). {assignment: (function, its solution line, the
# mistake, the task that must fail, words its hint must contain)}.  The mistaken line must be in
# the function's cell exactly once.
WRONG_SUBMISSIONS = {
    "assignment_01_transformation_rules": (
        "transform_covector",
        "return jnp.linalg.solve(J.T, omega)",
        "return J @ omega",  # transforms the covector like a vector
        "transform_covector",
        "pairing omega(v)",
    ),
    "assignment_02_pullback_metrics": (
        "empirical_fisher",
        "return U.T @ U / U.shape[0]",
        "return U.T @ U",  # the sum over examples instead of the mean
        "empirical_fisher",
        "N times too large",
    ),
    "assignment_03_natural_gradient": (
        "function_space_natural_gradient",
        "v = jnp.linalg.solve(g, dL)",
        "v = dL",  # the covector dL used as the ambient gradient: the metric left out
        "function_space_natural_gradient",
        "left out the metric",
    ),
    "assignment_04_hessian_endomorphism": (
        "hessian_endomorphism",
        "return jnp.linalg.solve(G, H)",
        "return H @ jnp.linalg.inv(G)",  # the wrong order
        "hessian_endomorphism",
        "the order matters",
    ),
    "assignment_05_laplace_evidence": (
        "log_density_in_chart",
        "return log_q(theta) + jnp.linalg.slogdet(phi.inverse_jacobian(psi))[1]",
        "return log_q(theta) - jnp.linalg.slogdet(phi.inverse_jacobian(psi))[1]",  # the sign
        "change_of_variables",
        "wrong sign",
    ),
    "assignment_06_horizontal_projection": (
        "quotient_metric",
        "P, Q = G.T @ G, H.T @ H",
        "P, Q = jnp.eye(G.shape[1]), jnp.eye(H.shape[1])",  # the Euclidean metric instead of (15)
        "quotient metric (15)",
        "metric (15)",
    ),
    "assignment_07_capstone": (
        "move_heads",
        'a["b_q"] = jnp.einsum("lhe,lhef->lhf", a["b_q"], inv(A_qk))  # the row b_q^T A^-1',
        'a["b_q"] = a["b_q"]',  # the query bias left out of the move
        "move_heads",
        "forgot the query bias",
    ),
}
