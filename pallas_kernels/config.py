"""Tuning knobs of the Pallas kernels in one frozen, validated object, and the backend choice.

``PallasConfig()`` holds the defaults chosen from H200 measurements (the figures, commands and versions are
in ``benchmarks/results/2026-11-30_h200_pallas.md``; ``pallas_kernels/README.md`` explains the choices). Knobs
change block shapes and instruction selection only, never results: every combination is bit-identical to the
references, for plans within the contract (write offsets non-decreasing over the live requests, as the plan
builders make them).
"""

from __future__ import annotations

import dataclasses

from canary_jax.contract import validation
from canary_jax.ops import backends

GATHER_MODES = ("quad", "pair", "word")
SOURCE_GATHER_MODES = ("quad", "pair", "word", "tile", "tile_contiguous")
MULTIPLIERS = ("auto", "portable", "asm")


def _pow2(x: int) -> bool:
    return x >= 1 and (x & (x - 1)) == 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class PallasConfig:
    """Block shapes and code-generation choices.

    Fields:
      verify_block: entries per verify block without real-KV sources (power of 2).
      verify_source_block: entries per verify block with real-KV sources (power of 2; one entry per thread
        at 4 warps, which the tile loads want).
      verify_num_warps: Triton warps per verify program.
      verify_max_programs: cap on the verify grid; programs loop over blocks (persistent grid), so the cost
        follows ``num_valid``, not the plan capacity.
      write_lanes: requests per chain program (power of 2): each lane runs one request's serial chain.
      write_num_warps: warps per chain program.
      write_prefetch: chain steps whose token / position / slot loads are issued one chunk ahead (power of 2;
        one ``[lanes, 2 * write_prefetch]`` load per array and chunk).
      write_entry_block: entries per block of the entry-parallel role of the first write launch (real-KV
        fingerprints, claim words), which runs beside the chains with ``write_num_warps`` warps (power of 2).
      write_long_chunk: entries per unrolled chunk of the long-request chain role (power of 2, at most 256).
      write_long_threshold: requests with more entries than this run in the long-request role (one request per
        program, the whole program on its chain) when the launch has more than this many tokens and at least
        twice as many tokens as the plan's request capacity (``write_req_capacity``, not the live requests);
        other requests run one per lane.
      write_block: entries per block of the parallel write passes (power of 2).
      write_max_programs: grid cap of the write passes.
      write_fused_max_tokens: launches of at most this many tokens that need no long-request role run as one
        program (:mod:`pallas_kernels.write_fused`: one kernel, nothing before or after it); 0 = never. The
        default, 128, covers a decode step's write: in the H200 serving step the fused HEAD write took 7.9 / 10.5
        us of kernels against 14.3 / 15.3 us for the multi-launch write at batch 1 / 128
        (``benchmarks/results/2026-12-05_h200_plan_kernel.md``); alone, at 4096 one-token requests, the one
        program is 5x slower (70 us against 13.5 us, ``benchmarks/results/2026-12-04_h200_write_fused.md``).
      write_fused_max_hashed: the same bound for launches with real-KV sources, whose fingerprints the one
        program then computes alone (0 = never fused with sources). The default, 128, covers a decode step's TAIL
        write: on an H100 the torch launchers' captured decode step (batch 128, PARTIAL) took 59.7 us of device
        time with it against 90.4 us without, and the one-token write 25.8 us against 31.7 us on the JAX path
        (``benchmarks/results/2026-12-05_h100_glue.md``); alone at 128 one-token requests with 4 sources the H200
        gave 18.1 us fused against 14.0 us (``benchmarks/results/2026-12-04_h200_write_fused.md``).
      write_small_max_tokens: a one-program write (fused, or inside the phase kernel) of at most this many tokens
        (and at most ``pallas_kernels.write_small.SMALL_MAX_TOKENS``, 128) over a plan of at most
        ``write_small.SMALL_MAX_REQS`` (128) request rows keeps the whole write in registers
        (:mod:`pallas_kernels.write_small`: three dependent memory round trips instead of about ten); 0 = never
        (the general one-program body). The same bytes either way. 32 by default: on an H100, a decode step's canary
        alone (plan, HEAD, TAIL, PARTIAL) took 16.5 us of kernels with it against 18.0 us without at batch 1, but
        143.7 against 103.7 us at batch 128, where the TAIL phase's one program hashes 128 winners' real KV
        (``benchmarks/results/2026-12-07_h100_small_write.md``); 2 to 32 tokens are not measured.
      write_fused_num_warps: warps of the fused program (power of 2).
      phase_one_launch: a HEAD / TAIL phase (verify, then write: :func:`canary_jax.verify_then_write`) whose write
        takes the one program (``write_fused_max_tokens`` / ``write_fused_max_hashed``), on a log with a launch
        ticket, runs as one kernel, ``canary_phase`` (:mod:`pallas_kernels.phase`): the last verify program to
        arrive writes the rows and runs the write. False: a verify launch and a write launch, the same bytes.
      phase_num_warps: warps per program of ``canary_phase`` (power of 2).
      gather: canary records and plan fields: ``quad`` (16-byte), ``pair`` (8-byte) vector gathers or ``word``.
      source_gather: how real-KV bytes are loaded (:mod:`pallas_kernels.real_kv`): ``tile`` (default: 2-D
        ``[block, source_tile_words]`` tiles of each entry's row, loaded 4 bytes per thread and row),
        ``tile_contiguous`` (the same with column indices Triton can prove contiguous: 16-byte loads and a
        shared-memory hand-over), or per-lane pieces of the entry's own row: ``pair`` (8 B), ``quad`` (16 B; its
        in-register split costs a layout conversion on Triton) or ``word`` (4 B). The default was the fastest
        on the H200 (``benchmarks/results/2026-11-30_h200_pallas.md``).
      source_tile_words: with the ``tile`` modes: uint32 words of a row per 2-D tile load in verify (power of
        2, at least 2); wider tiles keep more loads in flight per entry and use more registers.
      write_source_tile_words: the same for the write kernel's real-KV hashing (its default is narrower than
        verify's; both were picked by timing on the H200, see the results file above).
      source_unroll: 16-byte chunks (tiles with ``tile``) per source per iteration of the real-KV loop (loads
        run one iteration ahead); 0 = no loop, fully unrolled straight-line code (compile time grows steeply
        with the bytes hashed).
      multiplier: ``auto`` (``asm`` compiled, ``portable`` in interpret mode), ``portable`` or ``asm``.
      plan_block: verify entries per block of the plan kernel (:mod:`pallas_kernels.plan`; power of 2).
      plan_num_warps: warps per plan program (power of 2).
      plan_max_programs: cap on the plan grid; programs loop over blocks of the plan's capacity.
    """

    verify_block: int = 256
    verify_source_block: int = 128
    verify_num_warps: int = 4
    verify_max_programs: int = 4096
    write_lanes: int = 32
    write_num_warps: int = 1
    write_prefetch: int = 8
    write_entry_block: int = 32
    write_long_chunk: int = 16
    write_long_threshold: int = 64
    write_block: int = 128
    write_max_programs: int = 2048
    write_fused_max_tokens: int = 128
    write_fused_max_hashed: int = 128
    write_small_max_tokens: int = 32
    write_fused_num_warps: int = 16
    phase_one_launch: bool = True
    phase_num_warps: int = 8
    gather: str = "pair"
    source_gather: str = "tile"
    source_unroll: int = 1
    source_tile_words: int = 32
    write_source_tile_words: int = 16
    multiplier: str = "auto"
    plan_block: int = 256
    plan_num_warps: int = 4
    plan_max_programs: int = 1024

    def __post_init__(self):
        for name in (
            "verify_block",
            "verify_source_block",
            "write_lanes",
            "write_block",
            "write_entry_block",
            "source_tile_words",
            "verify_num_warps",
            "write_num_warps",
            "write_prefetch",
            "write_long_chunk",
            "write_source_tile_words",
            "write_fused_num_warps",
            "phase_num_warps",
            "plan_block",
            "plan_num_warps",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not _pow2(v):
                raise ValueError(f"kv-canary: PallasConfig.{name} must be a power of 2, got {v!r}")
        if self.write_long_chunk > 256:
            raise ValueError(
                f"kv-canary: PallasConfig.write_long_chunk must be at most 256 (unrolled per chunk), "
                f"got {self.write_long_chunk!r}"
            )
        for name in ("source_tile_words", "write_source_tile_words"):
            if getattr(self, name) < 2:
                raise ValueError(f"kv-canary: PallasConfig.{name} must be at least 2, got {getattr(self, name)!r}")
        for name in ("verify_max_programs", "write_max_programs", "write_long_threshold", "plan_max_programs"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"kv-canary: PallasConfig.{name} must be a positive int, got {v!r}")
        for name in ("write_fused_max_tokens", "write_fused_max_hashed", "write_small_max_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"kv-canary: PallasConfig.{name} must be a non-negative int, got {v!r}")
        if not isinstance(self.phase_one_launch, bool):
            raise ValueError(f"kv-canary: PallasConfig.phase_one_launch must be a bool, got {self.phase_one_launch!r}")
        if not isinstance(self.source_unroll, int) or isinstance(self.source_unroll, bool) or self.source_unroll < 0:
            raise ValueError(
                f"kv-canary: PallasConfig.source_unroll must be a non-negative int, got {self.source_unroll!r}"
            )
        if self.gather not in GATHER_MODES:
            raise ValueError(f"kv-canary: PallasConfig.gather must be one of {GATHER_MODES}, got {self.gather!r}")
        if self.source_gather not in SOURCE_GATHER_MODES:
            raise ValueError(
                f"kv-canary: PallasConfig.source_gather must be one of {SOURCE_GATHER_MODES}, "
                f"got {self.source_gather!r}"
            )
        if self.multiplier not in MULTIPLIERS:
            raise ValueError(
                f"kv-canary: PallasConfig.multiplier must be one of {MULTIPLIERS}, got {self.multiplier!r}"
            )

    def for_interpret(self, interpret: bool) -> PallasConfig:
        """The config actually used: in interpret mode the default chain prefetch (a GPU latency device)
        becomes 1, which keeps the CPU compile small; results do not depend on it. A prefetch set on purpose
        is kept, so tests can run the prefetch path interpreted."""
        if interpret and self.write_prefetch == _DEFAULT_PREFETCH and self.write_prefetch != 1:
            return dataclasses.replace(self, write_prefetch=1)
        return self

    def resolved_multiplier(self, interpret: bool) -> str:
        """The multiplier a launch uses: ``auto`` is ``portable`` in interpret mode and ``asm`` compiled.

        Raises:
          NotImplementedError: ``asm`` with ``interpret=True`` (the inline PTX needs the compiled GPU backend).
        """
        if self.multiplier == "auto":
            return "portable" if interpret else "asm"
        if self.multiplier == "asm" and interpret:
            raise NotImplementedError("kv-canary: the asm multiplier needs the compiled GPU backend (interpret=False)")
        return self.multiplier


DEFAULT_CONFIG = PallasConfig()
_DEFAULT_PREFETCH = DEFAULT_CONFIG.write_prefetch


default_interpret = backends.default_interpret


def launch_options(context, interpret: bool | None, config: PallasConfig | None) -> tuple[bool, PallasConfig]:
    """The statics of one Pallas launch, the shared prologue of ``verify_pallas`` and ``write_pallas``.

    Checks the kernels' own static precondition (at most 4 real-KV sources, for direct callers; the public
    entry points checked the whole launch already), then resolves:

    * ``interpret``: as given, else from where the canary buffer lives: compiled on a GPU platform, interpreted
      elsewhere (:func:`canary_jax.ops.backends.array_platform`; JAX's default backend only for a traced buffer,
      whose device is unknown);
    * ``config``: ``config`` or :data:`DEFAULT_CONFIG`, adjusted for that mode (:meth:`PallasConfig.for_interpret`).

    Args:
      context: the launch's :class:`~canary_jax.planning.plans.VerifyOrWriteContext`.
      interpret: the caller's choice, or None.
      config: the caller's config, or None.

    Returns:
      ``(interpret, config)``, both static.

    Raises:
      ValueError: more than 4 real-KV sources.
    """
    validation.check_source_count(len(context.real_kv_sources))
    if interpret is None:
        interpret = default_interpret(backends.array_platform(context.canary_buf))
    interpret = bool(interpret)
    return interpret, (config or DEFAULT_CONFIG).for_interpret(interpret)
