"""Reporting: SGLang's violation text for every fail reason, log / raise / none modes, the delayed pump,
summary statistics and the kernel-counter health check."""

from __future__ import annotations

import dataclasses
import logging

import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

from canary_jax.contract import constants, ints
from canary_jax.contract.layout import ViolationLog
from canary_jax.runtime.report import (
    CanaryViolationError,
    EnableWarner,
    HealthChecker,
    StatsLogger,
    ViolationMonitor,
    ViolationReporter,
    canary_stats,
    expected_health_tags,
    validate_mode,
)

T = constants.CanaryLaunchTag
F = constants.FailReason
H = 0xDE7FAE23A9A1B716
H_S = H - (1 << 64)
MIX = 0x1B798564098041C9  # mix3(H, 42, 0)


def make_log(rows, *, capacity=8, write_index=None, kernel_runs=None, slot_runs=None):
    ring = np.zeros((capacity, 8), np.int64)
    n = min(len(rows), capacity)
    if n:
        ring[:n] = np.asarray(rows[:n], np.int64)
    log = ViolationLog.allocate(ring_capacity=capacity)
    repl = dict(
        ring=jnp.asarray(ints.int64_to_pairs_np(ring)),
        write_index=jnp.asarray(np.array([len(rows) if write_index is None else write_index], np.int32)),
    )
    if kernel_runs is not None:
        repl["kernel_run_counters"] = jnp.asarray(ints.int64_to_pairs_np(np.asarray(kernel_runs, np.int64)))
    if slot_runs is not None:
        repl["slot_run_counters"] = jnp.asarray(ints.int64_to_pairs_np(np.asarray(slot_runs, np.int64)))
    return dataclasses.replace(log, **repl)


VERIFY_CHAIN_ROW = [T.TAIL_K_FULL, 5, 3, 42, -1, H_S, MIX, F.VERIFY_CHAIN_HASH_MISMATCH]
WRITE_TOKEN_ROW = [T.HEAD_K_SWA, 9, 12, 5, 6, MIX, 12, F.WRITE_TOKEN_MISMATCH]

VERIFY_CHAIN_TEXT = """\
kv_canary violation: launch_tag=TAIL_K_FULL fail_reason=verify_chain_hash slot_idx=5 position=3 stored_token=42 \
expected_token=-1 stored_chain_hash=0xde7fae23a9a1b716 expected_aux=0x1b798564098041c9
KV cache canary violation detected (kernel_kind=TAIL_K_FULL, slot_idx=5, position=3)
canary_kind:       per_forward_tail_k_full
  fail_reasons: verify_chain_hash
  stored:   token_id=42   position=3 prev_hash=0xde7fae23a9a1b716
  expected: prev_hash=0x1b798564098041c9
  total_violations=2 ring_overflow=False step_when_pumped=7"""

WRITE_TOKEN_TEXT = """\
kv_canary violation: launch_tag=HEAD_K_SWA fail_reason=write_token slot_idx=9 position=12 stored_token=5 \
expected_token=6 stored_chain_hash=0x1b798564098041c9 expected_aux=0x000000000000000c
KV cache canary violation detected (kernel_kind=HEAD_K_SWA, slot_idx=9, position=12)
canary_kind:       per_forward_head_k_swa
  fail_reasons: write_token
  actual:   token_id=5   position=12 prev_hash=0x1b798564098041c9
  expected: token_id=6   position=12
  total_violations=2 ring_overflow=False step_when_pumped=7"""


