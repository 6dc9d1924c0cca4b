"""Batch adapters (canary_jax.adapters.batches) and the plan builder's slot tables.

For each convention (sglang-jax, vLLM-style block tables), random logical batches (prefill, chunked prefill,
decode, shared prefix pages, padding rows and tokens) written in that convention must give plans byte-identical
to the SGLang-convention builder on the same logical batch written SGLang's way, and equal to the Python-int
oracle (``tests/helpers/plan_oracle.py``); the HEAD launch on both must leave identical canary bytes and logs.
This file: the sglang-jax adapter (random and hand batches, decode and mixed modes, the HEAD launch's bytes,
jit, every bad input refused before tracing with the field named) and x64 on (a subprocess) byte-identical to
x64 off for both conventions. The block-table adapter is ``tests/test_adapters_block_tables.py``'s, the toy
engines ``tests/test_adapters_engines.py``'s; the shared checks are ``tests/helpers/batch_parity.py``.

Run as a script (``python tests/test_adapters_batches.py --dump OUT.npz``) it writes the plans of the fixed
scenarios, for the x64 subprocess.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

from canary_jax.adapters import batches as ab
from canary_jax.planning.plan_builder import build_plans
from canary_jax.runtime.step import canary_plan
from helpers import engines as E
from helpers.batch_parity import (
    CACHE_LOC,
    I64,
    MAX_REQS,
    ParityBase,
    block_table_batch,
    config,
    fresh_state,
    logical,
    plan_bytes,
    sglang_batch,
    sglang_dict,
    sglang_jax_batch,
)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


class SglangJaxTest(ParityBase):
    def test_random_batches_match_sglang_and_oracle(self):
        # Prefill from scratch, chunked-prefill continuations, shared prefix pages, decode; padding rows (-1)
        # and tokens (-1); rows from 0; cache_loc spans aligned to 1, 2 or 4; capacity 128 and an overflowing 24.
        for seed in range(12):
            lb = logical(seed, decode=seed % 3 == 2)
            batch = sglang_jax_batch(lb, seed)
            self.check_parity(batch, lb, f"seed {seed}", cap=24 if seed % 4 == 3 else 128)

    def test_hand_batch(self):
        # Row 0 is a real request (4 tokens in the KV, 2 new, page size 4 spans); row 3 prefills 3 tokens; one
        # padding row. cache_loc spans: row 0 -> [0, 8), row 3 -> [8, 12).
        b = ab.from_sglang_jax(
            forward_mode="EXTEND",
            input_ids=np.array([11, 12, 21, 22, 23, 0], np.int32),
            positions=np.array([4, 5, 0, 1, 2, 0], np.int32),
            out_cache_loc=np.array([28, 29, 12, 13, 14, -1], np.int32),
            req_pool_indices=np.array([0, 3, -1], np.int32),
            seq_lens=np.array([6, 3, 0], np.int32),
            cache_loc=np.array([20, 21, 22, 23, 28, 29, 7, 7, 12, 13, 14, 7, 0, 0], np.int32),
            extend_prefix_lens=np.array([4, 0, 0], np.int32),
            extend_seq_lens=np.array([2, 3, 0], np.int32),
            cache_loc_page_size=4,
        )
        np.testing.assert_array_equal(I64(b.req_pool_indices), [1, 4, 0])
        np.testing.assert_array_equal(I64(b.req_to_token.row_starts), [0, 8, 12])
        vp, wp = build_plans(
            req_pool_indices=b.req_pool_indices,
            prefix_lens=b.prefix_lens,
            extend_seq_lens=b.extend_seq_lens,
            req_to_token=b.req_to_token,
            verify_capacity=8,
            write_req_capacity=3,
        )
        self.assertEqual(int(np.asarray(vp.verify_num_valid)[0]), 4)
        np.testing.assert_array_equal(I64(vp.verify_slot_indices)[:4], [20, 21, 22, 23])
        np.testing.assert_array_equal(I64(vp.verify_prev_slot_indices)[:4], [-1, 20, 21, 22])
        np.testing.assert_array_equal(I64(wp.write_offsets), [0, 2, 5, 5])
        np.testing.assert_array_equal(I64(wp.write_seed_slot_indices), [23, -1, -1])

    def test_decode_prefix_is_seq_lens_minus_one(self):
        b = ab.from_sglang_jax(
            forward_mode="DECODE",
            input_ids=np.array([5, 6, 0, 0], np.int32),
            positions=np.array([6, 2, 0, 0], np.int32),
            out_cache_loc=np.array([9, 3, -1, -1], np.int32),
            req_pool_indices=np.array([2, 0, -1, -1], np.int32),
            seq_lens=np.array([7, 3, 0, 0], np.int32),
            cache_loc=np.zeros(16, np.int32),
        )
        np.testing.assert_array_equal(I64(b.prefix_lens), [6, 2, 0, 0])
        np.testing.assert_array_equal(I64(b.extend_seq_lens), [1, 1, 0, 0])
        np.testing.assert_array_equal(I64(b.req_pool_indices), [3, 1, 0, 0])
        np.testing.assert_array_equal(I64(b.req_to_token.row_starts), [0, 7, 10, 10])

    def test_mixed_mode_derives_prefix_and_forward_batch_reader(self):
        class ForwardMode:
            name = "MIXED"

        class FB:  # an sglang-jax ForwardBatch's attribute names; MIXED leaves the extend lengths None
            forward_mode = ForwardMode()
            input_ids = np.array([1, 2, 3, 0], np.int32)
            positions = np.array([3, 4, 9, 0], np.int32)
            out_cache_loc = np.array([4, 5, 10, -1], np.int32)
            req_pool_indices = np.array([1, 0], np.int32)
            seq_lens = np.array([5, 10], np.int32)
            cache_loc = np.arange(16, dtype=np.int32)
            extend_prefix_lens = None
            extend_seq_lens = None

        b = ab.from_sglang_jax_batch(FB(), extend_seq_lens=np.array([2, 1], np.int32))
        np.testing.assert_array_equal(I64(b.prefix_lens), [3, 9])
        np.testing.assert_array_equal(I64(b.extend_seq_lens), [2, 1])

    def test_head_launch_matches_sglang_bytes(self):
        # From random canary bytes, HEAD (verify with the token assert, then write with the input assert) on the
        # sglang-jax batch and on the SGLang batch leaves identical canary buffers, ring, counters.
        lb = logical(5, decode=False)
        self.check_head_parity(sglang_jax_batch(lb, 5), lb, state_seed=1)

    def test_inside_jit(self):
        lb = logical(7, decode=False)
        d = E.to_sglang_jax(lb, cache_loc_len=CACHE_LOC, cache_loc_page_size=2, max_reqs=MAX_REQS, rng=random.Random(7))
        mode, page = d.pop("forward_mode"), d.pop("cache_loc_page_size")
        d.pop("expected_tokens"), d.pop("expected_tokens_valid_lens")
        state = fresh_state()

        @jax.jit
        def plan(arrays):
            return canary_plan(
                state,
                ab.from_sglang_jax(forward_mode=mode, cache_loc_page_size=page, **arrays),
                config=config(asserts=False),
            )

        got = plan({k: jnp.asarray(v) for k, v in d.items()})
        want = canary_plan(fresh_state(), sglang_batch(sglang_dict(lb)), config=config(asserts=False))
        self.assert_same_bytes(plan_bytes(got), plan_bytes(want), "jit")

    def test_bad_inputs_name_the_field(self):
        base = dict(
            forward_mode="EXTEND",
            input_ids=np.zeros(4, np.int32),
            positions=np.zeros(4, np.int32),
            out_cache_loc=np.zeros(4, np.int32),
            req_pool_indices=np.zeros(2, np.int32),
            seq_lens=np.zeros(2, np.int32),
            cache_loc=np.zeros(8, np.int32),
            extend_seq_lens=np.zeros(2, np.int32),
        )
        cases = [
            (
                dict(positions=np.zeros(5, np.int32)),
                ValueError,
                r"from_sglang_jax: positions must have shape \(4,\) "
                r"\[num_tokens\], got shape \(5,\)",
            ),
            (
                dict(seq_lens=np.zeros((2, 1), np.int32)),
                ValueError,
                r"seq_lens must be a 1-D integer array \[bs\], got shape \(2, 1\) dtype int32",
            ),
            (
                dict(req_pool_indices=np.zeros((2, 2), np.int32)),
                ValueError,
                r"req_pool_indices must be a 1-D "
                r"integer array \[bs\], got shape \(2, 2\)",
            ),
            (
                dict(out_cache_loc=np.zeros(4, np.float32)),
                TypeError,
                r"out_cache_loc must be an integer array "
                r"\[num_tokens\], got shape \(4,\) dtype float32",
            ),
            (
                dict(cache_loc=np.zeros((2, 4), np.int32)),
                ValueError,
                r"cache_loc must be a 1-D int32 array \[N\], "
                r"got shape \(2, 4\)",
            ),
            (
                dict(cache_loc=jnp.zeros(8, jnp.float32)),
                TypeError,
                r"cache_loc must be a 1-D int32 array \[N\], got "
                r"shape \(8,\) dtype float32",
            ),
            (dict(extend_seq_lens=None), ValueError, r"extend_seq_lens \(EXTEND batches\) is required"),
            (
                dict(forward_mode="TARGET_VERIFY"),
                NotImplementedError,
                "Unsupported forward mode for kv-canary: TARGET_VERIFY",
            ),
            (dict(cache_loc_page_size=0), ValueError, "cache_loc_page_size must be >= 1, got 0"),
            (
                dict(expected_tokens=np.zeros((2, 4), np.int32)),
                ValueError,
                "expected_tokens and expected_tokens_valid_lens go together",
            ),
        ]
        for change, exc, pattern in cases:
            with self.subTest(pattern=pattern), self.assertRaisesRegex(exc, pattern):
                ab.from_sglang_jax(**{**base, **change})

    def test_cache_loc_shorter_than_the_spans_is_refused_for_host_data(self):
        # Row 0 holds 3 slots, row 1 (padding, -1) 0, row 2 holds 4: spans [0:3], [3:7] of cache_loc.
        base = dict(
            forward_mode="DECODE",
            input_ids=np.zeros(3, np.int32),
            positions=np.zeros(3, np.int32),
            out_cache_loc=np.array([5, 9, -1], np.int32),
            req_pool_indices=np.array([0, 2, -1], np.int32),
            seq_lens=np.array([3, 4, 0], np.int32),
        )
        ab.from_sglang_jax(**base, cache_loc=np.arange(1, 8, dtype=np.int32))  # exactly long enough
        msg = (
            r"^kv-canary: from_sglang_jax: cache_loc has 6 entries but row 1 \(seq_lens\[1\] = 4\) reads "
            r"cache_loc\[3:7\] \(spans of the rows' seq_lens, in row order, each padded to cache_loc_page_size=1\)$"
        )
        for mode, extra in (("DECODE", {}), ("EXTEND", dict(extend_seq_lens=np.array([1, 1, 0], np.int32)))):
            with self.subTest(mode=mode), self.assertRaisesRegex(ValueError, msg):
                ab.from_sglang_jax(**{**base, **extra, "forward_mode": mode}, cache_loc=np.arange(1, 7, dtype=np.int32))
        with self.assertRaisesRegex(ValueError, r"cache_loc has 7 entries but row 1 .* reads cache_loc\[4:8\]"):
            ab.from_sglang_jax(**base, cache_loc=np.arange(1, 8, dtype=np.int32), cache_loc_page_size=2)
        # Device fields are not read on the host: a short cache_loc then reads slot 0 past its end.
        dev = {**base, "req_pool_indices": jnp.asarray(base["req_pool_indices"])}
        ab.from_sglang_jax(**dev, cache_loc=np.arange(1, 7, dtype=np.int32))


# --- x64 -------------------------------------------------------------------------------------------------
def _x64_scenarios():
    """(name, batch builder) pairs; the builder takes a ``wrap`` for the int64-valued arrays."""
    out = []
    for seed in range(3):
        lb = logical(500 + seed, decode=seed == 2)
        out.append((f"sglang_jax_{seed}", lambda wrap, lb=lb, seed=seed: sglang_jax_batch(lb, seed, wrap)))
        out.append((f"block_{seed}", lambda wrap, lb=lb, seed=seed: block_table_batch(lb, seed, wrap)))
    return out


def x64_dump(int64_inputs: bool) -> dict:
    wrap = (lambda a: jnp.asarray(np.asarray(a, np.int64))) if int64_inputs else np.asarray
    out = {"x64": np.array([bool(jax.config.read("jax_enable_x64"))])}
    for name, make in _x64_scenarios():
        for k, v in plan_bytes(canary_plan(fresh_state(), make(wrap), config=config())).items():
            out[f"{name}/{k}"] = v
    return out


class X64Test(absltest.TestCase):
    def test_x64_on_gives_the_same_bytes(self):
        # A subprocess with JAX_ENABLE_X64=1 (also feeding JAX int64 arrays) plans the fixed scenarios; every
        # plan byte equals this process's (x64 off), which equal the SGLang-convention plans checked above.
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "x64.npz")
            env = dict(
                os.environ,
                JAX_ENABLE_X64="1",
                JAX_PLATFORMS="cpu",
                PYTHONPATH=os.pathsep.join([ROOT, HERE, os.environ.get("PYTHONPATH", "")]),
            )
            proc = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--dump", out],
                env=env,
                capture_output=True,
                text=True,
                timeout=600,
            )
            self.assertEqual(proc.returncode, 0, proc.stderr[-4000:])
            with np.load(out) as z:
                on = {k: z[k] for k in z.files}
        self.assertFalse(bool(jax.config.read("jax_enable_x64")))
        self.assertTrue(bool(on.pop("x64")[0]))
        off = x64_dump(int64_inputs=False)
        off.pop("x64")
        self.assertEqual(sorted(on), sorted(off))
        for k in off:
            self.assertEqual(on[k].tobytes(), off[k].tobytes(), k)
        # and the x64-off plans equal the SGLang-convention builder's on the same logical batches
        for name, _ in _x64_scenarios():
            seed = int(name.rsplit("_", 1)[1])
            lb = logical(500 + seed, decode=seed == 2)
            want = plan_bytes(canary_plan(fresh_state(), sglang_batch(sglang_dict(lb)), config=config()))
            for k, v in want.items():
                self.assertEqual(off[f"{name}/{k}"].tobytes(), v.tobytes(), f"{name}/{k}")


if __name__ == "__main__":
    if "--dump" in sys.argv:
        np.savez(sys.argv[sys.argv.index("--dump") + 1], **x64_dump(int64_inputs=True))
    else:
        absltest.main()
