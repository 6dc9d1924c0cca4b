"""What a demo fault is (:class:`Fault`, :class:`Expectation`), what a fault-free workload looks like
(:class:`WorkloadTrace`), and the target pickers and in-place edits the kinds of :mod:`canary_jax.cli.demo.faults`
share.

The edits apply the public pure functions of :mod:`canary_jax.tools.faults` to the demo engine's arrays
(``engine.k_pool``: bf16 ``[layers, pages, page_size * kv_dim]``; the canary's HEAD / TAIL buffers) and store
the result back on the engine; the pickers read a scheduled batch's rows and never change anything.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from canary_jax.tools import faults as faults_lib


@dataclasses.dataclass(frozen=True)
class Expectation:
    detect: bool
    why_not: str = ""


class Fault:
    """Base class: ``try_inject`` returns a dict describing what it broke, or None if it cannot act now.

    ``ready(scheduler, batch)`` says, without changing anything, whether ``try_inject`` could act on this
    batch; ``detectable_after(trace, step)`` whether a fault injected at ``step`` of a workload (a
    :class:`WorkloadTrace` of a fault-free run) can still be seen before the workload ends. The campaign
    uses both to pick injection steps that fit the workload, and to refuse a workload too short for a kind.
    """

    kind: str = ""
    summary: str = ""
    caught_by: str = ""
    needs: str = "a request with a verified prefix"  # what ``ready`` waits for (for error messages)

    def expected(self, cfg) -> Expectation:
        return Expectation(True)

    def not_applicable(self, model_cfg) -> str:
        """Why this kind cannot be injected into this model at all ("" when it can)."""
        return ""

    def ready(self, sched, batch) -> bool:
        return bool(_verified_prefix_candidates(batch))

    def detectable_after(self, trace: WorkloadTrace, step: int) -> bool:
        """Default: the step's own canary launches see the fault."""
        return step < trace.num_steps

    def try_inject(self, engine, batch, rng: np.random.Generator, trial: int) -> dict[str, Any] | None:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class WorkloadTrace:
    """What a fault-free run of the workload looks like, step by step (from a scheduler-only dry run).

    Fields:
      num_steps: forward steps until every request has finished.
      ready: per fault kind, the steps at which that kind's ``ready`` holds.
      alloc_steps: steps whose scheduling allocated at least one page.
      sweep_steps: steps followed by a sweep of the prefix cache.
    """

    num_steps: int
    ready: dict
    alloc_steps: tuple
    sweep_steps: tuple


# --- helpers ---------------------------------------------------------------------------------------------
def _verified_prefix_candidates(batch, min_prefix: int = 1):
    """Batch rows whose verified prefix (prefix_len) is at least ``min_prefix`` tokens."""
    return [row for row in batch.rows if row.start >= min_prefix]


def _pick_verified_position(batch, rng):
    """A random ``(row, position)`` inside the already-verified prefix of a batch row, or None."""
    rows = _verified_prefix_candidates(batch)
    if not rows:
        return None
    row = rows[rng.integers(len(rows))]
    return row, int(rng.integers(row.start))


def _flip_k_bit(engine, slot: int, byte: int, bit: int) -> None:
    """XOR one bit of ``slot``'s layer-0 K bytes (:func:`canary_jax.tools.faults.flip_kv_bits` on layer 0)."""
    layer0 = faults_lib.flip_kv_bits(
        engine.k_pool[0],  # bf16 [pages, page_size * kv_dim]
        slot,
        page_size=engine.cfg.page_size,
        num_bytes_per_token=engine.model_cfg.kv_bytes_per_token,
        byte=byte,
        xor=1 << bit,
    )
    engine.k_pool = engine.k_pool.at[0].set(layer0)


def _flip_canary_field(engine, buffer: str, slot: int, field: int, bit: int) -> None:
    """Flip one bit of a canary record field (:func:`canary_jax.tools.faults.flip_canary_bits`)."""
    name = "k_head" if buffer == "HEAD" else "k_tail"
    engine.canary.set_buffer(name, faults_lib.flip_canary_bits(engine.canary.buffer(name), slot, field=field, bit=bit))
