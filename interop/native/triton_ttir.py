"""Pallas ``pallas_call`` equations as :class:`KernelSpec` s (Triton IR, grid, launch options), without triton.

The native torch path (issue #15) runs every compiled ``pallas_call`` equation of a launch's jaxpr as one Triton
kernel; this module turns the equation into the spec that :mod:`interop.native.triton_kernels` compiles and
launches with the ``triton`` package (this module itself imports neither triton nor torch):

* :func:`kernel_spec` lowers the equation once for the ``"cuda"`` platform (this works on a CPU-only host: jax
  falls back to compute capability 9.0) with ``debug=True``, which makes jax print the kernel's Triton IR
  (TTIR); the printed module, its locations stripped (:func:`strip_locations`), is the :class:`KernelSpec`. On
  jaxlibs that compile the TTIR inside the lowering (after 0.10.2) the lowering stops once it is printed.
* Specs are memoised in process (:func:`clear_memo`, :func:`lowering_count`) and on disk (:func:`cache_dir`),
  so a second process does not lower again; the spec type and that disk cache are
  :mod:`interop.native.ttir_spec`'s (re-exported here).

Where the behaviour comes from (jax 0.10.2 here, 0.11.2 on the H200 image):

* The launch ABI is jax's (``jax/_src/pallas/triton/pallas_call_registration.py``, ``pallas_call_lowering``):
  the kernel takes one pointer per input buffer, then one per output buffer (an output listed in
  ``input_output_aliases`` is the very buffer of its input), and nothing else; the grid is ``lowering.grid``
  (``lowering._process_grid_to_3d_grid``, mirrored by :func:`launch_grid`) padded to 3 dims; ``num_warps``
  defaults to 4 and ``num_stages`` to 3 on CUDA.
* The lowering (``jax/_src/pallas/triton/lowering.py``, ``lower_jaxpr_to_triton_module``) marks every pointer
  parameter ``tt.divisibility = 32`` (jax 0.10.2), and Triton's code generation may rely on it (vector loads):
  :func:`pointer_alignments` reads it for the launcher's checks.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import io
import json
import threading
from typing import Any

import numpy as np

from interop.native.ttir_spec import (  # noqa: F401  (re-exported: their first home is here)
    _CAPABILITY,
    _SPEC_FORMAT,
    CACHE_ENV,
    KernelSpec,
    _describe,
    _disk_key,
    _load_spec,
    _lowering_capability,
    cache_dir,
    spec_key,
    write_atomic,
)
from interop.native.ttir_text import MODULE_START, pointer_alignments, strip_locations, ttir_params

__all__ = [
    "CACHE_ENV",
    "KernelSpec",
    "cache_dir",
    "clear_memo",
    "kernel_spec",
    "launch_grid",
    "lowering_count",
    "pointer_alignments",
    "spec_key",
    "strip_locations",
    "ttir_params",
    "write_atomic",
]

_MEMO_ENTRIES = 512


# --- lowering ----------------------------------------------------------------------------------------------
def launch_grid(grid_mapping: Any) -> tuple[int, int, int]:
    """The CUDA launch grid of a Pallas Triton kernel, as jax computes it.

    Mirrors ``jax/_src/pallas/triton/lowering.py`` ``_process_grid_to_3d_grid`` (unmapped dims in order, then
    vmapped dims inner to outer; leading dims collapsed into x when there are more than 3 or y / z exceed
    65535) and ``pallas_call_registration.normalize_grid`` (padded with 1s).

    Raises:
      NotImplementedError: a dynamic grid bound (jax's Triton lowering refuses them too).
    """
    if getattr(grid_mapping, "num_dynamic_grid_bounds", 0):
        raise NotImplementedError("kv-canary: dynamic grid bounds are not supported by the Triton backend")
    grid = tuple(int(s) for s in grid_mapping.grid)
    vmapped = tuple(getattr(grid_mapping, "vmapped_dims", ()))
    launch = [s for i, s in enumerate(grid) if i not in vmapped] + [grid[d] for d in reversed(vmapped)]
    collapse = len(launch[:-2])
    limit = 2**16 - 1
    if collapse + 1 < len(launch) and launch[collapse + 1] > limit:
        collapse += 2
    elif collapse < len(launch) and launch[collapse] > limit:
        collapse += 1
    if collapse:
        launch = [int(np.prod(launch[:collapse])), *launch[collapse:]]
    if len(launch) > 3:
        raise ValueError(f"kv-canary: launch grid {launch} has more than 3 dims")
    return tuple(launch) + (1,) * (3 - len(launch))  # type: ignore[return-value]


def _launch_options(compiler_params: Any) -> tuple[int, int]:
    """``(num_warps, num_stages)`` as jax's CUDA lowering resolves them (defaults 4 and 3)."""
    if compiler_params is None:
        warps = stages = None
    elif isinstance(compiler_params, dict):  # older jax: {"triton": {...}} or the dict itself
        p = compiler_params.get("triton", compiler_params)
        warps, stages = p.get("num_warps"), p.get("num_stages")
    else:
        warps, stages = getattr(compiler_params, "num_warps", None), getattr(compiler_params, "num_stages", None)
    return (4 if warps is None else int(warps)), (3 if stages is None else int(stages))


def _label(params: dict) -> str:
    name = params.get("name")
    if name:
        return str(name)
    info = getattr(params.get("jaxpr"), "debug_info", None)
    return str(getattr(info, "func_name", None) or "<unnamed pallas_call>")


class _TtirCaptured(Exception):
    """Stops a lowering once the TTIR is printed (newer jaxlibs compile it with their own Triton next)."""


_LOCAL = threading.local()
_LOWER_LOCK = threading.Lock()


class _CompileProxy:
    """Stands in for jaxlib's ``triton`` module inside ``pallas_call_registration`` during our lowering.

    jaxlibs after 0.10.2 compile the TTIR to PTX inside the lowering rule (``triton.compile(platform, ...)``),
    seconds per kernel that :func:`kernel_spec` would throw away. Only the thread that runs
    :func:`kernel_spec` stops there; other threads reach the real module.
    """

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    def compile(self, *args, **kwargs):
        if getattr(_LOCAL, "skip_compile", False):
            _LOCAL.captured = True
            raise _TtirCaptured()
        return self._real.compile(*args, **kwargs)


@contextlib.contextmanager
def _gpu_info_without_a_gpu():
    """jax 0.12 refuses to lower a Triton ``pallas_call`` with no GPU present where earlier jax fell back to compute
    capability 9.0; this restores that target (the H200's: sm_90) for the lowering when no GPU is found. jax 0.12.0
    reads it from ``jax._src.pallas.triton.gpu_info`` (patched here); 0.12.1 and later from ``jax._src.gpu_info``,
    which takes the target from the public abstract device (``jax.sharding.use_abstract_mesh`` with an
    ``AbstractDevice``), as its error message asks."""
    try:
        from jax._src import gpu_info as gi  # jax >= 0.12.1
    except ImportError:
        gi = None
    if gi is not None:
        with _abstract_gpu_unless_present(gi):
            yield
        return
    try:
        from jax._src.pallas.triton import gpu_info as gi
    except ImportError:  # jax <= 0.11: the lowering falls back by itself
        yield
        return
    real = gi.get_gpu_info

    def with_fallback():
        try:
            return real()
        except ValueError:  # no GPU device
            return gi._get_gpu_info_impl(gi.GpuVersion.H200)

    gi.get_gpu_info = with_fallback
    try:
        yield
    finally:
        gi.get_gpu_info = real


@contextlib.contextmanager
def _abstract_gpu_unless_present(gi):
    """An abstract H200 device for the lowering where ``gi.get_gpu_info()`` finds no GPU; nothing otherwise."""
    import jax

    try:
        gi.get_gpu_info()
    except ValueError:  # no GPU device: lower for the H200 (sm_90)
        device = jax.sharding.AbstractDevice(device_kind=str(gi.GpuVersion.H200), num_cores=None, platform="cuda")
        with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device)):
            yield
        return
    yield


