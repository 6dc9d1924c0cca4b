"""Stream order between torch and JAX for the torch launchers (CUDA), and the launch fence.

JAX and torch use different CUDA streams. Each launch of :func:`interop.runner.run_in_place` (mode
``"fence"``, the default):

1. passes a fresh import of a small torch tensor (:func:`fence`) as the program's first argument: JAX hands its
   stream to ``__dlpack__(stream=...)``, torch makes that stream wait for its current stream, and the JAX
   computation waits for the imported buffer, so it starts after everything torch's current stream had queued;
2. exports one output with ``torch.from_dlpack``, which makes torch's current stream wait for the JAX
   computation.

``"host"`` synchronises on the host instead (slow, for debugging); ``"none"`` leaves ordering to the caller.
Outputs copied back on CUDA stay referenced (:func:`keep_until_consumed`) until torch's stream has read them.
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import torch

from interop import buffers, dlpack

__all__ = ["fence", "keep_until_consumed", "retire_pending", "set_stream_sync", "stream_sync"]

_STREAM_SYNC = ["fence"]


def set_stream_sync(mode: str) -> None:
    """CUDA ordering between torch's current stream and JAX: ``"fence"`` (default, asynchronous DLPack
    handshakes), ``"host"`` (synchronise torch's current stream before and block on JAX's result after; slow,
    for debugging), or ``"none"`` (caller orders the streams; unsafe)."""
    if mode not in ("fence", "host", "none"):
        raise ValueError(f"kv-canary: stream sync mode must be 'fence', 'host' or 'none', got {mode!r}")
    _STREAM_SYNC[0] = mode


def stream_sync() -> str:
    """The current stream sync mode (see :func:`set_stream_sync`)."""
    return _STREAM_SYNC[0]


# Outputs copied back on CUDA stay referenced until torch's stream has finished reading them (an event per
# launch, polled at the next launches), so JAX cannot recycle their memory under a pending torch copy.
_PENDING: collections.deque = collections.deque()


def retire_pending() -> None:
    """Drops the outputs whose torch copies have finished."""
    while _PENDING and _PENDING[0][0].query():
        _PENDING.popleft()


def keep_until_consumed(device: torch.device, outs) -> None:
    """Keeps ``outs`` alive until torch's current stream on ``device`` has passed this point."""
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(device))
    _PENDING.append((ev, outs))


_FENCES: dict[str, torch.Tensor] = {}
_CPU_FENCE: list[jax.Array] = []


def fence(device: torch.device, sync: str) -> jax.Array:
    """The first argument of every launch program.

    CUDA with ``sync == "fence"``: a fresh import of a 64-byte torch tensor, on purpose uncached: torch's
    ``__dlpack__(stream=...)`` makes the stream JAX imports on wait for torch's current stream, and the
    imported buffer's definition event then gates the whole JAX computation. Otherwise a constant.
    """
    if device.type == "cpu":
        if not _CPU_FENCE:
            _CPU_FENCE.append(jax.device_put(jnp.zeros((16,), jnp.uint8), jax.devices("cpu")[0]))
        return _CPU_FENCE[0]
    key = str(device)
    t = _FENCES.get(key)
    if t is None:
        t = _FENCES[key] = torch.zeros(64, dtype=torch.uint8, device=device)
    if sync == "fence":
        # The fence's bytes are never read, so no zero-copy / pointer check (a pointer query is an external
        # reference in PJRT, see set_alias_check): only the stream handshake of the import matters.
        return jax.dlpack.from_dlpack(t, copy=False)
    hit = buffers.import_cache().get(("fence", key))
    if hit is None:
        hit = dlpack._import_exact(t, name="fence")
        buffers.import_cache().put(("fence", key), hit, (t,))
    return hit
