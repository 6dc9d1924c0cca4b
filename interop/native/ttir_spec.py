"""A compiled ``pallas_call``'s :class:`KernelSpec` (Triton IR, grid, launch options) and its disk cache.

:mod:`interop.native.triton_ttir` lowers an equation to a spec and keeps it here: ``specs/<sha256>.json`` under
:func:`cache_dir`, keyed by :func:`_disk_key` (everything the lowering depends on), written atomically
(:func:`write_atomic`) and read back by :func:`_load_spec` (a missing or damaged file reads as a miss).
:mod:`interop.native.triton_ttir` re-exports every name here (their first home). Imports neither triton nor
torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import pathlib
import sys
import tempfile
from typing import Any

import numpy as np

CACHE_ENV = "CANARY_JAX_TRITON_CACHE"
"""Environment variable naming the cache directory (default ``~/.cache/canary_jax/triton``)."""

_SPEC_FORMAT = 1  # bump when the on-disk spec or its key material changes


# --- the spec ----------------------------------------------------------------------------------------------
def spec_key(ttir: str, num_warps: int, num_stages: int) -> str:
    """The cache key of a kernel: sha256 hex of ``(ttir, num_warps, num_stages)`` (a JSON array)."""
    return hashlib.sha256(json.dumps([ttir, int(num_warps), int(num_stages)]).encode()).hexdigest()


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """One compiled-mode ``pallas_call`` as a Triton kernel: what :class:`TritonKernel` compiles and launches.

    Fields:
      name: the ``pallas_call``'s name (``name=``, e.g. ``"canary_verify"``); else the TTIR function's name.
      ttir: the Triton IR module text (one ``tt.func``, every parameter a pointer), locations stripped.
      grid: the launch grid ``(x, y, z)``.
      num_warps: warps per program (the ``pallas_call``'s compiler params, default 4).
      num_stages: software-pipelining stages (default 3, jax's CUDA default).
      num_inputs: pointer parameters that are the equation's inputs (first).
      num_outputs: pointer parameters that are its outputs (after the inputs).
      key: :func:`spec_key` of ``(ttir, num_warps, num_stages)``, the cache key.

    Raises:
      ValueError: a key that is not the spec's own, a grid that is not 3 positive ints, negative counts.
    """

    name: str
    ttir: str
    grid: tuple[int, int, int]
    num_warps: int
    num_stages: int
    num_inputs: int
    num_outputs: int
    key: str

    def __post_init__(self):
        if len(self.grid) != 3 or any(not isinstance(g, int) or g < 1 for g in self.grid):
            raise ValueError(f"kv-canary: KernelSpec {self.name}: grid must be 3 positive ints, got {self.grid!r}")
        if self.num_inputs < 0 or self.num_outputs < 0 or self.num_warps < 1 or self.num_stages < 1:
            raise ValueError(
                f"kv-canary: KernelSpec {self.name}: bad counts (inputs {self.num_inputs}, outputs "
                f"{self.num_outputs}, warps {self.num_warps}, stages {self.num_stages})"
            )
        if self.key != spec_key(self.ttir, self.num_warps, self.num_stages):
            raise ValueError(f"kv-canary: KernelSpec {self.name}: key {self.key[:16]}... is not the spec's own")


# --- caches ------------------------------------------------------------------------------------------------
def cache_dir() -> pathlib.Path:
    """``$CANARY_JAX_TRITON_CACHE`` or ``~/.cache/canary_jax/triton``, created if missing.

    Holds ``specs/<sha256>.json`` (one :class:`KernelSpec` per lowered equation, keyed by what the lowering
    depends on) and ``<key>.ttir`` (the TTIR files triton compiles). Triton keeps the compiled kernels in its
    own cache (``$TRITON_CACHE_DIR``, default ``~/.triton/cache``).
    """
    env = os.environ.get(CACHE_ENV)
    path = pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "canary_jax" / "triton"
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_atomic(path: pathlib.Path, text: str) -> None:
    """Writes ``text`` to ``path`` through a temporary file and ``os.replace`` (readers never see a partial file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


_CAPABILITY: list[str] = []


def _lowering_capability() -> str:
    """The compute capability jax lowers for (its first GPU's, else 9.0), as ``pallas_call_lowering`` picks it."""
    if not _CAPABILITY:
        import jax

        try:
            cc = str(jax.local_devices(backend="gpu")[0].compute_capability)
        except Exception:  # noqa: BLE001 - no GPU backend: jax falls back to 9.0
            cc = "9.0"
        _CAPABILITY.append(cc)
    return _CAPABILITY[0]


def _describe(value: Any) -> str:
    return value if isinstance(value, str) else str(value)


def _disk_key(params: dict, avals_in: tuple, avals_out: tuple) -> str:
    """sha256 of everything the lowering depends on: versions, x64, the capability, the avals and every
    parameter but ``debug`` as text (the kernel jaxpr in full, literals unabbreviated)."""
    import jax
    import jaxlib

    jaxpr = params.get("jaxpr")
    with np.printoptions(threshold=sys.maxsize):
        described = {name: _describe(value) for name, value in sorted(params.items()) if name != "debug"}
    material = {
        "format": _SPEC_FORMAT,
        "jax": jax.__version__,
        "jaxlib": getattr(jaxlib, "__version__", ""),
        "x64": bool(jax.config.jax_enable_x64),
        "capability": _lowering_capability(),
        "func": str(getattr(getattr(jaxpr, "debug_info", None), "func_name", "")),
        "in": [str(a) for a in avals_in],
        "out": [str(a) for a in avals_out],
        "params": described,
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


def _load_spec(path: pathlib.Path) -> KernelSpec | None:
    try:
        d = json.loads(path.read_text())
        if d.pop("format", None) != _SPEC_FORMAT:
            return None
        d["grid"] = tuple(d["grid"])
        return KernelSpec(**d)
    except (OSError, ValueError, TypeError, KeyError):  # missing or damaged: lower again
        return None