@contextlib.contextmanager
def _skip_jaxlib_compile():
    try:
        from jax._src.pallas.triton import pallas_call_registration as reg
    except ImportError:  # another jax layout: lower with whatever compile it does
        reg = None
    real = getattr(reg, "triton", None)
    patch = real is not None and callable(getattr(real, "compile", None)) and not isinstance(real, _CompileProxy)
    if patch:
        reg.triton = _CompileProxy(real)
    _LOCAL.skip_compile, _LOCAL.captured = True, False
    try:
        yield
    finally:
        _LOCAL.skip_compile = False
        if patch:
            reg.triton = real


def _lower_and_print(eqn: Any, params: dict, avals_in: tuple) -> str:
    """What lowering ``eqn`` for ``"cuda"`` with ``debug=True`` prints (the kernel jaxpr, grid mapping, TTIR)."""
    import jax

    bind_params = dict(params, debug=True)

    def launch(*args):
        return eqn.primitive.bind(*args, **bind_params)

    buf = io.StringIO()
    with _LOWER_LOCK, _skip_jaxlib_compile(), _gpu_info_without_a_gpu(), contextlib.redirect_stdout(buf):
        try:
            jax.jit(launch).trace(*avals_in).lower(lowering_platforms=("cuda",))
        except Exception:  # noqa: BLE001 - ours (possibly wrapped by jax) once the TTIR is out; anything else raises
            if not getattr(_LOCAL, "captured", False):
                raise
    return buf.getvalue()


_LOWER_COUNT = [0]