class TextTest(absltest.TestCase):
    def test_exact_text_of_a_verify_and_a_write_row(self):
        msgs = ViolationReporter("log").messages(make_log([VERIFY_CHAIN_ROW, WRITE_TOKEN_ROW]), step=7)
        self.assertEqual(msgs, [VERIFY_CHAIN_TEXT, WRITE_TOKEN_TEXT])

    def test_each_fail_reason(self):
        cases = [
            (F.VERIFY_CHAIN_HASH_MISMATCH, "verify_chain_hash", "stored", "  expected: prev_hash=0x"),
            (F.VERIFY_POSITION_MISMATCH, "verify_position", "stored", "  expected: prev_hash=0x"),
            (F.VERIFY_REAL_KV_HASH_MISMATCH, "verify_real_kv_hash", "stored", "  expected: prev_hash=0x"),
            (F.VERIFY_TOKEN_MISMATCH, "verify_token", "stored", "  expected: token_id=77 prev_hash=0x"),
            (F.WRITE_TOKEN_MISMATCH, "write_token", "actual", "  expected: token_id=77   position=1"),
            (F.WRITE_POSITION_MISMATCH, "write_position", "actual", "  expected: token_id=77   position=1"),
        ]
        for bit, label, body, expected_line in cases:
            tag = T.SWEEP_V_SWA if label.startswith("verify") else T.TAIL_V_FULL
            row = [tag, 3, 4, 76, 77, H_S, 1, bit]
            (msg,) = ViolationReporter("log").messages(make_log([row]), step=1)
            lines = msg.split("\n")
            self.assertEqual(len(lines), 7, msg)
            self.assertTrue(
                lines[0].startswith(f"kv_canary violation: launch_tag={tag.name} fail_reason={label} "), msg
            )
            self.assertEqual(lines[3], f"  fail_reasons: {label}")
            self.assertTrue(
                lines[4].startswith(f"  {body}:   token_id=76   position=4 prev_hash=0xde7fae23a9a1b716"), msg
            )
            self.assertTrue(lines[5].startswith(expected_line), msg)
            kind = tag.name.lower() if tag.is_sweep else f"per_forward_{tag.name.lower()}"
            self.assertEqual(lines[2], f"canary_kind:       {kind}")

    def test_combined_bits_unknown_tag_and_no_bits(self):
        row = [99, 1, 2, 3, -1, 0, 0, F.VERIFY_POSITION_MISMATCH | F.VERIFY_TOKEN_MISMATCH]
        (msg,) = ViolationReporter("log").messages(make_log([row]))
        self.assertIn("launch_tag=unknown(99) fail_reason=verify_position+verify_token ", msg)
        self.assertIn("canary_kind:       unknown(99)", msg)
        self.assertIn("  fail_reasons: verify_position verify_token", msg)
        (msg,) = ViolationReporter("log").messages(make_log([[T.HEAD_K_FULL, 1, 2, 3, -1, 0, 0, 0]]))
        self.assertIn("fail_reason=none ", msg)
        self.assertIn("  fail_reasons: none", msg)

    def test_ring_overflow_reports_kept_rows_only(self):
        log = make_log([VERIFY_CHAIN_ROW, WRITE_TOKEN_ROW], capacity=2, write_index=5)
        msgs = ViolationReporter("log").messages(log, step=3)
        self.assertLen(msgs, 2)
        self.assertTrue(msgs[1].endswith("total_violations=5 ring_overflow=True step_when_pumped=3"))


class ModeTest(absltest.TestCase):
    def test_mode_validation(self):
        self.assertEqual(validate_mode("RAISE"), "raise")
        with self.assertRaisesRegex(ValueError, "kv-canary: kv_canary must be one of none/log/raise, got 'on'"):
            ViolationReporter("on")

    def test_log_mode_warns_once_per_row_and_advances(self):
        rep = ViolationReporter("log")
        with self.assertLogs("canary_jax", level=logging.WARNING) as cm:
            msgs = rep.log_or_raise(make_log([VERIFY_CHAIN_ROW, WRITE_TOKEN_ROW]), step=7)
        self.assertEqual([r.getMessage() for r in cm.records], [VERIFY_CHAIN_TEXT, WRITE_TOKEN_TEXT])
        self.assertEqual(msgs, [VERIFY_CHAIN_TEXT, WRITE_TOKEN_TEXT])
        self.assertEqual(rep.last_logged, 2)
        # Only rows recorded since are reported next time.
        with self.assertLogs("canary_jax", level=logging.WARNING) as cm:
            rep.log_or_raise(make_log([VERIFY_CHAIN_ROW, WRITE_TOKEN_ROW, VERIFY_CHAIN_ROW]), step=8)
        self.assertLen(cm.records, 1)
        self.assertEqual(rep.log_or_raise(make_log([VERIFY_CHAIN_ROW] * 3), step=9), [])

    def test_raise_mode_raises_once_with_all_rows(self):
        rep = ViolationReporter("raise")
        with self.assertRaises(RuntimeError) as cm:
            rep.log_or_raise(make_log([VERIFY_CHAIN_ROW, WRITE_TOKEN_ROW]), step=7)
        self.assertEqual(str(cm.exception), VERIFY_CHAIN_TEXT + "\n" + WRITE_TOKEN_TEXT)
        self.assertTrue(rep.is_raised)
        self.assertEqual(rep.log_or_raise(make_log([VERIFY_CHAIN_ROW] * 4), step=8), [])

    def test_none_mode_is_silent(self):
        self.assertEqual(ViolationReporter("none").log_or_raise(make_log([VERIFY_CHAIN_ROW])), [])

    def test_monitor_is_one_step_late(self):
        mon = ViolationMonitor(ViolationReporter("raise"), delayed=True)
        clean = make_log([])
        dirty = make_log([VERIFY_CHAIN_ROW, WRITE_TOKEN_ROW])
        self.assertEqual(mon.step(clean, step=1), [])
        self.assertEqual(mon.step(dirty, step=2), [])  # sees step 1's clean snapshot
        with self.assertRaisesRegex(RuntimeError, "step_when_pumped=3"):
            mon.step(dirty, step=3)
        self.assertEqual(mon.step(dirty, step=4), [])  # raised once, never again
        mon = ViolationMonitor(ViolationReporter("log"), delayed=True)
        with self.assertLogs("canary_jax", level=logging.WARNING):
            self.assertLen(mon.flush(dirty, step=5), 2)


