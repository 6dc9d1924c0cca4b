"""Lossless int64 input handling (SPEC 10): every accepted int64 form gives the same bytes, anything lossy
(uint64 past int64, bools, narrowing) is refused naming the argument, and 8-byte and sub-byte sources keep their
bytes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

import canary_jax
from canary_jax.contract import constants, ints
from helpers import oracle
from helpers.launch_refusals import (
    N,
    RefusalMixin,
    ctx_with,
    src,
    tok,
    wplan,
)


class Int64InputTest(absltest.TestCase):
    """int64 data is kept exact with x64 off (pairs), and refused where it would be truncated."""

    def test_numpy_int64_values_above_int32_kept(self):
        ctx = ctx_with(mode=constants.RealKvHashMode.NONE)
        big_tok, big_pos = 2**40 + 5, -(2**35)
        ctx = canary_jax.write(
            ctx,
            wplan(),
            np.array([big_tok, 0, 0, 0], np.int64),
            np.array([big_pos, 0, 0, 0], np.int64),
            np.array([3, 0, 0, 0], np.int64),
            backend="reference",
        )
        self.assertEqual(canary_jax.read_slot(ctx.canary_buf, 3), (big_tok, big_pos, oracle.s64(oracle.ANCHOR_HASH), 0))

    def test_accepted_forms_agree(self):
        values = [-1, 2**31, 0xFFFFFFFF, -(2**63)]
        want = np.array(values, np.int64)
        forms = [
            values,
            want,
            ints.int64_to_pairs_np(want),
            jnp.asarray(ints.int64_to_pairs_np(want)),
            jnp.asarray(ints.int64_to_pairs_np(want)).astype(jnp.int32),
        ]
        for form in forms:
            got = ints.pairs_to_int64_np(ints.as_int64_pairs(form, name="x", shape=(4,)))
            np.testing.assert_array_equal(got, want)
        # uint64 whose values fit int64: exact.
        big = np.array([0, 7, 2**32 + 1, 2**63 - 1], np.uint64)
        got = ints.pairs_to_int64_np(ints.as_int64_pairs(big, name="x", shape=(4,)))
        self.assertEqual(got.tolist(), [0, 7, 2**32 + 1, 2**63 - 1])

    def test_uint64_past_int64_refused(self):
        # -1 cast to uint64 is 2**64 - 1: an int64 tensor cannot hold it, and its bits would read as -1.
        for bad, value in (
            (np.array([-1, 5], np.int64).astype(np.uint64), 2**64 - 1),
            (np.array([3, 2**63], np.uint64), 2**63),
        ):
            with self.assertRaisesRegex(
                ValueError, rf"^kv-canary: x holds a value that does not fit int64: {value} \(uint64\)$"
            ):
                ints.as_int64_pairs(bad, name="x", shape=(2,))
            with self.assertRaisesRegex(ValueError, rf"^kv-canary: x holds a value that does not fit int64: {value}"):
                ints.int64_to_pairs_np(bad, name="x")
        # At a launch: refused naming the argument, and nothing changes.
        ctx = ctx_with()
        pos = np.array([0, 2**63 + 4, 0, 0], np.uint64)
        fn = lambda: canary_jax.write(ctx, wplan(), tok(), pos, tok(), backend="reference")  # noqa: E731
        RefusalMixin.assertRefused(self, ctx, ValueError, r"^kv-canary: positions holds a value that does not fit", fn)

    def test_uint64_jax_arrays_with_x64(self):
        with jax.enable_x64(True):
            ok = jnp.asarray(np.array([5, 2**63 - 1], np.uint64))
            self.assertEqual(ints.pairs_to_int64_np(ints.as_int64_pairs(ok, name="x")).tolist(), [5, 2**63 - 1])
            bad = jnp.asarray(np.array([5, 2**63], np.uint64))
            with self.assertRaisesRegex(
                ValueError, r"^kv-canary: x holds a value that does not fit int64: 9223372036854775808"
            ):
                ints.as_int64_pairs(bad, name="x")
            # Traced, the values cannot be checked: the dtype is refused.
            with self.assertRaisesRegex(TypeError, r"^kv-canary: x is a uint64 array inside a traced function"):
                jax.jit(lambda a: ints.as_int64_pairs(a, name="x"))(ok)

    def test_bools_refused(self):
        forms = ([True, False], np.array([True, False]), jnp.asarray([True, False]))
        for form in forms:
            with self.assertRaisesRegex(
                TypeError, r"^kv-canary: x must be an int64-valued integer array, got shape \[2\] dtype bool$"
            ):
                ints.as_int64_pairs(form, name="x", shape=(2,))
        with self.assertRaisesRegex(TypeError, r"expected integer data"):
            ints.int64_to_pairs_np([1, True])
        # Object arrays go through the exact path: a float inside is refused, not truncated.
        with self.assertRaisesRegex(TypeError, r"expected integer data"):
            ints.int64_to_pairs_np(np.array([1, 2.5], dtype=object))
        self.assertEqual(
            ints.int64_to_pairs_np(np.array([2**62, -3], dtype=object)).tolist(), [[0, 2**30], [2**32 - 3, 2**32 - 1]]
        )
        ctx = ctx_with()
        mask = np.array([True, False, True, True])
        for arg in ("input_ids", "positions", "out_cache_loc"):
            arrays = dict(input_ids=tok(), positions=tok(), out_cache_loc=tok())
            arrays[arg] = mask
            fn = lambda a=arrays: canary_jax.write(ctx, wplan(), **a, backend="reference")  # noqa: E731
            RefusalMixin.assertRefused(
                self,
                ctx,
                TypeError,
                rf"^kv-canary: {arg} must be an int64-valued integer array, got shape \[4\] dtype bool$",
                fn,
            )

    def test_narrow_forms_sign_or_zero_extend(self):
        self.assertEqual(
            ints.pairs_to_int64_np(
                ints.as_int64_pairs(jnp.asarray([-1, 5], jnp.int32), name="x", shape=(None,))
            ).tolist(),
            [-1, 5],
        )
        self.assertEqual(
            ints.pairs_to_int64_np(
                ints.as_int64_pairs(jnp.asarray([0xFFFFFFFF], jnp.uint32), name="x", shape=(1,))
            ).tolist(),
            [0xFFFFFFFF],
        )
        self.assertEqual(
            ints.pairs_to_int64_np(ints.as_int64_pairs(np.array([-3], np.int8), name="x", shape=(1,))).tolist(), [-3]
        )
        self.assertEqual(ints.pairs_to_int64_np(ints.as_int64_pairs([], name="x", shape=(0,))).shape, (0,))

    def test_python_ints_outside_int64_refused(self):
        for bad in ([2**63], [-1, 2**63], [2**64 - 1], [-(2**63) - 1]):
            with self.assertRaisesRegex(ValueError, r"kv-canary: x holds a value that does not fit int64"):
                ints.as_int64_pairs(bad, name="x")
        for bad in ([1.5], np.array([1.0]), jnp.asarray([1.0])):
            with self.assertRaisesRegex(TypeError, r"kv-canary: x must be an int64-valued integer array"):
                ints.as_int64_pairs(bad, name="x")

    def test_as_int32_refuses_truncation(self):
        with self.assertRaisesRegex(ValueError, r"kv-canary: n holds values outside int32"):
            ints.as_int32(np.array([2**31], np.int64), name="n")
        with self.assertRaisesRegex(ValueError, r"outside int32"):
            ints.as_int32(np.array([-(2**31) - 1], np.int64), name="n")
        self.assertEqual(
            np.asarray(ints.as_int32(np.array([2**31 - 1, -(2**31)], np.int64), name="n")).tolist(),
            [2**31 - 1, -(2**31)],
        )
        with self.assertRaisesRegex(TypeError, r"n must have dtype int32, got uint32"):
            ints.as_int32(jnp.zeros((1,), jnp.uint32), name="n")
        with self.assertRaisesRegex(TypeError, r"n must have dtype int32, got float64"):
            ints.as_int32(np.zeros((1,)), name="n")
        with self.assertRaisesRegex(ValueError, r"n must have shape \[1\], got \[2\]$"):
            ints.as_int32(np.zeros((2,), np.int32), name="n", shape=(1,))

    def test_pairs_round_trip(self):
        vals = np.array([0, 1, -1, 2**63 - 1, -(2**63), 0x0123456789ABCDEF], np.int64)
        pairs = ints.int64_to_pairs_np(vals)
        self.assertEqual(pairs.dtype, np.uint32)
        self.assertEqual(pairs.tobytes(), vals.astype("<i8").tobytes())  # same bytes as SGLang's int64 tensor
        np.testing.assert_array_equal(ints.pairs_to_int64_np(pairs), vals)
        with self.assertRaisesRegex(TypeError, r"trailing dim of 2"):
            ints.pairs_to_int64_np(np.zeros((3, 3), np.uint32))

    def test_numpy_eight_byte_source_keeps_bytes(self):
        # With x64 off jit would narrow int64 / float64 numpy arrays; the launch must hash the real bytes.
        raw = np.random.default_rng(0).integers(0, 256, (N, 16), dtype=np.uint8)
        for dt in (np.int64, np.float64, np.uint8):
            data = raw.view(dt)
            ctx = ctx_with(sources=[src(data)])
            ctx = canary_jax.write(ctx, wplan(), tok(), tok((0, 0, 0, 0)), tok((5, 0, 0, 0)), backend="reference")
            want = oracle.real_kv_hash([oracle.Source.of(raw, 1, 16, 16)], oracle.ALL, 5)
            self.assertEqual(canary_jax.read_slot(ctx.canary_buf, 5).real_kv_hash, oracle.s64(want), dt)

    def test_bool_and_narrow_dtype_sources(self):
        mask = (np.arange(N * 16).reshape(N, 16) % 3) == 0
        raw = np.random.default_rng(1).integers(0, 256, (N, 16), dtype=np.uint8)
        cases = [
            (jnp.asarray(mask), mask.view(np.uint8)),
            (mask, mask.view(np.uint8)),
            (jnp.asarray(raw.view(np.int16)), raw),
            (jnp.asarray(raw.view(np.float32)), raw),
        ]
        for tensor, want_bytes in cases:
            ctx = ctx_with(sources=[src(tensor)])
            ctx = canary_jax.write(ctx, wplan(), tok(), tok((0, 0, 0, 0)), tok((6, 0, 0, 0)), backend="reference")
            want = oracle.real_kv_hash([oracle.Source.of(want_bytes, 1, 16, 16)], oracle.ALL, 6)
            self.assertEqual(canary_jax.read_slot(ctx.canary_buf, 6).real_kv_hash, oracle.s64(want), tensor.dtype)


if __name__ == "__main__":
    absltest.main()
