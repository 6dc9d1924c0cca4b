"""Chain reuse between the write launches of a step (``canary_jax.ops.chain_hints``, the Pallas write).

The first write in a scope that runs the long-request role leaves its chains; a later one skips the long chain of
every request whose chain start (running prev_hash after the seed record, run position, gate) is the hint's, and
recomputes the others (lane-role launches, a decode step's, neither make nor take a hint). Pinned three ways:
bytes equal to the reference for a buffer equal to the first and for one whose seed records differ; a hint with
altered chains shows through exactly where the chain start matches (so the reuse really skips the chain); and the
step API's HEAD hands its hints to TAIL with the reference's bytes.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

import canary_jax
from canary_jax.ops import chain_hints, reference
from canary_jax.runtime.groups import CanaryBufferGroup, PoolKind
from canary_jax.runtime.state import CanaryBatch, CanaryState, CanaryStepConfig
from canary_jax.runtime.step import canary_head, canary_tail
from pallas_kernels.config import PallasConfig
from pallas_kernels.write import write_pallas

N_SLOTS = 256
LONG = PallasConfig(write_long_threshold=2, write_long_chunk=4, write_prefetch=2)
# The long-role launches share one shape (30 tokens, 4 requests), so the tests share its compiled programs.
COUNTS = [9, 2, 11, 8]  # request 1 at the threshold: the lane role
LONG_COUNTS = [9, 3, 11, 7]  # every request long


def _pairs(values):
    return jnp.asarray(np.asarray(values, dtype=np.int64).view(np.uint32).reshape(-1, 2))


def _launch(rng, counts):
    """A write launch: requests of ``counts`` tokens seeded from slots 1..len(counts) (records present in the
    buffer), positions continuing their seeds', distinct slots above 64."""
    t = int(sum(counts))
    plan = canary_jax.WritePlan.from_requests(counts=list(counts), seed_slots=list(range(1, len(counts) + 1)))
    buf = np.zeros((N_SLOTS, 32), np.uint8)
    seed_pos = rng.integers(0, 100, len(counts))
    for r, p in enumerate(seed_pos):
        buf[r + 1].view("<i8")[:3] = (int(rng.integers(0, 1000)), int(p), int(rng.integers(1, 1 << 62)))
    pos = np.concatenate([p + 1 + np.arange(c) for p, c in zip(seed_pos, counts)])
    slots = 64 + rng.permutation(N_SLOTS - 64)[:t]
    ctx = canary_jax.VerifyOrWriteContext(
        canary_buf=jnp.asarray(buf),
        kernel_kind=canary_jax.CanaryLaunchTag.HEAD_K_FULL,
        log=canary_jax.ViolationLog.allocate(ring_capacity=8),
    )
    return ctx, plan, _pairs(rng.integers(0, 1 << 40, t)), _pairs(pos), _pairs(slots)


def _same(test, got, want):
    np.testing.assert_array_equal(np.asarray(got.canary_buf), np.asarray(want.canary_buf))
    for name in ("ring", "write_index", "slot_run_counters"):
        np.testing.assert_array_equal(np.asarray(getattr(got.log, name)), np.asarray(getattr(want.log, name)))


