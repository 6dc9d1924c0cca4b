"""The toy engines of ``tests/helpers/engines.py`` with the batch adapters: each runs clean for tens of steps and
catches each injected fault; the hybrid (full + sliding-window) engine also plans, every step, what SGLang's
convention plans, and stays quiet when an SWA block freed out of the window is corrupted and then reused.
"""

from __future__ import annotations

import collections

import numpy as np
from absl.testing import absltest

from canary_jax.contract import constants
from canary_jax.planning.plans import VerifyPlan
from canary_jax.runtime.endpoints import ExpectedInputs
from canary_jax.runtime.groups import CanaryBufferGroup, PoolKind
from canary_jax.runtime.state import CanaryBatch, CanaryState
from canary_jax.runtime.step import canary_plan, canary_sweep
from helpers import engines as E
from helpers.batch_parity import (
    FR,
    I64,
    plan_bytes,
)

# --- engines ---------------------------------------------------------------------------------------------
EXPECTED_BITS = {
    "kv_flip": FR.VERIFY_REAL_KV_HASH_MISMATCH,
    "table_remap": FR.VERIFY_POSITION_MISMATCH,
    "token_swap": FR.WRITE_TOKEN_MISMATCH,
}


class EngineTest(absltest.TestCase):
    CLEAN_STEPS = 24

    def run_engine(self, cls) -> None:
        engine = cls(seed=3)
        for _ in range(self.CLEAN_STEPS):
            engine.step()
        self.assertEqual(engine.violations(), (0, 0), f"{cls.__name__} clean run")
        # the clean run exercised what it claims to
        self.assertGreater(engine.stats["shared_pages"], 0)
        self.assertGreater(engine.stats["chunked_prefills"], 0)
        self.assertGreater(engine.stats["finished"], 0)
        self.assertGreater(engine.stats["sweeps"], 0)
        self.assertGreater(engine.pages.reused, 0)
        if cls is E.BlockTableEngine:
            self.assertGreater(engine.stats["row_moves"], 0)
        else:
            self.assertGreater(engine.stats["row0_used"], 0)
        for kind, inject in E.FAULTS.items():
            with self.subTest(kind=kind):
                engine = cls(seed=11)  # a fresh episode
                info = None
                for _ in range(12):
                    info = engine.step(inject=None if info else inject) or info
                    if info:
                        break
                self.assertIsNotNone(info, f"{kind} found nothing to break")
                n, bits = engine.violations()
                self.assertGreater(n, 0, f"{kind} went undetected")
                self.assertTrue(bits & EXPECTED_BITS[kind], f"{kind}: fail bits {FR(bits)!r}")

    def test_sglang_jax_engine(self):
        self.run_engine(E.SglangJaxEngine)

    def test_block_table_engine(self):
        self.run_engine(E.BlockTableEngine)


def _swa_tag(tag: int) -> bool:
    return constants.CanaryLaunchTag(tag).group == "SWA"


