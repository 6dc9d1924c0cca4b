"""Pallas ``pallas_call`` s as Triton kernels launched from torch: compile and launch with the ``triton`` package.

The native torch path (issue #15) runs every compiled ``pallas_call`` equation of a launch's jaxpr as one Triton
kernel compiled by the ``triton`` package that torch ships, launched on torch's current CUDA stream with torch
tensors, with no JAX runtime per call. :mod:`interop.native.triton_ttir` turns the equation into a
:class:`KernelSpec` (its TTIR, grid and launch options; :func:`kernel_spec`, re-exported here with the other
spec and cache names); this module compiles and launches it:

1. :class:`TritonKernel` compiles a spec for its device (``triton.compile`` of the TTIR file, triton's own cache
   keeps the cubin) and launches it: ``launch(args)`` with one CUDA tensor per input, then one per output,
   checked first; ``launch_ptrs(ptrs)`` with raw data pointers for callers that guarantee what ``launch`` checks.
2. :func:`compile_offline` compiles a spec for ``sm_<capability>`` without a GPU (ptxas ships in the triton
   wheel), so CPU tests prove that the TTIR our jax emits compiles with torch's triton.

Where the behaviour comes from (triton 3.6.0; the launch ABI and pointer alignments are jax's, see
:mod:`interop.native.triton_ttir`):

* ``triton.compile`` of a ``.ttir`` path starts after Triton's own TTIR stage (``triton/compiler/compiler.py``:
  an IR source skips the passes of its own stage), while XLA starts its Triton pipeline with them
  (``xla/backends/gpu/codegen/triton/compilation_pipeline_cuda.cc``, "Based on make_ttir()": inliner, tensor
  pointer rewrite, canonicalize, combine, reorder broadcast, CSE, symbol DCE, loop unroll).
  :func:`optimized_ttir` therefore runs the nvidia backend's ``make_ttir`` first (it also halves the compile
  time of the write kernels).
* Every pointer parameter is ``tt.divisibility = 32`` (jax 0.10.2), and Triton's code generation may rely on it
  (vector loads): :meth:`TritonKernel.launch` refuses any pointer not aligned to its parameter's divisibility.
* The launch is ``CompiledKernel.__getitem__``'s (``triton/compiler/compiler.py``) without its per-call
  overhead: ``run(gx, gy, gz, stream, function, packed_metadata, launch_metadata, enter_hook, exit_hook,
  *pointers)``; ``run`` is the nvidia ``CudaLauncher``, which allocates per-launch global scratch (for kernels
  whose ``metadata.global_scratch_size > 0``) through ``triton.set_allocator`` (see :meth:`TritonKernel.launch`).
"""

from __future__ import annotations

import functools
import pathlib
import re
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from interop.native.triton_ttir import (
    CACHE_ENV,
    KernelSpec,
    cache_dir,
    clear_memo,
    kernel_spec,
    launch_grid,
    lowering_count,
    pointer_alignments,
    spec_key,
    strip_locations,
    ttir_params,
    write_atomic,
)

__all__ = [
    # compile and launch (this module)
    "TritonKernel",
    "compile_offline",
    "optimized_ttir",
    "triton_available",
    # re-exported from interop.native.triton_ttir for existing callers
    "CACHE_ENV",
    "KernelSpec",
    "cache_dir",
    "clear_memo",
    "kernel_spec",
    "launch_grid",
    "lowering_count",
    "spec_key",
    "strip_locations",
    "ttir_params",
]


# --- compile -----------------------------------------------------------------------------------------------
@functools.cache
def triton_available() -> bool:
    """Whether Triton kernels can run here: ``import triton`` works and ``torch.cuda.is_available()``. Never
    raises; asked once per process (the launchers ask on every launch)."""
    try:
        import triton  # noqa: F401

        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001 - any import or driver failure means "no"
        return False


def _ttir_path(spec: KernelSpec) -> pathlib.Path:
    path = cache_dir() / f"{spec.key}.ttir"
    if not path.exists():
        write_atomic(path, spec.ttir)
    return path


def optimized_ttir(spec: KernelSpec, capability: int = 90) -> pathlib.Path:
    """The TTIR file triton compiles for ``spec``: ``spec.ttir`` after the nvidia backend's ``make_ttir``
    passes (inliner, tensor-pointer rewrite, canonicalize, combine, reorder broadcast, CSE, symbol DCE, loop
    unroll: ``triton/backends/nvidia/compiler.py``), which ``triton.compile`` skips for a ``.ttir`` source.

    Written to ``cache_dir()/<key>.triton-<version>.sm<capability>.ttir`` (the raw text is
    ``cache_dir()/<key>.ttir``); needs the ``triton`` package, no GPU.
    """
    import triton

    out = cache_dir() / f"{spec.key}.triton-{triton.__version__}.sm{capability}.ttir"
    if out.exists():
        return out
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    raw = _ttir_path(spec)
    backend = make_backend(GPUTarget("cuda", capability, 32))
    options = backend.parse_options({"num_warps": spec.num_warps, "num_stages": spec.num_stages})
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = ir.parse_mlir_module(str(raw), context)
    module.context = context
    backend.make_ttir(module, {}, options, capability)
    write_atomic(out, module.str_nodebug())
    return out


