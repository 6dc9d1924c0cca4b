"""torch <-> JAX exchange over DLPack: zero-copy, lossless, and refusing rather than copying.

What this module guarantees (each pinned by ``tests/test_interop_dlpack.py``, and on CUDA by
``tests/test_interop_cuda.py``):

* :func:`to_jax` imports a torch tensor (or a fresh DLPack capsule) **without a copy**: the JAX array's buffer
  pointer equals the tensor's ``data_ptr()``; anything that DLPack cannot hand over as-is is refused with an
  error naming the argument: non-contiguous or oddly strided tensors, data pointers that are not aligned the
  way XLA needs (64 bytes on XLA:CPU, measured), devices other than CPU / CUDA, dtypes JAX would narrow
  (``float64`` / ``complex128`` with ``jax_enable_x64`` off), and capsules that were already consumed.
* int64 / uint64 tensors never become int32 (what ``jax.dlpack.from_dlpack`` does with x64 off, see
  PITFALLS): by default they are imported as ``int32[..., 2]`` little-endian word pairs through the torch view
  ``t.view(torch.int32).reshape(*t.shape, 2)``, the same memory and the same bytes (canary-jax's int64 form).
* :func:`to_torch` exports a JAX array to torch zero-copy (``torch.from_dlpack``), which on CUDA also makes
  torch's current stream wait for the array to be ready.
* :class:`ImportCache` keeps imported arrays so a steady-state launch does not re-import (one
  ``from_dlpack`` costs about 35 us on our CPU machines); entries die with the torch tensor they came from.

torch is required by this module (``canary_jax`` itself never imports torch).
"""

from __future__ import annotations

import collections
import ctypes
import threading
import weakref
from collections.abc import Hashable, Iterable
from typing import Any

import jax
import numpy as np

from canary_jax.contract import validation

try:
    import torch
    import torch.utils.dlpack
except ImportError as e:  # pragma: no cover - exercised only without torch
    raise ImportError("canary-jax interop needs torch: pip install 'canary-jax[torch]'") from e

__all__ = [
    "ImportCache",
    "as_torch_tensor",
    "contiguous_view",
    "device_alignment",
    "facts",
    "int64_pairs_view",
    "is_dlpack_capsule",
    "jax_device_for",
    "to_jax",
    "to_torch",
]

# --- DLPack capsules --------------------------------------------------------------------------------------
_FRESH_CAPSULE_NAMES = (b"dltensor", b"dltensor_versioned")
_USED_CAPSULE_NAMES = (b"used_dltensor", b"used_dltensor_versioned")

_PyCapsule_IsValid = ctypes.pythonapi.PyCapsule_IsValid
_PyCapsule_IsValid.restype = ctypes.c_int
_PyCapsule_IsValid.argtypes = [ctypes.py_object, ctypes.c_char_p]


def is_dlpack_capsule(obj: Any) -> bool:
    """Whether ``obj`` is a PyCapsule (fresh or consumed)."""
    return type(obj).__name__ == "PyCapsule"


def _capsule_is(obj: Any, names: tuple[bytes, ...]) -> bool:
    return any(_PyCapsule_IsValid(obj, n) for n in names)


def as_torch_tensor(x: Any, *, name: str) -> torch.Tensor:
    """A torch tensor for ``x`` without copying: a tensor itself, a fresh DLPack capsule, or any object with
    ``__dlpack__``.

    Raises:
      ValueError: a capsule that was already consumed (a capsule can be imported once).
      TypeError: anything else.
    """
    if isinstance(x, torch.Tensor):
        return x
    if is_dlpack_capsule(x):
        if _capsule_is(x, _USED_CAPSULE_NAMES):
            raise ValueError(
                f"kv-canary: {name} is a DLPack capsule that was already consumed; a capsule can be imported "
                "only once, export a fresh one (tensor.__dlpack__()) or pass the tensor itself"
            )
        if not _capsule_is(x, _FRESH_CAPSULE_NAMES):
            raise TypeError(f"kv-canary: {name} is a PyCapsule that does not hold a DLPack tensor")
        return torch.utils.dlpack.from_dlpack(x)
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__") and not isinstance(x, jax.Array):
        return torch.from_dlpack(x)
    raise TypeError(f"kv-canary: {name} must be a torch.Tensor (or a DLPack capsule), got {type(x).__name__}")


