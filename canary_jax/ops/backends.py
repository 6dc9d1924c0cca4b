"""The one backend registry: which implementation runs an op, chosen in one place.

Every entry point that runs a kernel asks this module: the JAX entry points (:func:`canary_jax.verify`,
:func:`canary_jax.write` and the runtime built on them), the torch launchers of :mod:`interop` (which pass the
torch device type as the platform) and the Pallas kernels (which ask whether to run in interpret mode).

Backends:

* ``reference``: the pure-jnp references (:mod:`canary_jax.ops.reference`), any platform.
* ``pallas``: the Pallas GPU (Triton) kernels (:mod:`pallas_kernels`), compiled on a GPU and interpreted elsewhere.
* ``pallas_tpu``: the Pallas TPU (Mosaic) kernels (:mod:`pallas_kernels.tpu`), compiled on a TPU and run in
  Pallas's TPU interpret mode elsewhere: verify and write (short and long requests alike) are TPU kernels.
  :data:`REFERENCE_FALLBACKS` lists any ``(backend, op)`` bound by name to a pure-jnp reference instead (none
  today).

The choice: the ``backend`` argument if given, else ``$CANARY_JAX_BACKEND`` if set, else ``pallas`` on a GPU
platform, ``pallas_tpu`` on a TPU platform and ``reference`` elsewhere (so the command line and ``CanaryGuard``,
which pass no backend, get the TPU kernels where the data is on a TPU). The platform is where the launch's data
lives (the canary buffer's device: :func:`array_platform`, or a torch tensor's ``device.type``), not JAX's default
backend: CPU arrays on a GPU host run on the CPU, so the Pallas kernels run interpreted there. Only a traced
buffer (inside a caller's ``jit``), whose device is not known, falls back to JAX's default backend.
``pallas_kernels`` builds on ``canary_jax``, so the registry knows the implementations by name
(:data:`IMPLEMENTATIONS`, ``"module:function"`` strings) and imports their module with :mod:`importlib` on first
use: ``canary_jax`` never imports ``pallas_kernels``.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable
from typing import Any

import jax

BACKENDS = ("reference", "pallas", "pallas_tpu")
"""Backend names, in the order the docs list them."""

BACKEND_ENV = "CANARY_JAX_BACKEND"
"""Environment variable naming the default backend (case-insensitive)."""

OPS = ("verify", "write")
"""Ops with one implementation per backend (the reference signature: see :mod:`canary_jax.ops.reference`)."""

IMPLEMENTATIONS: dict[tuple[str, str], str] = {
    ("reference", "verify"): "canary_jax.ops.reference:verify_reference",
    ("reference", "write"): "canary_jax.ops.reference:write_reference",
    ("pallas", "verify"): "pallas_kernels.verify:verify_pallas",
    ("pallas", "write"): "pallas_kernels.write:write_pallas",
    ("pallas_tpu", "verify"): "pallas_kernels.tpu.verify:verify_tpu",
    ("pallas_tpu", "write"): "pallas_kernels.tpu.write:write_tpu",
}
"""Each ``(backend, op)``'s implementation by name, ``"module:function"``, imported on first use by
:func:`implementation` (so this module imports neither the references nor the kernels)."""

PLAN_KERNELS: dict[str, str] = {"pallas": "pallas_kernels.plan:build_plans_pallas"}
"""The plan build's kernel per backend (:func:`plan_kernel`). A backend without one (``reference``, and
``pallas_tpu``: no TPU plan kernel yet) builds plans with the jnp builder, the same bytes in more launches."""

PHASE_KERNELS: dict[str, str] = {"pallas": "pallas_kernels.phase:phase_pallas"}
"""A HEAD / TAIL phase (verify, then write) as one launch, per backend (:func:`phase_kernel`). A backend without
one runs the phase as its verify, then its write: the same bytes in more launches."""

REFERENCE_FALLBACKS: frozenset[tuple[str, str]] = frozenset(
    key for key, name in IMPLEMENTATIONS.items() if key[0] != "reference" and name.startswith("canary_jax.ops.")
)
"""``(backend, op)`` pairs whose implementation is the pure-jnp reference on purpose (empty today: every backend
has its own kernel for every op). They take no ``interpret=`` / ``config=``; :func:`implementation` returns the
reference itself."""

GPU_PLATFORMS = ("gpu", "cuda", "rocm")
"""Platform names (JAX's ``default_backend()`` or a torch ``device.type``) that count as a GPU."""

TPU_PLATFORMS = ("tpu",)
"""Platform names (JAX's ``default_backend()`` or an array's device platform) that count as a TPU."""


def array_platform(x: Any) -> str | None:
    """The platform (``"cpu"``, ``"gpu"``, ...) of the devices holding the concrete JAX array ``x``; None for a
    tracer, for host data, or for an array spread over more than one platform."""
    if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
        return None
    platforms = {d.platform for d in x.devices()}
    return platforms.pop() if len(platforms) == 1 else None


def is_gpu_platform(platform: str | None = None) -> bool:
    """Whether ``platform`` (default: JAX's default backend) is a GPU platform (CUDA or ROCm)."""
    platform = jax.default_backend() if platform is None else str(platform)
    return platform in GPU_PLATFORMS


def is_tpu_platform(platform: str | None = None) -> bool:
    """Whether ``platform`` (default: JAX's default backend) is a TPU platform."""
    platform = jax.default_backend() if platform is None else str(platform)
    return platform in TPU_PLATFORMS


def default_interpret(platform: str | None = None) -> bool:
    """Whether the Pallas GPU kernels run in interpret mode: everywhere but on a GPU platform."""
    return not is_gpu_platform(platform)


def default_interpret_for(backend: str, platform: str | None = None) -> bool:
    """Whether ``backend``'s Pallas kernels run in interpret mode on ``platform``: the GPU kernels everywhere
    but on a GPU, the TPU kernels everywhere but on a TPU."""
    return not (is_tpu_platform(platform) if backend == "pallas_tpu" else is_gpu_platform(platform))


def check_backend_name(name: str) -> str:
    """``name`` lower-cased if it names a backend.

    Raises:
      ValueError: an unknown backend name (the message lists the known ones).
    """
    lowered = str(name).lower()
    if lowered not in BACKENDS:
        raise ValueError(f"kv-canary: backend must be one of {BACKENDS}, got {name!r}")
    return lowered


def resolve_backend(backend: str | None = None, *, platform: str | None = None) -> str:
    """The backend a launch runs on.

    Args:
      backend: a name from :data:`BACKENDS` (case-insensitive), or None for the default.
      platform: where the launch's data lives: a JAX platform name (``"cpu"``, ``"gpu"``, ...) or a torch
        ``device.type`` (``"cuda"``, ``"cpu"``). None means JAX's default backend.

    Returns:
      ``backend`` if given, else ``$CANARY_JAX_BACKEND`` if set and non-empty, else ``"pallas"`` on a GPU
      platform, ``"pallas_tpu"`` on a TPU platform and ``"reference"`` elsewhere.

    Raises:
      ValueError: an unknown backend name, from the argument or the environment.
    """
    name = backend if backend is not None else (os.environ.get(BACKEND_ENV) or None)
    if name is None:
        if is_gpu_platform(platform):
            return "pallas"
        return "pallas_tpu" if is_tpu_platform(platform) else "reference"
    return check_backend_name(name)


def implementation(op: str, backend: str, *, platform: str | None = None) -> Callable:
    """The function that runs ``op`` (``"verify"`` or ``"write"``) on ``backend``.

    Every backend shares the reference signatures: ``verify(context, plan, *, check_verify_expected_token)``
    and ``write(context, plan, input_ids, positions, out_cache_loc, *, enable_write_input_assert,
    expected_input_tokens, expected_input_positions)``, each returning the updated context.

    Args:
      op: ``"verify"`` or ``"write"``.
      backend: a name from :data:`BACKENDS`.
      platform: where the launch's data lives (as for :func:`resolve_backend`), for callers that trace the
        implementation (the Pallas wrappers cannot see a traced buffer's device): a Pallas implementation is
        then bound to interpret mode off on its platform (GPU for ``pallas``, TPU for ``pallas_tpu``) and on
        elsewhere. None: the Pallas wrappers decide from the canary buffer they get (JAX's default backend for
        a traced one). The same function is returned for the same arguments, so it can key a cache of
        compiled programs. The ops in :data:`REFERENCE_FALLBACKS` return the reference itself.

    Raises:
      ValueError: an unknown op or backend.
    """
    if op not in OPS:
        raise ValueError(f"kv-canary: op must be one of {OPS}, got {op!r}")
    backend = check_backend_name(backend)
    if backend == "reference" or (backend, op) in REFERENCE_FALLBACKS:
        return _resolve(IMPLEMENTATIONS[backend, op])
    return _pallas(backend, op, None if platform is None else default_interpret_for(backend, platform))


def plan_kernel(backend: str | None = None, *, platform: str | None = None) -> Callable | None:
    """The plan-build kernel of ``backend`` (resolved as :func:`resolve_backend`), or None where it has none.

    The kernel takes the checked :class:`~canary_jax.planning.plan_inputs.PlanInputs` and returns the plans, or
    None for a launch it does not support (:func:`pallas_kernels.plan.build_plans_pallas`). ``platform``: where
    the batch lives (None: JAX's default backend); it decides interpret mode as for :func:`implementation`.

    Raises:
      ValueError: an unknown backend name.
    """
    backend = resolve_backend(backend, platform=platform)
    name = PLAN_KERNELS.get(backend)
    if name is None:
        return None
    return functools.partial(_resolve(name), interpret=default_interpret_for(backend, platform))


def phase_kernel(backend: str, *, platform: str | None = None) -> Callable | None:
    """The one-launch phase of ``backend`` (a name from :data:`BACKENDS`), or None where it has none.

    It takes ``(context, verify_plan, write_plan, input_ids, positions, out_cache_loc, *,
    check_verify_expected_token, enable_write_input_assert, expected_input_tokens, expected_input_positions)`` and
    returns the context after the verify and the write (:func:`pallas_kernels.phase.phase_pallas`). ``platform``
    decides interpret mode as for :func:`implementation`.

    Raises:
      ValueError: an unknown backend name.
    """
    backend = check_backend_name(backend)
    name = PHASE_KERNELS.get(backend)
    if name is None:
        return None
    fn = _resolve(name)
    return fn if platform is None else functools.partial(fn, interpret=default_interpret_for(backend, platform))


@functools.cache
def _resolve(name: str) -> Callable:
    # "module:function" -> the function, its module imported on first use (the kernels build on canary_jax).
    module, _, attr = name.partition(":")
    return getattr(importlib.import_module(module), attr)


@functools.cache
def _pallas(backend: str, op: str, interpret: bool | None) -> Callable:
    fn = _resolve(IMPLEMENTATIONS[backend, op])
    return fn if interpret is None else functools.partial(fn, interpret=interpret)
