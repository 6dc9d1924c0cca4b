"""The reference verify's work follows the live entries, not the plan capacity (issue #12, defect 6).

``verify_reference`` picks, on device, one ``lax.switch`` branch per prefix size (``reference.prefix_buckets``):
the branch for ``n`` gathers and hashes entries ``[0, n)`` only. Pinned structurally, never by wall clock:

* which branch runs for each live count (a debug callback in every branch records its prefix size);
* the gathers of each branch are sized by its prefix, none by the capacity (read from the jaxpr);
* the result is byte-identical to the Python-int oracle in every branch, with x64 off and on.
"""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest

import canary_jax
from canary_jax.ops import reference
from helpers import suite_base
from helpers.suite_base import ALL, SrcSpec

CAP = 300  # prefix sizes (0, 64, 256, 300)
NUM_SLOTS = 96
RING = 32


class _Oracle(suite_base.SuiteBase, absltest.TestCase):
    """A harness host only (collects no tests of its own)."""

    __test__ = False
    BACKEND = "reference"
    VERIFY_IMPL = staticmethod(reference.verify_reference)
    WRITE_IMPL = staticmethod(reference.write_reference)
    VERIFY_CAPACITY = CAP
    NUM_SLOTS = NUM_SLOTS

    def runTest(self):  # noqa: N802 (unittest's name)
        pass


def _entries(rng: np.random.Generator, n: int) -> list[tuple[int, int, int]]:
    """``n`` entries over slots 1..NUM_SLOTS-1 laid as chains, some slot-0 (skipped) and some broken."""
    out = []
    for i in range(n):
        slot = int(rng.integers(0, NUM_SLOTS))  # 0: skipped but counted
        out.append((slot, i % 5, -1 if i % 5 == 0 else out[-1][0]))
    return out


def _harness(rng: np.random.Generator) -> suite_base.Harness:
    data = rng.integers(0, 256, (NUM_SLOTS, 64), dtype=np.uint8)
    h = _Oracle().harness(ring=RING, sources=[SrcSpec(data, 1, 64, 64)], mode=ALL, num_slots=NUM_SLOTS)
    # Clean chains on half the slots, so some entries pass and some fail.
    slots = list(range(1, NUM_SLOTS, 2))
    h.lay_chain(slots, [1000 + s for s in slots], list(range(len(slots))))
    return h


def test_prefix_buckets():
    assert reference.prefix_buckets(1) == (0, 1)
    assert reference.prefix_buckets(8) == (0, 8)
    assert reference.prefix_buckets(64) == (0, 64)
    assert reference.prefix_buckets(65) == (0, 64, 65)
    assert reference.prefix_buckets(CAP) == (0, 64, 256, 300)
    assert reference.prefix_buckets(8192) == (0, 64, 256, 1024, 4096, 8192)


@pytest.mark.parametrize("x64", [False, True])
def test_every_branch_matches_the_oracle(x64):
    prev = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", x64)
    try:
        rng = np.random.default_rng(12)
        h = _harness(rng)
        entries = _entries(rng, CAP)
        # Live counts at and around every bucket edge, past the capacity, negative; each compared whole.
        for nv in (0, 1, 15, 16, 17, 63, 64, 65, 255, 256, 257, 299, 300, 301, 5000, -3):
            h.verify(entries, num_valid=nv, check=True)
        h.verify(entries, num_valid=200, enable=0)  # disabled: only the launch counter moves
        assert h.write_index > RING  # the ring overflowed on the way (counted past its capacity)
        assert h.kernel_counter() == 17
        assert h.slot_counter() == 1 + 15 + 16 + 17 + 63 + 64 + 65 + 255 + 256 + 257 + 299 + 3 * 300
    finally:
        jax.config.update("jax_enable_x64", prev)


def _plan(num_valid: int, enable: int = 1, cap: int = CAP) -> canary_jax.VerifyPlan:
    return canary_jax.VerifyPlan.from_entries(
        slots=list(range(1, cap + 1)),
        positions=[0] * cap,
        prev_slots=[-1] * cap,
        verify_capacity=cap,
        num_valid=num_valid,
        enable=enable,
    )


def _context(num_slots: int = NUM_SLOTS, cap_rows: int = 64) -> canary_jax.VerifyOrWriteContext:
    pool = jnp.zeros((num_slots, cap_rows), jnp.uint8)
    return canary_jax.VerifyOrWriteContext(
        canary_buf=canary_jax.allocate_canary_buffer(num_slots=num_slots),
        kernel_kind=suite_base.TAG,
        log=canary_jax.ViolationLog.allocate(ring_capacity=RING),
        real_kv_sources=(canary_jax.RealKvSource(tensor=pool, page_size=1, num_bytes_per_token=64, read_bytes=64),),
        real_kv_hash_mode=ALL,
    )


def test_the_branch_that_runs_follows_the_live_count(monkeypatch):
    ran: list[int] = []
    inner = reference._verify_prefix

    def probed(context, plan, active, *, n, **kw):
        jax.debug.callback(lambda: ran.append(n))
        return inner(context, plan, active, n=n, **kw)

    monkeypatch.setattr(reference, "_verify_prefix", probed)
    jax.clear_caches()  # trace anew with the probe
    try:
        ctx = _context()
        cases = [(0, 1, 0), (-3, 1, 0), (1, 1, 64), (8, 1, 64), (64, 1, 64), (65, 1, 256)]
        cases += [(256, 1, 256), (257, 1, 300), (300, 1, 300), (9999, 1, 300), (8, 0, 0), (300, 0, 0)]
        for num_valid, enable, want in cases:
            ran.clear()
            out = reference.verify_reference(ctx, _plan(num_valid, enable))
            jax.block_until_ready(out)
            jax.effects_barrier()
            assert ran == [want], (num_valid, enable, ran)
            live = min(max(num_valid, 0), CAP) if enable else 0
            assert out.log.slot_run_counter(suite_base.TAG) == live
            assert out.log.num_violations() == live  # every live entry reads an empty record: all fail
    finally:
        jax.clear_caches()


def _walk(jaxpr):
    """Every equation of ``jaxpr``, sub-jaxprs included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _walk(sub)


def test_each_branch_gathers_only_its_prefix():
    cap = 4096  # distinct from every other dimension here
    jaxpr = jax.make_jaxpr(reference.verify_reference)(_context(), _plan(8, cap=cap)).jaxpr
    conds = [e for e in _walk(jaxpr) if e.primitive.name == "cond"]
    assert len(conds) == 1
    branches = conds[0].params["branches"]
    sizes = reference.prefix_buckets(cap)
    assert len(branches) == len(sizes) == 5  # 0, 64, 256, 1024, 4096
    for n, branch in zip(sizes, branches):
        gathers = [e for e in _walk(branch.jaxpr) if e.primitive.name == "gather"]
        if n == 0:
            assert gathers == []  # nothing live: nothing read
            continue
        assert gathers, n
        for g in gathers:
            lead = g.outvars[0].aval.shape[0]
            assert lead == n, (n, g.outvars[0].aval.shape)  # sized by the prefix, never by the capacity
    # Outside the switch nothing gathers: all per-entry work lives in the branches.
    top = [e for e in jaxpr.eqns if e.primitive.name == "gather"]
    inner = [e for e in _walk(jaxpr) if e.primitive.name == "gather"]
    assert top == [] and len(inner) > 0