# --- layout checks ----------------------------------------------------------------------------------------
def facts(t: torch.Tensor) -> validation.ArrayFacts:
    """What :mod:`canary_jax.contract.validation` checks of ``t``: shape, dtype name (``str(t.dtype)``, so messages name
    torch dtypes), itemsize, strides in bytes and contiguity."""
    size = t.element_size()
    return validation.ArrayFacts(
        tuple(t.shape), str(t.dtype), size, tuple(s * size for s in t.stride()), t.is_contiguous()
    )


def contiguous_view(t: torch.Tensor, name: str) -> torch.Tensor:
    """A new view of ``t`` with canonical row-major strides (same memory; never ``t`` itself, so importing it
    does not pin ``t``'s Python object).

    ``is_contiguous()`` ignores the strides of size-1 dims, which torch may export through DLPack as they are;
    re-striding makes the exported layout exactly row-major.

    Raises:
      ValueError: ``t`` is not contiguous (transposed, sliced with a step, expanded, ...).
    """
    validation.check_contiguous(facts(t), name)
    # view(dtype) first: measured on torch 2.13, a DLPack export of most other views (as_strided, reshape,
    # slicing) keeps the base tensor's Python object alive, which would defeat ImportCache's weak references.
    # view(-1).view(shape) then rebuilds row-major strides (size-1 dims may carry odd ones).
    return t.view(t.dtype).view(-1).view(tuple(t.shape))


def int64_pairs_view(t: torch.Tensor, name: str = "tensor") -> torch.Tensor:
    """``int64``/``uint64 [*S]`` -> ``int32 [*S, 2]`` little-endian (lo, hi) words, the same memory.

    Raises:
      TypeError: ``t`` is not a 64-bit integer tensor.
      ValueError: ``t`` is not contiguous.
    """
    if t.dtype not in (torch.int64, torch.uint64):
        raise TypeError(f"kv-canary: {name} must have dtype torch.int64, got {t.dtype}")
    t = contiguous_view(t, name)
    return t.view(torch.int32).reshape(*t.shape, 2)


# --- devices and alignment --------------------------------------------------------------------------------
def jax_device_for(t: torch.Tensor) -> jax.Device:
    """The JAX device that DLPack places ``t`` on.

    Raises:
      ValueError: the tensor's device type is neither CPU nor CUDA, or JAX has no such device.
    """
    kind = t.device.type
    if kind == "cpu":
        return jax.devices("cpu")[0]
    if kind == "cuda":
        try:
            gpus = jax.devices("gpu")
        except RuntimeError:
            gpus = []
        idx = t.device.index if t.device.index is not None else torch.cuda.current_device()
        for d in gpus:
            if d.id == idx or getattr(d, "local_hardware_id", None) == idx:
                return d
        raise ValueError(f"kv-canary: tensor is on {t.device} but JAX has no GPU device {idx} (devices: {gpus})")
    raise ValueError(f"kv-canary: only CPU and CUDA tensors can be exchanged with JAX, got device {t.device}")


_ALIGN_LOCK = threading.Lock()
_ALIGNMENT: dict[str, int] = {}
_EXECUTABLE_MIN_ALIGN = 16  # bytes; XLA's argument-buffer check on GPU (see device_alignment)


def device_alignment(device: torch.device) -> int:
    """Smallest data-pointer alignment (bytes) at which JAX imports a tensor of ``device``'s type zero-copy.

    Measured once per device type by importing byte slices at exact alignments 1, 2, 4, ..., 256 with
    ``copy=False`` (64 on XLA:CPU in jax 0.10.2). 512 if none of them imported.
    """
    key = device.type
    with _ALIGN_LOCK:
        if key in _ALIGNMENT:
            return _ALIGNMENT[key]
    probe = torch.zeros(4096, dtype=torch.uint8, device=device)
    base = probe.data_ptr()
    found = 512
    a = 1
    while a <= 256:
        # an offset whose address has alignment exactly a
        off = next(o for o in range(0, 2048) if (base + o) % a == 0 and (base + o) % (2 * a) != 0)
        try:
            arr = jax.dlpack.from_dlpack(probe[off : off + 64], copy=False)
            ok = arr.unsafe_buffer_pointer() == base + off
        except Exception:  # noqa: BLE001 - any refusal means "not at this alignment"
            ok = False
        if ok:
            found = a
            break
        a *= 2
    # Importing is not the whole story: a compiled XLA executable also checks its argument buffers. On the
    # H200 (jax 0.11.2) imports succeeded at any alignment, but an 8-byte-aligned counter view then failed at
    # launch with "INTERNAL: Address of buffer N must be a multiple of 10" (hex: 16 bytes). So never report
    # less than 16; smaller-aligned tensors go through the aligned byte windows of ``interop.buffers``.
    found = max(found, _EXECUTABLE_MIN_ALIGN)
    with _ALIGN_LOCK:
        _ALIGNMENT[key] = found
    return found


