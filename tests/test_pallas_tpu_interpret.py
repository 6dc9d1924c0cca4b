"""The shared verify suites (``tests/helpers/verify_suite.py`` with its real-KV part), the write suite
(``tests/helpers/write_suite.py``), the pipeline suite and the public entry suite (every suite the GPU kernels run
in ``tests/test_pallas_interpret.py``) against the Pallas TPU (Mosaic) kernels, ``pallas_kernels.tpu.verify.verify_tpu``
and ``pallas_kernels.tpu.write.write_tpu``, and the registry's choice of them on a TPU.

Without a TPU (CI) the kernel runs in Pallas's TPU interpret mode (``pltpu.InterpretParams``, reads out of bounds
raise, uninitialised memory NaN-filled), with race detection on: the interpreter emulates the HBM / VMEM / SMEM
memory spaces, the async copies and their semaphores, not the speed. Sizes pick the tiling edges (blocks of 16
entries: several live blocks, a partial last block, blocks past ``num_valid`` that copy nothing), not large
counts. ``TpuVerifyX64Test`` runs the same suites with ``jax_enable_x64`` on; ``TpuWriteTest`` /
``TpuWriteX64Test`` do the same for the write (blocks of 16 entries and 8 requests, store calls of 40 entries).
"""

from __future__ import annotations

from unittest import mock

import jax
import numpy as np
from absl.testing import absltest

import canary_jax
from canary_jax.adapters import layouts as adapter_layouts
from canary_jax.ops import backends, reference
from helpers import oracle, pipeline_suite, public_suite, verify_suite, write_suite
from helpers.suite_base import ALL, B_RKV, B_WPOS, PARTIAL, H, SrcSpec, s64
from pallas_kernels.tpu.config import TpuConfig
from pallas_kernels.tpu.verify import verify_tpu
from pallas_kernels.tpu.write import write_tpu


def _races_found() -> bool:
    """Whether the TPU interpreter's race detector reported a race since its state was last reset (jax keeps the
    flag in a private module; False where this jax has none)."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc

    races = getattr(ipc, "races", None)
    return bool(getattr(races, "races_found", False))


def _race_checked(fn):
    """``fn`` (a verify) that fails when the interpreter's race detector flagged its launch. jax resets the
    detector's state at each ``pallas_call``, so this sees the launch's last call (every launch here but the
    segmented one of ``test_tpu_block_not_a_power_of_two_and_segments`` makes one call)."""

    def checked(*args, **kwargs):
        out = fn(*args, **kwargs)
        jax.block_until_ready(out.log.write_index)
        if _races_found():
            raise AssertionError("the TPU interpreter reported a race (see the RACE DETECTED lines above)")
        return out

    return checked


def _all_calls_race_checked(fn):
    """``fn`` (a write: several ``pallas_call`` s) that fails when the race detector flagged any of its calls: every
    detector state the interpreter creates during the launch is kept and read afterwards."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc

    def checked(*args, **kwargs):
        made = []

        class Recording(ipc.RaceDetectionState):
            def __init__(self, *a, **kw):
                super().__init__(*a, **kw)
                made.append(self)

        with mock.patch.object(ipc, "RaceDetectionState", Recording):
            out = fn(*args, **kwargs)
            jax.block_until_ready((out.canary_buf, out.log.write_index))
        if any(r.races_found for r in made):
            raise AssertionError("the TPU interpreter reported a race (see the RACE DETECTED lines above)")
        return out

    return checked


class _X64Mode:
    """Runs the class's tests with x64 ``X64``; with ``X64_SUBSET`` set, only the tests it names (the others skip)."""

    X64 = False
    X64_SUBSET: frozenset[str] | None = None  # tests this class runs (None: all)

    def setUp(self):
        super().setUp()
        if self.X64_SUBSET is not None and self._testMethodName not in self.X64_SUBSET:
            self.skipTest("x64 on: runs the subset in X64_SUBSET (interpret mode is slow; CI's time)")
        self.enter_context(jax.enable_x64(self.X64))