class CollapseAndPumpTest(absltest.TestCase):
    def test_raise_mode_error_carries_rows_and_sglangs_text(self):
        rep = ViolationReporter("raise")
        with self.assertRaises(CanaryViolationError) as cm:
            rep.log_or_raise(make_log([VERIFY_CHAIN_ROW, WRITE_TOKEN_ROW]), step=7)
        e = cm.exception
        self.assertIsInstance(e, RuntimeError)
        self.assertEqual(str(e), VERIFY_CHAIN_TEXT + "\n" + WRITE_TOKEN_TEXT)
        self.assertEqual(e.messages, [VERIFY_CHAIN_TEXT, WRITE_TOKEN_TEXT])
        self.assertEqual([r.slot_idx for r in e.records], [5, 9])
        self.assertEqual((e.step, e.recorded_step, e.kv_state), (7, None, None))

    def test_collapse_reports_a_repeated_row_once_and_counts_it(self):
        rep = ViolationReporter("log", collapse=True)
        with self.assertLogs("canary_jax", level=logging.WARNING) as cm:
            msgs = rep.log_or_raise(make_log([VERIFY_CHAIN_ROW, WRITE_TOKEN_ROW]), step=7)
        self.assertEqual(msgs, [VERIFY_CHAIN_TEXT, WRITE_TOKEN_TEXT])  # first reports: SGLang's text, unchanged
        self.assertLen(cm.records, 2)
        rows = [VERIFY_CHAIN_ROW, WRITE_TOKEN_ROW, VERIFY_CHAIN_ROW, VERIFY_CHAIN_ROW]
        self.assertEqual(rep.log_or_raise(make_log(rows), step=8), [])  # two repeats: counted, not logged
        self.assertEqual(rep.log_or_raise(make_log(rows + [VERIFY_CHAIN_ROW]), step=10), [])
        self.assertLen(rep.last_records, 1)
        c = rep.collapsed
        self.assertEqual([(x.record.slot_idx, x.count, x.first, x.last) for x in c], [(5, 4, 7, 10), (9, 1, 7, 7)])
        self.assertEqual(
            rep.repeat_lines(),
            [
                "kv_canary violation repeated: launch_tag=TAIL_K_FULL fail_reason=verify_chain_hash slot_idx=5 "
                "position=3 count=4 first_step=7 last_step=10"
            ],
        )
        # A row differing in any column is a new record (here: the fail bits).
        other = VERIFY_CHAIN_ROW[:7] + [F.VERIFY_CHAIN_HASH_MISMATCH | F.VERIFY_POSITION_MISMATCH]
        with self.assertLogs("canary_jax", level=logging.WARNING):
            self.assertLen(rep.log_or_raise(make_log(rows + [VERIFY_CHAIN_ROW, other]), step=11), 1)
        # Without collapse every row is reported (SGLang), while the counts are kept all the same.
        plain = ViolationReporter("log")
        self.assertLen(plain.messages(make_log(rows), step=1), 4)
        self.assertEqual(plain.collapsed[0].count, 3)

    def test_none_mode_decodes_without_reporting(self):
        rep = ViolationReporter("none")
        self.assertEqual(rep.log_or_raise(make_log([VERIFY_CHAIN_ROW]), step=2), [])
        self.assertEqual([r.slot_idx for r in rep.last_records], [5])
        self.assertEqual(rep.last_logged, 1)

    def test_delayed_monitor_reads_the_previous_steps_log_not_the_current_one(self):
        mon = ViolationMonitor(ViolationReporter("log"), delayed=True)
        step1 = make_log([VERIFY_CHAIN_ROW])
        step2 = make_log([VERIFY_CHAIN_ROW, WRITE_TOKEN_ROW])  # step 2 recorded a second row
        self.assertEqual(mon.step(step1, step=1), [])  # stages step 1's snapshot
        with self.assertLogs("canary_jax", level=logging.WARNING) as cm:
            msgs = mon.step(step2, step=2)
        # Only step 1's row, with step 1's write index; step 2's row waits for the next pump.
        want = VERIFY_CHAIN_TEXT.replace("total_violations=2", "total_violations=1").replace("=7", "=2")
        self.assertEqual(msgs, [want])
        self.assertLen(cm.records, 1)
        self.assertEqual((mon.last_recorded_step, [r.slot_idx for r in mon.last_records]), (1, [5]))
        with self.assertLogs("canary_jax", level=logging.WARNING):
            self.assertEqual(mon.step(step2, step=3), [WRITE_TOKEN_TEXT.replace("=7", "=3")])
        self.assertEqual(mon.last_recorded_step, 2)
        self.assertEqual(mon.step(step2, step=4), [])  # the write index did not grow: nothing read
        with self.assertRaises(CanaryViolationError) as cm:
            raising = ViolationMonitor(ViolationReporter("raise"), delayed=True)
            raising.step(step1, step=5)
            raising.step(step2, step=6)
        self.assertEqual(cm.exception.recorded_step, 5)

    def test_enable_warner_is_one_step_late_with_sglangs_text(self):
        w = EnableWarner(verify_capacity=300)
        with self.assertNoLogs("canary_jax", level=logging.WARNING):
            self.assertFalse(w.tick(jnp.array([1, 0], jnp.int32)))  # staged: the SWA group overflowed
        with self.assertLogs("canary_jax", level=logging.WARNING) as cm:
            self.assertTrue(w.tick(jnp.array([1, 1], jnp.int32)))
        self.assertEqual(
            cm.records[0].getMessage(),
            "kv-canary: per-forward verify skipped this step due to overflow (total=1, capacity=300); "
            "check ServerArgs / pool sizing",
        )
        self.assertFalse(w.tick(jnp.array([0], jnp.int32)))  # reads the clean step
        with self.assertLogs("canary_jax", level=logging.WARNING) as cm:
            self.assertTrue(w.tick(jnp.array([1], jnp.int32)))
        self.assertIn("(total=2, capacity=300)", cm.records[0].getMessage())
        self.assertEqual(w.overflow_count_total, 2)