# --- import / export --------------------------------------------------------------------------------------
_NARROWED_WITHOUT_X64 = {torch.float64, torch.complex128}


def _x64() -> bool:
    return bool(jax.config.read("jax_enable_x64"))


def to_jax(x: Any, *, name: str = "tensor", int64: str = "pairs", cache: ImportCache | None = None) -> jax.Array:
    """Imports a torch tensor into JAX without copying it.

    Args:
      x: a torch tensor, a fresh DLPack capsule or an object with ``__dlpack__``.
      name: argument name for error messages.
      int64: what to do with int64 / uint64 tensors: ``"pairs"`` (default) imports ``int32[*S, 2]`` word
        pairs (lossless with x64 off and on); ``"native"`` imports int64 and needs ``jax_enable_x64``;
        ``"refuse"`` raises.
      cache: optional :class:`ImportCache`; a hit skips ``from_dlpack``.

    Returns:
      A JAX array sharing the tensor's memory (pointer-equal; int64 as pairs unless ``int64="native"``).

    Raises:
      ValueError: non-contiguous, misaligned, consumed capsule, unsupported device.
      TypeError: a dtype that JAX would narrow (int64 with ``int64="refuse"`` / ``"native"`` without x64,
        float64 / complex128 without x64), or an unsupported object.
    """
    src = as_torch_tensor(x, name=name)
    owner = src if isinstance(x, torch.Tensor) else None
    t = _importable_view(src, name=name, int64=int64)
    if cache is not None and owner is not None:
        key = ImportCache.key_for(t)
        hit = cache.get(key)
        if hit is not None:
            return hit
    arr = _import_exact(t, name=name, dtype=src.dtype)
    if cache is not None and owner is not None:
        cache.put(ImportCache.key_for(t), arr, (owner,))
    return arr


def _importable_view(t: torch.Tensor, *, name: str, int64: str) -> torch.Tensor:
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"kv-canary: {name} is on {t.device}; only CPU and CUDA tensors can be exchanged with JAX")
    if t.dtype in (torch.int64, torch.uint64):
        if int64 == "pairs":
            return int64_pairs_view(t, name)
        if int64 == "native" and _x64():
            return contiguous_view(t, name)
        raise TypeError(
            f"kv-canary: {name} has dtype {t.dtype}; with jax_enable_x64 off JAX would silently import it as "
            "int32. Import it as uint32 word pairs (int64='pairs') instead"
        )
    if t.dtype in _NARROWED_WITHOUT_X64 and not _x64():
        raise TypeError(f"kv-canary: {name} has dtype {t.dtype}, which JAX narrows with jax_enable_x64 off")
    return contiguous_view(t, name)


def misaligned_message(t: torch.Tensor, name: str, align: int, *, dtype: torch.dtype | None = None) -> str:
    """Why ``t`` cannot be imported: its pointer and storage offset in bytes, and the offset in elements of
    ``dtype`` (the caller's dtype; ``t`` may be an int32 pairs view of an int64 tensor)."""
    dtype = t.dtype if dtype is None else dtype
    off_bytes = t.storage_offset() * t.element_size()
    itemsize = torch.empty((), dtype=dtype).element_size()
    return (
        f"kv-canary: {name} data pointer 0x{t.data_ptr():x} is not aligned to {align} bytes, which XLA needs to "
        f"import it without a copy (storage offset {off_bytes} bytes = {off_bytes // itemsize} {dtype} elements)"
    )


def _import_exact(t: torch.Tensor, *, name: str, dtype: torch.dtype | None = None) -> jax.Array:
    """``from_dlpack(t, copy=False)`` plus the zero-copy / dtype-width checks (``dtype``: the caller's dtype
    when ``t`` is a pairs view, for messages)."""
    if t.numel() > 0:
        align = device_alignment(t.device)
        if t.data_ptr() % align:
            raise ValueError(
                misaligned_message(t, name, align, dtype=dtype)
                + "; pass an aligned tensor (e.g. a fresh allocation or .clone())"
            )
    try:
        arr = jax.dlpack.from_dlpack(t, copy=False)
    except ValueError as e:
        if "aligned" in str(e):
            raise ValueError(
                f"kv-canary: {name} is not aligned the way XLA needs for a zero-copy import: {e}"
            ) from None
        raise
    except Exception as e:  # JaxRuntimeError for exotic strides
        raise ValueError(f"kv-canary: {name} cannot be imported into JAX without a copy: {e}") from None
    if np.dtype(arr.dtype).itemsize != t.element_size() or tuple(arr.shape) != tuple(t.shape):
        raise TypeError(
            f"kv-canary: {name} changed type on import ({t.dtype}{tuple(t.shape)} -> {arr.dtype}{tuple(arr.shape)})"
        )
    if t.numel() > 0 and arr.unsafe_buffer_pointer() != t.data_ptr():
        raise ValueError(
            f"kv-canary: {name} was copied on import (0x{t.data_ptr():x} -> 0x{arr.unsafe_buffer_pointer():x}); "
            "refusing a silent copy"
        )
    return arr


