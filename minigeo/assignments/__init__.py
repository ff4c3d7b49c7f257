r"""Automatic checks for the course's assignments (floor 4; imported as ``minigeo.assignments``).

A student fills in a function in an assignment notebook and passes it to a ``check_*`` function
here.  The check calls it on random points, random reparametrizations and random group elements,
compares it with minigeo's reference implementation and with the invariances the chapter proves,
prints one line per check (``PASS`` or ``FAIL`` with a hint), and returns a :class:`CheckReport`.
A student's function that still raises ``NotImplementedError`` fails with the message
"not implemented yet", and any other exception is reported in one line instead of a traceback, so a
check cell never stops the notebook.

Checks run in float64 (inside ``jax.enable_x64``) so that a correct answer passes with tolerance
``1e-8`` whatever the notebook's default precision.  A complex answer is compared with its imaginary
part (a right real part plus ``5j`` fails).  Every check has a time limit (its ``time_limit``
argument in seconds, by default ``minigeo.assignments.TIME_LIMIT`` = 120): a student's function
that loops forever fails with "timed out after N s" instead of hanging the notebook.  The limit
interrupts Python code (a ``SIGALRM`` timer on the main thread on POSIX; elsewhere a watchdog
thread, which leaves the runaway function running in the background).

The assignments live in the repository's ``assignments/`` folder; the lecturers' guide in the book
explains how to adapt them.
"""

from __future__ import annotations

from ._kit import CheckReport
from .capstone import (
    check_bootstrap_distinct,
    check_kendall_tau,
    check_kendall_tau_bootstrap,
    check_move_heads,
    check_sharpness_pair,
)
from .hessian_endomorphism import (
    check_christoffel_derivation,
    check_hessian_endomorphism,
    check_invariant_trace,
    check_riemannian_hessian,
)
from .horizontal_projection import (
    check_horizontal_projection,
    check_quotient_metric,
    check_vertical_dimension,
    check_vertical_vector,
)
from .laplace_evidence import (
    check_change_of_variables,
    check_chart_map,
    check_invariant_laplace_evidence,
    check_invariant_map,
    check_laplace_log_evidence,
)
from .natural_gradient import (
    check_function_space_natural_gradient,
    check_generalized_inverse,
    check_gram_rank,
    check_reparametrized_mp_step,
    check_span_projection,
)
from .pullback_metrics import (
    check_categorical_fisher,
    check_empirical_fisher,
    check_fisher_rank,
    check_ggn_vector_product,
    check_natural_gradient_regression,
)
from .transformation_rules import (
    check_chart_gradient_step,
    check_natural_gradient_step,
    check_transform_covector,
    check_transform_vector,
)

__all__ = [
    "CheckReport",
    "check_transform_vector",
    "check_transform_covector",
    "check_natural_gradient_step",
    "check_chart_gradient_step",
    "check_ggn_vector_product",
    "check_categorical_fisher",
    "check_empirical_fisher",
    "check_natural_gradient_regression",
    "check_fisher_rank",
    "check_function_space_natural_gradient",
    "check_span_projection",
    "check_generalized_inverse",
    "check_reparametrized_mp_step",
    "check_gram_rank",
    "check_hessian_endomorphism",
    "check_invariant_trace",
    "check_riemannian_hessian",
    "check_christoffel_derivation",
    "check_change_of_variables",
    "check_invariant_map",
    "check_laplace_log_evidence",
    "check_invariant_laplace_evidence",
    "check_chart_map",
    "check_vertical_vector",
    "check_quotient_metric",
    "check_horizontal_projection",
    "check_vertical_dimension",
    "check_move_heads",
    "check_sharpness_pair",
    "check_kendall_tau",
    "check_kendall_tau_bootstrap",
    "check_bootstrap_distinct",
]

#: Default time limit of one ``check_*`` call, in seconds (the correct answers take a few seconds,
#: mostly compilation).  Pass ``time_limit=`` to a check, or set this, to change it.
TIME_LIMIT: float = 120.0