class ChainHintTest(absltest.TestCase):
    def test_a_lane_role_launch_leaves_no_hint(self):
        rng = np.random.default_rng(2)
        ctx, plan, ids, pos, loc = _launch(rng, [1, 3, 2, 1])
        with chain_hints.chain_scope() as scope:
            got = write_pallas(ctx, plan, ids, pos, loc)
            self.assertIsNone(scope.hint)
        _same(self, got, reference.write_reference(ctx, plan, ids, pos, loc))

    def test_second_write_reuses_and_recomputes_where_seeds_differ(self):
        # One launch: requests 0 and 2 long with their seeds kept (reused); request 1 at the threshold (the lane
        # role) and request 3 long, each with a seed record that differs in the second buffer (recomputed).
        rng = np.random.default_rng(3)
        ctx, plan, ids, pos, loc = _launch(rng, COUNTS)
        other = np.asarray(ctx.canary_buf).copy()
        for r in (1, 3):
            other[r + 1].view("<i8")[2] ^= 0x55
        ctx2 = ctx.replace(canary_buf=jnp.asarray(other), kernel_kind=canary_jax.CanaryLaunchTag.TAIL_K_FULL)
        with chain_hints.chain_scope() as scope:
            first = write_pallas(ctx, plan, ids, pos, loc, config=LONG)
            self.assertIsNotNone(scope.hint)
            made = scope.hint
            second = write_pallas(ctx2, plan, ids, pos, loc, config=LONG)
            self.assertIs(scope.hint, made)  # a consumer leaves the scope's hint as it is
        _same(self, first, reference.write_reference(ctx, plan, ids, pos, loc))
        _same(self, second, reference.write_reference(ctx2, plan, ids, pos, loc))

    def test_a_matching_chain_start_takes_the_hints_chains(self):
        # Alter the hint's prev_hash words: every entry of a request whose chain start matches stores a prev_hash
        # from them (its checkpoints, and the replays from them), the request whose chain start is made to
        # differ stores its own.
        rng = np.random.default_rng(4)
        counts = LONG_COUNTS
        ctx, plan, ids, pos, loc = _launch(rng, counts)
        with chain_hints.chain_scope() as scope:
            write_pallas(ctx, plan, ids, pos, loc, config=LONG)
        hint = scope.hint
        state = np.asarray(hint.req_state).copy()
        state[2, 0] ^= 1  # request 2's recorded chain start no longer matches
        bad = dataclasses.replace(hint, prev_at=hint.prev_at ^ jnp.uint32(0x1000), req_state=jnp.asarray(state))
        with chain_hints.chain_scope(bad):
            got = np.asarray(write_pallas(ctx, plan, ids, pos, loc, config=LONG).canary_buf)
        want = np.asarray(reference.write_reference(ctx, plan, ids, pos, loc).canary_buf)
        slots = np.asarray(loc)[:, 0]
        starts = np.concatenate([[0], np.cumsum(counts)])
        for r in range(len(counts)):
            for e in range(starts[r], starts[r + 1]):
                prev_got, prev_want = got[slots[e]].view("<u8")[2], want[slots[e]].view("<u8")[2]
                if r != 2:
                    self.assertNotEqual(prev_got, prev_want, (r, e))
                else:
                    self.assertEqual(prev_got, prev_want, (r, e))
                np.testing.assert_array_equal(got[slots[e]][:16], want[slots[e]][:16])  # token, position

    def test_a_hint_of_other_shapes_is_not_used(self):
        rng = np.random.default_rng(5)
        ctx, plan, ids, pos, loc = _launch(rng, COUNTS)
        ctx_b, plan_b, ids_b, pos_b, loc_b = _launch(rng, [3, 3, 3])
        with chain_hints.chain_scope() as scope:
            write_pallas(ctx, plan, ids, pos, loc, config=LONG)
            got = write_pallas(ctx_b, plan_b, ids_b, pos_b, loc_b, config=LONG)
            self.assertEqual(scope.hint.flags.shape, (sum(COUNTS),))
        _same(self, got, reference.write_reference(ctx_b, plan_b, ids_b, pos_b, loc_b))

    def test_outside_a_scope_nothing_is_left(self):
        rng = np.random.default_rng(6)
        ctx, plan, ids, pos, loc = _launch(rng, [1, 1])
        self.assertIsNone(chain_hints.current())
        write_pallas(ctx, plan, ids, pos, loc)
        self.assertIsNone(chain_hints.current())


def _batch(prefix, slots, held):
    r2t = np.zeros((2, 256), np.int32)
    r2t[1, : len(held)] = held
    n = len(slots)
    return CanaryBatch(
        req_pool_indices=np.array([1], np.int64),
        prefix_lens=np.array([prefix], np.int64),
        extend_seq_lens=np.array([n], np.int64),
        input_ids=np.arange(100 + prefix, 100 + prefix + n, dtype=np.int64),
        positions=np.arange(prefix, prefix + n, dtype=np.int64),
        out_cache_loc=np.array(slots, np.int64),
        req_to_token=r2t,
    )


class StepReuseTest(absltest.TestCase):
    def run_steps(self, backend):
        cfg = CanaryStepConfig(verify_capacity=256, write_req_capacity=1, backend=backend, enable_v_half=True)
        group = CanaryBufferGroup.allocate(kind=PoolKind.FULL, num_slots=256, has_v_half=True)
        state = CanaryState.create((group,), ring_capacity=8)
        slots = list(range(10, 160))
        hints = []
        # Two prefill chunks of 70 tokens (the long-request role: hints) and a decode step (none).
        for prefix, n in ((0, 70), (70, 70), (140, 1)):
            batch = _batch(prefix, slots[prefix : prefix + n], slots[: prefix + n])
            state, plans = canary_head(state, batch, config=cfg)
            hints.append(plans.chain_hints)
            if prefix == 70:  # between HEAD and TAIL, TAIL-K's record of the seed slot changes: TAIL-K recomputes
                g = state.groups[0]
                k_tail = np.asarray(g.k_tail).copy()
                k_tail[slots[69]].view("<i8")[2] ^= 0x77
                state = state.replace(groups=(g.with_buffers(k_tail=jnp.asarray(k_tail)),))
            state, _ = canary_tail(state, plans, batch, config=cfg)
        return state, hints

    def test_head_hands_its_chains_to_tail_with_the_references_bytes(self):
        got, hints = self.run_steps("pallas")
        want, ref_hints = self.run_steps("reference")
        self.assertTrue(all(h is not None and h[0] is not None for h in hints[:2]))
        self.assertIsNone(hints[2])  # a decode step's writes carry none
        self.assertTrue(all(h is None for h in ref_hints))  # the reference computes every chain
        for name in ("k_head", "k_tail", "v_head", "v_tail"):
            a, b = getattr(got.groups[0], name), getattr(want.groups[0], name)
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
        for name in ("ring", "write_index", "slot_run_counters", "kernel_run_counters"):
            np.testing.assert_array_equal(np.asarray(getattr(got.log, name)), np.asarray(getattr(want.log, name)))
        self.assertGreater(int(want.log.write_index[0]), 0)  # the changed seed record was reported


if __name__ == "__main__":
    absltest.main()
