"""``sglang_jax_pools`` on stand-ins with sglang-jax 0.0.2's attributes (the real objects: tests/stacks/)."""

from __future__ import annotations

from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

from canary_jax.adapters.sglang_jax_pools import sglang_jax_pools
from canary_jax.contract.constants import FailReason
from canary_jax.contract.sources import SlotChunks

RKV = FailReason.VERIFY_REAL_KV_HASH_MISMATCH


def pools(size=16, page=4, heads=2, dim=8, layers=2, shape=None):
    """``MHATokenToKVPool`` / ``ReqToTokenPool`` / allocator stand-ins (memory_pool.py, allocator.py)."""
    rows = shape or (size + page, 2 * heads, dim)
    kv = SimpleNamespace(
        size=size,
        page_size=page,
        head_num=heads,
        head_dim=dim,
        layer_num=layers,
        kv_buffer=[jnp.zeros(rows, jnp.bfloat16) for _ in range(layers)],
    )
    r2t = SimpleNamespace(size=5, max_context_len=36)
    alloc = SimpleNamespace(page_size=page, size=size, get_kvcache=lambda: kv)
    return kv, r2t, alloc


class SglangJaxPoolsTest(absltest.TestCase):
    def test_sizes_and_sources(self):
        kv, r2t, alloc = pools()
        c = sglang_jax_pools(kv, r2t, allocator=alloc)
        self.assertEqual((c.num_slots, c.page_size, c.cache_loc_page_size), (20, 4, 4))
        self.assertEqual((c.max_batch_size, c.max_seq_len), (5, 36))
        caps = c.capacities
        self.assertEqual((caps.verify_capacity, caps.write_req_capacity, caps.sweep_capacity), (60, 5, 20))
        self.assertEqual(int(c.groups()[0].k_head.shape[0]), 20)
        (((k,), (v,)),) = c.sources(kv.kv_buffer, v_half=True)
        self.assertIs(k.tensor, kv.kv_buffer[0])  # layer 0 itself, no copy
        self.assertEqual(k.chunks, SlotChunks(chunk_bytes=16, num_chunks=2, chunk_stride_bytes=32, offset_bytes=0))
        self.assertEqual(v.chunks.offset_bytes, 16)
        self.assertEqual(c.sources(kv)[0][1], ())  # the pool object works too; no V half unless asked

    def test_guard_sized_from_the_pools(self):
        kv, r2t, alloc = pools()
        c = sglang_jax_pools(kv, r2t, allocator=alloc)

        def write(kv_buffer, inputs):
            rows = jnp.ones((inputs.out_cache_loc.shape[0], 4, 8), jnp.bfloat16) * inputs.input_ids[:, None, None]
            return [kv_buffer[0].at[inputs.out_cache_loc].set(rows), *kv_buffer[1:]]

        g = c.guard(write, mode="none")
        self.assertEqual(g.capacities, c.capacities)
        self.assertEqual(int(g.state.groups[0].k_head.shape[0]), 20)
        self.assertIs(c.guard(write)._step_fn, g._step_fn)  # guards of one runner share their step programs
        r2t_rows = np.zeros((5, 36), np.int32)
        r2t_rows[0, :3] = [4, 5, 6]
        batch = c.batch(
            SimpleNamespace(
                forward_mode="EXTEND",
                input_ids=np.array([7, 8, 9, 0], np.int32),
                positions=np.array([0, 1, 2, 0], np.int32),
                out_cache_loc=np.array([4, 5, 6, -1], np.int32),
                req_pool_indices=np.array([0, -1], np.int32),
                seq_lens=np.array([3, 0], np.int32),
                cache_loc=np.array([4, 5, 6, 0, 0, 0, 0, 0], np.int32),
                extend_prefix_lens=np.array([0, 0], np.int32),
                extend_seq_lens=np.array([3, 0], np.int32),
            )
        )
        kv.kv_buffer = g.step(kv.kv_buffer, batch)
        self.assertEqual(np.asarray(kv.kv_buffer[0][5, 0]).astype(np.int32).tolist(), [8] * 8)  # write_fn ran
        kv.kv_buffer[0] = kv.kv_buffer[0].at[5, 2, 3].add(1)  # K head 1 of slot 5 changes after its step
        batch2 = c.batch(
            SimpleNamespace(
                forward_mode="DECODE",
                input_ids=np.array([10, 0], np.int32),
                positions=np.array([3, 0], np.int32),
                out_cache_loc=np.array([7, -1], np.int32),
                req_pool_indices=np.array([0, -1], np.int32),
                seq_lens=np.array([4, 0], np.int32),
                cache_loc=np.array([4, 5, 6, 7, 0, 0, 0, 0], np.int32),
            )
        )
        kv.kv_buffer = g.step(kv.kv_buffer, batch2)
        g.flush()
        self.assertEqual({(r.slot_idx, r.fail_reason_bits) for r in g.violations()}, {(5, int(RKV))})
        with self.assertRaisesRegex(TypeError, r"write_fn must be callable, got int"):
            c.guard(3)
        with self.assertRaisesRegex(TypeError, r"\['num_slots'\] come from the pools"):
            c.guard(write, num_slots=8)

    def test_refusals(self):
        kv, r2t, alloc = pools()
        mla = SimpleNamespace(**vars(kv), kv_lora_rank=512)
        cases = (
            (lambda: sglang_jax_pools(mla, r2t), NotImplementedError, r"MLA pool .* kv_lora_rank=512"),
            (lambda: sglang_jax_pools(SimpleNamespace(), r2t), TypeError, r"token_to_kv_pool .* no attribute 'size'"),
            (
                lambda: sglang_jax_pools(pools(shape=(20, 2, 2, 8))[0], r2t),
                ValueError,
                r"layer_num=2 arrays .* \(20, 4, 8\) .* got 2 with kv_buffer\[0\] shape \(20, 2, 2, 8\)",
            ),
            (
                lambda: sglang_jax_pools(kv, r2t, allocator=SimpleNamespace(page_size=1)),
                ValueError,
                r"allocator.page_size=1 but token_to_kv_pool.page_size=4",
            ),
            (lambda: sglang_jax_pools(kv, r2t, allocator=pools()[2]), ValueError, r"get_kvcache\(\) is not"),
            (lambda: sglang_jax_pools(kv, SimpleNamespace(size=0)), ValueError, r"req_to_token_pool.size must be"),
            (
                lambda: sglang_jax_pools(kv, r2t).sources([jnp.zeros((8, 4, 8))]),
                ValueError,
                r"kv_buffer\[0\] must be .* = \(20, 4, 8\), got shape \(8, 4, 8\)",
            ),
        )
        for fn, err, msg in cases:
            with self.subTest(msg=msg), self.assertRaisesRegex(err, msg):
                fn()


if __name__ == "__main__":
    absltest.main()
