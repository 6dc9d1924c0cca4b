"""Pipeline suite: write and verify launches together: a hand-built prefill / decode pipeline, 64-bit counter
carries, and seeded fuzz of growing chains (ring overflow, real-KV sources) against the oracle.

``PipelineSuite`` is a mixin: a ``test_*.py`` class mixes it into ``absltest.TestCase`` and sets
``VERIFY_IMPL`` / ``WRITE_IMPL`` / ``CONFIG`` / ``BACKEND`` (see ``suite_base``); each launch then calls that
implementation with that configuration.
"""

from __future__ import annotations

import random

import numpy as np

from helpers import oracle
from helpers.suite_base import ALL, NONE, PARTIAL, TAG, SrcSpec, SuiteBase


def fuzz_pipeline(tc: SuiteBase, seed: int, *, sources=(), mode=NONE, ring=None, flags=None, public=False):
    """Random requests growing chains: write steps, verify plans with prev=0 (~15 %), random expected
    tokens (-1 / match / mismatch), random corruption, out-of-range entries; whole state compared.

    ``flags`` fixes both the write input assert and the verify token check (fewer compiled variants);
    None draws them per launch; ``public`` launches through ``canary_jax.verify`` / ``write``."""
    rnd = random.Random(seed)
    h = tc.harness(ring=ring, sources=sources, mode=mode, chain_assert=rnd.randint(0, 1), public=public)
    n = tc.NUM_SLOTS
    free = list(range(1, n))
    rnd.shuffle(free)
    reqs = [dict(slots=[], tokens=[], positions=[]) for _ in range(rnd.randint(1, tc.WRITE_REQ_CAPACITY))]
    for _ in range(tc.FUZZ_LAUNCHES):
        # --- write step ---
        wreqs, budget = [], tc.NUM_TOKENS
        for rq in reqs:
            k = min(rnd.choice([0, 1, 1, 2, 3, 7]), len(free), budget)
            budget -= k
            seed_slot = rq["slots"][-1] if rq["slots"] else -1
            if rnd.random() < 0.1:
                seed_slot = rnd.choice([-1, rnd.randrange(n), n + rnd.randrange(5)])
            ents = []
            for _j in range(k):
                slot = free.pop() if rnd.random() > 0.1 else rnd.choice([-1, 0, n, rnd.randrange(n)])
                tok = rnd.choice([rnd.randrange(1 << 17), -1, 2**31, rnd.randrange(-(2**63), 2**63)])
                pos = len(rq["positions"]) + rnd.choice([0] * 8 + [1, -1])
                etok = tok if rnd.random() < 0.8 else tok + 1
                epos = pos if rnd.random() < 0.8 else pos - 1
                ents.append((slot, tok, pos, etok, epos))
                if 0 <= slot < n:
                    rq["slots"].append(slot)
                    rq["tokens"].append(tok)
                    rq["positions"].append(pos)
            wreqs.append((seed_slot, ents))
        nvr = len(wreqs) if rnd.random() < 0.8 else rnd.randint(0, len(wreqs))
        h.write(wreqs, num_valid_reqs=nvr, input_assert=rnd.random() < 0.5 if flags is None else flags)
        # --- random corruption ---
        if rnd.random() < 0.5:
            slot = rnd.randrange(1, n)
            rec = list(h.record(slot))
            rec[rnd.randrange(4)] ^= 1 << rnd.randrange(64)
            h.poke(slot, [oracle.s64(v) for v in rec])
        # --- verify step over all known chains ---
        ents = []
        for rq in reqs:
            for k, slot in enumerate(rq["slots"]):
                prev = rq["slots"][k - 1] if k else -1
                if rnd.random() < 0.15:
                    prev = 0
                elif rnd.random() < 0.03:
                    prev = rnd.choice([n + 1, -3, rnd.randrange(n)])
                r = rnd.random()
                etok = -1 if r < 0.3 else (rq["tokens"][k] if r < 0.85 else rq["tokens"][k] ^ 5)
                epos = k if rnd.random() < 0.95 else k + 1
                if rnd.random() < 0.03:
                    slot = rnd.choice([0, n + 2, -1])
                ents.append((slot, epos, prev, etok))
        rnd.shuffle(ents)
        ents = ents[: tc.VERIFY_CAPACITY]
        nv = len(ents) if rnd.random() < 0.9 else rnd.randint(0, tc.VERIFY_CAPACITY + 5)
        tail = (rnd.randrange(n), 1, 0, 3)  # read only if num_valid exceeds the entries
        h.verify(
            ents,
            num_valid=nv,
            enable=int(rnd.random() < 0.9),
            check=rnd.random() < 0.5 if flags is None else flags,
            tail=tail,
        )
    return h


class PipelineSuite(SuiteBase):
    """Write-then-verify behaviour every implementation must reproduce byte for byte."""

    def test_counters_carry_past_32_bits(self):
        h = self.harness()
        h.preset_counters(TAG, 2**32 - 2, 2**32 - 1)
        h.verify([(0, 0, 0)] * 5)
        self.assertEqual((h.slot_counter(), h.kernel_counter()), (2**32 + 3, 2**32))
        h.preset_counters(TAG, 2**63 - 1, 2**64 - 1)  # int64 wrap-around
        h.write([(-1, [(3, 1, 0), (4, 1, 1)])])
        self.assertEqual((h.slot_counter(), h.kernel_counter()), (-(2**63) + 1, 0))

    def test_write_then_verify_pipeline(self):
        h = self.harness()
        # Step 1: prefill 3 tokens; step 2: decode one more seeded from the last slot; verify all.
        h.write([(-1, [(5, 11, 0), (6, 12, 1), (7, 13, 2)]), (-1, [(8, 21, 0)])])
        h.verify([(5, 0, -1), (6, 1, 5), (7, 2, 6), (8, 0, -1)])
        h.write([(7, [(9, 14, 3)]), (8, [(10, 22, 1)])])
        h.verify([(5, 0, -1), (6, 1, 5), (7, 2, 6), (9, 3, 7), (8, 0, -1), (10, 1, 8)])
        self.assertEqual(h.write_index, 0)
        self.assertEqual(h.slot_counter(), 4 + 4 + 2 + 6)

    # --- seeded fuzz ---
    def test_fuzz_pipeline(self):
        total = 0
        for seed in self.FUZZ_SEEDS:
            h = fuzz_pipeline(self, seed)
            total += h.write_index
        self.assertGreater(total, 0)

    def test_fuzz_pipeline_ring_overflow(self):
        overflowed = 0
        for seed in self.FUZZ_SEEDS[:3]:
            h = fuzz_pipeline(self, 100 + seed, ring=self.SMALL_RING)
            overflowed += h.write_index > self.SMALL_RING
        self.assertGreater(overflowed, 0)

    def test_fuzz_pipeline_real_kv(self):
        rng = np.random.default_rng(3)
        srcs = [
            SrcSpec(rng.integers(0, 256, (self.NUM_SLOTS // 4, 4 * 32 + 16), dtype=np.uint8), 4, 32, 32),
            SrcSpec(rng.integers(0, 256, (self.NUM_SLOTS // 2, 16), dtype=np.uint8), 1, 16, 16),
        ]
        for k, mode in enumerate((PARTIAL, ALL)):
            fuzz_pipeline(self, 200 + k, sources=srcs, mode=mode, flags=True)