class HybridSwaEngineTest(absltest.TestCase):
    """vLLM's hybrid KV cache (a full-attention group and a sliding-window group, each with its block table and
    pool; ``E.HybridBlockTableEngine``) through the step API: HEAD, the model's KV write into both pools, TAIL
    with each group's layer-0 K, a periodic sweep of both groups. Every step's plans equal, byte for byte, those
    of SGLang's convention (dense ``req_to_token`` + full-to-SWA LUT, SPEC 7) for the same logical batch, but
    for one documented difference (see :meth:`HybridBlockTableEngine.sglang_view`)."""

    CLEAN_STEPS = 30
    SEED = 5

    def parity_observer(self, counts):
        swa_state = None

        def observe(engine, work, arrays, batch, plans):
            nonlocal swa_state
            v = engine.sglang_view(work, arrays)
            if swa_state is None:
                swa_state = CanaryState.create(
                    [
                        CanaryBufferGroup.allocate(kind=PoolKind.FULL, num_slots=engine.num_slots, has_v_half=False),
                        CanaryBufferGroup.allocate(
                            kind=PoolKind.SWA,
                            num_slots=engine.num_swa_slots,
                            has_v_half=False,
                            swa_index_lut=v["full_to_swa_index_mapping"],
                            swa_window_size=engine.SWA_WINDOW,
                        ),
                    ]
                )
            full, swa = swa_state.groups
            state = swa_state.replace(groups=(full, swa.replace(swa_index_lut=v["full_to_swa_index_mapping"])))
            sglang = CanaryBatch(
                req_pool_indices=v["req_pool_indices"],
                prefix_lens=v["prefix_lens"],
                extend_seq_lens=v["extend_seq_lens"],
                input_ids=arrays["input_ids"],
                positions=arrays["positions"],
                out_cache_loc=arrays["model_slots"],
                req_to_token=v["req_to_token"],
                expected_inputs=ExpectedInputs(tokens=arrays["expected_true"], positions=arrays["positions"]),
                req_to_verify_expected_tokens=v["expected_tokens"],
                req_to_verify_expected_tokens_valid_lens=arrays["valid_lens"],
            )
            want = plan_bytes(canary_plan(state, sglang, config=engine.config))
            got = plan_bytes(plans)
            # vLLM frees SWA blocks per request; SGLang's LUT is per full slot. Where a request's window-start
            # predecessor is freed in its own SWA row while another request still holds that shared slot,
            # vLLM's plan says prev 0 (chain check skipped) and SGLang's the live slot: patch exactly those.
            prefix = v["prefix_lens"]
            counts_per_row = [min(int(q), engine.SWA_WINDOW) if q > 0 else 0 for q in prefix]
            want["1_prev"] = want["1_prev"].copy()
            for i, p in v["prev_conflicts"]:
                idx = sum(counts_per_row[:i]) + p - max(0, int(prefix[i]) - engine.SWA_WINDOW)
                self.assertNotEqual(int(I64(want["1_prev"][idx : idx + 1])[0]), 0)
                want["1_prev"][idx] = 0
                counts["prev_conflicts"] += 1
            for k in want:
                self.assertEqual(got[k].tobytes(), want[k].tobytes(), f"step {engine.step_no}: {k}")
            self.assertEqual(int(got["1_enable"][0]), 1)
            counts["swa_entries"] += int(got["1_num_valid"][0])
            counts["full_entries"] += int(got["0_num_valid"][0])
            counts["steps"] += 1

        return observe

    def test_clean_run_matches_sglang_plans(self):
        engine = E.HybridBlockTableEngine(seed=self.SEED)
        counts = collections.Counter()
        observe = self.parity_observer(counts)
        for _ in range(self.CLEAN_STEPS):
            engine.step(observe=observe)
        self.assertEqual(engine.violations(), (0, 0), "hybrid clean run")
        self.assertEqual(counts["steps"], self.CLEAN_STEPS)
        st = engine.stats
        # the run exercised what it claims to: chunked prefill, decode past the window, full and SWA prefix
        # hits, SWA blocks freed out of the window and reused by other requests, finished requests, both sweeps
        for key in ("chunked_prefills", "decode_past_window", "shared_pages", "swa_shared_blocks", "swa_freed"):
            self.assertGreater(st[key], 0, key)
        self.assertGreater(st["finished"], 5)
        self.assertGreater(st["sweeps"], 5)
        self.assertGreater(st["row_moves"], 0)
        self.assertGreater(engine.swa.reused, 5)
        self.assertGreater(engine.pages.reused, 0)
        self.assertGreater(counts["swa_entries"], 100)
        self.assertGreater(counts["full_entries"], counts["swa_entries"])
        self.assertLess(engine.num_swa_slots, engine.num_slots)
        counters = I64(engine.state.log.slot_run_counters)
        for tag in ("HEAD_K_SWA", "TAIL_K_SWA", "SWEEP_K_SWA", "HEAD_K_FULL", "TAIL_K_FULL", "SWEEP_K_FULL"):
            self.assertGreater(int(counters[constants.CanaryLaunchTag[tag]]), 0, tag)

    def test_each_fault_is_detected_by_its_group(self):
        expected = {
            "swa_kv_flip": (FR.VERIFY_REAL_KV_HASH_MISMATCH, "SWA"),
            "swa_table_remap": (FR.VERIFY_POSITION_MISMATCH, "SWA"),
            "kv_flip": (FR.VERIFY_REAL_KV_HASH_MISMATCH, "FULL"),
            "token_swap": (FR.WRITE_TOKEN_MISMATCH, None),
        }
        for kind, inject in E.HYBRID_FAULTS.items():
            with self.subTest(kind=kind):
                engine = E.HybridBlockTableEngine(seed=11)  # a fresh episode
                for _ in range(6):  # past the window first
                    engine.step()
                info = None
                for _ in range(12):
                    info = engine.step(inject=inject)
                    if info:
                        break
                self.assertIsNotNone(info, f"{kind} found nothing to break")
                n, rows = engine.violation_rows()
                self.assertGreater(n, 0, f"{kind} went undetected")
                bit, group = expected[kind]
                hits = [r for r in rows if int(r[7]) & bit]
                self.assertTrue(hits, f"{kind}: fail bits {FR(int(np.bitwise_or.reduce(rows[:, 7])))!r}")
                if group is not None:
                    self.assertTrue(all(_swa_tag(int(r[0])) == (group == "SWA") for r in rows), f"{kind}: {rows}")

    def test_freed_swa_block_reused_is_quiet(self):
        # A block that left every window (freed, not in the prefix cache) gets a flipped byte in each slot. Read
        # now, those slots fail (control: a sweep of the block, whose canary records are still there). Instead
        # the pool hands it to another request, whose writes replace the KV and the records; its HEAD / TAIL
        # windows and the sweeps cover it again. Nothing is reported: the canary never reads a freed SWA block
        # (it is the null block in its old owner's SWA row).
        engine = E.HybridBlockTableEngine(seed=self.SEED)
        block = first = 0
        for _ in range(12):
            engine.step()
            block, first = E.flip_freed_swa_block(engine)
            if block:
                break
        self.assertTrue(block, "no freed SWA block to flip")
        ps = engine.PAGE_SIZE
        control = VerifyPlan.from_entries(
            slots=[block * ps + i for i in range(ps)], positions=[first + i for i in range(ps)], prev_slots=[0] * ps
        )
        probe = canary_sweep(engine.state, (None, control), config=engine.config, real_kv_sources=engine.sources())
        rows = I64(probe.log.ring)[: int(np.asarray(probe.log.write_index)[0])]
        self.assertEqual(len(rows), ps)
        self.assertTrue(all(int(r[7]) == FR.VERIFY_REAL_KV_HASH_MISMATCH for r in rows), rows)
        self.assertEqual(engine.violations(), (0, 0))  # the probe's log was not kept
        sweeps_at_flip = engine.stats["sweeps"]
        for _ in range(20):
            engine.step()
            if engine.stats["watched_verified"] >= ps and engine.stats["sweeps"] > sweeps_at_flip + 1:
                break
        self.assertGreaterEqual(engine.stats["watched_verified"], ps, "the block was not reused")
        self.assertGreater(engine.stats["sweeps"], sweeps_at_flip + 1)
        self.assertEqual(engine.violations(), (0, 0))


if __name__ == "__main__":
    absltest.main()
