"""The verify sweep's scenario (``benchmarks.sweep_verify``): clean and corrupted inputs of one mode, built
once, and the jnp reference's logs on them.

Entries and sources are those of ``benchmarks.bench``'s verify cases (``harness.verify_chains``). The
corrupted copy flips token / position / real-KV-field bytes in the canary and bytes of source 0's rows, so
about 1.25 rows per corruption overflow a ``CORRUPT_RING``-row ring.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import canary_jax
from benchmarks import harness
from canary_jax.ops import reference
from pallas_kernels.verify import verify_pallas

LOG_FIELDS = ("ring", "write_index", "slot_run_counters", "kernel_run_counters")
MODES = {"all_x4": (harness.ALL, 4), "partial_x4": (harness.PARTIAL, 4), "all_x1": (harness.ALL, 1)}
CORRUPT_RING = 256  # ring rows of the corrupted check: small enough that it overflows (fill-once path)


def log_arrays(log) -> dict:
    return {f: np.asarray(getattr(log, f)) for f in LOG_FIELDS}


def log_diff(a: dict, b: dict) -> list[str]:
    """Names of the log fields that differ in dtype, shape or bytes."""
    return [
        f
        for f in LOG_FIELDS
        if a[f].dtype != b[f].dtype or a[f].shape != b[f].shape or a[f].tobytes() != b[f].tobytes()
    ]


@dataclasses.dataclass
class Scenario:
    """One mode's inputs (clean: ``buf`` / ``tensors``; corrupted: ``bad_buf`` / ``bad_tensors``) and the
    reference's logs on them (``reference_logs``)."""

    name: str
    case: harness.Case
    srcs: tuple
    buf: jax.Array
    plan: object
    tensors: tuple
    bad_buf: jax.Array
    bad_tensors: tuple
    needed_bytes: float
    ref_bad: dict | None = None
    ref_clean: dict | None = None  # after ref_clean_launches launches
    ref_clean_launches: int = 0
    populated: str = ""


def build(mode_name: str, data: harness.Data, bargs: harness.Args, *, populate: str, corruptions: int) -> Scenario:
    """The scenario of mode ``mode_name`` (a key of ``MODES``); ``populate``: pallas | reference | none."""
    mode, k = MODES[mode_name]
    case = harness.Case(f"verify_{mode_name}", "verify", mode, k)
    entries = bargs.entries
    slots2d, pos2d, prev2d = harness.verify_chains(data, entries)  # the inputs of bench's verify cases
    srcs = data.sources(k)
    buf = jnp.zeros((bargs.pool, 32), jnp.uint8)
    how = populate
    if populate == "pallas":
        try:
            buf, _ = harness.populate(data, buf, srcs, mode, slots2d, pos2d, None)
        except Exception as e:  # noqa: BLE001 - e.g. a write kernel mid-edit: fall back to the jnp reference
            how = f"reference (pallas write failed: {type(e).__name__}: {str(e)[:300]})"
            print(f"  populate: {how}", flush=True)
            populate = "reference"
    if populate == "reference":
        buf = harness.populate_reference(data, buf, srcs, mode, slots2d, pos2d)
    plan = canary_jax.VerifyPlan.from_entries(
        slots=slots2d.reshape(-1), positions=pos2d.reshape(-1), prev_slots=prev2d.reshape(-1)
    )
    tensors = tuple(s.tensor for s in srcs)
    # Corrupted copy: four equal groups of distinct entries get a flipped token byte, position byte, stored
    # real-KV-field byte, or a flipped byte inside the hashed part of source 0's row.
    rng = np.random.default_rng(bargs.seed + 1)
    kk = max(4, min(corruptions, entries // 16)) // 4 * 4
    ent = rng.choice(entries, kk, replace=False)
    slots = slots2d.reshape(-1)[ent].astype(np.int32)
    g = np.array_split(slots, 4)
    bad_buf = buf
    for grp, byte in zip(g[:3], (0, 8, 24)):
        idx = jnp.asarray(grp)
        bad_buf = bad_buf.at[idx, byte].set(bad_buf[idx, byte] ^ jnp.uint8(1))
    eff = 16 if mode == harness.PARTIAL else harness.ROW_BYTES
    offs = jnp.asarray(rng.integers(0, eff, g[3].shape[0]).astype(np.int32))
    t0 = tensors[0]
    rows = jnp.asarray(g[3])
    bad_t0 = t0.at[rows, offs].set(t0[rows, offs] ^ jnp.uint8(0x5A))
    bad_tensors = (bad_t0,) + tensors[1:]
    jax.block_until_ready((buf, bad_buf, bad_t0))
    return Scenario(
        mode_name,
        case,
        srcs,
        buf,
        plan,
        tensors,
        bad_buf,
        bad_tensors,
        harness.needed_bytes(case, bargs),
        populated=how,
    )


def steps(sc: Scenario, cfg):
    """``(step_pallas, step_ref)``: ``log = step(log, (buf, plan, tensors))`` with ``cfg`` / the reference."""

    def step_pallas(log, c):
        ctx = harness.make_context(c[0], log, harness.with_tensors(sc.srcs, c[2]), sc.case.mode)
        return verify_pallas(ctx, c[1], config=cfg).log

    def step_ref(log, c):
        ctx = harness.make_context(c[0], log, harness.with_tensors(sc.srcs, c[2]), sc.case.mode)
        return reference.verify_reference(ctx, c[1]).log

    return step_pallas, step_ref


def reference_logs(sc: Scenario, launches: int) -> None:
    """Sets ``sc.ref_bad`` (one launch on the corrupted inputs) and ``sc.ref_clean`` (``launches`` launches on
    the clean ones)."""
    _, step_ref = steps(sc, None)
    log = canary_jax.ViolationLog.allocate(ring_capacity=CORRUPT_RING)
    sc.ref_bad = log_arrays(jax.jit(step_ref)(log, (sc.bad_buf, sc.plan, sc.bad_tensors)))

    @jax.jit
    def many(s, c):
        return jax.lax.fori_loop(0, launches, lambda i, s_: step_ref(s_, c), s)

    clean_log = many(canary_jax.ViolationLog.allocate(ring_capacity=1024), (sc.buf, sc.plan, sc.tensors))
    sc.ref_clean = log_arrays(clean_log)
    sc.ref_clean_launches = launches