def _lower_spec(eqn: Any, label: str, params: dict, avals_in: tuple, avals_out: tuple) -> KernelSpec:
    _LOWER_COUNT[0] += 1
    printed = _lower_and_print(eqn, params, avals_in)
    starts = [m.start() for m in MODULE_START.finditer(printed)]
    if len(starts) != 1:
        raise ValueError(
            f"kv-canary: lowering pallas_call {label} for cuda printed {len(starts)} Triton modules, expected exactly 1"
        )
    ttir = strip_locations(printed[starts[0] :])
    func, ptr_params = ttir_params(ttir)
    n_in, n_out = len(avals_in), len(avals_out)
    if len(ptr_params) != n_in + n_out:
        raise ValueError(
            f"kv-canary: pallas_call {label}: its TTIR function takes {len(ptr_params)} parameters, the equation has "
            f"{n_in} inputs + {n_out} outputs"
        )
    pointer_alignments(ttir, label)
    warps, stages = _launch_options(params.get("compiler_params"))
    return KernelSpec(
        name=str(params.get("name") or func),
        ttir=ttir,
        grid=launch_grid(params["grid_mapping"]),
        num_warps=warps,
        num_stages=stages,
        num_inputs=n_in,
        num_outputs=n_out,
        key=spec_key(ttir, warps, stages),
    )


_MEMO: collections.OrderedDict = collections.OrderedDict()
_MEMO_LOCK = threading.Lock()


def clear_memo() -> None:
    """Forgets the in-process specs (the disk cache stays)."""
    with _MEMO_LOCK:
        _MEMO.clear()


def lowering_count() -> int:
    """How many equations :func:`kernel_spec` has lowered in this process (cache misses; tests pin hits)."""
    return _LOWER_COUNT[0]


def kernel_spec(eqn: Any) -> KernelSpec:
    """The :class:`KernelSpec` of one compiled-mode ``pallas_call`` equation.

    Lowers ``eqn`` for ``"cuda"`` (``jax.jit`` of a function binding ``eqn.primitive`` with ``eqn.params`` but
    ``debug=True``, ``.trace(*avals).lower(lowering_platforms=("cuda",))``, stdout captured) and takes the one
    Triton module jax prints, locations stripped. On jaxlibs that compile the TTIR inside the lowering (after
    0.10.2) the lowering stops once the module is printed (our compile is triton's, later).

    Memoised in process by the identity of every equation parameter (held, so an id cannot be reused) and the
    avals; and on disk under :func:`cache_dir` by a sha256 of the versions, x64 mode, lowering capability,
    avals and every parameter's text, so another process with the same kernel does not lower.

    Args:
      eqn: a ``jax.core.JaxprEqn`` of primitive ``pallas_call`` with ``params["interpret"]`` false.

    Returns:
      The spec: ``num_inputs = len(eqn.invars)``, ``num_outputs = len(eqn.outvars)``, grid and warps from the
      equation's grid mapping and compiler params.

    Raises:
      TypeError: ``eqn`` is not a ``pallas_call`` equation.
      ValueError: the kernel is interpreted (``interpret`` true), the lowering printed no or several Triton
        modules, or the TTIR's parameters do not match the equation; each message names the kernel.
      NotImplementedError: a dynamic grid or a non-pointer kernel parameter.
    """
    primitive = getattr(eqn, "primitive", None)
    if getattr(primitive, "name", None) != "pallas_call":
        raise TypeError(f"kv-canary: kernel_spec needs a pallas_call equation, got {getattr(primitive, 'name', eqn)!r}")
    params = eqn.params
    label = _label(params)
    if params.get("interpret"):
        raise ValueError(
            f"kv-canary: pallas_call {label} runs interpreted (interpret={params.get('interpret')!r}); only compiled "
            "kernels (interpret=False) have a Triton kernel"
        )
    avals_in = tuple(v.aval for v in eqn.invars)
    avals_out = tuple(v.aval for v in eqn.outvars)
    values = tuple(params.values())
    memo_key = (tuple(params), tuple(id(v) for v in values), avals_in, avals_out)
    with _MEMO_LOCK:
        hit = _MEMO.get(memo_key)
        if hit is not None and all(a is b for a, b in zip(hit[0], values)):
            _MEMO.move_to_end(memo_key)
            return hit[1]
    path = cache_dir() / "specs" / f"{_disk_key(params, avals_in, avals_out)}.json"
    spec = _load_spec(path)
    if spec is None:
        spec = _lower_spec(eqn, label, params, avals_in, avals_out)
        with contextlib.suppress(OSError):  # a read-only cache only costs the next process a lowering
            write_atomic(path, json.dumps({"format": _SPEC_FORMAT, **dataclasses.asdict(spec)}))
    with _MEMO_LOCK:
        _MEMO[memo_key] = (values, spec)  # holds the values: their ids stay theirs while the entry lives
        while len(_MEMO) > _MEMO_ENTRIES:
            _MEMO.popitem(last=False)
    return spec
