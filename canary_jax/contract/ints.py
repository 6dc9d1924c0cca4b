"""Lossless int64 handling with ``jax_enable_x64`` off and on.

SGLang keeps every plan, token and ring field as int64. With x64 off (JAX's default) no JAX array can be
64-bit and ``jnp.asarray(np.int64_array)`` silently truncates (PITFALLS). canary-jax therefore holds each
int64 array as ``uint32[..., 2]``: little-endian (lo, hi) words, the same bytes as the int64 array. This
module converts to and from that form at the API boundary and refuses anything that would lose bits.

Accepted for an int64 argument of logical shape ``S`` (see :func:`as_int64_pairs`):

* ``uint32`` or ``int32`` array of shape ``S + (2,)``: already pairs (bit-reinterpreted, no copy of values);
* ``int64`` array of shape ``S`` (numpy, or JAX with x64 on): split exactly into pairs;
* ``uint64`` array of shape ``S`` whose values all fit int64 (below 2**63): split exactly; a larger value is
  refused (ValueError: an int64 tensor cannot hold it), and so is a traced uint64 array (TypeError: its
  values cannot be checked);
* ``int32`` / ``int16`` / ``int8`` / ``uint32`` / ``uint16`` / ``uint8`` array of shape ``S``: widened exactly
  (sign-extended for signed types, :func:`canary_jax.contract.pairs.from_int32`), since every such value is an int64;
* Python ints / nested lists: taken as int64 (values outside int64 raise).

Anything else, bools included (a mask is not a token id, a position or a slot), raises ``TypeError`` naming the
argument and its dtype.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from canary_jax.contract import arrays, pairs

INT32_MIN = -(2**31)  # the int32 bounds, the one home of these two literals (planning, runtime, interop read them)
INT32_MAX = 2**31 - 1


def x64_enabled() -> bool:
    """Whether ``jax_enable_x64`` is on right now."""
    return bool(jax.config.read("jax_enable_x64"))


def int64_to_pairs_np(values: Any, *, name: str = "value") -> np.ndarray:
    """Host int64 data (ints, lists, any integer numpy array) to ``uint32[..., 2]`` pairs, exactly.

    Args:
      values: the data.
      name: the argument named in messages.

    Raises:
      TypeError: non-integer data, bools included (Python or numpy).
      ValueError: a value outside int64: a Python int, or a uint64 value of 2**63 or more (which an int64
        tensor cannot hold; reinterpreting its bits would turn it negative).
    """
    if not hasattr(values, "dtype") or np.dtype(values.dtype) == object:
        # Python ints / (nested) lists / object arrays: exact int64 or refuse. (np.asarray alone would turn
        # [2**63] into uint64 and wrap it to -2**63, [-1, 2**63] into float64, and [True] into bool.)
        obj = np.asarray(values, dtype=object)
        flat = obj.reshape(-1).tolist()
        if any(isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) for v in flat):
            raise TypeError("kv-canary: expected integer data, got non-integer Python values")
        bad = [int(v) for v in flat if not -(2**63) <= int(v) < 2**63]
        if bad:
            raise ValueError(f"kv-canary: {name} holds a value that does not fit int64: {bad[0]}")
        values = np.array([int(v) for v in flat], dtype=np.int64).reshape(obj.shape)
    arr = np.asarray(values)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"kv-canary: expected integer data, got dtype {arr.dtype}")
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) >= 2**63:
        raise ValueError(f"kv-canary: {name} holds a value that does not fit int64: {int(arr.max())} (uint64)")
    arr = np.ascontiguousarray(arr, dtype="<i8")  # exact: every value fits int64
    return arr.view("<u4").reshape(arr.shape + (2,)).astype(np.uint32)


def to_device(x: Any, device: jax.Device | jax.sharding.Sharding | None = None) -> jax.Array:
    """A host 32-bit (or narrower) numpy array moved by a transfer to ``device`` (None: the default device,
    uncommitted). A JAX array stays as it is, except that one not committed to a device is committed to
    ``device`` when one is given (a transfer at most, never a compiled program).

    ``jnp.asarray(numpy_array)`` would compile a small program per shape in jax 0.10 (``lax.stage``), which a
    serving loop with changing sizes must not do; ``jax.device_put`` only copies. Callers pass 32-bit data
    only (``device_put`` narrows 64-bit dtypes with x64 off).
    """
    if isinstance(x, jax.Array):
        if device is None or getattr(x, "committed", True):
            return x
        return jax.device_put(x, device)
    arr = np.asarray(x)
    assert arr.dtype.itemsize <= 4, arr.dtype
    return jax.device_put(arr, device)


def exact_int64_np(values: Any, *, name: str) -> np.ndarray:
    """Host integer data as a numpy int64 array, exactly (no float truncation, no silent wrap).

    Raises:
      TypeError: non-integer data (floats, strings), naming ``name``.
      ValueError: values outside int64, naming ``name``.
    """
    try:
        return pairs_to_int64_np(int64_to_pairs_np(values, name=name))
    except TypeError:
        raise TypeError(f"kv-canary: {name} must hold integers, got {np.asarray(values).dtype} data") from None


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
    return f"shape {arrays.format_shape(np.shape(x))} dtype {getattr(x, 'dtype', type(x).__name__)}"


def as_int64_pairs(
    x: Any, *, name: str, shape: Sequence[int | None] | None = None, host: bool = False
) -> jax.Array | np.ndarray:
    """Normalises an int64-valued argument to ``uint32[*S, 2]`` without losing a bit.

    Works on concrete arrays and on tracers (dtype and shape are static), so it is safe inside ``jit``; a
    ``uint64`` JAX array is refused there (its values cannot be checked against the int64 range while
    tracing).

    Args:
      x: see the module docstring for accepted forms.
      name: argument name for error messages.
      shape: expected logical shape ``S``; ``None`` entries match any size; ``None`` skips the check.
      host: host data (numpy, lists, ints) stays a numpy array instead of moving to the device (the entry
        points pad it to a bucket first, see :mod:`canary_jax.ops.padding`); JAX arrays are unaffected.

    Returns:
      ``uint32`` array of shape ``S + (2,)`` (numpy when ``host`` and ``x`` is host data, else JAX).

    Raises:
      TypeError: wrong dtype (bools, floats, complex, unknown objects), or a traced ``uint64`` array.
      ValueError: wrong rank or shape, or a value outside int64 (Python ints, uint64 values >= 2**63).
    """
    logical_ndim = None if shape is None else len(shape)
    if isinstance(x, jax.Array):  # concrete arrays and tracers
        dt = np.dtype(x.dtype)
        if dt == np.dtype(np.uint64):
            if isinstance(x, jax.core.Tracer):
                raise TypeError(
                    f"kv-canary: {name} is a uint64 array inside a traced function, where its values cannot be "
                    "checked against the int64 range; pass int64 (SGLang's dtype)"
                )
            big = int(np.asarray(x).max()) if x.size else 0
            if big >= 2**63:
                raise ValueError(f"kv-canary: {name} holds a value that does not fit int64: {big} (uint64)")
        if dt in (np.dtype(np.int64), np.dtype(np.uint64)):
            out = jax.lax.bitcast_convert_type(x, jnp.uint32)
        elif dt.itemsize == 4 and dt.kind in "iu" and logical_ndim is not None and _pairs_shaped(x, logical_ndim):
            out = jax.lax.bitcast_convert_type(x, jnp.uint32) if dt != np.uint32 else x
        elif dt.kind in "iu" and dt.itemsize <= 4:
            out = pairs.pack(pairs.from_int32(x))
        else:
            raise TypeError(f"kv-canary: {name} must be an int64-valued integer array, got {_describe(x)}")
    else:
        arr = np.asarray(x) if not isinstance(x, np.ndarray) else x
        if logical_ndim is not None and _pairs_shaped(arr, logical_ndim) and arr.dtype in _PAIR_DTYPES:
            out = arr.astype(np.uint32, copy=False)
        else:
            try:
                out = int64_to_pairs_np(x if not hasattr(x, "dtype") else arr, name=name)
            except TypeError:
                raise TypeError(
                    f"kv-canary: {name} must be an int64-valued integer array, got {_describe(arr)}"
                ) from None
        if not host:
            out = to_device(out)
    if shape is not None and not arrays.shape_matches(out.shape[:-1], shape):
        want, got = arrays.format_shape(shape), arrays.format_shape(out.shape[:-1])
        raise ValueError(f"kv-canary: {name} must have shape {want} (int64), got shape {got}")
    return out


def is_traced_int32(x: Any) -> bool:
    """Whether ``x`` is a traced JAX ``int32`` vector. Such an int64-valued per-entry field can stay *narrow*: the
    Pallas plan and phase kernels read it as it is, one word an entry, sign-extended (exact: every int32 is an
    int64), so inside a caller's ``jit`` no widening op runs before them (on a GPU each would be a kernel launch
    of its own)."""
    return isinstance(x, jax.core.Tracer) and np.dtype(x.dtype) == np.dtype(np.int32) and x.ndim == 1


def as_int64_field(x: Any, *, name: str, shape: Sequence[int | None], host: bool = False) -> jax.Array | np.ndarray:
    """:func:`as_int64_pairs` (``host`` as there) for a per-entry field of logical shape ``shape`` (one dim), except
    that a traced int32 vector (:func:`is_traced_int32`) is returned as it is, narrow; :func:`widen` makes its
    pairs.

    Raises:
      TypeError / ValueError: as :func:`as_int64_pairs`.
    """
    if len(shape) == 1 and is_traced_int32(x):
        if not arrays.shape_matches(x.shape, shape):
            want, got = arrays.format_shape(shape), arrays.format_shape(x.shape)
            raise ValueError(f"kv-canary: {name} must have shape {want} (int64), got shape {got}")
        return x
    return as_int64_pairs(x, name=name, shape=shape, host=host)


def widen(x: Any) -> Any:
    """The ``uint32[N, 2]`` pairs of a narrow field (a JAX ``int32[N]``, :func:`as_int64_field`), sign-extended;
    anything else (pairs, None) unchanged."""
    if isinstance(x, jax.Array) and np.dtype(x.dtype) == np.dtype(np.int32) and x.ndim == 1:
        return pairs.pack(pairs.from_int32(x))
    return x


_PAIR_DTYPES = (np.dtype(np.uint32), np.dtype(np.int32))


def _pairs_shaped(x: Any, logical_ndim: int) -> bool:
    """Whether ``x`` has the shape of int64 pairs of rank ``logical_ndim``: ``[..., 2]``, one more dim."""
    return x.ndim == logical_ndim + 1 and x.shape[-1] == 2


def as_int32(
    x: Any, *, name: str, shape: Sequence[int | None] | None = None, host: bool = False
) -> jax.Array | np.ndarray:
    """Checks an int32 argument (SGLang's int32 tensors: num_valid, enable, write_index, req_to_token).

    Numpy data of another integer dtype is accepted only if every value fits int32; JAX arrays must already
    be int32 (so nothing is converted silently inside a traced program). Host data moves to the device, or
    with ``host=True`` stays an ``int32`` numpy array (a caller's ``jit`` then transfers it with the other
    arguments: no per-field transfer).

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
        out = arr.astype(np.int32, copy=False) if host else to_device(arr.astype(np.int32))
    if shape is not None:
        arrays.check_shape(name, out.shape, shape)
    return out
