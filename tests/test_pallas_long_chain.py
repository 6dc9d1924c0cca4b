"""The Pallas write kernel's long-request chain role against the Python-int oracle.

The role (``pallas_kernels.write_long.write_long_kernel``, with the replay in
``pallas_kernels.write_won.write_won_kernel``) takes requests
with more than ``write_long_threshold`` entries when a launch has more tokens than that and at least twice as
many tokens as the plan's request capacity (a prefill or mixed batch). The shared suites' launches (64 tokens,
8 request rows) stay under the default threshold, so here the write and pipeline suites run again with
``LONG_CONFIG`` passed to every launch (a threshold of 2 and chunks of 4 entries): every request of 3 entries
or more walks the long role, with chunk edges inside and between requests, and short requests keep the lane
role in the same launch. Extra cases: long requests that share a chunk, one program running several
long requests, token counts that are not a multiple of the chunk (padding), other chunk sizes, negative and
out-of-range slots inside a long request, x64 on, and chains across launches.
"""

from __future__ import annotations

import random

import jax
from absl.testing import absltest

from canary_jax.ops import backends
from helpers import oracle, pipeline_suite, suite_base, write_suite
from pallas_kernels.config import PallasConfig

LONG_CONFIG = PallasConfig(write_long_threshold=2, write_long_chunk=4, write_prefetch=2)


