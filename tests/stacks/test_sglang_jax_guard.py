"""The canary through ``CanaryGuard`` inside sglang-jax 0.0.2's own serving loop (``sgl_serving``, ``canary="guard"``).

The same Scheduler, pools, allocator and radix cache as ``test_sglang_jax``; here each forward is one
``guard.step`` (``SglangJaxPools.guard``: plan, HEAD, the pool's own ``set_kv_buffer_legacy``, TAIL in one
program), and violations arrive one step late through the guard's ``on_violations`` and its log-mode warnings
(SGLang's text). Skipped when sglang-jax is not installed, unless ``CANARY_REQUIRE_STACKS=1``.
"""

from __future__ import annotations

import os
import unittest

try:
    import sgl_jax  # noqa: F401
except ImportError as e:
    if os.environ.get("CANARY_REQUIRE_STACKS") == "1":
        raise ImportError(f"CANARY_REQUIRE_STACKS=1 but sglang-jax is not importable: {e}") from e
    raise unittest.SkipTest(f"sglang-jax is not installed ({e}); tests/stacks/requirements.txt pins it") from e

import dataclasses

import sgl_serving as S
import test_sglang_jax as T
from absl.testing import absltest


def guarded(fault=None, **kw) -> S.Server:
    cfg = dataclasses.replace(T.config(), canary="guard")
    if fault is None:
        return S.Server(cfg).run()
    state = {}

    def stop(server):
        if fault.done is None:
            return False
        state.setdefault("at", server.it)
        return bool(server.violations) or server.it >= state["at"] + 30

    return S.Server(cfg, fault=fault).run(stop=stop)


class GuardServingTest(absltest.TestCase):
    def test_clean(self):
        s = guarded()
        self.assertIsNotNone(s.guard)
        self.assertGreaterEqual(len(s.forwards), 50)
        self.assertEqual(s.guard.step_index, len(s.forwards))
        self.assertEqual(len(s.sched.outputs), len(s.workload))
        self.assertEqual(s.guard.flush(), [])
        self.assertEqual(s.violations, [])
        self.assertEqual(s.guard.violations(), [])
        self.assertEqual(s.guard_logs, [])
        self.assertGreater(s.prefix_hits, 0)
        self.assertGreater(s.reused_slots, 0)
        self.assertLessEqual(s.guard.num_compiles, 2)  # one extend and one decode bucket
        s.sched.check_memory()

    def check(self, s, fault, want, text):
        """The fault's slot is reported with ``want`` among its reasons, and each of the guard's warnings for that
        slot names ``text`` (SGLang's fail_reason field)."""
        self.assertIsNotNone(fault.done, "the fault found no target")
        slot = fault.done["slot"]
        at_slot = [r for _, r in s.violations if r.slot_idx == slot]
        self.assertTrue(at_slot, f"{type(fault).__name__} {fault.done}: {s.violations}")
        for r in at_slot:
            self.assertTrue(T.FailReason(r.fail_reason_bits) & want, r)
        logged = [m for m in s.guard_logs if f" slot_idx={slot} " in m]
        self.assertBetween(len(logged), 1, len(at_slot))  # identical rows (two readers, one step) log once
        for m in logged:
            self.assertIn(text, m.splitlines()[0])

    def test_k_flip_beyond_16_bytes_all(self):
        f = T.KvFlip(row=2, byte=40)  # K head 1, past the first 16 bytes of the K sequence
        s = guarded(f)
        self.check(s, f, T.RKV, "fail_reason=verify_real_kv_hash ")
        self.assertEqual(T.reasons(s.violations), T.RKV)  # nothing but the real-KV hash
        self.assertTrue(all(f" slot_idx={f.done['slot']} " in m for m in s.guard_logs), s.guard_logs)

    def test_remapped_req_to_token(self):
        f = T.RemapReqToToken()
        s = guarded(f)
        self.check(s, f, T.POS, "verify_position")


if __name__ == "__main__":
    absltest.main()
