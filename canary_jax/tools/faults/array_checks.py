"""Array checks and the copy-on-write setter shared by the fault functions (:mod:`canary_jax.tools.faults`).

The one job here: refuse a non-array, a wrong rank, non-integer data or a concrete index out of range with a
``kv-canary:`` ``TypeError`` / ``ValueError`` naming the argument, and write one element into a copy (numpy) or
with ``.at[].set(mode="drop")`` (JAX: a traced index out of range changes nothing).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from canary_jax.runtime import shapes


def _is_jax(x: Any) -> bool:
    return isinstance(x, jax.Array)


def _check_index(v: Any, name: str, size: int) -> None:
    """Refuses a concrete index that is not one int in ``[0, size)``, naming it (a traced index is left to
    ``mode="drop"``: out of range, it changes nothing)."""
    if shapes.is_traced(v):
        return
    if isinstance(v, bool) or not isinstance(v, (int, np.integer, np.ndarray, jax.Array)):
        raise TypeError(f"kv-canary: {name} must be an int, got {type(v).__name__}")
    a = np.asarray(v)
    if a.size != 1 or not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"kv-canary: {name} must be one integer, got {a.dtype} of shape {a.shape}")
    i = int(a.reshape(-1)[0])
    if not 0 <= i < size:
        raise ValueError(f"kv-canary: {name} must be in [0, {size}), got {i}")


def _set(x: Any, index: tuple, value: Any) -> Any:
    """A copy of ``x`` with ``x[index] = value`` (numpy) or ``x.at[index].set(value, mode="drop")`` (JAX)."""
    if _is_jax(x):
        return x.at[index].set(jnp.asarray(value).astype(x.dtype), mode="drop")
    out = np.array(x, copy=True)
    out[index] = value
    return out


def _check_array(x: Any, name: str, ndim: int) -> None:
    if not (_is_jax(x) or isinstance(x, np.ndarray)):
        raise TypeError(f"kv-canary: {name} must be a numpy or JAX array, got {type(x).__name__}")
    if x.ndim != ndim:
        raise ValueError(f"kv-canary: {name} must be {ndim}-D, got shape {tuple(x.shape)}")
    if not np.issubdtype(np.dtype(x.dtype), np.integer):
        raise TypeError(f"kv-canary: {name} must be an integer array, got dtype {x.dtype}")