class TpuVerifyTest(_X64Mode, verify_suite.VerifySuite, absltest.TestCase):
    BACKEND = "pallas_tpu"
    VERIFY_IMPL = staticmethod(_race_checked(backends.implementation("verify", "pallas_tpu")))
    WRITE_IMPL = staticmethod(backends.implementation("write", "pallas_tpu"))
    CONFIG = TpuConfig(verify_block=16, detect_races=True)
    FUZZ_SEEDS = (0,)
    # The GPU suite's 70000 entries guard 16-bit grid limits; interpreted TPU copies make that minutes long. Here:
    # a capacity past a prefix bucket (64) and 13 blocks, with failures in the first, a middle and the last block.
    LARGE_ENTRIES = 200
    LARGE_BAD_ENTRIES = (3, 101)

    # --- tiling edges of the TPU kernel ---
    def test_tpu_partial_last_block_and_dead_blocks(self):
        # Capacity 70: prefix buckets (0, 64, 70); live counts on both sides of 64 and of each block edge.
        h = self.harness()
        h.lay_chain([1, 2], [10, 20], [0, 1])
        for live in (1, 16, 17, 64, 65, 70):
            ents = [(1, 0, -1), (2, 1, 1)] * 35
            ents[live - 1] = (ents[live - 1][0], 777, ents[live - 1][2])  # the last live entry fails
            h.verify(ents, cap=70, num_valid=live)
        self.assertEqual([r[1] for r in h.rows()], [1, 2, 1, 2, 1, 2])

    def test_tpu_block_not_a_power_of_two_and_segments(self):
        # Blocks of 24 entries, calls of 40 entries (the SMEM bound): 64 entries run as calls of 40 and 24.
        h = self.harness(config=TpuConfig(verify_block=24, verify_prefetch_entries=40, detect_races=True))
        h.lay_chain([1, 2], [10, 20], [0, 1])
        ents = [(1, 0, -1), (2, 1, 1)] * 32
        for k in (0, 23, 24, 39, 40, 47, 63):
            ents[k] = (ents[k][0], 900, ents[k][2])
        h.verify(ents)
        self.assertEqual(h.write_index, 7)
        h.verify(ents, num_valid=39)  # the second call is skipped
        self.assertEqual(h.write_index, 10)  # entries 0, 23, 24

    def test_tpu_config_refusals(self):
        for kw in ({"verify_block": 12}, {"verify_block": 0}, {"verify_prefetch_entries": 4}, {"verify_block": True}):
            with self.assertRaisesRegex(
                ValueError, r"^kv-canary: TpuConfig\.\w+ must be a positive multiple of 8, got"
            ):
                TpuConfig(**kw)

    def test_tpu_long_source_rows_fold_in_a_loop(self):
        # ALL over 256 bytes (64 words): past the straight-line fold, the kernel folds in a loop.
        rng = np.random.default_rng(7)
        data = rng.integers(0, 256, (self.NUM_SLOTS, 512), dtype=np.uint8)
        for mode in (PARTIAL, ALL):
            h = self.harness(sources=[SrcSpec(data, 2, 256, 256)], mode=mode)
            h.lay_chain([5, 6, 9], [1, 2, 3], [0, 1, 2])
            h.verify([(5, 0, -1), (6, 1, 5), (9, 2, 6)])
            self.assertEqual(h.rows(), [])
            bad = data.copy()
            bad[9 // 2, (9 % 2) * 256 + 250] ^= 1  # a byte past the first 16: only ALL sees it
            src = canary_jax.RealKvSource(tensor=bad, page_size=2, num_bytes_per_token=256, read_bytes=256)
            h.ctx = h.ctx.replace(real_kv_sources=(src,))
            h.osrcs = (verify_suite.oracle.Source.of(bad, 2, 256, 256),)
            h.verify([(5, 0, -1), (6, 1, 5), (9, 2, 6)])
            self.assertEqual([r[1] for r in h.rows()], [9] if mode == ALL else [])

    # --- every layout the layout adapters describe (chunked sources, fp8 / fp4 / int4 data and scales) ---
    def test_tpu_adapter_layouts(self):
        import test_adapters_layouts as LT

        lays = {lay.name: lay for lay in LT.layouts()}
        groups = (  # at most 4 sources per launch; every layout once under ALL, small chunks under PARTIAL too
            (("heads_major", "fused_k", "quant_fp8"), (ALL,)),
            (("unified_layer1_k", "quant_fp4_heads_major"), (ALL,)),
            (("fused_fp8_padded_v", "fused_v", "quant_int4"), (ALL,)),
            (("token_major", "token_major_unpaged", "k_then_v_v", "fused_kv"), (ALL,)),
            (("stacked_layer0", "stacked_layer2"), (ALL,)),
            (("sglang_jax_fused3d_k", "sglang_jax_fused3d_v", "sglang_jax_fused3d_kv"), (ALL,)),
        )
        if self.X64:  # x64 on: the chunked layouts with sub-word heads and scales, PARTIAL and ALL
            groups = ((groups[1][0], (PARTIAL,)), groups[2])
        if not self.X64:
            self.assertEqual({n for names, _ in groups for n in names}, set(lays))
        n = LT.N
        slots = [s for s in LT.SLOTS if 0 < s < n]
        for names, modes in groups:
            srcs = sum((lays[k].srcs for k in names), ())
            for mode in modes:
                want = [LT.want_hash(sum((lays[k].seq_of(s) for k in names), []), mode) for s in slots]
                buf = np.zeros((n, 32), np.uint8)
                for s, w in zip(slots, want, strict=True):
                    verify_suite.oracle.write_record(buf, s, [0, 0, verify_suite.H, w])
                bad = slots[2]
                verify_suite.oracle.write_record(buf, bad, [0, 0, verify_suite.H, want[2] ^ 1])
                ctx = canary_jax.VerifyOrWriteContext(
                    canary_buf=jax.numpy.asarray(buf),
                    kernel_kind=canary_jax.CanaryLaunchTag.TAIL_K_FULL,
                    log=canary_jax.ViolationLog.allocate(ring_capacity=8),
                    real_kv_sources=srcs,
                    real_kv_hash_mode=mode,
                )
                ents = slots + [n, -1]  # past the pool and negative: zero records, zero fingerprints
                plan = canary_jax.VerifyPlan.from_entries(
                    slots=ents, positions=[0] * len(ents), prev_slots=[-1] * len(slots) + [0, 0]
                )
                with self.subTest(names=names, mode=mode.name):
                    got = self.VERIFY_IMPL(ctx, plan, config=self.CONFIG).log
                    h_s = verify_suite.s64(verify_suite.H)  # the oracle's row: only the flipped fingerprint fails
                    self.assertEqual(got.ring_rows().tolist(), [[int(ctx.kernel_kind), bad, 0, 0, -1, h_s, h_s, B_RKV]])
                    self.assertEqual(got.slot_run_counter(ctx.kernel_kind), len(ents))


class TpuVerifyX64Test(TpuVerifyTest):
    """The same kernel with ``jax_enable_x64`` on, over a subset that reaches every kernel path (hand rows,
    boundary values and hashes, out-of-range slots, ring overflow, a fuzz seed, real KV dense and chunked,
    the tiling edges)."""

    X64 = True
    FUZZ_SEEDS = (1,)
    X64_SUBSET = frozenset(
        {
            "test_verify_token_and_position_bits_34",
            "test_verify_boundary_values",
            "test_verify_boundary_hashes",
            "test_verify_out_of_range_slots_read_as_zero_records",
            "test_verify_ring_full_keeps_counting",
            "test_fuzz_random_verify",
            "test_verify_two_sources_literal",
            "test_tpu_partial_last_block_and_dead_blocks",
            "test_tpu_long_source_rows_fold_in_a_loop",
            "test_tpu_adapter_layouts",
        }
    )


def _reference_verify(context, plan, *, config=None, **kwargs):
    """The reference verify with the harness's ``config=`` dropped: the write classes check what a write stored with
    it (the TPU verify has its own classes above, and interpret-mode time is CI's)."""
    del config
    return reference.verify_reference(context, plan, **kwargs)


class TpuWriteTest(_X64Mode, write_suite.WriteSuite, absltest.TestCase):
    """The write suite against ``write_tpu`` in TPU interpret mode, race detection on for each of its calls. The
    sizes pick the tiling edges: 32 tokens in chain blocks of 16 (a request's chain crosses blocks), 16 requests
    in seed blocks of 8 (the seed copies double-buffered), stores in calls of 24 and 8 entries (the SMEM bound;
    the first call ends in a partial block)."""

    BACKEND = "pallas_tpu"
    VERIFY_IMPL = staticmethod(_reference_verify)
    WRITE_IMPL = staticmethod(_all_calls_race_checked(backends.implementation("write", "pallas_tpu")))
    CONFIG = TpuConfig(write_block=16, write_req_block=8, write_prefetch_entries=24, detect_races=True)
    WRITE_REQ_CAPACITY = 16
    NUM_TOKENS = 32

    # --- tiling edges of the TPU kernels ---
    def test_tpu_long_chain_across_blocks_and_calls(self):
        # Blocks of 24 entries (64 = 24 + 24 + 16: a partial last chain block), seed calls of 8 requests (16 rows:
        # two calls), store calls of 8 entries. One long request from a seed crosses every block, with a skipped
        # slot, a slot past the buffer, a duplicate slot (the later entry wins) and a position jump; then short
        # requests, one seeded from a slot the long request rewrites (it sees the old record).
        cfg = TpuConfig(write_block=24, write_req_block=8, write_prefetch_entries=8, detect_races=True)
        h = self.harness(config=cfg)
        h.poke(50, [7, 10, H, 0])
        long_ents = [(60 + k, 1000 + k, 11 + k) for k in range(48)]
        long_ents[5] = (-1, 5, 16)  # skipped: no advance
        long_ents[30] = (self.NUM_SLOTS + 3, 5, 41)  # past the buffer: skipped
        long_ents[40] = (62, 77, 51)  # slot 62 again: this entry wins
        long_ents[44] = (104, 1044, 99)  # a jump: chain-position row, the chain continues on 99
        reqs = [(50, long_ents), (-1, [(50, 1, 0), (51, 2, 1)]), (50, [(52, 3, 11)])]
        reqs += [(-1, [(110 + r, r, 0)]) for r in range(6)]
        h.write(reqs, num_tokens=64)  # the harness compares everything with the oracle
        # A skipped entry does not move run_pos, so the entry after each skip (slots 66, 91) is a jump too; after
        # the jump to 99 the next entry (position 56) is one as well.
        self.assertEqual([(r[1], r[7]) for r in h.rows()], [(s, B_WPOS) for s in (66, 91, 104, 105)])
        self.assertEqual(h.record(62)[:2], (77, 51))
        self.assertEqual(h.record(52)[2], s64(oracle.mix3(H, 7, 10)))  # seed 50 read before request 1 rewrote it
        self.assertEqual(h.slot_counter(), 46 + 2 + 1 + 6)

    def test_tpu_fuzz_against_the_oracle(self):
        # Seeded launches on one harness (state carried; the harness compares the whole state with the Python-int
        # oracle after each): ragged requests, one of them long, random seeds (some just written, some past the
        # buffer), duplicate, negative and out-of-range slots, positions that sometimes follow the seed.
        rng = np.random.default_rng(11)
        n = self.NUM_SLOTS
        h = self.harness()
        for launch in range(3):
            reqs, left = [], self.NUM_TOKENS
            for r in range(int(rng.integers(1, self.WRITE_REQ_CAPACITY + 1))):
                count = min(left, int(rng.integers(12, 20)) if r == 0 else int(rng.integers(0, 5)))
                left -= count
                seed = int(rng.choice([-1, int(rng.integers(0, n)), n + 2]))
                p0 = int(rng.integers(0, 4))
                ents = []
                for k in range(count):
                    slot = int(
                        rng.choice([int(rng.integers(0, 40)), -1, n + int(rng.integers(0, 3))], p=[0.8, 0.1, 0.1])
                    )
                    tok, pos = int(rng.integers(-5, 1 << 40)), p0 + k + int(rng.random() < 0.1)
                    ents.append((slot, tok, pos, tok + int(rng.random() < 0.2), pos + int(rng.random() < 0.2)))
                reqs.append((seed, ents))
            h.write(reqs, input_assert=bool(launch % 2), num_valid_reqs=len(reqs) - int(rng.random() < 0.3))
        self.assertGreater(h.write_index, 0)

    def test_tpu_config_write_refusals(self):
        for kw in ({"write_block": 12}, {"write_req_block": 0}, {"write_prefetch_entries": 4}):
            with self.assertRaisesRegex(
                ValueError, r"^kv-canary: TpuConfig\.\w+ must be a positive multiple of 8, got"
            ):
                TpuConfig(**kw)


class TpuWriteX64Test(TpuWriteTest):
    """The same kernels with ``jax_enable_x64`` on, over a subset that reaches every kernel path (chains from
    seeds, both asserts, skipped and out-of-range slots and seeds, duplicates, int64 boundary values, and
    every call's int64 ``program_id`` in interpret mode; the real-KV fold is the verify's, run with x64 on by
    ``TpuVerifyX64Test``). CI's time keeps it to this subset."""

    X64 = True
    X64_SUBSET = frozenset(
        {
            "test_write_resume_from_seed",
            "test_write_input_assert_row_before_chain_row",
            "test_write_negative_out_cache_loc_skipped",
            "test_write_out_of_range_seed_reads_zero_record",
            "test_write_seeds_read_before_launch",
            "test_write_duplicate_slot_later_entry_wins",
            "test_write_boundary_values",
        }
    )


class TpuPipelineTest(pipeline_suite.PipelineSuite, absltest.TestCase):
    """Write and verify launches together (the pipeline suite the GPU kernels run: a prefill / decode pipeline,
    counters carried past 32 bits, fuzzed growing chains with ring overflow and real KV) on the TPU verify and
    write, both in TPU interpret mode with the verify's and the write's small tiling edges."""

    BACKEND = "pallas_tpu"
    VERIFY_IMPL = staticmethod(backends.implementation("verify", "pallas_tpu"))
    WRITE_IMPL = staticmethod(backends.implementation("write", "pallas_tpu"))
    CONFIG = TpuConfig(verify_block=16, write_block=16, write_req_block=8, write_prefetch_entries=24)
    # Interpreted TPU launches cost time per entry (the emulated copies), not just per compile: 32 tokens and 32
    # verify entries are still two blocks of 16 on each side (and two store calls of 24 and 8 entries), and three
    # fuzz seeds (the ring-overflow fuzz's count) of six launches each (CI time).
    NUM_TOKENS = 32
    VERIFY_CAPACITY = 32
    FUZZ_SEEDS = (0, 1, 2)


class TpuPublicEntryTest(public_suite.PublicEntrySuite, absltest.TestCase):
    """``canary_jax.verify`` / ``write`` with ``backend="pallas_tpu"`` (the TPU verify and write with their default
    configuration, interpreted here): validation before tracing, donation, and a fuzzed
    write/verify pipeline against the oracle."""

    BACKEND = "pallas_tpu"
    VERIFY_IMPL = staticmethod(backends.implementation("verify", "pallas_tpu"))
    WRITE_IMPL = staticmethod(backends.implementation("write", "pallas_tpu"))


class TpuRaceDetectorTest(absltest.TestCase):
    """The race check above is live: the interpreter flags a kernel that reads a copy's target before waiting."""

    def test_read_before_wait_is_a_race(self):
        from jax.experimental import pallas as pl
        from jax.experimental.pallas import tpu as pltpu

        def kernel(x_hbm, o_ref, buf, sem):
            copy = pltpu.make_async_copy(x_hbm.at[pl.ds(0, 8)], buf, sem.at[0])
            copy.start()
            o_ref[...] = buf[...]  # before the wait
            copy.wait()

        f = pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((8, 128), np.uint32),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            scratch_shapes=[pltpu.VMEM((8, 128), np.uint32), pltpu.SemaphoreType.DMA((1,))],
            interpret=pltpu.InterpretParams(detect_races=True),
        )
        try:  # jax <= 0.11 records the race in the detector's state; jax 0.12 raises at the racing access
            jax.block_until_ready(f(np.ones((16, 128), np.uint32)))
        except Exception as e:  # noqa: BLE001 - the interpreter's io_callback wraps the detector's RuntimeError
            self.assertIn("RACE DETECTED", str(e))
        else:
            self.assertTrue(_races_found())
        finally:
            pltpu.reset_tpu_interpret_mode_state()


