"""Checks on framework-neutral array facts (SPEC 1, 3, 10): shapes, dtypes, contiguity, the canary buffer, the
violation ring, and the launch's static enums.

Checks are written on facts about an array (:class:`ArrayFacts`: shape, a dtype name, the itemsize, strides in
bytes, contiguity), so :mod:`canary_jax` and :mod:`interop` call the very same code; each side only turns its
arrays into facts (:func:`array_facts` for numpy / JAX, ``interop.arguments`` for torch). Dtype names are compared
and printed as given, so torch callers keep torch's names in the messages (``torch.int64``) and JAX callers
numpy's (``uint32``). :class:`DtypeNames` says how each side spells the dtypes of SGLang's tensors, and whether
int64 arrays are held as ``uint32[..., 2]`` pairs. Messages are SGLang's where SGLang has one; ``TypeError`` for a
wrong kind or dtype, ``ValueError`` for a wrong value or shape. One of the three parts of
:mod:`canary_jax.contract.validation`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from canary_jax.contract import constants


# --- facts ---------------------------------------------------------------------------------------------------
class ArrayFacts(NamedTuple):
    """What the checks need to know about one array.

    Fields:
      shape: the array's shape.
      dtype: the dtype's display name (``"uint8"`` for numpy / JAX, ``"torch.uint8"`` for torch).
      itemsize: bytes per element.
      strides_bytes: strides in bytes (dense row-major for JAX arrays).
      contiguous: whether the elements are dense and row-major.
    """

    shape: tuple[int, ...]
    dtype: str
    itemsize: int
    strides_bytes: tuple[int, ...]
    contiguous: bool = True


def dense_strides_bytes(shape: Sequence[int], itemsize: int) -> tuple[int, ...]:
    """Row-major strides in bytes of a dense array of ``shape``."""
    out, acc = [], int(itemsize)
    for d in reversed(tuple(shape)):
        out.append(acc)
        acc *= int(d)
    return tuple(reversed(out))


def array_facts(x: Any) -> ArrayFacts:
    """Facts of a numpy array, a JAX array or tracer, or a ``jax.ShapeDtypeStruct``.

    numpy arrays report their real strides and contiguity; everything else is dense and row-major.
    """
    dt = np.dtype(x.dtype)
    shape = tuple(int(d) for d in x.shape)
    if isinstance(x, np.ndarray):
        return ArrayFacts(shape, str(dt), dt.itemsize, tuple(int(s) for s in x.strides), bool(x.flags.c_contiguous))
    return ArrayFacts(shape, str(dt), dt.itemsize, dense_strides_bytes(shape, dt.itemsize))


class DtypeNames(NamedTuple):
    """How one side spells SGLang's dtypes, and how it holds int64 arrays.

    Fields:
      u8, i32, i64: dtype names of SGLang's uint8, int32 and int64 tensors on this side.
      int64_pairs: int64 arrays are held as ``u32[..., 2]`` pairs (``i64`` is then ``"uint32"``).
    """

    u8: str
    i32: str
    i64: str
    int64_pairs: bool

    def int64_shape(self, *logical: int | None) -> tuple[int | None, ...]:
        """The physical shape of an int64 array of logical shape ``logical``."""
        return logical + (2,) if self.int64_pairs else logical


JAX_DTYPES = DtypeNames(u8="uint8", i32="int32", i64="uint32", int64_pairs=True)
"""canary-jax's own arrays: int64 as ``uint32[..., 2]`` pairs."""


# --- arrays -------------------------------------------------------------------------------------------------
def shape_matches(got: Sequence[int], want: Sequence[int | None]) -> bool:
    """Whether ``got`` has ``want``'s rank and sizes (``None`` in ``want`` matches any size)."""
    got, want = tuple(got), tuple(want)
    return len(got) == len(want) and all(w is None or w == g for w, g in zip(want, got))


def format_shape(shape: Sequence[int | None]) -> str:
    """A shape as messages print it: ``[4, 2]``, ``[]`` for a scalar, ``*`` for a size that may be anything
    (``None``): ``[*, 8]``."""
    return "[" + ", ".join("*" if d is None else str(int(d)) for d in shape) + "]"


def check_shape(name: str, got: Sequence[int], want: Sequence[int | None]) -> None:
    """Raises ValueError ``kv-canary: {name} must have shape [4, *], got [4, 3, 2]`` on a mismatch (see
    :func:`format_shape`)."""
    if not shape_matches(got, want):
        raise ValueError(f"kv-canary: {name} must have shape {format_shape(want)}, got {format_shape(got)}")


def check_same_length(name: str, length: int, *, ref_name: str, ref_length: int) -> None:
    """``name`` has as many entries as ``ref_name`` (SGLang binds ``num_tokens`` to ``input_ids``, the first
    token array it checks, and matches the others against it).

    Raises:
      ValueError: ``kv-canary: input_ids (3 entries) is shorter than positions (5 entries); they must have
        the same length``: the shorter array is named first, whichever of the two it is.
    """
    if length != ref_length:
        (short, n_short), (long, n_long) = sorted(((ref_name, ref_length), (name, length)), key=lambda e: e[1])
        raise ValueError(
            f"kv-canary: {short} ({n_short} entries) is shorter than {long} ({n_long} entries); "
            "they must have the same length"
        )


