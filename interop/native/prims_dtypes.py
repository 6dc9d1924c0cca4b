"""Storage dtypes and the helpers every rule module of the native torch path shares (see
:mod:`interop.native.prims`, which re-exports the public names).
"""

from __future__ import annotations

import jax.extend.core as jcore
import numpy as np
import torch


class UnsupportedPrimitive(NotImplementedError):
    """A primitive (or a param or dtype of it) with no torch rule; the message names it."""


# --- dtypes ---------------------------------------------------------------------------------------------------
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
    "float16": (torch.float16, np.float16),
    "bfloat16": (torch.bfloat16, np.int16),
    "float32": (torch.float32, np.float32),
    "float64": (torch.float64, np.float64),
}


def _entry(dtype) -> tuple:
    try:
        return _DTYPES[np.dtype(dtype).name]
    except (KeyError, TypeError):
        raise TypeError(f"canary native: no torch storage dtype for {dtype!r}") from None


def storage_dtype(dtype) -> torch.dtype:
    """The torch dtype holding the same bytes as a numpy/JAX ``dtype`` (``uint32`` -> ``torch.int32``, ...).

    Raises:
      TypeError: a dtype with no storage here (complex, float8, int4, ...), named in the message.
    """
    return _entry(dtype)[0]


def from_numpy(a: np.ndarray, device) -> torch.Tensor:
    """A numpy array (any dtype of :func:`storage_dtype`, ml_dtypes bfloat16 included) as a new storage tensor
    on ``device``, bit-exact. Raises TypeError for other dtypes."""
    a = np.asarray(a)
    st, view = _entry(a.dtype)
    t = torch.from_numpy(np.array(a, order="C", copy=True).view(view))
    return (t.view(st) if t.dtype != st else t).to(device)


def to_numpy(t: torch.Tensor, dtype) -> np.ndarray:
    """A storage tensor as a numpy array of the JAX ``dtype`` (a CPU copy; bits reinterpreted, not converted).

    Raises:
      TypeError: ``t.dtype`` is not ``storage_dtype(dtype)``.
    """
    st, view = _entry(dtype)
    if t.dtype != st:
        raise TypeError(f"canary native: a {np.dtype(dtype)} value is stored as {st}, got {t.dtype}")
    x = t.detach().to("cpu").contiguous()
    if st == torch.bfloat16:
        x = x.view(torch.int16)
    return x.numpy().view(np.dtype(dtype)).copy()


def constant(value, dtype, device) -> torch.Tensor:
    """A literal or constant (scalar or array, of JAX dtype ``dtype``) as a storage tensor on ``device``."""
    return from_numpy(np.asarray(value, dtype=np.dtype(dtype)), device)


def _bits(dt) -> int:
    return np.dtype(dt).itemsize * 8


def _kind(dt) -> str:
    """numpy's kind letter, with ml_dtypes' bfloat16 (kind "V") as the float it is."""
    dt = np.dtype(dt)
    return "f" if dt.name == "bfloat16" else dt.kind


def _uis(dt) -> bool:
    """Unsigned held in signed storage (uint16/32/64; uint8 has torch.uint8)."""
    dt = np.dtype(dt)
    return _kind(dt) == "u" and dt.itemsize > 1


def _smin(bits: int) -> int:
    return -(1 << (bits - 1))


def _signed(v: int, bits: int) -> int:
    """Python int ``v`` mod 2**bits as the signed value with the same bits."""
    v &= (1 << bits) - 1
    return v - (1 << bits) if v >> (bits - 1) else v


def _int_of(st: torch.dtype) -> torch.dtype:
    """The signed integer dtype of a float storage dtype's width."""
    return {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}.get(st, torch.int64)


def _index(t: torch.Tensor, dt) -> torch.Tensor:
    """Integer index values (JAX dtype ``dt``, unsigned ones interpreted unsigned) as int64; uint64 values past
    int64 saturate at INT64_MAX (out of bounds for every real dimension)."""
    dt = np.dtype(dt)
    if dt.itemsize == 8:
        return torch.where(t < 0, (1 << 63) - 1, t) if _kind(dt) == "u" else t
    t = t.long()
    return t & ((1 << _bits(dt)) - 1) if _uis(dt) else t