def _compile(spec: KernelSpec, capability: int):
    """``(CompiledKernel, seconds)``: ``triton.compile`` of ``spec`` for ``GPUTarget("cuda", capability, 32)``."""
    import triton
    from triton.backends.compiler import GPUTarget

    t = time.perf_counter()
    path = optimized_ttir(spec, capability)
    compiled = triton.compile(
        str(path),
        target=GPUTarget("cuda", capability, 32),
        options={"num_warps": spec.num_warps, "num_stages": spec.num_stages},
    )
    return compiled, time.perf_counter() - t


_PTX_ENTRY = re.compile(r"\.entry\s+([\w$]+)\s*\(([^)]*)\)", re.S)


def compile_offline(spec: KernelSpec, capability: int = 90) -> dict:
    """Compiles ``spec`` for ``sm_<capability>`` without a GPU (ptxas ships in the triton wheel).

    Args:
      spec: the kernel.
      capability: the compute capability as an int (90 for the H100 / H200).

    Returns:
      ``{"name": the kernel's entry name, "shared_bytes": its static shared memory, "num_params": parameters of
      the PTX entry (the pointers plus the global and profile scratch pointers triton 3.6 appends),
      "global_scratch_size": bytes of global scratch per program (0: none needed), "compile_s": wall seconds,
      a hit in triton's cache included}``.

    Raises:
      ImportError: no ``triton`` package.
    """
    compiled, seconds = _compile(spec, capability)
    md = compiled.metadata
    m = _PTX_ENTRY.search(compiled.asm["ptx"])
    return {
        "name": str(md.name),
        "shared_bytes": int(md.shared),
        "num_params": m.group(2).count(".param") if m else -1,
        "global_scratch_size": int(getattr(md, "global_scratch_size", 0) or 0),
        "compile_s": round(seconds, 3),
    }


# --- launch ------------------------------------------------------------------------------------------------
def _torch_scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """triton's allocator protocol backed by torch's caching allocator (current device and stream), so a CUDA
    graph capture records the allocation in its pool."""
    del stream  # torch allocates on the current stream, which the launch uses
    buf = torch.empty(size, dtype=torch.uint8, device="cuda")
    if buf.data_ptr() % alignment:
        raise RuntimeError(f"kv-canary: torch gave scratch at 0x{buf.data_ptr():x}, need {alignment}-byte alignment")
    return buf