def check_array(facts: ArrayFacts, name: str, dtype: str, shape: Sequence[int | None]) -> None:
    """Dtype, then shape.

    Raises:
      TypeError: ``kv-canary: {name} must have dtype {dtype}, got {facts.dtype}``.
      ValueError: wrong rank or size (see :func:`check_shape`).
    """
    if facts.dtype != dtype:
        raise TypeError(f"kv-canary: {name} must have dtype {dtype}, got {facts.dtype}")
    check_shape(name, facts.shape, shape)


def check_contiguous(facts: ArrayFacts, name: str) -> None:
    """SGLang's check and message: ``kv-canary: {name} must be contiguous`` (ValueError)."""
    if not facts.contiguous:
        raise ValueError(f"kv-canary: {name} must be contiguous")


# --- canary buffer --------------------------------------------------------------------------------------------
def check_canary_buffer(facts: ArrayFacts, *, name: str = "canary_buf", u8: str = "uint8") -> None:
    """A canary buffer ``uint8[num_slots, slot_stride_bytes]`` (SPEC 1.1).

    ``1 <= num_slots <= 2**31 - 1``. SGLang's matchers let an empty buffer through, but no launch can use
    one (every entry would address a slot outside it, which SGLang leaves undefined and canary-jax's jnp
    gathers cannot express), so both the JAX entry points and the torch launchers refuse it here, before
    anything runs. The stride is a multiple of 8 bytes (SGLang's references view the buffer as int64) holding
    at least the four int64 fields.

    Raises:
      TypeError: dtype is not ``u8``.
      ValueError: not 2-D; stride not a multiple of 8 bytes; stride below 32 bytes (SGLang's message, in
        int64 fields); no slots, or ``2**31`` slots or more.
    """
    if facts.dtype != u8:
        raise TypeError(f"kv-canary: {name} must have dtype {u8}, got {facts.dtype}")
    if len(facts.shape) != 2:
        raise ValueError(f"kv-canary: {name} must be 2-D [num_slots, slot_stride_bytes], got shape {facts.shape}")
    num_slots, stride = facts.shape
    if stride % 8 != 0:
        raise ValueError(f"kv-canary: {name} slot stride must be a multiple of 8 bytes, got {stride}")
    if stride < constants.CANARY_SLOT_BYTES:
        raise ValueError(f"kv-canary: canary_buf slot stride must hold at least 4 int64 fields, got {stride // 8}")
    if not 1 <= num_slots < 2**31:
        raise ValueError(f"kv-canary: {name} must have between 1 and 2**31 - 1 slots, got {num_slots}")


# --- launch statics -------------------------------------------------------------------------------------------
def check_kernel_kind(kernel_kind: Any) -> constants.CanaryLaunchTag:
    """The launch tag as a ``CanaryLaunchTag``.

    Raises:
      ValueError: ``kv-canary: kernel_kind must be a CanaryLaunchTag, got {kernel_kind!r}``.
    """
    return _enum_member(constants.CanaryLaunchTag, kernel_kind, "kernel_kind")


def check_hash_mode(mode: Any) -> constants.RealKvHashMode:
    """The real-KV hash mode as a ``RealKvHashMode``.

    Raises:
      ValueError: ``kv-canary: real_kv_hash_mode must be a RealKvHashMode, got {mode!r}``.
    """
    return _enum_member(constants.RealKvHashMode, mode, "real_kv_hash_mode")


def _enum_member(enum: type, value: Any, name: str) -> Any:
    try:
        return enum(int(value))
    except (TypeError, ValueError):
        raise ValueError(f"kv-canary: {name} must be a {enum.__name__}, got {value!r}") from None


def check_expected_inputs(enable_write_input_assert: bool, *, has_tokens: bool, has_positions: bool) -> None:
    """The write-input-assert presence rule (SGLang's ``write_ref`` messages).

    Raises:
      ValueError: an expected tensor missing with the assert on, or present with it off.
    """
    if enable_write_input_assert:
        if not (has_tokens and has_positions):
            raise ValueError("kv-canary: expected input tensors are required when enable_write_input_assert=True")
    elif has_tokens or has_positions:
        raise ValueError("kv-canary: expected input tensors must be None when enable_write_input_assert=False")


def check_ring(facts: ArrayFacts, names: DtypeNames, *, name: str = "violation_ring") -> None:
    """The violation ring: int64 ``[R, 8]`` with ``R >= 1`` (SPEC 1.2).

    Raises:
      TypeError / ValueError naming the ring.
    """
    check_array(facts, name, names.i64, names.int64_shape(None, constants.VIOLATION_FIELDS))
    if facts.shape[0] < 1:
        raise ValueError(f"kv-canary: {name} must have at least one row")
