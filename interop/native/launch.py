"""The native torch path of the launchers: trace once, then run the launch's kernels as Triton kernels on torch's
stream.

:func:`run_native` has :func:`interop.runner.run_in_place`'s contract (same body factories, same in-place
result) without JAX at launch time: the first launch of a (op, statics, shapes, dtypes, device, x64) traces the
body with ``jax.make_jaxpr`` on abstract values and builds a :class:`~interop.native.program.Program`; every
later launch runs that program on the caller's tensors: the Pallas kernels as Triton kernels compiled with the
``triton`` package that torch ships (:mod:`interop.native.triton_kernels`), on ``torch.cuda.current_stream()``, and
nothing between them but the copies the memory plan needs. No DLPack, no host sync: a torch CUDA graph captures a
launch.

Which path a launcher takes (:func:`resolve_path`): the ``path`` keyword, else ``$CANARY_JAX_TORCH_PATH``, else
``"native"`` for the Pallas backend on CUDA tensors when triton is importable and ``"dlpack"`` otherwise.
``path="native"`` with ``backend="pallas"`` on CPU tensors runs the same program with the Pallas kernels
interpreted by JAX (the CPU test vehicle). A body with work outside its kernels (``backend="reference"``, a plan
launch the plan kernel does not take) is refused with ``NotNative``.
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import numpy as np
import torch

from interop import buffers
from interop.buffers import TensorArg
from interop.native import environ, program, replay, storage, triton_kernels, ttir_spec, ttir_text

PATHS = ("native", "dlpack")
"""Torch launch paths: ``native`` (the launch's kernels as Triton kernels) and ``dlpack`` (a jitted JAX program)."""

PATH_ENV = "CANARY_JAX_TORCH_PATH"
"""Environment variable naming the default torch launch path (case-insensitive)."""


def resolve_path(path: str | None, device: torch.device, backend: str = "pallas") -> str:
    """The torch launch path for tensors on ``device`` running ``backend``'s kernels.

    Returns ``path`` if given, else ``$CANARY_JAX_TORCH_PATH`` if set and non-empty, else ``"native"`` for the
    Pallas backend on CUDA when :func:`interop.native.triton_kernels.triton_available`, and ``"dlpack"``
    otherwise (the jnp reference is glue, not kernels, which the native path refuses).

    Raises:
      ValueError: a name not in :data:`PATHS` (from the argument or the environment).
    """
    name = path if path is not None else (environ.get(PATH_ENV) or None)
    if name is None:
        native = device.type == "cuda" and backend == "pallas" and triton_kernels.triton_available()
        return "native" if native else "dlpack"
    low = str(name).lower()
    if low not in PATHS:
        src = "path" if path is not None else f"${PATH_ENV}"
        raise ValueError(f"kv-canary: {src} must be one of {PATHS}, got {name!r}")
    return low


_JAX_DTYPES = {
    torch.uint8: np.uint8,
    torch.int8: np.int8,
    torch.int16: np.int16,
    torch.int32: np.int32,
    torch.float16: np.float16,
    torch.float32: np.float32,
    torch.bool: np.bool_,
}


def _aval(t: torch.Tensor, name: str) -> jax.ShapeDtypeStruct:
    if t.dtype in (torch.int64, torch.uint64):
        return jax.ShapeDtypeStruct((*t.shape, 2), np.uint32)
    if t.dtype == torch.bfloat16:
        return jax.ShapeDtypeStruct(tuple(t.shape), jax.numpy.bfloat16)
    if t.dtype in (torch.float64, torch.complex128) and not jax.config.read("jax_enable_x64"):
        raise TypeError(f"kv-canary: {name} has dtype {t.dtype}, which JAX narrows with jax_enable_x64 off")
    dt = _JAX_DTYPES.get(t.dtype) or (np.float64 if t.dtype == torch.float64 else None)
    if dt is None:
        raise TypeError(f"kv-canary: {name} has dtype {t.dtype}, which the native torch path does not take")
    return jax.ShapeDtypeStruct(tuple(t.shape), dt)


@dataclasses.dataclass(frozen=True)
class _Compiled:
    """A compiled ``pallas_call`` (``interpret=False``) as a Triton kernel: launched with pointers (operands, then
    results, as XLA passes them; an aliased result is its operand's buffer), every pointer contiguous and aligned
    as the TTIR declares (:class:`interop.native.program.Program` stages what is not)."""

    kernel: Any
    aliases: tuple
    name: str

    @property
    def alignments(self) -> tuple[int, ...]:
        return self.kernel.alignments

    def launch_ptrs(self, ptrs: list[int]) -> None:
        self.kernel.launch_ptrs(ptrs)


TINY_BYTES = 16
"""Operands of at most this many bytes (counters, the write index, flags) take any element-aligned pointer: their
``tt.divisibility`` is dropped (:func:`interop.native.ttir_text.relax_alignment`), so no launch stages them."""


def compiled_pallas(eqn, device: torch.device) -> _Compiled:
    """The Triton kernel of a compiled ``pallas_call`` equation, compiled now (a kernel that does not lower or
    compile fails the build, before anything has run).

    Raises:
      NotNative: ``device`` is not a CUDA device.
    """
    if device.type != "cuda":
        raise program.NotNative(f"a compiled pallas_call ({eqn.params.get('name')}) needs CUDA tensors, not {device}")
    spec = triton_kernels.kernel_spec(eqn)
    tiny = {k for k, v in enumerate((*eqn.invars, *eqn.outvars)) if v.aval.size * v.aval.dtype.itemsize <= TINY_BYTES}
    if tiny:
        ttir = ttir_text.relax_alignment(spec.ttir, tiny)
        spec = dataclasses.replace(spec, ttir=ttir, key=ttir_spec.spec_key(ttir, spec.num_warps, spec.num_stages))
    kern = triton_kernels.TritonKernel(spec, device)
    kern.compile()
    return _Compiled(kern, _aliases(eqn), spec.name)


@dataclasses.dataclass(frozen=True)
class _Interpreted:
    """A ``pallas_call`` with ``interpret=True`` run by JAX's interpreter on host copies (CPU launches): every
    result is a fresh tensor, which the program copies into its buffer."""

    call: Any
    aliases: tuple
    name: str
    in_dtypes: tuple
    out_dtypes: tuple

    def interpret(self, args: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        dev = args[0].device if args else torch.device("cpu")
        outs = self.call(*[storage.to_numpy(a, dt) for a, dt in zip(args, self.in_dtypes)])
        return [storage.from_numpy(np.asarray(o).astype(dt, copy=False), dev) for o, dt in zip(outs, self.out_dtypes)]


def interpreted_pallas(eqn) -> _Interpreted:
    """The kernel of an interpreted ``pallas_call`` equation, jitted once on first use."""
    call = jax.jit(lambda *xs: eqn.primitive.bind(*xs, **eqn.params))
    return _Interpreted(
        call,
        _aliases(eqn),
        eqn.params.get("name") or "pallas_call",
        tuple(v.aval.dtype for v in eqn.invars),
        tuple(v.aval.dtype for v in eqn.outvars),
    )


def _aliases(eqn) -> tuple:
    return tuple((int(i), int(o)) for i, o in eqn.params["input_output_aliases"])


def _kernel_for(device: torch.device) -> Callable:
    def kernel_for(eqn):
        if eqn.params.get("interpret"):
            return interpreted_pallas(eqn)
        return compiled_pallas(eqn, device)

    return kernel_for


@dataclasses.dataclass
class _Launch:
    program: program.Program
    names: tuple[str, ...]
    out_names: tuple[str, ...]


_PROGRAMS: dict[Hashable, _Launch] = {}
_LOCK = threading.Lock()
_TRACES = [0]


def trace_count() -> int:
    """How many launch bodies the native path has traced (a steady state traces none)."""
    return _TRACES[0]


def check_writable(args: Sequence[TensorArg]) -> None:
    """Refuses, before anything runs, a mutable argument torch would not let the launch update in place: an
    inference tensor (allocated under ``torch.inference_mode()``) launched outside inference mode. Without this
    the launch would fail half-way, some outputs written and others not.

    Raises:
      ValueError: naming the argument.
    """
    if torch.is_inference_mode_enabled():
        return
    for a in args:
        if a.mutable and a.tensor.is_inference():
            raise ValueError(
                f"kv-canary: {a.name} is an inference tensor (allocated under torch.inference_mode()) and this "
                "launch runs outside inference mode, where torch refuses in-place updates of it; launch inside "
                "torch.inference_mode() or allocate the canary state outside it"
            )


_REFUSALS = {"plan": " (the plan kernel takes no launch without request rows or with an empty table or pool)"}


def _build(op, statics, body_factory, args: Sequence[TensorArg], device) -> _Launch:
    body = body_factory(statics)
    names = tuple(a.name for a in args)
    out_names = tuple(a.name for a in args if a.mutable)

    def flat(*xs):
        new = body(dict(zip(names, xs)))
        return tuple(new[n] for n in out_names)

    avals = [_aval(a.tensor, a.name) for a in args]
    closed = jax.make_jaxpr(flat)(*avals)
    _TRACES[0] += 1
    try:
        prog = program.build(closed, device=device, mutable=[a.mutable for a in args], kernel_for=_kernel_for(device))
    except program.NotNative as e:
        backend = statics[0]
        why = _REFUSALS.get(op, "") if backend != "reference" else " (the reference backend has no kernels)"
        raise type(e)(f"kv-canary: the {op} launch ({backend}) cannot take the native torch path{why}: {e}") from e
    return _Launch(prog, names, out_names)


def _key(op, statics, body_factory, args, device) -> tuple:
    return (
        op,
        statics,
        body_factory,
        device,
        bool(jax.config.read("jax_enable_x64")),
        tuple((a.name, a.mutable, tuple(a.tensor.shape), a.tensor.dtype) for a in args),
    )


def _launch_for(op, statics, body_factory, args, device) -> _Launch:
    key = _key(op, statics, body_factory, args, device)
    hit = _PROGRAMS.get(key)
    if hit is None:
        with _LOCK:
            hit = _PROGRAMS.get(key)
            if hit is None:
                hit = _PROGRAMS[key] = _build(op, statics, body_factory, args, device)
    return hit


_FELL_BACK: dict[Hashable, str] = {}  # launch key -> why its native build failed (the path was not asked for)
_READY = replay.KeyMemo()  # launcher replay key -> its _Launch (checked and built)


def forget_checked() -> None:
    """Forgets which launch keys passed :func:`run_native`'s checks (their programs stay built): the next launch
    of each checks again (``benchmarks/native_bench.py`` measures what that costs)."""
    _READY.clear()


def run_native(
    op: Hashable,
    statics: Hashable,
    body_factory: Callable,
    args: Sequence[TensorArg],
    *,
    fallback: Callable | None = None,
    key: Hashable | None = None,
) -> bool:
    """Runs ``body_factory(statics)`` on ``args`` as its kernels (Triton kernels on CUDA), writing the mutable
    arguments back in place (the contract of :func:`interop.runner.run_in_place`). Returns whether it did
    (False: it took ``fallback``).

    ``fallback`` (the launchers pass :func:`interop.runner.run_in_place` when the native path is only the
    default, not asked for): if the first launch of a shape cannot be *built* (tracing, a primitive without a
    rule, a kernel whose Triton IR does not lower or compile), nothing has run yet; the launch then takes
    ``fallback(op, statics, body_factory, args)`` instead, with one ``RuntimeWarning`` naming the error, and
    so do later launches of that shape. The same checks run either way; only the path differs.

    ``key``: the launcher's replay key (:mod:`interop.native.replay`), which names every tensor's address, shape,
    strides and dtype, the torch modes and the bucket policy; a key that launched here before skips the device,
    aliasing and writability checks and the program lookup (they would give the same answers). None: no memo.

    Raises:
      ValueError / TypeError: device mix or overlapping mutable tensors (:func:`interop.buffers.
        check_device_and_aliasing`), an inference tensor as an output outside inference mode
        (:func:`check_writable`), or a dtype JAX would narrow; raised before anything runs.
      interop.native.program.NotNative (or the lowering's / triton's
        error): a body the native path cannot build, without ``fallback`` (first launch only; nothing has run).
    """
    ready = _READY.get(key)
    if ready is not None:  # this key's checks passed and its program is built: launch it
        ready.program([a.tensor for a in args])
        return True
    device = buffers.check_device_and_aliasing(args)
    check_writable(args)
    if fallback is not None and _FELL_BACK:
        key = _key(op, statics, body_factory, args, device)
        if key in _FELL_BACK:
            fallback(op, statics, body_factory, args)
            return False
    try:
        launch = _launch_for(op, statics, body_factory, args, device)
    except Exception as e:  # noqa: BLE001 - any build failure; nothing has run
        if fallback is None:
            raise
        why = f"{type(e).__name__}: {e}"
        _FELL_BACK[_key(op, statics, body_factory, args, device)] = why
        warnings.warn(
            f"kv-canary: the native torch path could not build this {op} launch ({why}); launches of this shape "
            "take the DLPack path instead (path='native' raises the error)",
            RuntimeWarning,
            stacklevel=6,  # run_native < _run < launch < replay.run < the launcher < its caller
        )
        fallback(op, statics, body_factory, args)
        return False
    launch.program([a.tensor for a in args])
    _READY.put(key, launch)
    return True
