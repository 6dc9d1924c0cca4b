"""Real-KV sources from real KV pool layouts (``canary_jax.adapters.layouts``) and chunked sources.

Every expected hash comes from the Python-int oracle (``helpers.oracle.fold_bytes`` / ``combine``) over a byte
sequence built here with numpy from the *logical* arrays (K, V, heads, layers, scales) a pool was assembled
from, never from the source geometry or canary_jax output. Each layout is hashed by the jnp reference and by
the Pallas kernel body (interpreted), with ``jax_enable_x64`` off and on, under PARTIAL and ALL.

Documented non-detections: a byte past the first 16 of a slot's sequence under PARTIAL, a byte of the other
half of a fused pool (V under ``half="k"``), a padding head, another layer, or another slot.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from jax.experimental import pallas as pl

import canary_jax as cj
from canary_jax.adapters import layouts as L
from canary_jax.contract import sources
from canary_jax.contract.sources import RealKvSource, SlotChunks
from canary_jax.ops import backends, reference
from helpers import oracle
from pallas_kernels import real_kv
from pallas_kernels.hashing import PairHash

PARTIAL, ALL = cj.RealKvHashMode.PARTIAL, cj.RealKvHashMode.ALL
P, PS = 5, 4  # pages, page size: 20 slots
N = P * PS


def rand(shape, dtype, seed):
    """Random values of ``dtype`` (bytes drawn uniformly; sub-byte dtypes from 4-bit ints)."""
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    if dt == np.dtype(jnp.int4):
        return rng.integers(-8, 8, shape).astype(dt)
    if sources.element_bits(dt) == 4:  # float4_e2m1fn: any of its 16 codes, by value
        values = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
        return (rng.choice(values, shape) * rng.choice([-1, 1], shape)).astype(dt)
    raw = rng.integers(0, 256, (*shape, dt.itemsize), dtype=np.uint8)
    return raw.view(dt).reshape(shape)


def le_bytes(a) -> bytes:
    """Bytes of ``a`` (row-major); 4-bit dtypes packed two per byte, element 2i in the low nibble."""
    a = np.asarray(a)
    if sources.element_bits(a.dtype) == 4:
        v = a.reshape(-1).view(np.uint8) & 0xF
        return bytes((v[0::2] | (v[1::2] << 4)).astype(np.uint8).tobytes())
    return np.ascontiguousarray(a).tobytes()


def want_hash(seqs, mode, read_bytes=None) -> int:
    """Oracle fingerprint of one slot: ``seqs`` is one byte sequence per source (zero-padded to 16 here)."""
    per = []
    for k, seq in enumerate(seqs):
        seq = seq + bytes(-len(seq) % 16)
        n = 16 if mode == PARTIAL else (read_bytes[k] if read_bytes else len(seq))
        per.append(oracle.fold_bytes(seq[:n]))
    return oracle.combine(per)


def ints(u) -> list[int]:
    lo = np.asarray(u.lo).astype(np.uint64)
    hi = np.asarray(u.hi).astype(np.uint64)
    return [int(x) for x in (lo | (hi << np.uint64(32)))]


def ref_hashes(srcs, mode, slots) -> list[int]:
    srcs = sources.device_sources(srcs)
    descs = sources.check_real_kv_sources(srcs, mode, num_slots=N)
    return ints(sources.real_kv_hash_reference([s.tensor for s in srcs], descs, jnp.asarray(slots, jnp.int32)))


@functools.partial(jax.jit, static_argnames=("descs", "gather", "unroll", "tile_words"))
def _kernel_hash(slots, tensors, *, descs, gather, unroll, tile_words):
    words = [sources.source_words(t) for t in tensors]

    def body(slot_ref, *refs):
        s = slot_ref[...]
        h = real_kv.real_kv_hash(refs[:-1], descs, s, s >= 0, PairHash("portable"), gather, unroll, tile_words)
        refs[-1][...] = jnp.stack([h.lo, h.hi], axis=1)

    out = pl.pallas_call(
        body,
        out_shape=jax.ShapeDtypeStruct((slots.shape[0], 2), jnp.uint32),
        interpret=not backends.is_gpu_platform(),  # compiled on a GPU: the chunked reads must lower in Triton
        name="rkv_probe",
    )(slots, *words)
    return out


def pallas_hashes(srcs, mode, slots, gather="tile", unroll=1, tile_words=16) -> list[int]:
    srcs = sources.device_sources(srcs)
    descs = sources.check_real_kv_sources(srcs, mode, num_slots=N)
    out = np.asarray(
        _kernel_hash(
            jnp.asarray(slots, jnp.int32),
            tuple(s.tensor for s in srcs),
            descs=descs,
            gather=gather,
            unroll=unroll,
            tile_words=tile_words,
        )
    ).astype(np.uint64)
    return [int(x) for x in (out[:, 0] | (out[:, 1] << np.uint64(32)))]


SLOTS = [1, 2, 5, 7, 19, 0, -1, N]  # in range, then slot 0, a negative and one past the pool (zero bytes)


class Layout:
    """A pool built from logical arrays, its sources, and the oracle's byte sequence of each slot."""

    def __init__(self, name, srcs, seq_of):
        self.name, self.srcs, self.seq_of = name, tuple(srcs), seq_of

    def want(self, mode, slots=SLOTS):
        out = []
        for s in slots:
            if 0 <= s < N:
                out.append(want_hash(self.seq_of(s), mode))
            else:  # outside every source: zero bytes
                out.append(want_hash([bytes(len(q)) for q in self.seq_of(1)], mode))
        return out