class StatsTest(absltest.TestCase):
    def test_canary_stats(self):
        slot_runs = np.zeros(12, np.int64)
        slot_runs[[0, 2]] = [10, 2**33]
        log = make_log([VERIFY_CHAIN_ROW], capacity=1, write_index=3, slot_runs=slot_runs, kernel_runs=np.arange(12))
        stats = canary_stats(log, step=200, sweep_passes=4, active_tags=[0, 2])
        self.assertEqual(stats.protected_tokens, 10 + 2**33)
        self.assertTrue(stats.ring_overflow)
        self.assertEqual(
            stats.line(),
            f"[canary] step=200 protected_tokens={10 + 2**33} sweep_passes=4 violations=3 launch_tags_active=2/12",
        )
        np.testing.assert_array_equal(stats.kernel_runs, np.arange(12))

    def test_stats_logger_period_and_delay(self):
        log = make_log([], slot_runs=np.ones(12, np.int64))
        sl = StatsLogger(active_tags=[0], every_n_steps=2)
        with self.assertLogs("canary_jax", level=logging.INFO) as cm:
            lines = [sl.step(log, step=s) for s in range(5)]
        self.assertEqual(
            lines,
            [
                None,
                None,
                "[canary] step=2 protected_tokens=12 sweep_passes=0 violations=0 launch_tags_active=1/12",
                None,
                "[canary] step=4 protected_tokens=12 sweep_passes=0 violations=0 launch_tags_active=1/12",
            ],
        )
        self.assertLen(cm.records, 2)
        delayed = StatsLogger(every_n_steps=2, delayed=True)
        with self.assertLogs("canary_jax", level=logging.INFO):
            out = [delayed.step(log, step=s) for s in range(4)]
        self.assertEqual([o is not None for o in out], [False, False, False, True])
        self.assertIn("step=2 ", out[3])
        self.assertIsNone(StatsLogger(every_n_steps=0).step(log, step=100))