def _export_contexts(n: int):
    """``(sources, mode, check, context)`` of the export tests, on a canary of ``n`` slots: no sources, a dense
    source with heads-major chunks under ALL, the dense source under PARTIAL."""
    dense = canary_jax.RealKvSource(
        tensor=np.zeros((n // 2, 512), np.uint8), page_size=2, num_bytes_per_token=256, read_bytes=256
    )
    chunked = adapter_layouts.sources_for_heads_major(np.zeros((2, n // 4, 4, 8), jax.numpy.bfloat16))
    for srcs, mode, check in (((), 0, True), ((dense, *chunked), ALL, False), ((dense,), PARTIAL, True)):
        ctx = canary_jax.VerifyOrWriteContext(
            canary_buf=jax.numpy.zeros((n, 32), np.uint8),
            kernel_kind=canary_jax.CanaryLaunchTag.TAIL_K_FULL,
            log=canary_jax.ViolationLog.allocate(ring_capacity=8),
            real_kv_sources=srcs,
            real_kv_hash_mode=mode,
        )
        yield srcs, mode, check, ctx


class TpuLoweringTest(absltest.TestCase):
    """The kernel lowers to Mosaic for a TPU without one (``jax.export`` with ``platforms=["tpu"]``): block
    shapes, scalar prefetch, the async copies and semaphores, and the uint32 hashing pass Pallas's TPU lowering.
    (The Mosaic compiler's own layout passes run only on a TPU.)"""

    def test_exports_for_tpu(self):
        from pallas_kernels.tpu.verify import _verify_jit

        slots = list(range(1, 100))
        plan = canary_jax.VerifyPlan.from_entries(slots=slots, positions=[0] * len(slots), prev_slots=[-1] * len(slots))
        for srcs, mode, check, ctx in _export_contexts(128):

            def f(c, p, check=check):
                return _verify_jit(c, p, check=check, interpret=False, config=TpuConfig(verify_block=32))

            with self.subTest(sources=len(srcs), mode=int(mode)):
                text = jax.export.export(jax.jit(f), platforms=["tpu"])(ctx, plan).mlir_module()
                self.assertIn("tpu_custom_call", text)

    def test_write_exports_for_tpu(self):
        # The three write calls (seeds, chain, stores) lower to Mosaic: with and without sources, with the assert.
        from pallas_kernels.tpu.write import _write_jit

        plan = canary_jax.WritePlan.from_requests(counts=[30, 10, 8], seed_slots=[-1, 5, 7])
        ids = jax.numpy.zeros((48, 2), np.uint32)
        for srcs, mode, check, ctx in _export_contexts(128):

            def f(c, p, a, check=check):
                e = a if check else None
                cfg = TpuConfig(write_block=16, write_req_block=8, write_prefetch_entries=32)
                return _write_jit(c, p, a, a, a, e, e, assert_inputs=check, interpret=False, config=cfg)

            with self.subTest(sources=len(srcs), mode=int(mode)):
                text = jax.export.export(jax.jit(f), platforms=["tpu"])(ctx, plan, ids).mlir_module()
                self.assertEqual(text.count("tpu_custom_call"), 4)  # seeds, chain, stores in 2 calls


class TpuRegistryTest(absltest.TestCase):
    """The registry picks the TPU kernel where the data lives on a TPU (the platform faked on a CPU)."""

    def test_tpu_platform_picks_tpu_verify(self):
        self.assertEqual(backends.resolve_backend(platform="tpu"), "pallas_tpu")
        self.assertEqual(backends.resolve_backend(platform="cpu"), "reference")
        self.assertEqual(backends.resolve_backend(platform="gpu"), "pallas")
        fn = backends.implementation("verify", "pallas_tpu", platform="tpu")
        self.assertIs(fn.func, verify_tpu)
        self.assertEqual(fn.keywords, {"interpret": False})  # compiled on a TPU
        fn = backends.implementation("verify", "pallas_tpu", platform="cpu")
        self.assertEqual(fn.keywords, {"interpret": True})  # TPU interpret mode elsewhere

    def test_cpu_buffer_on_a_tpu_host(self):
        # A TPU host keeps CPU arrays too: the backend and the interpret mode follow the buffer, not the host.
        def ctx():  # fresh each launch: the public entry point donates the log
            return canary_jax.VerifyOrWriteContext(
                canary_buf=canary_jax.allocate_canary_buffer(num_slots=16),
                kernel_kind=canary_jax.CanaryLaunchTag.TAIL_K_FULL,
                log=canary_jax.ViolationLog.allocate(ring_capacity=4),
            )

        plan = canary_jax.VerifyPlan.from_entries(slots=[3, 4], positions=[1, 0], prev_slots=[0, -1])
        want = canary_jax.verify(ctx(), plan, backend="reference").log
        with mock.patch.object(jax, "default_backend", return_value="tpu"):
            self.assertEqual(backends.resolve_backend(platform="cpu"), "reference")  # auto, CPU buffer
            for got in (
                canary_jax.verify(ctx(), plan, backend="pallas_tpu").log,  # interpreted: the buffer is on the CPU
                verify_tpu(ctx(), plan).log,  # the wrapper called directly, on concrete CPU arrays
            ):
                for field in ("ring", "write_index", "slot_run_counters", "kernel_run_counters"):
                    np.testing.assert_array_equal(np.asarray(getattr(got, field)), np.asarray(getattr(want, field)))
        self.assertEqual(int(np.asarray(want.write_index)[0]), 2)
        bound = backends.implementation("verify", "pallas_tpu", platform="cpu")
        self.assertIs(bound, backends.implementation("verify", "pallas_tpu", platform="cpu"))  # one cache key

    def test_tpu_write_is_the_tpu_kernel(self):
        self.assertNotIn(("pallas_tpu", "write"), backends.REFERENCE_FALLBACKS)
        self.assertEqual(backends.REFERENCE_FALLBACKS, frozenset())
        fn = backends.implementation("write", "pallas_tpu", platform="tpu")
        self.assertIs(fn.func, write_tpu)
        self.assertEqual(fn.keywords, {"interpret": False})  # compiled on a TPU
        self.assertEqual(backends.implementation("write", "pallas_tpu", platform="cpu").keywords, {"interpret": True})
        self.assertIs(backends.implementation("write", "reference"), reference.write_reference)

    def test_default_backend_tpu_reaches_the_tpu_kernel(self):
        # CanaryGuard and the command line pass no backend: on a TPU host they resolve to pallas_tpu, and the
        # public entry point then runs verify_tpu (interpreted here, because the buffer is on the CPU).
        with (
            mock.patch.object(jax, "default_backend", return_value="tpu"),
            mock.patch.dict("os.environ", {backends.BACKEND_ENV: ""}),
        ):
            self.assertEqual(backends.resolve_backend(), "pallas_tpu")
            self.assertTrue(backends.is_tpu_platform())
            with mock.patch.object(backends, "array_platform", return_value="tpu"):
                calls = []
                real = backends.implementation

                def spy(op, backend, *, platform=None):
                    calls.append((op, backend, platform))
                    return real(op, backend, platform="cpu")  # interpret: the data is really on the CPU

                with mock.patch.object(backends, "implementation", spy):
                    log = canary_jax.ViolationLog.allocate(ring_capacity=4)
                    ctx = canary_jax.VerifyOrWriteContext(
                        canary_buf=canary_jax.allocate_canary_buffer(num_slots=16),
                        kernel_kind=canary_jax.CanaryLaunchTag.TAIL_K_FULL,
                        log=log,
                    )
                    plan = canary_jax.VerifyPlan.from_entries(slots=[3], positions=[1], prev_slots=[0])
                    ctx = canary_jax.verify(ctx, plan)
        self.assertEqual(calls, [("verify", "pallas_tpu", "tpu")])
        self.assertEqual(int(np.asarray(ctx.log.write_index)[0]), 1)  # stored position 0 != 1


if __name__ == "__main__":
    absltest.main()
