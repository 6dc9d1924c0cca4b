"""Torch storage for JAX values on the native path: the torch dtype that holds a JAX dtype's bytes, host copies
both ways, and a contiguous buffer seen as a value of another shape and dtype.

Unsigned integers live in the signed type's bit pattern (``uint32`` in ``torch.int32``), bfloat16 in
``torch.bfloat16``; every tensor holds the bytes XLA would.
"""

from __future__ import annotations

import numpy as np
import torch

# jax dtype name -> (torch storage dtype, numpy dtype with the same bytes that torch.from_numpy accepts)
_DTYPES = {
    "bool": (torch.bool, np.bool_),
    "int8": (torch.int8, np.int8),
    "uint8": (torch.uint8, np.uint8),
    "int16": (torch.int16, np.int16),
    "uint16": (torch.int16, np.int16),
    "int32": (torch.int32, np.int32),
    "uint32": (torch.int32, np.int32),
    "int64": (torch.int64, np.int64),
    "uint64": (torch.int64, np.int64),
    "bfloat16": (torch.bfloat16, np.int16),
    "float16": (torch.float16, np.float16),
    "float32": (torch.float32, np.float32),
    "float64": (torch.float64, np.float64),
}


def _entry(dtype) -> tuple:
    try:
        return _DTYPES[np.dtype(dtype).name]
    except (KeyError, TypeError):
        raise TypeError(f"kv-canary: no torch storage dtype for {dtype!r} on the native path") from None


def storage_dtype(dtype) -> torch.dtype:
    """The torch dtype holding the same bytes as a numpy / JAX ``dtype`` (``uint32`` -> ``torch.int32``, ...).

    Raises:
      TypeError: a dtype with no storage here (complex, float8, int4, ...), named in the message.
    """
    return _entry(dtype)[0]


def from_numpy(a, device) -> torch.Tensor:
    """A numpy array (any dtype of :func:`storage_dtype`, ml_dtypes bfloat16 included) as a new contiguous storage
    tensor on ``device``, bit-exact. Raises TypeError for other dtypes."""
    a = np.asarray(a)
    st, view = _entry(a.dtype)
    t = torch.from_numpy(np.array(a, order="C", copy=True).view(view))
    return (t.view(st) if t.dtype != st else t).to(device)


def to_numpy(t: torch.Tensor, dtype) -> np.ndarray:
    """A storage tensor as a numpy array of the JAX ``dtype`` (a host copy; bits reinterpreted, not converted).

    Raises:
      TypeError: ``t.dtype`` is not ``storage_dtype(dtype)``.
    """
    st, _ = _entry(dtype)
    if t.dtype != st:
        raise TypeError(f"kv-canary: a {np.dtype(dtype)} value is stored as {st}, got {t.dtype}")
    x = t.detach().to("cpu").contiguous()
    if st == torch.bfloat16:
        x = x.view(torch.int16)
    return x.numpy().view(np.dtype(dtype)).copy()


def as_value(buf: torch.Tensor, shape, st: torch.dtype) -> torch.Tensor:
    """The contiguous tensor ``buf`` seen as a value of ``shape`` in torch storage dtype ``st`` (same memory,
    row-major bytes; the total size must match)."""
    if buf.dtype == st:
        return buf.reshape(shape)
    return buf.reshape(-1).view(torch.uint8).view(st).reshape(shape)