class HealthTest(absltest.TestCase):
    ACTIVE = (T.HEAD_K_FULL, T.HEAD_V_FULL, T.TAIL_K_FULL, T.TAIL_V_FULL, T.SWEEP_K_FULL, T.HEAD_K_SWA)

    def counters(self, **runs):
        k = np.zeros(12, np.int64)
        for name, v in runs.items():
            k[T[name]] = v
        return k

    def test_expected_tags(self):
        self.assertEqual(expected_health_tags(self.ACTIVE), (T.HEAD_K_FULL, T.TAIL_K_FULL, T.HEAD_K_SWA))
        self.assertEqual(expected_health_tags(self.ACTIVE, sweep_interval=4, enable_v_half=True), self.ACTIVE)

    def test_stalled_tag_raises(self):
        hc = HealthChecker(self.ACTIVE)
        hc.check(self.counters(HEAD_K_FULL=5, TAIL_K_FULL=5, HEAD_K_SWA=5), step=100)
        with self.assertRaisesRegex(
            RuntimeError,
            r"^kv-canary: kernel_run_counter did not increase since previous check for "
            r"tags=\[TAIL_K_FULL, HEAD_K_SWA\] at step=200; canary path is not executing$",
        ):
            hc.check(self.counters(HEAD_K_FULL=9, TAIL_K_FULL=5, HEAD_K_SWA=5), step=200)

    def test_schedule_and_log_input(self):
        hc = HealthChecker([T.HEAD_K_FULL])
        stalled = make_log([], kernel_runs=np.zeros(12, np.int64))
        for step in (0, 50, 99, 150):
            hc.step(stalled, step=step)  # warm-up / off-period steps never check
        with self.assertRaisesRegex(RuntimeError, r"tags=\[HEAD_K_FULL\] at step=100"):
            hc.step(stalled, step=100)
        grown = make_log([], kernel_runs=self.counters(HEAD_K_FULL=3))
        HealthChecker([T.HEAD_K_FULL], every_n_steps=1, warmup_steps=0).check(grown, step=1)

    def test_delayed_check_uses_previous_snapshot(self):
        hc = HealthChecker([T.HEAD_K_FULL], every_n_steps=10, warmup_steps=10, delayed=True)
        hc.step(make_log([], kernel_runs=self.counters(HEAD_K_FULL=4)), step=10)  # staged
        hc.step(make_log([], kernel_runs=self.counters(HEAD_K_FULL=4)), step=11)  # checks step 10's: grew 0 -> 4
        hc.step(make_log([], kernel_runs=self.counters(HEAD_K_FULL=4)), step=20)  # staged
        with self.assertRaisesRegex(RuntimeError, r"tags=\[HEAD_K_FULL\] at step=21"):
            hc.step(make_log([], kernel_runs=self.counters(HEAD_K_FULL=9)), step=21)

    def test_a_nonzero_launch_ticket_is_refused_at_a_check(self):
        # A ticket left non-zero makes every one-launch phase misjudge its last program; the due check says so.
        grown = make_log([], kernel_runs=self.counters(HEAD_K_FULL=3))
        hc = HealthChecker([T.HEAD_K_FULL], every_n_steps=10, warmup_steps=10)
        hc.step(dataclasses.replace(grown, launch_ticket=jnp.array([3], jnp.int32)), step=9)  # not due: not read
        with self.assertRaisesRegex(RuntimeError, r"^kv-canary: launch_ticket is 3 between launches at step=10 "):
            hc.step(dataclasses.replace(grown, launch_ticket=jnp.array([3], jnp.int32)), step=10)
        hc.step(dataclasses.replace(grown, launch_ticket=None), step=20)  # a log without a ticket: counters only


if __name__ == "__main__":
    absltest.main()
