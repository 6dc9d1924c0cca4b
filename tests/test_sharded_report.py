"""Collapse mode of the sharded report on host logs (one device): :attr:`ViolationReporter.last_shown` and the
:class:`~canary_jax.runtime.sharded.ShardedViolationReporter` that mirrors it per shard."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

from canary_jax.contract import constants, ints
from canary_jax.contract.layout import ViolationLog
from canary_jax.runtime.report import CanaryViolationError, ViolationReporter
from canary_jax.runtime.sharded import ShardedViolationReporter

T = constants.CanaryLaunchTag
F = constants.FailReason
ROW_A = [T.SWEEP_K_FULL, 2, 1, 6, -1, 7, 7, F.VERIFY_REAL_KV_HASH_MISMATCH]
ROW_B = [T.TAIL_K_FULL, 5, 3, 42, -1, 9, 9, F.VERIFY_CHAIN_HASH_MISMATCH]


def make_log(rows, capacity=8):
    ring = np.zeros((capacity, 8), np.int64)
    ring[: len(rows)] = np.asarray(rows, np.int64)
    log = ViolationLog.allocate(ring_capacity=capacity)
    return dataclasses.replace(
        log,
        ring=jnp.asarray(ints.int64_to_pairs_np(ring)),
        write_index=jnp.asarray(np.array([len(rows)], np.int32)),
    )


class LastShownTest(absltest.TestCase):
    def test_last_shown_is_one_record_per_message(self):
        for collapse, shown in ((False, [2, 5, 2]), (True, [2, 5])):
            rep = ViolationReporter("none", collapse=collapse)
            msgs = rep.messages(make_log([ROW_A, ROW_B, ROW_A]), step=0)
            self.assertEqual([r.slot_idx for r in rep.last_records], [2, 5, 2])
            self.assertEqual([r.slot_idx for r in rep.last_shown], shown)
            self.assertLen(msgs, len(shown))
            # the next call sees only the new row: a repeat under collapse shows nothing
            msgs = rep.messages(make_log([ROW_A, ROW_B, ROW_A, ROW_B]), step=1)
            self.assertEqual([r.slot_idx for r in rep.last_records], [5])
            self.assertEqual([r.slot_idx for r in rep.last_shown], [] if collapse else [5])
            self.assertLen(msgs, len(rep.last_shown))


class ShardedCollapseTest(absltest.TestCase):
    def test_collapse_is_per_shard(self):
        rep = ShardedViolationReporter("none", collapse=True)
        logs = {(0, 0): make_log([ROW_A, ROW_A]), (1, 1): make_log([ROW_A, ROW_B])}
        msgs = rep.messages(logs, step=0)
        # shard (0, 0)'s repeat is left out; shard (1, 1)'s equal row is its own first report
        self.assertEqual(
            [(m.splitlines()[0].split(" slot_idx=")[1].split()[0], m.rsplit(" ", 1)[1]) for m in msgs],
            [("2", "shard=(0,0)"), ("2", "shard=(1,1)"), ("5", "shard=(1,1)")],
        )
        self.assertEqual([r.shard for r in rep.last_records], [(0, 0), (0, 0), (1, 1), (1, 1)])
        plain = ShardedViolationReporter("none")
        self.assertLen(plain.messages(logs, step=0), 4)


class ShardedRaiseTest(absltest.TestCase):
    def test_error_records_carry_the_shard(self):
        rep = ShardedViolationReporter("raise")
        logs = {(0, 0): make_log([ROW_A]), (1, 1): make_log([ROW_A])}
        with self.assertRaises(CanaryViolationError) as cm:
            rep.log_or_raise(logs, step=3)
        recs = cm.exception.records
        # identical rows on two shards stay distinguishable
        self.assertEqual([r.shard for r in recs], [(0, 0), (1, 1)])
        self.assertEqual(
            [(r.slot_idx, r.tag, r.reasons) for r in recs], [(2, "SWEEP_K_FULL", ["verify_real_kv_hash"])] * 2
        )
        self.assertEqual(recs[0].as_dict()["shard"], [0, 0])
        self.assertEqual(recs[1].record.slot_idx, 2)


if __name__ == "__main__":
    absltest.main()
