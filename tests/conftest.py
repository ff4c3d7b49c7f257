"""Test configuration: float64 everywhere for exactness checks.

``jax_enable_x64`` must be set before any array is created, hence at import
time of the conftest (pytest imports it before the test modules).
"""

import jax

jax.config.update("jax_enable_x64", True)
