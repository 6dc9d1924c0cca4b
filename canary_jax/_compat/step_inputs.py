"""Old home of the guard's inputs: :mod:`canary_jax.runtime.step_inputs` holds them now.

Kept so ``canary_jax.step_inputs.CanaryCapacities`` and the rest keep importing; the guard's host int32 check
(``_check_host_int32``) is :func:`canary_jax.runtime.prepare.check_host_int32`.
"""

from __future__ import annotations

from canary_jax.contract.ints import INT32_MAX as _INT32_MAX  # noqa: F401  (old name)
from canary_jax.contract.ints import INT32_MIN as _INT32_MIN  # noqa: F401  (old name)
from canary_jax.runtime import step_inputs as _moved
from canary_jax.runtime.prepare import check_host_int32 as _check_host_int32  # noqa: F401  (old name)
from canary_jax.runtime.step_inputs import (  # noqa: F401  (re-exported)
    _STEP_INPUT_INT32_FIELDS,
    VERIFY_CAPACITY_POOL_FACTOR,
    CanaryCapacities,
    StepInputs,
    _dense_req_to_token,
    _describe_signature,
    _table_signature,
    normalize_sources,
    parse_real_kv_hash_mode,
)

__all__ = list(_moved.__all__)