def layouts() -> list[Layout]:
    out = []
    H, D = 2, 8  # bf16: a head is 16 bytes
    k = rand((P, PS, H, D), jnp.bfloat16, 1)
    v = rand((P, PS, H, D), jnp.bfloat16, 2)

    def slot(a, s):
        return a[s // PS, s % PS]

    out.append(Layout("token_major", L.sources_for_token_major(jnp.asarray(k)), lambda s: [le_bytes(slot(k, s))]))
    out.append(
        Layout(
            "token_major_unpaged",
            L.sources_for_token_major(jnp.asarray(k.reshape(N, H, D)), paged=False),
            lambda s: [le_bytes(slot(k, s))],
        )
    )
    # sglang-jax / vLLM TPU / EasyDeL v3: [pages, page_size, 2H // packing, packing, D], K0 V0 K1 V1
    fused = np.stack([k, v], axis=3).reshape(P, PS, 2 * H // 2, 2, D)
    for half, pick in (("k", lambda s: slot(k, s)), ("v", lambda s: slot(v, s))):
        out.append(
            Layout(
                f"fused_{half}",
                L.sources_for_fused_kv(jnp.asarray(fused), num_kv_heads=H, half=half),
                lambda s, pick=pick: [le_bytes(pick(s))],
            )
        )
    out.append(
        Layout(
            "fused_kv",
            L.sources_for_fused_kv(jnp.asarray(fused), half="kv"),
            lambda s: [le_bytes(np.stack([slot(k, s), slot(v, s)], axis=1))],
        )
    )
    # sglang-jax 0.0.2 MHATokenToKVPool.kv_buffer[layer], as allocated: [num_slots, 2H, D], built as its merge_kv
    # builds it (concat([k, v], -1).reshape(T, 2H, D): row 2h = K head h, 2h + 1 = V head h); unpaged, no reshape
    k3, v3 = k.reshape(N, H, D), v.reshape(N, H, D)
    fused3 = np.concatenate([k3, v3], axis=-1).reshape(N, 2 * H, D)
    for half, pick in (("k", lambda s: k3[s]), ("v", lambda s: v3[s]), ("kv", lambda s: fused3[s])):
        out.append(
            Layout(
                f"sglang_jax_fused3d_{half}",
                L.sources_for_fused_kv(jnp.asarray(fused3), half=half),
                lambda s, pick=pick: [le_bytes(pick(s))],
            )
        )
    # fp8, one KV head with packing 4: 2 real combined heads + 2 padding heads (D = 4: a head is 4 bytes)
    k8 = rand((P, PS, 1, 4), jnp.float8_e4m3fn, 3)
    v8 = rand((P, PS, 1, 4), jnp.float8_e4m3fn, 4)
    pad = rand((P, PS, 2, 4), jnp.float8_e4m3fn, 5)
    fused8 = np.concatenate([np.stack([k8, v8], axis=3).reshape(P, PS, 2, 4), pad], axis=2).reshape(P, PS, 1, 4, 4)
    out.append(
        Layout(
            "fused_fp8_padded_v",
            L.sources_for_fused_kv(jnp.asarray(fused8), num_kv_heads=1, half="v"),
            lambda s: [le_bytes(slot(v8, s))],
        )
    )
    kv_first = np.stack([k, v], axis=2)  # [P, PS, 2, H, D]
    out.append(
        Layout(
            "k_then_v_v",
            L.sources_for_fused_kv(jnp.asarray(kv_first), half="v", kv_layout="k_then_v"),
            lambda s: [le_bytes(slot(v, s))],
        )
    )
    layers = np.stack([k, v, k[::-1]], axis=0)  # [3 layers, P, PS, H, D]
    out.append(
        Layout(
            "stacked_layer0",
            L.sources_for_stacked(jnp.asarray(layers)),
            lambda s: [le_bytes(slot(layers[0], s))],
        )
    )
    out.append(
        Layout(
            "stacked_layer2",
            L.sources_for_stacked(jnp.asarray(layers), layer=2),
            lambda s: [le_bytes(slot(layers[2], s))],
        )
    )
    # vLLM TPU unified block-major: [pages, layers, page_size, 2H // packing, packing, D], layer 1, K half
    unified = np.stack([fused, fused[::-1]], axis=1)
    k1 = np.stack([k, v], axis=3)[::-1][..., 0, :]  # layer 1 holds fused[::-1]: its K heads
    out.append(
        Layout(
            "unified_layer1_k",
            L.sources_for_stacked(jnp.asarray(unified), layer=1, layer_axis=1, half="k"),
            lambda s: [le_bytes(slot(k1, s))],
        )
    )
    hm = np.ascontiguousarray(np.transpose(k, (2, 0, 1, 3)))  # [H, P, PS, D]
    out.append(Layout("heads_major", L.sources_for_heads_major(jnp.asarray(hm)), lambda s: [le_bytes(slot(k, s))]))
    # quantised: fp8 data of 8 bytes per token (padded to 16) + f32 per-token-head scales (8 bytes)
    q = rand((P, PS, 1, 8), jnp.float8_e4m3fn, 6)
    sc = rand((P, PS, 2), np.float32, 7)
    out.append(
        Layout(
            "quant_fp8",
            L.sources_for_quantised(jnp.asarray(q), jnp.asarray(sc)),
            lambda s: [le_bytes(slot(q, s)), le_bytes(slot(sc, s))],
        )
    )
    q4 = rand((P, PS, 2, 16), jnp.int4, 8)  # packed: 16 bytes per token
    sc4 = rand((P, PS, 1), np.float32, 9)
    out.append(
        Layout(
            "quant_int4",
            L.sources_for_quantised(jnp.asarray(q4), jnp.asarray(sc4)),
            lambda s: [le_bytes(slot(q4, s)), le_bytes(slot(sc4, s))],
        )
    )
    f4 = rand((H, P, PS, 8), jnp.float4_e2m1fn, 10)  # heads-major packed fp4: a head is 4 bytes
    sch = rand((H, P, PS), np.float32, 11)
    out.append(
        Layout(
            "quant_fp4_heads_major",
            L.sources_for_quantised(jnp.asarray(f4), jnp.asarray(sch), layout="heads_major"),
            lambda s: [
                b"".join(le_bytes(f4[h, s // PS, s % PS]) for h in range(H)),
                b"".join(le_bytes(sch[h, s // PS, s % PS]) for h in range(H)),
            ],
        )
    )
    return out


class ReferenceLayoutsTest(absltest.TestCase):
    """The jnp reference hashes every layout as the oracle does, with x64 off and on."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.layouts = layouts()

    def test_hashes_match_oracle(self):
        for x64 in (False, True):
            with jax.enable_x64(x64):
                for lay in self.layouts:
                    for mode in (PARTIAL, ALL):
                        with self.subTest(layout=lay.name, mode=mode.name, x64=x64):
                            self.assertEqual(ref_hashes(lay.srcs, mode, SLOTS), lay.want(mode))

    def test_heads_major_equals_token_major(self):
        by_name = {lay.name: lay for lay in self.layouts}
        for mode in (PARTIAL, ALL):
            self.assertEqual(
                ref_hashes(by_name["heads_major"].srcs, mode, SLOTS),
                ref_hashes(by_name["token_major"].srcs, mode, SLOTS),
            )
        # the 4 descriptors of the tuple are static: a heads-major K, token-major K, fused K and stacked layer 0
        four = (by_name["heads_major"].srcs + by_name["token_major"].srcs + by_name["fused_k"].srcs) + by_name[
            "stacked_layer0"
        ].srcs
        want = [
            want_hash(
                [by_name["token_major"].seq_of(s)[0]] * 2
                + by_name["fused_k"].seq_of(s)
                + by_name["stacked_layer0"].seq_of(s),
                ALL,
            )
            for s in SLOTS[:5]
        ]
        self.assertEqual(ref_hashes(four, ALL, SLOTS[:5]), want)

    def test_dense_equivalent_is_sglangs_descriptor(self):
        """A token-major pool of 16-byte multiples gets SGLang's dense descriptor (the same program)."""
        k = jnp.zeros((P, PS, 2, 8), jnp.bfloat16)
        (src,) = L.sources_for_token_major(k)
        (d,) = sources.source_descriptors([src], ALL)
        self.assertEqual(d, sources.SourceDescriptor(PS, 32, 32, 32, PS * 32, P))
        self.assertTrue(d.dense)
        (hm,) = L.sources_for_heads_major(jnp.zeros((2, P, PS, 8), jnp.bfloat16))
        (d,) = sources.source_descriptors([hm], PARTIAL)
        self.assertEqual((d.chunk_bytes, d.num_chunks, d.chunk_stride_rows, d.chunk_stride_cols), (16, 2, 1, 0))

    def test_read_bytes_prefix(self):
        """ALL with read_bytes < the sequence hashes exactly its leading bytes (fused K: head 0 only)."""
        k = rand((P, PS, 2, 8), jnp.bfloat16, 1)
        v = rand((P, PS, 2, 8), jnp.bfloat16, 2)
        fused = jnp.asarray(np.stack([k, v], axis=3).reshape(P, PS, 4, 8))
        srcs = L.sources_for_fused_kv(fused, half="k", read_bytes=16)
        want = [want_hash([le_bytes(k[s // PS, s % PS])], ALL, read_bytes=[16]) for s in SLOTS[:5]]
        self.assertEqual(ref_hashes(srcs, ALL, SLOTS[:5]), want)

    def test_flips(self):
        """A flipped protected byte changes the slot's hash; bytes outside the hashed range do not."""
        H, D = 2, 16  # bf16: a head is 32 bytes, so PARTIAL (16 bytes) leaves most of head 0 out
        k = rand((P, PS, H, D), jnp.bfloat16, 3)
        v = rand((P, PS, H, D), jnp.bfloat16, 4)
        fused = np.stack([k, v], axis=3).reshape(P, PS, 2 * H, D)
        u8 = fused.view(np.uint8).reshape(P, PS, 2 * H, 2 * D)
        s = 6  # slot 6 = page 1, index 2
        page, j = divmod(s, PS)

        def hashes(arr, mode, half="k"):
            return ref_hashes(L.sources_for_fused_kv(jnp.asarray(arr.view(fused.dtype)), half=half), mode, [s, s + 1])

        base = {(m, h): hashes(u8, m, h) for m in (PARTIAL, ALL) for h in ("k", "v")}
        cases = (  # (combined head, byte, {(mode, half) that must see it})
            (0, 0, {(PARTIAL, "k"), (ALL, "k")}),  # K head 0, byte 0
            (0, 20, {(ALL, "k")}),  # K head 0 past byte 16: ALL only
            (2, 5, {(ALL, "k")}),  # K head 1
            (1, 3, {(PARTIAL, "v"), (ALL, "v")}),  # V head 0
            (3, 31, {(ALL, "v")}),  # last byte of V head 1
        )
        for head, byte, seen in cases:
            bad = u8.copy()
            bad[page, j, head, byte] ^= 0x40
            for key, before in base.items():
                with self.subTest(head=head, byte=byte, mode=key[0].name, half=key[1]):
                    after = hashes(bad, *key)
                    self.assertEqual(after[1], before[1])  # the next slot never moves
                    self.assertEqual(after[0] != before[0], key in seen)
        # heads-major: a byte of head 1 of slot s moves only slot s, under ALL only (it is past byte 16)
        hm = np.ascontiguousarray(np.transpose(k, (2, 0, 1, 3))).view(np.uint8)
        bad = hm.copy()
        bad[1, page, j, 3] ^= 1
        for mode, moved in ((PARTIAL, False), (ALL, True)):
            a = ref_hashes(L.sources_for_heads_major(jnp.asarray(hm.view(k.dtype))), mode, [s, s + 1])
            b = ref_hashes(L.sources_for_heads_major(jnp.asarray(bad.view(k.dtype))), mode, [s, s + 1])
            self.assertEqual((a[0] != b[0], a[1] == b[1]), (moved, True))
        # stacked: another layer's bytes never move layer 0
        layers = rand((2, P, PS, H, D), jnp.bfloat16, 5).view(np.uint8)
        bad = layers.copy()
        bad[1, page, j, 0, 0] ^= 1
        for mode in (PARTIAL, ALL):
            a = ref_hashes(L.sources_for_stacked(jnp.asarray(layers)), mode, [s])
            b = ref_hashes(L.sources_for_stacked(jnp.asarray(bad)), mode, [s])
            self.assertEqual(a, b)
        # quantised: a scale byte is protected in PARTIAL (8 scale bytes < 16)
        q = rand((P, PS, 1, 16), jnp.float8_e4m3fn, 6)
        sc = rand((P, PS, 2), np.float32, 7)
        bad = sc.copy().view(np.uint8)
        bad[page, j, 7] ^= 1
        a = ref_hashes(L.sources_for_quantised(jnp.asarray(q), jnp.asarray(sc)), PARTIAL, [s])
        b = ref_hashes(L.sources_for_quantised(jnp.asarray(q), jnp.asarray(bad.view(np.float32))), PARTIAL, [s])
        self.assertNotEqual(a, b)

    def test_sglang_jax_fused3d(self):
        """sglang-jax 0.0.2's layer as allocated, [size + page_size, 2H, D] bf16 (D = 128: a head is 256 bytes).

        The source holds the pool array itself (no reshape, no copy), its slot index is the pool row, and a flip
        moves the K half's hash exactly where the K bytes it hashes are: K head 0 bytes [0, 16) under PARTIAL and
        ALL, K head 0 past byte 16 and K head 1 (row 2) under ALL only, a V row (row 1) never."""
        size, page, H, D = N - PS, PS, 2, 128  # N rows: the size + page_size rows sglang-jax allocates
        k = rand((size + page, H, D), jnp.bfloat16, 21)
        v = rand((size + page, H, D), jnp.bfloat16, 22)
        fused = np.concatenate([k, v], axis=-1).reshape(size + page, 2 * H, D)  # memory_pool.merge_kv
        pool = jnp.asarray(fused)
        (src,) = L.sources_for_fused_kv(pool, half="k")
        self.assertIs(src.tensor, pool)
        self.assertEqual((src.page_size, src.num_bytes_per_token), (1, 2 * H * D * 2))
        self.assertEqual(
            src.chunks, SlotChunks(chunk_bytes=2 * D, num_chunks=H, chunk_stride_bytes=4 * D, offset_bytes=0)
        )
        s = 9
        for mode in (PARTIAL, ALL):
            # golden: K head 0 then K head 1 of slot s, as Python bytes of the logical K (not of the pool)
            want = want_hash([le_bytes(k[s, 0]) + le_bytes(k[s, 1])], mode)
            self.assertEqual(ref_hashes((src,), mode, [s]), [want])
        u8 = fused.view(np.uint8).reshape(size + page, 2 * H, 2 * D)
        base = {m: ref_hashes((src,), m, [s, s + 1]) for m in (PARTIAL, ALL)}
        cases = ((0, 3, {PARTIAL, ALL}), (0, 100, {ALL}), (2, 0, {ALL}), (1, 0, set()), (3, 255, set()))
        for row, byte, seen in cases:
            bad = u8.copy()
            bad[s, row, byte] ^= 0x10
            srcs = L.sources_for_fused_kv(jnp.asarray(bad.view(fused.dtype)))
            for mode in (PARTIAL, ALL):
                with self.subTest(row=row, byte=byte, mode=mode.name):
                    after = ref_hashes(srcs, mode, [s, s + 1])
                    self.assertEqual(after[1], base[mode][1])
                    self.assertEqual(after[0] != base[mode][0], mode in seen)
        with self.assertRaisesRegex(ValueError, r"fused_kv: pool must be at least 3-D, got shape \(20, 512\)"):
            L.sources_for_fused_kv(pool.reshape(size + page, -1))
        with self.assertRaisesRegex(ValueError, r"a paged pool must be .* got shape \(20, 4, 128\).*paged=False"):
            L.sources_for_fused_kv(pool, paged=True)


class PallasLayoutsTest(absltest.TestCase):
    """The Pallas kernel body (interpreted on a CPU, compiled on a GPU) hashes chunked layouts as the oracle does."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.by_name = {lay.name: lay for lay in layouts()}

    def test_kernel_matches_oracle(self):
        cases = (  # (sources, gather, unroll, tile words, x64)
            (("heads_major", "fused_k", "quant_fp8"), "tile", 1, 16, False),
            (("unified_layer1_k", "quant_fp4_heads_major"), "tile", 0, 8, True),
            (("fused_fp8_padded_v", "heads_major", "quant_int4"), "quad", 2, 16, False),
            (("fused_k", "fused_fp8_padded_v", "stacked_layer2"), "word", 1, 16, True),
            (("stacked_layer0", "k_then_v_v", "fused_kv"), "tile_contiguous", 1, 32, False),
            (("sglang_jax_fused3d_k", "sglang_jax_fused3d_v", "sglang_jax_fused3d_kv"), "tile", 1, 16, True),
        )
        for names, gather, unroll, tw, x64 in cases:
            srcs = sum((self.by_name[n].srcs for n in names), ())
            with jax.enable_x64(x64):
                for mode in (PARTIAL, ALL):
                    want = [
                        want_hash(sum((self.by_name[n].seq_of(s) for n in names), []), mode)
                        if 0 <= s < N
                        else want_hash([bytes(len(q)) for n in names for q in self.by_name[n].seq_of(1)], mode)
                        for s in SLOTS
                    ]
                    with self.subTest(names=names, gather=gather, mode=mode.name, x64=x64):
                        self.assertEqual(pallas_hashes(srcs, mode, SLOTS, gather, unroll, tw), want)


class EndToEndTest(absltest.TestCase):
    """Public write then verify with a heads-major K source and quantised scales; a flip fires bit 4 only."""

    def test_write_verify_flip(self):
        H, D = 2, 8
        k = rand((P, PS, H, D), jnp.bfloat16, 12)
        hm = np.ascontiguousarray(np.transpose(k, (2, 0, 1, 3)))
        sc = rand((P, PS, 1), np.float32, 13)
        slots = np.arange(1, 9)
        for backend in ("reference", "pallas"):

            def srcs(hm_, sc_):
                return L.sources_for_heads_major(jnp.asarray(hm_)) + L.sources_for_quantised(
                    jnp.asarray(np.zeros((P, PS, 16), np.uint8)), jnp.asarray(sc_)
                )

            ctx = cj.VerifyOrWriteContext(
                canary_buf=cj.allocate_canary_buffer(num_slots=N),
                kernel_kind=cj.CanaryLaunchTag.TAIL_K_FULL,
                log=cj.ViolationLog.allocate(ring_capacity=8),
                real_kv_sources=srcs(hm, sc),
                real_kv_hash_mode=ALL,
            )
            plan = cj.WritePlan.from_requests(counts=[len(slots)], seed_slots=[-1])
            ctx = cj.write(ctx, plan, slots * 3, np.arange(len(slots)), slots, backend=backend)
            buf = np.asarray(ctx.canary_buf)
            for s in slots:
                want = want_hash([le_bytes(k[s // PS, s % PS]), bytes(16), le_bytes(sc[s // PS, s % PS])], ALL)
                self.assertEqual(int.from_bytes(buf[s, 24:32].tobytes(), "little"), want, (backend, s))
            bad = sc.copy()
            bad.view(np.uint8)[1, 1, 3] ^= 0x80  # slot 5's scale: its sign bit
            ctx = ctx.replace(real_kv_sources=srcs(hm, bad))
            prev = np.concatenate([[-1], slots[:-1]])
            vplan = cj.VerifyPlan.from_entries(slots=slots, positions=np.arange(len(slots)), prev_slots=prev)
            ctx = cj.verify(ctx, vplan, backend=backend)
            rows = np.asarray(cj.pairs_to_int64_np(np.asarray(ctx.log.ring)))
            self.assertEqual(int(ctx.log.write_index[0]), 1, backend)
            self.assertEqual((int(rows[0, 1]), int(rows[0, 7])), (5, int(cj.FailReason.VERIFY_REAL_KV_HASH_MISMATCH)))


VIEW_OPS = ("reshape", "bitcast_convert_type", "squeeze", "expand_dims")


def large_ops(jaxpr, limit: int) -> list[tuple[str, tuple]]:
    """Every equation of ``jaxpr`` (recursively, not into kernel bodies) that is not a view of its operand
    and produces an output of ``limit`` bytes or more."""
    out = []
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "pallas_call":
            continue
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    out += large_ops(sub, limit)
        if name in VIEW_OPS or name in ("pjit", "jit", "closed_call", "cond", "while"):
            continue
        for v in eqn.outvars:
            aval = v.aval
            if hasattr(aval, "shape") and int(np.prod(aval.shape)) * np.dtype(aval.dtype).itemsize >= limit:
                out.append((name, tuple(aval.shape)))
    return out


class NoCopyTest(absltest.TestCase):
    """Sources stay views of the pool: between the pool and the kernels (or the reference's gathers) the
    traced programs hold only reshapes and bitcasts, and the compiled reference allocates far less than a
    pool. (Interpret-mode Pallas copies every operand by design, so its compiled memory says nothing.)"""

    POOLS = {
        "heads_major": (jnp.zeros((8, 256, 16, 64), jnp.bfloat16), L.sources_for_heads_major),
        "fused_k": (jnp.zeros((256, 16, 8, 2, 64), jnp.bfloat16), L.sources_for_fused_kv),
        "stacked": (jnp.zeros((4, 256, 16, 8, 64), jnp.bfloat16), L.sources_for_stacked),
        "int4": (jnp.zeros((256, 16, 8, 64), jnp.int4), L.sources_for_token_major),
        "copy_on_purpose": (  # a transpose before the canary: the check must see it
            jnp.zeros((8, 256, 16, 64), jnp.bfloat16),
            lambda p: L.sources_for_token_major(jnp.transpose(p, (1, 2, 0, 3))),
        ),
    }

    def _verify(self, impl, make):
        vplan = cj.VerifyPlan.from_entries(
            slots=np.arange(1, 65), positions=np.arange(64), prev_slots=-np.ones(64, np.int64)
        )

        def f(buf, log, pool):
            ctx = cj.VerifyOrWriteContext(
                canary_buf=buf,
                kernel_kind=cj.CanaryLaunchTag.TAIL_K_FULL,
                log=log,
                real_kv_sources=make(pool),
                real_kv_hash_mode=ALL,
            )
            return impl(ctx, vplan).log

        return f

    def test_traced_programs_only_view_the_pool(self):
        from pallas_kernels.verify import verify_pallas

        impls = {
            "reference": reference.verify_reference,
            "pallas": functools.partial(verify_pallas, interpret=True),
        }
        args = (cj.allocate_canary_buffer(num_slots=256 * 16), cj.ViolationLog.allocate(ring_capacity=8))
        for name, (pool, make) in self.POOLS.items():
            for backend, impl in impls.items():
                with self.subTest(layout=name, backend=backend):
                    jaxpr = jax.make_jaxpr(self._verify(impl, make))(*args, pool).jaxpr
                    found = large_ops(jaxpr, pool.nbytes // 8)
                    if name == "copy_on_purpose":
                        self.assertIn("transpose", [op for op, _ in found])
                    else:
                        self.assertEqual(found, [])
                        self.assertGreater(pool.nbytes, 1 << 20)

    def test_compiled_reference_allocates_no_pool(self):
        args = (cj.allocate_canary_buffer(num_slots=256 * 16), cj.ViolationLog.allocate(ring_capacity=8))
        for name in ("heads_major", "stacked", "int4"):
            pool, make = self.POOLS[name]
            mem = jax.jit(self._verify(reference.verify_reference, make)).lower(*args, pool).compile()
            with self.subTest(layout=name):
                self.assertLess(mem.memory_analysis().temp_size_in_bytes, pool.nbytes // 16)


class RefusalTest(absltest.TestCase):
    def test_tensor_none(self):
        with self.assertRaisesRegex(TypeError, r"^kv-canary: RealKvSource\.tensor must be an array .*got NoneType$"):
            RealKvSource(tensor=None, page_size=1, num_bytes_per_token=16, read_bytes=16)

    def test_sub_byte_tensor_must_fill_bytes(self):
        with self.assertRaisesRegex(ValueError, r"4-bit dtype int4 must hold whole bytes .* got shape \(4, 3\)"):
            RealKvSource(tensor=jnp.zeros((4, 3), jnp.int4), page_size=1, num_bytes_per_token=16, read_bytes=16)
        # int4 rows count packed bytes: 64 int4 = 32 bytes, so nbpt 32 fits and 64 does not
        src = RealKvSource(tensor=jnp.zeros((8, 64), jnp.int4), page_size=1, num_bytes_per_token=32, read_bytes=32)
        self.assertEqual(sources.source_descriptors([src], ALL)[0].row_bytes, 32)
        bad = RealKvSource(tensor=jnp.zeros((8, 64), jnp.int4), page_size=1, num_bytes_per_token=64, read_bytes=64)
        with self.assertRaisesRegex(ValueError, r"dim-1 is 32 bytes but page_size=1 x num_bytes_per_token=64"):
            sources.check_real_kv_sources([bad], ALL)

    def test_sglang_source_stays_strict(self):
        """Without chunks a source keeps SGLang's checks: 16-byte multiples and a 2-D view at launch."""
        with self.assertRaisesRegex(ValueError, r"num_bytes_per_token must be a positive multiple of 16, got 8"):
            RealKvSource(tensor=jnp.zeros((8, 16), jnp.uint8), page_size=1, num_bytes_per_token=8, read_bytes=8)
        three_d = RealKvSource(
            tensor=jnp.zeros((8, 2, 16), jnp.uint8), page_size=1, num_bytes_per_token=32, read_bytes=32
        )
        with self.assertRaisesRegex(ValueError, r"\(viewed as uint8\) must be 2-D, got 3-D"):
            sources.check_real_kv_sources([three_d], ALL)

    def test_chunk_fields(self):
        t = jnp.zeros((4, 64), jnp.uint8)
        bad = (
            (dict(chunk_bytes=6), r"chunks\.chunk_bytes must be a positive multiple of 4, got 6"),
            (dict(chunk_bytes=8, num_chunks=0), r"chunks\.num_chunks must be >= 1, got 0"),
            (dict(chunk_bytes=8, chunk_stride_bytes=-4), r"chunk_stride_bytes must be a non-negative multiple of 4"),
            (dict(chunk_bytes=8, offset_bytes=2), r"offset_bytes must be a non-negative multiple of 4, got 2"),
            (dict(chunk_bytes=8, num_chunks=3, chunk_stride_bytes=16), r"chunks cross the end of a row: .* byte 88"),
            (dict(chunk_bytes=8, offset_bytes=4 * 64), r"chunks lie past the tensor's 4 rows"),
        )
        for kw, msg in bad:
            with self.subTest(**kw), self.assertRaisesRegex(ValueError, msg):
                RealKvSource(tensor=t, page_size=4, num_bytes_per_token=16, read_bytes=16, chunks=SlotChunks(**kw))
        with self.assertRaisesRegex(ValueError, r"read_bytes must be a positive multiple of 16 in \(0, 16\] .* got 32"):
            RealKvSource(tensor=t, page_size=1, num_bytes_per_token=8, read_bytes=32, chunks=SlotChunks(chunk_bytes=8))
        with self.assertRaisesRegex(TypeError, r"RealKvSource\.chunks must be a SlotChunks or None"):
            RealKvSource(tensor=t, page_size=1, num_bytes_per_token=16, read_bytes=16, chunks=(8, 1))
        # a chunked source must still cover the canary buffer
        short = RealKvSource(
            tensor=t, page_size=1, num_bytes_per_token=16, read_bytes=16, chunks=SlotChunks(chunk_bytes=8)
        )
        with self.assertRaisesRegex(ValueError, r"real_kv_sources\[0\] covers 4 slots .* canary_buf has 8 slots"):
            sources.check_real_kv_sources([short], PARTIAL, num_slots=8)

    def test_layout_errors_name_the_argument(self):
        bf = jnp.zeros((P, PS, 4, 8), jnp.bfloat16)
        cases = (
            (lambda: L.sources_for_fused_kv(bf, half="q"), ValueError, r"sources_for_fused_kv: half must be"),
            (
                lambda: L.sources_for_fused_kv(bf, num_kv_heads=3),
                ValueError,
                r"pool \(shape \(5, 4, 4, 8\) dtype bfloat16\) holds 4 combined K/V heads .* num_kv_heads=3",
            ),
            (lambda: L.sources_for_fused_kv(bf, kv_layout="k_then_v"), ValueError, r"needs a pool \[\.\.\., 2, heads"),
            (lambda: L.sources_for_fused_kv(bf[0, 0]), ValueError, r"pool must be at least 3-D, got shape \(4, 8\)"),
            (lambda: L.sources_for_stacked(bf[None], layer=1), ValueError, r"layer=1 is outside the pool's 1 layers"),
            (lambda: L.sources_for_stacked(bf[None], layer_axis=2), ValueError, r"layer_axis must be 0 or 1, got 2"),
            (lambda: L.sources_for_heads_major(bf[None]), ValueError, r"pool must be \[num_kv_heads, num_pages"),
            (
                lambda: L.sources_for_heads_major(jnp.zeros((2, P, PS, 2), jnp.float8_e4m3fn)),
                ValueError,
                r"sources_for_heads_major: pool \(shape \(2, 5, 4, 2\) dtype float8_e4m3fn\) puts 2-byte pieces",
            ),
            (lambda: L.sources_for_token_major(None), TypeError, r"pool must be a JAX or numpy array, got NoneType"),
            (
                lambda: L.sources_for_quantised(bf, jnp.zeros((P, PS + 1), jnp.float32)),
                ValueError,
                r"scales \(shape \(5, 5\) dtype float32\) must have the data's \[num_pages, page_size\]",
            ),
            (
                lambda: L.sources_for_quantised(bf, jnp.zeros((P, PS, 1), jnp.bfloat16)),
                ValueError,
                r"scales \(shape \(5, 4, 1\) dtype bfloat16\) hold 2 byte\(s\) per slot; .* would NOT be protected",
            ),
            (lambda: L.sources_for_quantised(bf, None, layout="x"), ValueError, r"layout must be 'token_major'"),
        )
        for fn, exc, msg in cases:
            with self.subTest(msg=msg), self.assertRaisesRegex(exc, msg):
                fn()
        # scales=None is the explicit, documented choice to protect the data alone
        self.assertLen(L.sources_for_quantised(bf, None), 1)

    def test_more_than_four_sources_refused(self):
        four = L.sources_for_quantised(jnp.zeros((P, PS, 16), jnp.uint8), jnp.zeros((P, PS, 1), jnp.float32)) * 2
        sources.check_real_kv_sources(four, ALL, num_slots=N)
        with self.assertRaisesRegex(ValueError, r"at most 4 RealKvSource entries supported by the CUDA ABI, got 5"):
            sources.check_real_kv_sources(four + four[:1], ALL, num_slots=N)


if __name__ == "__main__":
    absltest.main()