def _lit(eqn, i: int):
    """The static value of input ``i`` when it is a literal, else None."""
    v = eqn.invars[i]
    return np.asarray(v.val) if isinstance(v, jcore.Literal) else None


def _dt(eqn, i: int = 0) -> np.dtype:
    return np.dtype(eqn.invars[i].aval.dtype)


def _out(eqn, i: int = 0):
    return eqn.outvars[i].aval


def _order(x: torch.Tensor, dt) -> torch.Tensor:
    """x mapped so signed comparison gives dt's order (unsigned in signed storage: flip the sign bit)."""
    return x ^ _smin(_bits(dt)) if _uis(dt) else x


def _widen_u(x: torch.Tensor, bits: int) -> torch.Tensor:
    return x.long() & ((1 << bits) - 1)


def _default_fill(dt):
    if dt == np.bool_:
        return True
    if _kind(dt) == "f":
        return float("nan")
    if _kind(dt) == "u":
        return 255 if dt.itemsize == 1 else -1
    return _smin(_bits(dt))


def _fill_scalar(value, dt):
    if value is None:
        return _default_fill(dt)
    if dt == np.bool_:
        return bool(value)
    if _kind(dt) == "f":
        return float(value)
    return int(value) & 255 if dt == np.uint8 else _signed(int(value), _bits(dt))


# --- registration -------------------------------------------------------------------------------------------
class Table:
    """One rule module's rules, compilers and param checks, added to :mod:`interop.native.prims`' tables by
    :meth:`register` (the modules cannot import prims, which imports them)."""

    def __init__(self):
        self.rules: list = []  # (names, fn, fresh, multi)
        self.comps: dict = {}
        self.checks: dict = {}

    def rule(self, *names: str, fresh: bool = True, multi: bool = False):
        """Decorator: ``fn(eqn, args, donate)`` is the rule of ``names`` (see ``prims._reg``)."""

        def deco(fn):
            self.rules.append((names, fn, fresh, multi))
            return fn

        return deco

    def comp(self, *names: str):
        """Decorator: ``fn(ctx) -> run | None`` compiles ``names`` (see ``prims.compile_rule``)."""

        def deco(fn):
            for n in names:
                self.comps[n] = fn
            return fn

        return deco

    def register(self, reg, comp, checks: dict) -> None:
        """Adds everything registered here through ``prims._reg`` / ``prims._comp`` and to ``checks``."""
        for names, fn, fresh, multi in self.rules:
            reg(*names, fresh=fresh, multi=multi)(fn)
        for name, fn in self.comps.items():
            comp(name)(fn)
        checks.update(self.checks)


# --- compile context ------------------------------------------------------------------------------------------
class Ctx:
    """What a compiler sees of one equation: its params and avals, the device, and its constant inputs."""

    def __init__(self, eqn, device: torch.device, consts: dict[int, torch.Tensor]):
        self.eqn, self.device, self.params = eqn, device, eqn.params
        self.consts = consts
        self.n_in = len(eqn.invars)

    def dt(self, i: int = 0) -> np.dtype:
        """JAX dtype of input ``i``."""
        return np.dtype(self.eqn.invars[i].aval.dtype)

    def shape(self, i: int = 0) -> tuple[int, ...]:
        """Static shape of input ``i``."""
        return tuple(self.eqn.invars[i].aval.shape)

    def out(self, i: int = 0):
        """Aval of output ``i``."""
        return self.eqn.outvars[i].aval

    def const(self, i: int) -> torch.Tensor | None:
        """Input ``i``'s value (a storage tensor on the device) when it is a build-time constant, else None."""
        return self.consts.get(i)

    def host(self, i: int) -> torch.Tensor | None:
        """Input ``i``'s constant value as a CPU storage tensor, or None when it is not constant or cannot be read
        now (the meta device; a CUDA stream capturing a graph)."""
        c = self.consts.get(i)
        if c is None or c.device.type == "meta":
            return None
        if c.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        return c.detach().to("cpu")

    def scalar(self, value, st: torch.dtype) -> torch.Tensor:
        """A 0-d tensor on the device (a binary op with a 0-d tensor costs half what one with a Python scalar
        does: no wrapped-number tensor per call)."""
        return torch.tensor(value, dtype=st, device=self.device)