def to_torch(a: jax.Array) -> torch.Tensor:
    """Exports a JAX array to torch without a copy (on CUDA, torch's current stream waits for it)."""
    return torch.from_dlpack(a)


# --- import cache -----------------------------------------------------------------------------------------
class ImportCache:
    """Imported JAX arrays (or other per-tensor values) keyed by (device, data pointer, shape, dtype), alive
    while the torch tensors they were made from are.

    Entries are dropped as soon as one of their owner tensors dies (weak references), when an array was
    donated (deleted) and not replaced, or when the cache exceeds ``max_entries`` (least recently used first).
    Never hold an owner strongly next to an entry: import views of the owners (``fresh_view``), since an
    imported tensor itself is kept alive by its DLPack export and its weak reference would never fire. While
    an entry lives, its array keeps the torch storage alive, so the address cannot be reused by another tensor.
    """

    def __init__(self, max_entries: int = 1024):
        self._max = int(max_entries)
        self._d: collections.OrderedDict[Hashable, tuple[Any, tuple]] = collections.OrderedDict()
        self._keys_by_ref: dict[int, set] = {}  # id(weak reference) -> keys of the entries it guards
        self._lock = threading.RLock()
        self.hits = 0
        self.misses = 0
        self_ref = weakref.ref(self)

        def _on_death(r, self_ref=self_ref):
            c = self_ref()
            if c is not None:
                with c._lock:
                    for key in c._keys_by_ref.pop(id(r), set()).copy():
                        c._drop(key)

        self._on_death = _on_death

    @staticmethod
    def key_for(t: torch.Tensor, extra: Hashable = None) -> Hashable:
        return (t.get_device(), t.data_ptr(), t.shape, t.dtype, extra)  # device index: -1 on the CPU

    def ref(self, owner: Any) -> weakref.ref:
        """A weak reference to ``owner`` that evicts this cache's entries of ``owner`` when it dies."""
        return weakref.ref(owner, self._on_death)

    def get(self, key: Hashable) -> Any:
        # a hit takes no lock (dict reads and move_to_end are atomic under the GIL): launches look up every call
        entry = self._d.get(key)
        if entry is not None:
            arr, refs = entry
            live = True
            for r in refs:
                if r() is None:
                    live = False
            if live and not (arr.__class__ is not tuple and isinstance(arr, jax.Array) and arr.is_deleted()):
                try:
                    self._d.move_to_end(key)
                except KeyError:  # dropped meanwhile by another thread: still a valid value for this call
                    pass
                self.hits += 1
                return arr
            with self._lock:
                if self._d.get(key) is entry:  # not replaced by another thread meanwhile
                    self._drop(key)
        self.misses += 1
        return None

    def put(self, key: Hashable, arr: Any, owners: Iterable[Any]) -> None:
        """Stores ``arr`` under ``key``; ``owners`` are tensors or weak references made by :meth:`ref`."""
        refs = tuple(o if isinstance(o, weakref.ref) else self.ref(o) for o in owners)
        if not refs or any(r() is None for r in refs):
            return
        with self._lock:
            self._drop(key)
            self._d[key] = (arr, refs)
            for r in refs:
                self._keys_by_ref.setdefault(id(r), set()).add(key)
            while len(self._d) > self._max:
                self._drop(next(iter(self._d)))

    def _drop(self, key: Hashable) -> None:
        entry = self._d.pop(key, None)
        if entry is None:
            return
        for r in entry[1]:
            keys = self._keys_by_ref.get(id(r))
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._keys_by_ref[id(r)]

    def discard(self, key: Hashable) -> None:
        with self._lock:
            self._drop(key)

    def clear(self) -> None:
        with self._lock:
            self._d.clear()
            self._keys_by_ref.clear()

    def __len__(self) -> int:
        return len(self._d)
