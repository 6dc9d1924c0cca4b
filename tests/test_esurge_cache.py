"""``canary_jax.adapters.esurge_cache`` on stand-ins of easydel 0.3.0's cache objects (no easydel needed)."""

from __future__ import annotations

from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

from canary_jax.adapters.block_tables import from_block_tables
from canary_jax.adapters.esurge_cache import esurge_cache
from canary_jax.adapters.layouts import sources_for_fused_kv


def config(**kw):
    base = dict(
        num_pages=16, page_size=4, num_kv_heads=2, k_headdim=128, v_headdim=128, max_model_length=32, version="v2"
    )
    return SimpleNamespace(**{**base, **kw})


class EsurgeCacheTest(absltest.TestCase):
    def test_sizes_from_the_cache(self):
        pages = jnp.zeros((16, 4, 4, 128), jnp.bfloat16)
        cache = SimpleNamespace(metadata=config(), views=[SimpleNamespace(kv_pages=pages)])
        c = esurge_cache(cache, max_num_seqs=2)
        self.assertEqual((c.num_slots, c.page_size, c.max_batch_size, c.max_seq_len), (64, 4, 3, 32))
        self.assertEqual(c.capacities.verify_capacity, 3 * 32)  # min(3 * 64, 3 rows * 32)
        self.assertEqual(c.step_config().write_req_capacity, 3)
        ((k, v),) = c.sources(cache)
        self.assertEqual(v, ())
        self.assertEqual(k, sources_for_fused_kv(pages, half="k", num_kv_heads=2))
        self.assertEqual(c.sources(pages), c.sources(cache))

    def test_batch_is_from_block_tables_with_page_size_and_null_page(self):
        c = esurge_cache(config(), max_num_seqs=2)
        f = dict(
            input_ids=np.array([11, 12, 13, 0], np.int32),
            positions=np.array([4, 5, 2, 0], np.int32),
            query_start_loc=np.array([0, 2, 3], np.int32),
            seq_lens=np.array([6, 3], np.int32),
            block_table=np.array([[5, 7, 0, 0], [3, 0, 0, 0]], np.int32),
            num_reqs=2,
        )
        got, want = c.batch(**f), from_block_tables(**f, block_size=4, null_block=0)
        for name in ("req_pool_indices", "prefix_lens", "extend_seq_lens", "out_cache_loc", "input_ids"):
            np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), name)
        np.testing.assert_array_equal(np.asarray(got.out_cache_loc)[:3, 0], [28, 29, 14])  # page 7 off 0, 1; page 3

    def test_refusals(self):
        with self.assertRaisesRegex(ValueError, r"k_headdim=128 but v_headdim=64"):
            esurge_cache(config(v_headdim=64), max_num_seqs=2)
        with self.assertRaisesRegex(ValueError, r"version must be 'v2' or 'v3', got 'v1'"):
            esurge_cache(config(version="v1"), max_num_seqs=2)
        with self.assertRaisesRegex(ValueError, r"num_pages must be a positive int, got -1"):
            esurge_cache(config(num_pages=-1), max_num_seqs=2)
        with self.assertRaisesRegex(TypeError, r"no attribute 'page_size'"):
            esurge_cache(SimpleNamespace(num_pages=4), max_num_seqs=2)
        with self.assertRaisesRegex(ValueError, r"max_num_seqs must be a positive int, got 0"):
            esurge_cache(config(), max_num_seqs=0)
        c = esurge_cache(config(), max_num_seqs=2)
        with self.assertRaisesRegex(ValueError, r"num_pages \* page_size = 64, got shape \(8, 4, 4, 128\)"):
            c.sources(jnp.zeros((8, 4, 4, 128), jnp.bfloat16))


if __name__ == "__main__":
    absltest.main()
