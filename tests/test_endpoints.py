"""Buffer groups and endpoints: layout per group, sweep/non-sweep seed errors, dispatch routing, SWA
pre-translation (incl. the -1 sentinel), shared ring."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

from canary_jax.contract import constants, decode
from canary_jax.contract.layout import ViolationLog, read_slot
from canary_jax.contract.sources import RealKvSource
from canary_jax.planning.plans import VerifyPlan, WritePlan
from canary_jax.runtime.endpoints import (
    ExpectedInputs,
    build_endpoints_from_group,
    dispatch,
    launch_group,
    select_endpoints,
)
from canary_jax.runtime.groups import CanaryBufferGroup, PoolKind

T = constants.CanaryLaunchTag
N = 16
BACKEND = "reference"
H_S = 0xDE7FAE23A9A1B716 - (1 << 64)  # anchor hash as stored


def source(rows=N):
    return RealKvSource(tensor=jnp.zeros((rows, 16), jnp.uint8), page_size=1, num_bytes_per_token=16, read_bytes=16)


def full_group(has_v=True):
    return CanaryBufferGroup.allocate(kind=PoolKind.FULL, num_slots=N, has_v_half=has_v)


def swa_group(lut, has_v=False):
    return CanaryBufferGroup.allocate(
        kind=PoolKind.SWA, num_slots=N, has_v_half=has_v, swa_index_lut=lut, swa_window_size=4
    )


def write_args(slots, ids, positions):
    """One request writing ``slots`` from the anchor."""
    return dict(
        write_plan=WritePlan.from_requests(counts=[len(slots)], seed_slots=[-1], write_req_capacity=2),
        input_ids=np.asarray(ids, np.int64),
        positions=np.asarray(positions, np.int64),
        out_cache_loc=np.asarray(slots, np.int64),
    )


EMPTY_VERIFY = dict(slots=[], positions=[], prev_slots=[], verify_capacity=4)


class LayoutTest(absltest.TestCase):
    def test_full_group_with_v_half(self):
        g = full_group()
        srcs = ((source(),), (source(),))  # (K half, V half): passed with the launch, never kept in the group
        eps = build_endpoints_from_group(g, real_kv_sources=srcs)
        self.assertEqual(
            [e.kernel_kind for e in eps],
            [T.HEAD_K_FULL, T.HEAD_V_FULL, T.TAIL_K_FULL, T.TAIL_V_FULL, T.SWEEP_K_FULL, T.SWEEP_V_FULL],
        )
        by = {e.kernel_kind: e for e in eps}
        self.assertIs(by[T.HEAD_K_FULL].canary_buf, g.k_head)
        self.assertIs(by[T.HEAD_V_FULL].canary_buf, g.v_head)
        self.assertIs(by[T.TAIL_K_FULL].canary_buf, g.k_tail)
        self.assertIs(by[T.TAIL_V_FULL].canary_buf, g.v_tail)
        # SWEEP shares the TAIL buffer and the TAIL sources of its half; HEAD has no sources.
        self.assertIs(by[T.SWEEP_K_FULL].canary_buf, g.k_tail)
        self.assertIs(by[T.SWEEP_V_FULL].canary_buf, g.v_tail)
        self.assertEqual(by[T.HEAD_K_FULL].real_kv_sources, ())
        self.assertEqual(by[T.HEAD_V_FULL].real_kv_sources, ())
        self.assertIs(by[T.TAIL_K_FULL].real_kv_sources[0], srcs[0][0])
        self.assertIs(by[T.SWEEP_K_FULL].real_kv_sources[0], srcs[0][0])
        self.assertIs(by[T.SWEEP_V_FULL].real_kv_sources[0], srcs[1][0])
        self.assertTrue(all(e.full_to_swa_index_mapping is None for e in eps))
        self.assertEqual([e.buffer_name for e in eps], ["k_head", "v_head", "k_tail", "v_tail", "k_tail", "v_tail"])
        self.assertHeadBuffersDistinct(g)

    def assertHeadBuffersDistinct(self, g):
        self.assertIsNot(g.k_head, g.k_tail)

    def test_mla_group_has_no_v_endpoints(self):
        eps = build_endpoints_from_group(full_group(has_v=False))
        self.assertEqual([e.kernel_kind for e in eps], [T.HEAD_K_FULL, T.TAIL_K_FULL, T.SWEEP_K_FULL])

    def test_swa_group_tags_and_lut(self):
        lut = np.arange(N + 1, dtype=np.int64)
        g = swa_group(lut, has_v=True)
        eps = build_endpoints_from_group(g)
        self.assertEqual([int(e.kernel_kind) for e in eps], list(range(6, 12)))
        for e in eps:
            self.assertIs(e.full_to_swa_index_mapping, g.swa_index_lut)
        self.assertEqual(g.swa_index_lut.shape, (N + 1, 2))  # stored as int64 pairs

    def test_up_to_twelve_endpoints_for_an_swa_pool(self):
        eps = build_endpoints_from_group(full_group()) + build_endpoints_from_group(
            swa_group(np.arange(N + 1), has_v=True)
        )
        self.assertEqual(sorted(int(e.kernel_kind) for e in eps), list(range(12)))

    def test_select_endpoints(self):
        eps = build_endpoints_from_group(full_group())
        self.assertEqual([e.kernel_kind for e in select_endpoints(eps, "head", enable_v_half=False)], [T.HEAD_K_FULL])
        self.assertEqual([e.kernel_kind for e in select_endpoints(eps, "TAIL")], [T.TAIL_K_FULL, T.TAIL_V_FULL])
        self.assertEqual([e.kernel_kind for e in select_endpoints(eps, "sweep")], [T.SWEEP_K_FULL, T.SWEEP_V_FULL])
        with self.assertRaisesRegex(ValueError, "phase must be one of head/tail/sweep, got 'middle'"):
            select_endpoints(eps, "middle")

    def test_group_validation(self):
        buf = jnp.zeros((N, 32), jnp.uint8)
        with self.assertRaisesRegex(ValueError, "SWA CanaryBufferGroup requires swa_index_lut"):
            CanaryBufferGroup(kind=PoolKind.SWA, k_head=buf, k_tail=buf, swa_window_size=4)
        with self.assertRaisesRegex(ValueError, "FULL CanaryBufferGroup must not carry swa_index_lut"):
            CanaryBufferGroup(kind=PoolKind.FULL, k_head=buf, k_tail=buf, swa_index_lut=np.arange(3))
        with self.assertRaisesRegex(ValueError, "needs swa_window_size > 0, got 0"):
            CanaryBufferGroup(kind=PoolKind.SWA, k_head=buf, k_tail=buf, swa_index_lut=np.arange(3))
        with self.assertRaisesRegex(ValueError, "both v_head and v_tail"):
            CanaryBufferGroup(kind=PoolKind.FULL, k_head=buf, k_tail=buf, v_head=buf)
        with self.assertRaisesRegex(ValueError, "V-half real-KV sources given for group FULL, which has no V half"):
            build_endpoints_from_group(
                CanaryBufferGroup(kind=PoolKind.FULL, k_head=buf, k_tail=buf), real_kv_sources=((), (source(),))
            )
        with self.assertRaisesRegex(TypeError, "unexpected keyword argument 'real_kv_sources_k'"):
            CanaryBufferGroup(kind=PoolKind.FULL, k_head=buf, k_tail=buf, real_kv_sources_k=(source(),))
        with self.assertRaisesRegex(TypeError, "k_head must have dtype uint8"):
            CanaryBufferGroup(kind=PoolKind.FULL, k_head=jnp.zeros((N, 32), jnp.int32), k_tail=buf)


class LaunchTest(absltest.TestCase):
    def test_seed_errors_name_the_tag(self):
        eps = {e.kernel_kind: e for e in build_endpoints_from_group(full_group())}
        log = ViolationLog.allocate(ring_capacity=4)
        plan = VerifyPlan.from_entries(**EMPTY_VERIFY)
        with self.assertRaisesRegex(
            NotImplementedError, r"^kv-canary: launch_per_forward not supported on sweep endpoint SWEEP_K_FULL$"
        ):
            eps[T.SWEEP_K_FULL].launch_per_forward(
                verify_plan=plan, violation_log=log, backend=BACKEND, **write_args([1], [5], [0])
            )
        with self.assertRaisesRegex(
            NotImplementedError, r"^kv-canary: launch_sweep not supported on non-sweep endpoint HEAD_K_FULL$"
        ):
            eps[T.HEAD_K_FULL].launch_sweep(verify_plan=plan, violation_log=log, backend=BACKEND)
        with self.assertRaisesRegex(NotImplementedError, "non-sweep endpoint TAIL_V_FULL$"):
            eps[T.TAIL_V_FULL].launch_sweep(verify_plan=plan, violation_log=log, backend=BACKEND)
        # Nothing was launched.
        self.assertEqual(int(log.kernel_run_counters.sum()), 0)

    def test_dispatch_routes_sweep_to_verify_only(self):
        g = full_group(has_v=False)
        eps = {e.kernel_kind: e for e in build_endpoints_from_group(g)}
        log = ViolationLog.allocate(ring_capacity=4)
        before = np.asarray(g.k_tail).copy()
        plan = VerifyPlan.from_entries(slots=[3], positions=[7], prev_slots=[0], verify_capacity=4)
        # Write arguments are ignored for a sweep endpoint: dispatch never raises the seed error.
        ep, log = dispatch(
            eps[T.SWEEP_K_FULL], verify_plan=plan, violation_log=log, backend=BACKEND, **write_args([1], [5], [0])
        )
        np.testing.assert_array_equal(np.asarray(ep.canary_buf), before)
        self.assertEqual(log.kernel_run_counter(T.SWEEP_K_FULL), 1)
        self.assertEqual(log.slot_run_counter(T.SWEEP_K_FULL), 1)
        rec = decode.decode_violations(log)
        self.assertLen(rec, 1)  # stored position 0 != 7
        self.assertEqual((rec[0].tag, rec[0].reasons), ("SWEEP_K_FULL", ["verify_position"]))

    def test_dispatch_per_forward_stamps_tag_on_both_launches(self):
        g = full_group(has_v=False)
        ep = build_endpoints_from_group(g)[0]
        self.assertEqual(ep.kernel_kind, T.HEAD_K_FULL)
        log = ViolationLog.allocate(ring_capacity=8)
        # Verify slot 2 expecting position 9 (stored 0) -> verify row; write token 5 where 6 is expected.
        plan = VerifyPlan.from_entries(slots=[2], positions=[9], prev_slots=[0], verify_capacity=4)
        ep, log = dispatch(
            ep,
            verify_plan=plan,
            violation_log=log,
            backend=BACKEND,
            enable_write_input_assert=True,
            expected_inputs=ExpectedInputs(tokens=np.array([6], np.int64), positions=np.array([0], np.int64)),
            **write_args([1], [5], [0]),
        )
        rec = decode.decode_violations(log)
        self.assertEqual(
            [(r.tag, r.reasons) for r in rec], [("HEAD_K_FULL", ["verify_position"]), ("HEAD_K_FULL", ["write_token"])]
        )
        self.assertEqual(log.kernel_run_counter(T.HEAD_K_FULL), 2)
        self.assertEqual(read_slot(ep.canary_buf, 1), (5, 0, H_S, 0))  # HEAD: real_kv_hash 0 (no sources)
        g = g.with_endpoint(ep)
        self.assertIs(g.k_head, ep.canary_buf)

    def test_dispatch_per_forward_requires_write_inputs(self):
        ep = build_endpoints_from_group(full_group(has_v=False))[1]
        with self.assertRaisesRegex(ValueError, "per-forward endpoint TAIL_K_FULL needs write_plan, input_ids"):
            dispatch(
                ep,
                verify_plan=VerifyPlan.from_entries(**EMPTY_VERIFY),
                violation_log=ViolationLog.allocate(ring_capacity=4),
            )
        with self.assertRaisesRegex(ValueError, "expected input tensors are required"):
            ep.launch_per_forward(
                verify_plan=VerifyPlan.from_entries(**EMPTY_VERIFY),
                violation_log=ViolationLog.allocate(ring_capacity=4),
                enable_write_input_assert=True,
                **write_args([1], [5], [0]),
            )

    def test_swa_pretranslation_with_sentinel_row(self):
        # Full slots 1, 2, 3 -> SWA slots 9, evicted sentinel -1 (write skipped), 4.
        lut = np.array([0, 9, -1, 4] + [0] * (N - 3), np.int64)
        g = swa_group(lut)
        ep = build_endpoints_from_group(g)[0]
        self.assertEqual(ep.kernel_kind, T.HEAD_K_SWA)
        log = ViolationLog.allocate(ring_capacity=4)
        ep, log = ep.launch_per_forward(
            verify_plan=VerifyPlan.from_entries(**EMPTY_VERIFY),
            violation_log=log,
            backend=BACKEND,
            **write_args([1, 2, 3], [11, 22, 33], [0, 1, 2]),
        )
        self.assertEqual(read_slot(ep.canary_buf, 9)[:2], (11, 0))
        self.assertEqual(read_slot(ep.canary_buf, 4)[:2], (33, 2))
        # Slots 1, 2, 3 of the SWA buffer are untouched; the skipped entry did not advance the chain or count.
        for s in (1, 2, 3):
            self.assertEqual(read_slot(ep.canary_buf, s), (0, 0, 0, 0))
        self.assertEqual(log.slot_run_counter(T.HEAD_K_SWA), 2)

    def test_x64_on_is_byte_identical(self):
        lut = np.array([0, 9, -1, 4] + [0] * (N - 3), np.int64)
        plan = VerifyPlan.from_entries(slots=[9], positions=[1], prev_slots=[-1], verify_capacity=4)

        def run():
            g = swa_group(lut)
            g, log = launch_group(
                g,
                "head",
                verify_plan=plan,
                violation_log=ViolationLog.allocate(ring_capacity=4),
                backend=BACKEND,
                **write_args([1, 2, 3], [11, 22, 33], [0, 1, 2]),
            )
            return np.asarray(g.k_head), np.asarray(log.ring), np.asarray(log.write_index), log.counters()

        off = run()
        with jax.enable_x64(True):
            on = run()
        for a, b in zip(jax.tree_util.tree_leaves(off), jax.tree_util.tree_leaves(on)):
            self.assertEqual(a.dtype, b.dtype)
            np.testing.assert_array_equal(a, b)
        self.assertEqual(int(off[2][0]), 1)  # slot 9 stored position 0, plan expects 1

    def test_launch_group_shares_one_ring(self):
        g = full_group(has_v=True)
        log = ViolationLog.allocate(ring_capacity=8)
        plan = VerifyPlan.from_entries(slots=[2], positions=[9], prev_slots=[0], verify_capacity=4)
        g, log = launch_group(
            g,
            "tail",
            verify_plan=plan,
            violation_log=log,
            enable_v_half=True,
            backend=BACKEND,
            **write_args([1], [5], [0]),
        )
        g, log = launch_group(g, "sweep", verify_plan=plan, violation_log=log, enable_v_half=False, backend=BACKEND)
        rec = decode.decode_violations(log)
        self.assertEqual([r.tag for r in rec], ["TAIL_K_FULL", "TAIL_V_FULL", "SWEEP_K_FULL"])
        self.assertEqual(log.num_violations(), 3)
        # Both TAIL halves wrote slot 1 of their own buffer; the sweep read the TAIL-K buffer.
        self.assertEqual(read_slot(g.k_tail, 1)[0], 5)
        self.assertEqual(read_slot(g.v_tail, 1)[0], 5)
        self.assertEqual(read_slot(g.k_head, 1)[0], 0)
        counters = log.counters()[1]
        self.assertEqual(list(np.nonzero(counters)[0]), [T.TAIL_K_FULL, T.TAIL_V_FULL, T.SWEEP_K_FULL])


if __name__ == "__main__":
    absltest.main()