class PallasLongChainTest(write_suite.WriteSuite, pipeline_suite.PipelineSuite, absltest.TestCase):
    """The write and pipeline suites with the long-request role on (verify launches do not use it)."""

    BACKEND = "pallas"
    VERIFY_IMPL = staticmethod(backends.implementation("verify", "pallas"))
    WRITE_IMPL = staticmethod(backends.implementation("write", "pallas"))
    CONFIG = LONG_CONFIG
    FUZZ_SEEDS = tuple(range(3))
    # The long role's source loads at both ends (one source at page 1, four at page 64); the cases between run
    # through the lane role in tests/test_pallas_interpret.py (CI time).
    SOURCE_CASES = ((1, 1), (4, 64))

    # Not run here: its requests have 2 entries, under the threshold, so no entry walks the long role; the same
    # lane-role launches (NONE, PARTIAL, ALL, short read_bytes) run byte for byte in tests/test_pallas_interpret.py,
    # and real KV through the long role is checked by test_write_one_to_four_sources_and_pages (ALL, 20 entries)
    # and test_fuzz_pipeline_real_kv (PARTIAL and ALL) below.
    test_write_real_kv_modes = None

    def test_long_role_is_on_for_these_shapes(self):
        # The shapes below must really route requests to the long role, or the suite tests nothing new.
        t, cw = self.NUM_TOKENS, self.WRITE_REQ_CAPACITY
        self.assertTrue(t > LONG_CONFIG.write_long_threshold and t >= 2 * cw)

    def test_long_requests_sharing_chunks_and_programs(self):
        """Six long requests of 3..9 entries with unaligned starts (several requests per 4-entry chunk) among
        short ones, grown by a second launch; then a 16-token launch (5 long-role programs for 5 requests)."""
        h = self.harness()
        rnd = random.Random(5)
        free = list(range(1, self.NUM_SLOTS))
        rnd.shuffle(free)
        reqs = []
        for r in range(self.WRITE_REQ_CAPACITY):
            k = [3, 1, 9, 5, 2, 7, 4, 6][r]
            reqs.append((-1, [(free.pop(), 100 * r + j, j) for j in range(k)]))
        h.write(reqs)
        self.assertEqual(h.write_index, 0)
        # Grow every chain by one more launch from its last slot (seeds >= 0: the chain-position gate is on).
        reqs2 = [
            (ents[-1][0], [(free.pop(), 7 + j, len(ents) + j) for j in range(3 + r % 4)])
            for r, (_, ents) in enumerate(reqs)
        ]
        h.write(reqs2)
        self.assertEqual(h.write_index, 0)
        # 16 tokens: 5 long-role programs for the 5 requests of 3 entries (one of them with a wrong position).
        reqs3 = [(-1, [(free.pop(), 1, 0), (free.pop(), 2, 1), (free.pop(), 3, 2 + (r == 3))]) for r in range(5)]
        h.write(reqs3, num_tokens=16)
        self.assertEqual(h.write_index, 0)  # the chain-position gate is off for seeds < 0

    def test_long_request_with_bad_slots_and_positions(self):
        """Negative, zero and out-of-range slots inside a long request: skipped without advancing the chain;
        wrong positions raise chain-position rows in entry order."""
        h = self.harness()
        n = self.NUM_SLOTS
        h.poke(5, [11, 3, oracle.s64(suite_base.H), 0])
        ents = [
            (10, 1, 4),
            (-1, 2, 5),
            (11, 3, 5),
            (n, 4, 6),
            (12, 5, 9),
            (0, 6, 10),
            (13, 7, 11),
            (n + 7, 8, 12),
            (14, 9, 12),
            (15, 10, 12),
        ]
        h.write([(5, ents), (-1, [(20, 1, 0)])], input_assert=False)
        rows = h.rows()
        self.assertEqual([r[1] for r in rows], [12, 15])  # pos 9 after 5, pos 12 after 12
        self.assertEqual([r[6] for r in rows], [6, 13])  # expected positions

    def test_long_role_with_x64_on(self):
        """The long role traced with ``jax_enable_x64`` on (grid ids and sums are int64 there) gives the same
        state as the oracle."""
        with jax.enable_x64(True):
            h = self.harness()
            h.poke(5, [11, 3, oracle.s64(suite_base.H), 0])
            ents = [(10 + j, 100 + j, 4 + j + (j == 6), 100 + j + (j == 2), 4 + j) for j in range(11)]
            h.write([(5, ents), (-1, [(40, 1, 0), (41, 2, 1)])], input_assert=True)
            self.assertEqual(h.write_index, 4)  # a token and a position input row, two chain-position rows

    def test_one_program_runs_several_long_requests(self):
        """``write_max_programs=1``: a single long-role program walks every long request in rank order."""
        h = self.harness(
            config=PallasConfig(write_long_threshold=2, write_long_chunk=4, write_prefetch=2, write_max_programs=1)
        )
        reqs = [(-1, [(10 * r + j + 1, r, j + (r == 3 and j == 2)) for j in range(3 + r)]) for r in range(6)]
        h.write(reqs)
        h.write(
            [
                (ents[-1][0], [(70 + 6 * r + j, 9, len(ents) + j + (r == 1)) for j in range(4)])
                for r, (_, ents) in enumerate(reqs)
            ]
        )
        self.assertEqual(h.write_index, 1)  # request 1 of the second launch starts one position late

    def test_token_counts_off_the_chunk_grid_and_other_chunks(self):
        """37 and 45 tokens (not multiples of the chunk: the padded loads and the last partial chunk) with
        chunks of 2 and 16 entries (the class's chunk is 4); one token count per chunk size, so each configuration
        compiles one write program (37 % 2 = 1, 45 % 16 = 13: every launch ends inside a chunk). A chunk of 8 ran
        here too: the same code as 16 with another constant, one more compiled program (CI time)."""
        for chunk, num_tokens in ((2, 37), (16, 45)):
            h = self.harness(config=PallasConfig(write_long_threshold=3, write_long_chunk=chunk, write_prefetch=2))
            reqs = [
                (-1, [(j + 1, 5 + j, j) for j in range(17)]),
                (-1, [(30, 1, 0)]),
                (-1, [(40 + j, 7, j) for j in range(12)]),
            ]
            h.write(reqs, num_tokens=num_tokens)
            h.write([(17, [(60 + j, 3, 17 + j + (j == 9)) for j in range(20)])], num_tokens=num_tokens)
            self.assertEqual(h.write_index, 2)  # position 27 where 26 is due, then 27 where 28 is due

    def test_fuzz_long_requests(self):
        """Random long and short requests over several launches, input asserts on and off."""
        for seed in range(3):
            rnd = random.Random(300 + seed)
            h = self.harness(chain_assert=rnd.randint(0, 1))
            n = self.NUM_SLOTS
            free = list(range(1, n))
            rnd.shuffle(free)
            last = {}
            for _launch in range(3):
                budget, reqs = self.NUM_TOKENS, []
                for r in range(rnd.randint(1, self.WRITE_REQ_CAPACITY)):
                    k = min(rnd.choice([0, 1, 2, 3, 5, 8, 13]), budget, len(free))
                    budget -= k
                    ents = []
                    for j in range(k):
                        slot = free.pop() if rnd.random() > 0.15 else rnd.choice([-1, 0, n, rnd.randrange(n)])
                        tok = rnd.choice([rnd.randrange(1 << 20), -1, rnd.randrange(-(2**63), 2**63)])
                        pos = j + rnd.choice([0] * 8 + [1, -1])
                        ents.append(
                            (
                                slot,
                                tok,
                                pos,
                                tok if rnd.random() < 0.8 else tok ^ 1,
                                pos if rnd.random() < 0.8 else pos + 2,
                            )
                        )
                    reqs.append((last.get(r, -1), ents))
                    if ents and 0 <= ents[-1][0] < n:
                        last[r] = ents[-1][0]
                h.write(
                    reqs,
                    input_assert=rnd.random() < 0.5,
                    num_valid_reqs=len(reqs) if rnd.random() < 0.8 else rnd.randint(0, len(reqs)),
                )


if __name__ == "__main__":
    absltest.main()
