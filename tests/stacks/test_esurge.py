"""The canary inside EasyDeL 0.3.0 eSurge's own serving code (``esurge_serving``): a clean run, then each fault.

Requests are served by eSurge's Scheduler (chunked prefill, prefix caching) and CacheManager page pool, the
runner's own ``_update_states`` over its SequenceBuffer and page table, ``BatchMetadataPreparer`` and a v2
``RaggedPagesCache`` written by its own ``concatenate_to_cache``; the canary is fed the preparer's fields through
``from_block_tables`` and hashes layer 0's K heads through ``sources_for_fused_kv``.

Each fault is injected into the real cache, page table or batch fields, and the test asserts the FailReason the
canary reports for it. Skipped when easydel is not importable, unless ``CANARY_REQUIRE_STACKS=1`` and
``CANARY_STACK=esurge`` (its CI job, .ci/run): then a missing package fails the collection. The sglang-jax job
sets only the first, so this module skips there.
"""

from __future__ import annotations

import os
import unittest

import numpy as np

try:
    import easydel.inference.esurge  # noqa: F401
except ImportError as e:
    if os.environ.get("CANARY_REQUIRE_STACKS") == "1" and os.environ.get("CANARY_STACK") == "esurge":
        raise ImportError(f"CANARY_REQUIRE_STACKS=1 CANARY_STACK=esurge but easydel is not importable: {e}") from e
    raise unittest.SkipTest(f"easydel is not installed ({e}); tests/stacks/requirements-esurge.txt pins it") from e

import esurge_serving as S
import jax
from absl.testing import absltest

from canary_jax.contract.constants import FailReason

POS, CHAIN = FailReason.VERIFY_POSITION_MISMATCH, FailReason.VERIFY_CHAIN_HASH_MISMATCH
RKV, POS_W = FailReason.VERIFY_REAL_KV_HASH_MISMATCH, FailReason.WRITE_POSITION_MISMATCH


def reasons(records) -> FailReason:
    out = FailReason(0)
    for _, r in records:
        out |= FailReason(r.fail_reason_bits)
    return out


def live_rows(server: S.Server, *, computed: int = 5) -> list[int]:
    """Sequence-buffer rows whose request has at least ``computed`` tokens in the KV."""
    sb = server.runner.sequence_buffer
    return [r for r in range(sb.num_reqs) if int(sb.num_computed_tokens[r]) >= computed]


class Fault:
    """Injects once, from step ``at`` on, when its target exists; ``done`` says where and what."""

    def __init__(self, at: int = 10):
        self.at, self.done = at, None

    def __call__(self, server, fields):
        if self.done is None and server.it >= self.at:
            self.done = self.inject(server, fields) if fields is not None else self.inject_tables(server)
        return fields

    def inject(self, server, fields):
        return None

    def inject_tables(self, server):
        return None


class KvFlip(Fault):
    """One bit of layer 0's K head 0 (combined head 0) of a running request's position 0, in the cache itself."""

    def inject_tables(self, server):
        rows = live_rows(server)
        if not rows:
            return None
        page = int(server.runner.sequence_buffer.page_table[0].get_cpu_tensor()[rows[0], 0])
        view = server.cache.views[0]
        host = np.array(view.kv_pages)
        host.view(np.uint16)[page, 0, 0, 3] ^= 0x0008
        server.cache.views[0] = view.replace(kv_pages=jax.device_put(host, view.kv_pages.sharding))
        return dict(slot=page * server.cfg.page_size)


class RemapPageTable(Fault):
    """A running row's page-table entry 0 (the runner's own table) points at another running row's page 1."""

    def inject_tables(self, server):
        rows = live_rows(server, computed=2 * server.cfg.page_size)
        if len(rows) < 2:
            return None
        pt = server.runner.sequence_buffer.page_table[0].get_cpu_tensor()
        a, b = rows[0], rows[1]
        if pt[b, 1] in pt[a, :]:
            return None
        old, pt[a, 0] = int(pt[a, 0]), pt[b, 1]
        return dict(old=old, page=int(pt[a, 0]))


class PositionCorruption(Fault):
    """Token 0's position, as the canary is fed it, is one more than the request's own."""

    def inject(self, server, fields):
        pos = np.array(fields["positions"])
        pos[0] += 1
        fields["positions"] = pos
        return dict(position=int(pos[0]))


class EsurgeServingTest(absltest.TestCase):
    def test_no_false_positives(self):
        server = S.Server(S.ServeConfig()).run()
        self.assertGreaterEqual(len(server.forwards), 50)
        self.assertEqual(server.finished, len(server.workload))  # every request finished
        self.assertEqual(server.violations, [])
        self.assertGreater(server.prefix_hits, 0)  # eSurge's prefix cache
        self.assertGreater(server.chunked, 0)  # chunked prefill
        self.assertGreater(server.reused_pages, 0)  # freed pages written again
        for _, rid, prompt, mt in server.workload:  # the fake model's greedy tokens, all of them
            toks, pos = list(prompt), len(prompt) - 1
            for _ in range(mt):
                toks.append(S.next_token(toks[-1], pos))
                pos += 1
            self.assertEqual(server.outputs[rid], toks[len(prompt) :], rid)

    def run_fault(self, fault: Fault, want: FailReason) -> S.Server:
        server = S.Server(S.ServeConfig(), fault=fault).run(until=24)
        self.assertIsNotNone(fault.done, "the fault found no target")
        got = reasons(server.violations)
        self.assertTrue(got & want, f"{type(fault).__name__} {fault.done}: reported {got!r}, want {want!r}")
        return server

    def test_k_flip(self):
        fault = KvFlip()
        server = self.run_fault(fault, RKV)
        self.assertEqual(reasons(server.violations), RKV)
        self.assertIn(fault.done["slot"], {r.slot_idx for _, r in server.violations})

    def test_remapped_page_table_entry(self):
        self.run_fault(RemapPageTable(), POS | CHAIN)

    def test_position_corruption(self):
        server = self.run_fault(PositionCorruption(), POS_W)
        # the write assert at the step itself; the slot stamped with the wrong position fails verify after
        self.assertEqual(reasons(server.violations), POS_W | POS)
        self.assertEqual(FailReason(server.violations[0][1].fail_reason_bits), POS_W)


if __name__ == "__main__":
    absltest.main()
