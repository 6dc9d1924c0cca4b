"""Lossless int64 handling with ``jax_enable_x64`` off and on.

SGLang keeps every plan, token and ring field as int64. With x64 off (JAX's default) no JAX array can be
64-bit and ``jnp.asarray(np.int64_array)`` silently truncates (PITFALLS). canary-jax therefore holds each
int64 array as ``uint32[..., 2]``: little-endian (lo, hi) words, the same bytes as the int64 array. This
module converts to and from that form at the API boundary and refuses anything that would lose bits.

Accepted for an int64 argument of logical shape ``S`` (see :func:`as_int64_pairs`):

* ``uint32`` or ``int32`` array of shape ``S + (2,)``: already pairs (bit-reinterpreted, no copy of values);
* ``int64`` / ``uint64`` array of shape ``S`` (numpy, or JAX with x64 on): split exactly into pairs;
* ``int32`` / ``int16`` / ``int8`` / ``uint8`` / ``uint16`` / ``bool`` array of shape ``S``: widened exactly
  (sign-extended for signed types), since every such value is an int64;
* Python ints / nested lists: taken as int64 (values outside int64 raise).

Anything else raises ``TypeError`` naming the argument.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from canary_jax import validation

_NARROW_INTS = (np.int8, np.int16, np.int32, np.uint8, np.uint16, np.bool_)


def x64_enabled() -> bool:
    """Whether ``jax_enable_x64`` is on right now."""
    return bool(jax.config.read("jax_enable_x64"))


def int64_to_pairs_np(values: Any) -> np.ndarray:
    """Host int64 data (ints, lists, any integer numpy array) to ``uint32[..., 2]`` pairs, exactly.

    Raises:
      TypeError: for non-integer data.
      ValueError: for Python ints outside the int64 range.
    """
    if not hasattr(values, "dtype"):
        # Python ints / (nested) lists: exact int64 or refuse. (np.asarray alone would turn [2**63] into
        # uint64 and wrap it to -2**63, and [-1, 2**63] into float64.)
        obj = np.asarray(values, dtype=object)
        flat = obj.reshape(-1).tolist()
        if any(isinstance(v, (float, complex)) or not isinstance(v, (int, np.integer)) for v in flat):
            raise TypeError("kv-canary: expected integer data, got non-integer Python values")
        try:
            values = np.array([int(v) for v in flat], dtype=np.int64).reshape(obj.shape)
        except OverflowError as e:
            raise ValueError(f"kv-canary: value does not fit int64: {e}") from None
    arr = np.asarray(values)
    if arr.dtype == object or arr.dtype.kind not in "iub":
        if arr.dtype == object:
            try:
                arr = np.asarray(values, dtype=np.int64)
            except OverflowError as e:
                raise ValueError(f"kv-canary: value does not fit int64: {e}") from None
        else:
            raise TypeError(f"kv-canary: expected integer data, got dtype {arr.dtype}")
    if arr.dtype == np.uint64:
        arr = arr.view(np.int64)
    elif arr.dtype != np.int64:
        arr = arr.astype(np.int64)
    arr = np.ascontiguousarray(arr, dtype="<i8")
    return arr.view("<u4").reshape(arr.shape + (2,)).astype(np.uint32)


def to_device(x: Any) -> jax.Array:
    """A host 32-bit (or narrower) numpy array moved to the default device by a transfer, or ``x`` itself if it
    is already a JAX array.

    ``jnp.asarray(numpy_array)`` would compile a small program per shape in jax 0.10 (``lax.stage``), which a
    serving loop with changing sizes must not do; ``jax.device_put`` only copies. Callers pass 32-bit data
    only (``device_put`` narrows 64-bit dtypes with x64 off).
    """
    if isinstance(x, jax.Array):
        return x
    arr = np.asarray(x)
    assert arr.dtype.itemsize <= 4, arr.dtype
    return jax.device_put(arr)


def exact_int64_np(values: Any, *, name: str) -> np.ndarray:
    """Host integer data as a numpy int64 array, exactly (no float truncation, no silent wrap).

    Raises:
      TypeError: non-integer data (floats, strings), naming ``name``.
      ValueError: values outside int64, naming ``name``.
    """
    try:
        return pairs_to_int64_np(int64_to_pairs_np(values))
    except TypeError:
        raise TypeError(f"kv-canary: {name} must hold integers, got {np.asarray(values).dtype} data") from None
    except ValueError:
        raise ValueError(f"kv-canary: {name} holds a value that does not fit int64") from None


def check_int(value: Any, *, name: str, minimum: int | None = None, maximum: int | None = None) -> int:
    """A Python/numpy integer scalar as ``int`` (floats and bools refused, nothing rounded).

    Raises:
      TypeError: not an integer.
      ValueError: outside ``[minimum, maximum]``.
    """
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"kv-canary: {name} must be an int, got {value!r}")
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"kv-canary: {name} must be an int, got {value!r}") from None
    if minimum is not None and v < minimum:
        raise ValueError(f"kv-canary: {name} must be >= {minimum}, got {v}")
    if maximum is not None and v > maximum:
        raise ValueError(f"kv-canary: {name} must be <= {maximum}, got {v}")
    return v


def pairs_to_int64_np(pairs: Any) -> np.ndarray:
    """``uint32[..., 2]`` pairs (JAX or numpy) to a numpy int64 array of shape ``pairs.shape[:-1]``."""
    arr = np.asarray(pairs)
    if arr.ndim < 1 or arr.shape[-1] != 2 or arr.dtype.itemsize != 4 or arr.dtype.kind not in "iu":
        raise TypeError(
            f"kv-canary: expected 32-bit pairs with a trailing dim of 2, got shape {arr.shape} dtype {arr.dtype}"
        )
    arr = np.ascontiguousarray(arr.astype(np.uint32, copy=False), dtype="<u4")
    return arr.view("<i8").reshape(arr.shape[:-1]).astype(np.int64)


def _describe(x: Any) -> str:
    return f"shape {tuple(np.shape(x))} dtype {getattr(x, 'dtype', type(x).__name__)}"


def as_int64_pairs(
    x: Any, *, name: str, shape: Sequence[int | None] | None = None, host: bool = False
) -> jax.Array | np.ndarray:
    """Normalises an int64-valued argument to ``uint32[*S, 2]`` without losing a bit.

    Works on concrete arrays and on tracers (dtype and shape are static), so it is safe inside ``jit``.

    Args:
      x: see the module docstring for accepted forms.
      name: argument name for error messages.
      shape: expected logical shape ``S``; ``None`` entries match any size; ``None`` skips the check.
      host: host data (numpy, lists, ints) stays a numpy array instead of moving to the device (the entry
        points pad it to a bucket first, see :mod:`canary_jax.padding`); JAX arrays are unaffected.

    Returns:
      ``uint32`` array of shape ``S + (2,)`` (numpy when ``host`` and ``x`` is host data, else JAX).

    Raises:
      TypeError: wrong dtype (floats, complex, unknown objects).
      ValueError: wrong rank or shape, or Python ints outside int64.
    """
    if isinstance(x, jax.Array):  # concrete arrays and tracers
        dt = np.dtype(x.dtype)
        logical_ndim = None if shape is None else len(shape)
        if dt in (np.dtype(np.int64), np.dtype(np.uint64)):
            out = jax.lax.bitcast_convert_type(x, jnp.uint32)
        elif (
            dt.itemsize == 4
            and dt.kind in "iu"
            and (logical_ndim is not None and x.ndim == logical_ndim + 1 and x.shape[-1] == 2)
        ):
            out = jax.lax.bitcast_convert_type(x, jnp.uint32) if dt != np.uint32 else x
        elif dt.kind in "iub" and dt.itemsize <= 4:
            lo = x.astype(jnp.uint32) if dt.kind != "b" else x.astype(jnp.uint32)
            if dt.kind == "i":
                hi = jnp.where(x < 0, jnp.uint32(0xFFFFFFFF), jnp.uint32(0))
            else:
                hi = jnp.zeros_like(lo)
            out = jnp.stack([lo, hi], axis=-1)
        else:
            raise TypeError(f"kv-canary: {name} must be an int64-valued integer array, got {_describe(x)}")
    else:
        arr = np.asarray(x) if not isinstance(x, np.ndarray) else x
        logical_ndim = None if shape is None else len(shape)
        if (
            logical_ndim is not None
            and arr.ndim == logical_ndim + 1
            and arr.shape[-1] == 2
            and arr.dtype in (np.dtype(np.uint32), np.dtype(np.int32))
        ):
            out = arr.astype(np.uint32, copy=False)
        else:
            try:
                out = int64_to_pairs_np(x if not hasattr(x, "dtype") else arr)
            except TypeError:
                raise TypeError(
                    f"kv-canary: {name} must be an int64-valued integer array, got {_describe(arr)}"
                ) from None
            except ValueError:
                raise ValueError(f"kv-canary: {name} holds a value that does not fit int64") from None
        if not host:
            out = to_device(out)
    if shape is not None and not validation.shape_matches(out.shape[:-1], shape):
        want, got = validation.shape_pattern(shape), tuple(out.shape[:-1])
        raise ValueError(f"kv-canary: {name} must have shape {want} (int64), got shape {got}")
    return out


def as_int32(x: Any, *, name: str, shape: Sequence[int | None] | None = None) -> jax.Array:
    """Checks an int32 argument (SGLang's int32 tensors: num_valid, enable, write_index, req_to_token).

    Numpy data of another integer dtype is accepted only if every value fits int32; JAX arrays must already
    be int32 (so nothing is converted silently inside a traced program).

    Raises:
      TypeError: wrong dtype.
      ValueError: wrong shape, or numpy values outside int32.
    """
    if isinstance(x, jax.Array):  # concrete arrays and tracers
        if np.dtype(x.dtype) != np.dtype(np.int32):
            raise TypeError(f"kv-canary: {name} must have dtype int32, got {x.dtype}")
        out = x
    else:
        arr = np.asarray(x)
        if arr.dtype.kind not in "iu":
            raise TypeError(f"kv-canary: {name} must have dtype int32, got {arr.dtype}")
        if arr.size and (arr.min() < np.iinfo(np.int32).min or arr.max() > np.iinfo(np.int32).max):
            raise ValueError(
                f"kv-canary: {name} holds values outside int32 (min {arr.min()}, max {arr.max()}); refusing to truncate"
            )
        out = to_device(arr.astype(np.int32))
    if shape is not None:
        validation.check_shape(name, out.shape, shape)
    return out