def _hooks_on(hook: Any) -> bool:
    """Whether a triton launch hook will do something: triton 3.6 keeps a ``HookChain`` (empty by default)."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return True if calls is None else bool(calls)


class TritonKernel:
    """A :class:`KernelSpec` compiled for one CUDA device and launched on torch's current stream.

    Args:
      spec: the kernel.
      device: a CUDA ``torch.device`` (``cuda`` without an index: the current device at construction).

    Raises:
      ValueError: ``device`` is not a CUDA device.
      NotImplementedError: a kernel parameter that is not a pointer.
    """

    def __init__(self, spec: KernelSpec, device: torch.device):
        if not isinstance(spec, KernelSpec):
            raise TypeError(f"kv-canary: TritonKernel needs a KernelSpec, got {type(spec).__name__}")
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"kv-canary: Triton kernel {spec.name} needs a CUDA device, got {device}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
        self.spec = spec
        self.device = device
        self._index = device.index
        self._align = pointer_alignments(spec.ttir, spec.name)
        n = spec.num_inputs + spec.num_outputs
        if len(self._align) != n:
            raise ValueError(
                f"kv-canary: Triton kernel {spec.name}: TTIR takes {len(self._align)} pointers, the spec says "
                f"{spec.num_inputs} inputs + {spec.num_outputs} outputs"
            )
        self._lock = threading.Lock()
        self._compiled = None
        self._run = None
        self._function = None
        self._packed = None
        self._runtime = None  # triton.knobs.runtime (launch hooks)
        self._scratch = False

    @property
    def alignments(self) -> tuple[int, ...]:
        """Per argument (inputs, then outputs), the byte alignment its data pointer needs: the TTIR parameter's
        ``tt.divisibility`` (32 for every pointer with jax 0.10.2)."""
        return tuple(self._align)

    def compile(self) -> None:
        """Compiles for the device's compute capability and loads the kernel on it (idempotent, thread-safe).

        The TTIR goes to ``cache_dir()/<key>.ttir`` (and its ``make_ttir``-optimised form beside it, see
        :func:`optimized_ttir`); triton's cache keeps the cubin, so a second process only loads it.

        Raises:
          RuntimeError: no triton or no CUDA here; triton's own errors (e.g. ``OutOfResources``).
        """
        if self._run is not None:
            return
        with self._lock:
            if self._run is not None:
                return
            if not triton_available():
                raise RuntimeError(f"kv-canary: Triton kernel {self.spec.name} needs the triton package and CUDA")
            from triton import knobs

            major, minor = torch.cuda.get_device_capability(self._index)
            compiled, _ = _compile(self.spec, major * 10 + minor)
            with torch.cuda.device(self._index):
                run = compiled.run  # CompiledKernel._init_handles: loads the cubin on the current device
            md = compiled.metadata
            self._scratch = int(getattr(md, "global_scratch_size", 0) or 0) > 0
            self._compiled = compiled
            self._function = compiled.function
            self._packed = compiled.packed_metadata
            self._runtime = knobs.runtime
            self._run = run

    def _pointers(self, args: Sequence[torch.Tensor]) -> list[int]:
        spec = self.spec
        if len(args) != len(self._align):
            raise ValueError(
                f"kv-canary: Triton kernel {spec.name} takes {spec.num_inputs} inputs + {spec.num_outputs} outputs "
                f"= {len(self._align)} tensors, got {len(args)}"
            )
        ptrs = []
        for i, (t, align) in enumerate(zip(args, self._align)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(
                    f"kv-canary: Triton kernel {spec.name}: argument {i} is {type(t).__name__}, not a tensor"
                )
            p = t.data_ptr()
            if p % align:
                raise ValueError(
                    f"kv-canary: Triton kernel {spec.name}: argument {i} data pointer 0x{p:x} is not aligned to "
                    f"{align} bytes (its TTIR parameter declares tt.divisibility = {align})"
                )
            if not t.is_contiguous():
                raise ValueError(
                    f"kv-canary: Triton kernel {spec.name}: argument {i} (pointer 0x{p:x}) is not contiguous"
                )
            if t.get_device() != self._index:
                raise ValueError(
                    f"kv-canary: Triton kernel {spec.name}: argument {i} (pointer 0x{p:x}) is on {t.device}, the "
                    f"kernel runs on {self.device}"
                )
            ptrs.append(p)
        return ptrs

    def launch(self, args: Sequence[torch.Tensor]) -> None:
        """Launches the kernel on ``torch.cuda.current_stream(device)`` (so a CUDA graph capture records it).

        Args:
          args: ``num_inputs`` tensors, then ``num_outputs`` tensors, all contiguous, on the kernel's device,
            with data pointers aligned as the TTIR declares (``tt.divisibility``, 32 bytes with jax 0.10.2). An
            aliased output (``input_output_aliases``) is the same tensor as its input. Shapes and dtypes are
            the caller's to get right: the kernel sees raw pointers (its TTIR has the shapes baked in).

        Checks run before anything touches CUDA; the first launch compiles (:meth:`compile`). A kernel with
        global scratch allocates it per launch through triton's allocator; if none is set in this context, a
        torch-backed one is installed (``triton.set_allocator``). Launch hooks (``triton.knobs.runtime.
        launch_enter_hook`` / ``launch_exit_hook``) are honoured when any is registered.

        Raises:
          ValueError: wrong argument count, misaligned or non-contiguous tensor, tensor on another device;
            the message names the kernel, the argument index and its pointer.
          TypeError: an argument that is not a tensor.
        """
        self.launch_ptrs(self._pointers(args))

    def launch_ptrs(self, ptrs: Sequence[int]) -> None:
        """:meth:`launch` with the data pointers given (operands, then results) and nothing checked: the native
        program's launch (:class:`interop.native.program.Program` keeps its buffers contiguous, aligned as
        :attr:`alignments` says and on the kernel's device, and allocates the results).

        The same call into triton's launcher as ``launch`` (first launch compiles, the kernel's device is made
        current if it is not, the current stream, scratch allocator and launch hooks as ``launch``). A broken
        contract is undefined behaviour: wrong bytes, a CUDA fault (which poisons the CUDA context), or an error
        from triton's launcher, never one of :meth:`launch`'s messages.
        """
        if self._run is None:
            self.compile()
        if torch.cuda.current_device() != self._index:
            with torch.cuda.device(self._index):
                self._launch(ptrs)
        else:
            self._launch(ptrs)

    def _launch(self, ptrs: list[int]) -> None:
        stream = torch._C._cuda_getCurrentRawStream(self._index)
        gx, gy, gz = self.spec.grid
        if self._scratch:
            _ensure_allocator()
        runtime = self._runtime
        enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
        if _hooks_on(enter) or _hooks_on(leave):
            meta = self._compiled.launch_metadata(self.spec.grid, stream, *ptrs)
            self._run(gx, gy, gz, stream, self._function, self._packed, meta, enter, leave, *ptrs)
        else:
            self._run(gx, gy, gz, stream, self._function, self._packed, None, None, None, *ptrs)


def _ensure_allocator() -> None:
    import triton
    from triton.runtime import _allocation

    if _allocation._allocator.get() is _allocation._NULL_ALLOCATOR:
        triton.set_allocator(_torch_scratch)
