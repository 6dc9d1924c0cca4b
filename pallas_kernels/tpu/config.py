"""Tuning knobs of the TPU kernels (:class:`TpuConfig`) and the interpret-mode choice (:func:`interpret_params`).

Knobs change block shapes only, never results: every value is bit-identical to
:func:`canary_jax.ops.reference.verify_reference` / :func:`~canary_jax.ops.reference.write_reference`.
"""

from __future__ import annotations

import dataclasses

from jax.experimental.pallas import tpu as pltpu

from canary_jax.ops import backends


@dataclasses.dataclass(frozen=True, kw_only=True)
class TpuConfig:
    """Block shapes and interpret-mode checks of the TPU kernels.

    Fields:
      verify_block: entries per grid step of the verify kernel (a multiple of 8: the sublane tile of 32-bit
        data; a prefix shorter than this runs as one block of its own length).
      verify_prefetch_entries: entries per verify ``pallas_call`` (a multiple of 8): each call scalar-prefetches
        two ``int32`` rows per entry into SMEM (64 KiB at the default), a longer live prefix runs as several
        calls in entry order.
      write_block: entries per grid step of the write kernels (chain, store; a multiple of 8; a launch with fewer
        tokens runs as one block of its own length).
      write_req_block: requests per grid step of the write's seed kernel (a multiple of 8; fewer requests run as
        one block).
      write_prefetch_entries: entries (or requests) per seed / store ``pallas_call`` (a multiple of 8): each call
        scalar-prefetches one ``int32`` row per entry into SMEM (32 KiB at the default); longer launches run as
        several calls in entry order.
      detect_races: in interpret mode, let the interpreter check the DMAs and semaphores for races
        (``pltpu.InterpretParams(detect_races=...)``); slower.

    Raises:
      ValueError: a block or prefetch size not a positive multiple of 8.
    """

    verify_block: int = 256
    verify_prefetch_entries: int = 8192
    write_block: int = 256
    write_req_block: int = 256
    write_prefetch_entries: int = 8192
    detect_races: bool = False

    def __post_init__(self):
        for name in (
            "verify_block",
            "verify_prefetch_entries",
            "write_block",
            "write_req_block",
            "write_prefetch_entries",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 8 or v % 8:
                raise ValueError(f"kv-canary: TpuConfig.{name} must be a positive multiple of 8, got {v!r}")


DEFAULT_CONFIG = TpuConfig()


def interpret_params(interpret, context, config: TpuConfig):
    """The ``interpret=`` of the TPU ``pallas_call`` s.

    Args:
      interpret: ``None`` (compiled where the canary buffer lives on a TPU, interpreted elsewhere; a traced
        buffer follows JAX's default backend), a bool, or a ``pltpu.InterpretParams`` used as given.
      context: the launch context (its canary buffer's platform).
      config: the :class:`TpuConfig` (``detect_races``).

    Returns:
      ``False`` (compiled) or a ``pltpu.InterpretParams`` (reads out of bounds raise, uninitialised memory is
      NaN-filled so a read of it shows).
    """
    if isinstance(interpret, pltpu.InterpretParams):
        return interpret
    if interpret is None:
        interpret = not backends.is_tpu_platform(backends.array_platform(context.canary_buf))
    if not interpret:
        return False
    return pltpu.InterpretParams(
        detect_races=config.detect_races, out_of_bounds_reads="raise", uninitialized_memory="nan"
    )
