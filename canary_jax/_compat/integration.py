"""One-call integration: guard a JAX serving stack's step function with the KV canary.

:class:`~canary_jax.runtime.guard.CanaryGuard` does for a JAX stack what SGLang's ``install_canary`` does for
SGLang (``python/sglang/srt/kv_canary/api.py``): capacities from the server's pool and batch sizes, the model's
``forward`` bracketed by HEAD and TAIL launches in one jitted program, then the host-side pump::

    guard = CanaryGuard(step_fn, num_slots=NUM_SLOTS, max_batch_size=MAX_BS, max_seq_len=MAX_LEN)
    for batch in batches:
        kv = guard.step(kv, req_pool_indices=..., prefix_lens=..., extend_seq_lens=..., input_ids=...,
                        positions=..., out_cache_loc=..., req_to_token=...)

The guard is part of the step API and lives with it: :mod:`canary_jax.runtime.guard` (the guard),
:mod:`canary_jax.runtime.guarded` (its jitted program), :mod:`canary_jax.runtime.guard_reports` (its host pump
and reads back), :mod:`canary_jax.runtime.step_inputs` (what it is sized by and what ``step_fn`` exchanges), all
re-exported by :mod:`canary_jax.runtime`. This module, the guard's first home, re-exports the same names, so
``canary_jax.integration.CanaryGuard``, ``canary_jax.integration.CanaryCapacities`` and the rest keep working.
"""

from __future__ import annotations

from canary_jax.runtime.guard import CanaryGuard
from canary_jax.runtime.step_inputs import (
    VERIFY_CAPACITY_POOL_FACTOR,  # noqa: F401  (re-exported: its first home)
    CanaryCapacities,
    StepInputs,
    normalize_sources,
    parse_real_kv_hash_mode,
)

__all__ = [
    "CanaryCapacities",
    "CanaryGuard",
    "StepInputs",
    "normalize_sources",
    "parse_real_kv_hash_mode",
]
