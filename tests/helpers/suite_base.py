"""Shared base of the backend suites: golden values, the oracle-checking ``Harness`` and the ``SuiteBase`` mixin.

Every launch runs on the implementation under test and on the independent Python-int oracle
(``helpers/oracle.py``); the whole state is compared after each launch: canary buffer bytes, the whole ring,
write_index and both per-tag counter arrays. Hand scenarios also assert exact ring rows (SPEC 2.6).

To add an implementation: a ``test_*.py`` class mixes the suites (``VerifySuite``, ``WriteSuite``,
``PipelineSuite``, ``PublicEntrySuite``) into ``absltest.TestCase`` and sets ``VERIFY_IMPL`` / ``WRITE_IMPL``
(reference signatures: ``canary_jax.ops.backends.implementation``), ``CONFIG`` (passed as ``config=`` to every
launch; None where there is none) and ``BACKEND`` (for the cases that go through ``canary_jax.verify`` / ``write``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

import canary_jax
from canary_jax.contract import constants
from helpers import oracle

# --- golden values (SPEC 2.6; Python ints, uint64) ---------------------------------------------------------
H = 0xDE7FAE23A9A1B716  # splitmix64(CANARY_CHAIN_ANCHOR)
H_S = H - (1 << 64)  # as stored (int64): -2414019407054260458
CHAIN5_TOKENS = (101, 202, 303, 404, 505)
CHAIN5_PREV = (0xDE7FAE23A9A1B716, 0x542FE5061275A6AB, 0x9890D56BDE53142E, 0x5213C65EEE8A1DD1, 0xC749AFFE5A5A9634)
CHAIN5_NEXT = 0x3A650FCC4023CD13
RESUME_PREV = (0x5E35681BCFCE7CF6, 0x56D3E7D2989B8E36, 0xDD87E0146C9036A8, 0x1CBB47092FF8336E, 0x3579999BB482D1FC)
PATTERN16 = bytes([0x01, 0x02, 0x04, 0x08, 0x10, 0x20, 0x40, 0x80, 0x81, 0x82, 0x84, 0x88, 0x90, 0xA0, 0xC0, 0xFF])
PATTERN16_STORED = 0x6041580849E6407D
BYTES00_0F_STORED = 0xD6D75024DFD6C30C  # 1 source, bytes 00..0F
BYTES00_1F_ALL32_STORED = 0xB44181DFE9420039  # 1 source, ALL read_bytes 32 over bytes 00..1F
TWO_SOURCES_STORED = 0xB6209A488C3F52B0  # src0 bytes 00..0F, src1 bytes 10..1F
FF16_STORED = 0xCA5420B0710A0DAC
MIX3_000 = 0  # mix3(0, 0, 0): the chain hash of an all-zero record

TAG = constants.CanaryLaunchTag.TAIL_K_FULL
NONE, PARTIAL, ALL = constants.RealKvHashMode.NONE, constants.RealKvHashMode.PARTIAL, constants.RealKvHashMode.ALL
B_CHAIN, B_POS, B_RKV, B_WTOK, B_WPOS, B_TOK = 1, 2, 4, 8, 16, 32


def s64(v: int) -> int:
    return oracle.s64(v)


def pairs(values, n: int | None = None, fill: int = 0) -> jnp.ndarray:
    """int64 values -> ``uint32[n, 2]`` little-endian pairs, built with numpy only (independent of ints.py)."""
    vals = [int(v) for v in values]
    if n is not None:
        vals = vals + [fill] * (n - len(vals))
    arr = np.array([oracle.u64(v) for v in vals], dtype=np.uint64).astype("<u8")
    return jnp.asarray(arr.view("<u4").reshape(-1, 2).copy())


def ring_int64(log) -> np.ndarray:
    arr = np.ascontiguousarray(np.asarray(log.ring), dtype="<u4")
    return arr.view("<i8").reshape(arr.shape[0], 8)


def counters_int64(x) -> np.ndarray:
    arr = np.ascontiguousarray(np.asarray(x), dtype="<u4")
    return arr.view("<i8").reshape(arr.shape[0])


@dataclasses.dataclass
class SrcSpec:
    """A real-KV source: host bytes plus its layout (shared by the backend and the oracle)."""

    data: np.ndarray  # uint8[rows, row_bytes] (or any dtype, 2-D)
    page_size: int
    nbpt: int
    read_bytes: int


@dataclasses.dataclass(frozen=True)
class Launch:
    """How a harness runs its launches.

    ``verify(context, plan, *, check_verify_expected_token)`` and ``write(context, plan, input_ids, positions,
    out_cache_loc, *, enable_write_input_assert, expected_input_tokens, expected_input_positions)`` return the
    new context; ``encode`` turns the harness's int64 token arrays (numpy) into what ``write`` takes.
    """

    verify: Callable[..., Any]
    write: Callable[..., Any]
    encode: Callable[[np.ndarray], Any]

    @classmethod
    def implementation(cls, verify_impl, write_impl, config=None) -> Launch:
        """The implementations called directly, ``config=`` bound when given; token arrays as int64 pairs."""
        if config is not None:
            verify_impl = functools.partial(verify_impl, config=config)
            write_impl = functools.partial(write_impl, config=config)
        return cls(verify=verify_impl, write=write_impl, encode=pairs)

    @classmethod
    def public(cls, backend: str) -> Launch:
        """The public ``canary_jax.verify`` / ``write`` (validation, donation) with ``backend=``; numpy int64."""
        return cls(
            verify=functools.partial(canary_jax.verify, backend=backend),
            write=functools.partial(canary_jax.write, backend=backend),
            encode=np.asarray,
        )


class Harness:
    """Runs every launch on the implementation and on the oracle, and checks they agree afterwards."""

    def __init__(
        self,
        tc: SuiteBase,
        launch: Launch,
        *,
        num_slots: int,
        stride: int,
        ring: int,
        sources=(),
        mode=NONE,
        chain_assert: int = 1,
        buf: np.ndarray | None = None,
    ):
        self.tc = tc
        self.launch = launch
        self.st = oracle.State.fresh(num_slots, stride, ring, chain_position_assert=chain_assert)
        if buf is not None:
            self.st.buf[...] = buf
        self.srcs = tuple(sources)
        self.mode = mode
        log = canary_jax.ViolationLog.allocate(ring_capacity=ring, enable_chain_position_assert=bool(chain_assert))
        self.ctx = canary_jax.VerifyOrWriteContext(
            canary_buf=jnp.asarray(self.st.buf.copy()),
            kernel_kind=TAG,
            log=log,
            real_kv_sources=tuple(
                canary_jax.RealKvSource(
                    tensor=jnp.asarray(s.data),
                    page_size=s.page_size,
                    num_bytes_per_token=s.nbpt,
                    read_bytes=s.read_bytes,
                )
                for s in self.srcs
            ),
            real_kv_hash_mode=mode,
        )
        self.osrcs = tuple(oracle.Source.of(s.data, s.page_size, s.nbpt, s.read_bytes) for s in self.srcs)

    # --- direct canary edits (both sides) ---
    def poke(self, slot: int, fields: Sequence[int]) -> None:
        oracle.write_record(self.st.buf, slot, fields)
        buf = np.array(self.ctx.canary_buf)
        oracle.write_record(buf, slot, fields)
        self.ctx = self.ctx.replace(canary_buf=jnp.asarray(buf))

    def lay_chain(self, slots, tokens, positions, seed_hash: int = H) -> list[int]:
        """Stores a clean chain directly (independent of the write kernel); returns stored prev hashes."""
        hs = oracle.chain_prev_hashes(tokens, positions, seed_hash)
        for k, slot in enumerate(slots):
            rkv = oracle.real_kv_hash(self.osrcs, int(self.mode), slot)
            self.poke(slot, [tokens[k], positions[k], hs[k], rkv])
        return hs[: len(slots)]

    def preset_counters(self, tag: int, slot_count: int, kernel_count: int) -> None:
        """Sets both per-tag int64 counters of ``tag`` (both sides)."""
        log = self.ctx.log
        slot_arr = np.array(log.slot_run_counters)
        kern_arr = np.array(log.kernel_run_counters)
        slot_arr[int(tag)] = [slot_count & 0xFFFFFFFF, (slot_count >> 32) & 0xFFFFFFFF]
        kern_arr[int(tag)] = [kernel_count & 0xFFFFFFFF, (kernel_count >> 32) & 0xFFFFFFFF]
        self.ctx = self.ctx.replace(
            log=dataclasses.replace(
                log, slot_run_counters=jnp.asarray(slot_arr), kernel_run_counters=jnp.asarray(kern_arr)
            )
        )
        self.st.slot_counters[int(tag)] = oracle.s64(slot_count)
        self.st.kernel_counters[int(tag)] = oracle.s64(kernel_count)

    # --- launches ---
    def verify(self, entries, *, num_valid=None, enable=1, check=False, tag=TAG, cap=None, tail=None, compare=True):
        """entries: (slot, expected_position, prev_slot[, expected_token]); padded to capacity with ``tail``."""
        cap = self.tc.VERIFY_CAPACITY if cap is None else cap
        ents = [tuple(e) + ((-1,) if len(e) == 3 else ()) for e in entries]
        filler = tail if tail is not None else (0, 0, 0, -1)
        full = ents + [filler] * (cap - len(ents))
        assert len(full) == cap, (len(full), cap)
        slots, poss, prevs, toks = (list(c) for c in zip(*full, strict=True))
        nv = len(ents) if num_valid is None else num_valid
        plan = canary_jax.VerifyPlan(
            verify_slot_indices=pairs(slots),
            verify_expected_tokens=pairs(toks),
            verify_expected_positions=pairs(poss),
            verify_prev_slot_indices=pairs(prevs),
            verify_num_valid=jnp.asarray(np.array([nv], np.int32)),
            enable=jnp.asarray(np.array([enable], np.int32)),
        )
        oracle.verify(
            self.st,
            tag=int(tag),
            slots=slots,
            positions=poss,
            prev_slots=prevs,
            expected_tokens=toks,
            num_valid=nv,
            enable=enable,
            check_token=check,
            sources=self.osrcs,
            mode=int(self.mode),
        )
        self.ctx = self.launch.verify(self.ctx.replace(kernel_kind=tag), plan, check_verify_expected_token=check)
        if compare:
            self.check()

    def write(self, reqs, *, num_valid_reqs=None, input_assert=False, tag=TAG, pad=None, compare=True, num_tokens=None):
        """reqs: list of (seed_slot, [(slot, token, position[, expected_token, expected_position]), ...]).

        Token arrays have NUM_TOKENS entries; the tail past the last request is ``pad`` (default: entries
        that would overwrite slots 1..k if a backend read past the offsets).
        """
        cw = self.tc.WRITE_REQ_CAPACITY
        t = self.tc.NUM_TOKENS if num_tokens is None else num_tokens
        assert len(reqs) <= cw
        offsets, seeds, flat = [0], [], []
        for seed, ents in reqs:
            seeds.append(seed)
            for e in ents:
                e = tuple(e)
                flat.append(e if len(e) == 5 else e + (e[1], e[2]))
            offsets.append(len(flat))
        assert len(flat) <= t, (len(flat), t)
        offsets += [0] * (cw + 1 - len(offsets))
        seeds += [-1] * (cw - len(seeds))
        k = 0
        while len(flat) < t:
            k += 1
            flat.append(pad if pad is not None else (1 + k % 7, 7777, 9999, 1, 2))
        loc, ids, pos, etok, epos = (
            (np.array(c, dtype=np.int64) for c in zip(*flat, strict=True)) if flat else (np.zeros(0, np.int64),) * 5
        )
        nvr = len(reqs) if num_valid_reqs is None else num_valid_reqs
        self.write_raw(
            offsets, seeds, nvr, ids, pos, loc, etok, epos, input_assert=input_assert, tag=tag, compare=compare
        )

    def write_raw(self, offsets, seeds, nvr, ids, pos, loc, etok, epos, *, input_assert=False, tag=TAG, compare=True):
        """One write launch from raw plan arrays (offsets: Cw + 1, seeds: Cw) and int64 token arrays."""
        ids, pos, loc, etok, epos = (np.asarray(a, np.int64) for a in (ids, pos, loc, etok, epos))
        plan = canary_jax.WritePlan(
            write_offsets=pairs(offsets),
            write_seed_slot_indices=pairs(seeds),
            write_num_valid_reqs=jnp.asarray(np.array([nvr], np.int32)),
        )
        oracle.write(
            self.st,
            tag=int(tag),
            offsets=offsets,
            seeds=seeds,
            input_ids=ids.tolist(),
            positions=pos.tolist(),
            out_cache_loc=loc.tolist(),
            num_valid_reqs=nvr,
            input_assert=input_assert,
            expected_tokens=etok.tolist(),
            expected_positions=epos.tolist(),
            sources=self.osrcs,
            mode=int(self.mode),
        )
        enc = self.launch.encode
        self.ctx = self.launch.write(
            self.ctx.replace(kernel_kind=tag),
            plan,
            enc(ids),
            enc(pos),
            enc(loc),
            enable_write_input_assert=input_assert,
            expected_input_tokens=enc(etok) if input_assert else None,
            expected_input_positions=enc(epos) if input_assert else None,
        )
        if compare:
            self.check()

    # --- observation ---
    def check(self) -> None:
        """Whole-state equality with the oracle."""
        tc = self.tc
        np.testing.assert_array_equal(np.asarray(self.ctx.canary_buf), self.st.buf, err_msg="canary buffer")
        np.testing.assert_array_equal(ring_int64(self.ctx.log), self.st.ring, err_msg="violation ring")
        tc.assertEqual(int(np.asarray(self.ctx.log.write_index)[0]), self.st.write_index, "write_index")
        np.testing.assert_array_equal(
            counters_int64(self.ctx.log.slot_run_counters), self.st.slot_counters, err_msg="slot_run_counters"
        )
        np.testing.assert_array_equal(
            counters_int64(self.ctx.log.kernel_run_counters), self.st.kernel_counters, err_msg="kernel_run_counters"
        )

    @property
    def write_index(self) -> int:
        return int(np.asarray(self.ctx.log.write_index)[0])

    def rows(self) -> list[list[int]]:
        n = min(self.write_index, self.ctx.log.ring.shape[0])
        return ring_int64(self.ctx.log)[:n].tolist()

    def slot_counter(self, tag=TAG) -> int:
        return int(counters_int64(self.ctx.log.slot_run_counters)[int(tag)])

    def kernel_counter(self, tag=TAG) -> int:
        return int(counters_int64(self.ctx.log.kernel_run_counters)[int(tag)])

    def record(self, slot: int) -> tuple[int, int, int, int]:
        return oracle.read_record(np.asarray(self.ctx.canary_buf), slot)


class SuiteBase:
    """Shapes, the implementation under test and ``harness()``; a mixin, never collected on its own.

    Shapes are fixed per class so jit compiles once per configuration; a class may shrink ``FUZZ_SEEDS`` or
    ``LARGE_ENTRIES`` for slow implementations.
    """

    BACKEND: str  # name for the public canary_jax.verify / write
    VERIFY_IMPL: Callable[..., Any]  # staticmethod, reference signature
    WRITE_IMPL: Callable[..., Any]  # staticmethod, reference signature
    CONFIG: Any = None  # passed as config= to every launch when not None (a pallas_kernels PallasConfig)
    NUM_SLOTS = 128
    SLOT_STRIDE = 32
    VERIFY_CAPACITY = 64
    WRITE_REQ_CAPACITY = 8
    NUM_TOKENS = 64
    RING_CAPACITY = 64
    SMALL_RING = 4
    FUZZ_SEEDS = tuple(range(6))
    FUZZ_LAUNCHES = 6
    LARGE_ENTRIES = 70_000  # > 65535: catches 16-bit grid / index limits
    LARGE_BAD_ENTRIES = (65535, 65536)  # the large verify's failing entries (with the last), here the 16-bit edge

    def harness(
        self,
        *,
        ring=None,
        sources=(),
        mode=NONE,
        chain_assert=1,
        num_slots=None,
        stride=None,
        buf=None,
        config=None,
        public=False,
    ) -> Harness:
        """A fresh harness; ``config`` overrides ``CONFIG``; ``public`` launches through ``canary_jax``."""
        if public:
            assert config is None, "the public entry points take no configuration"
            launch = Launch.public(self.BACKEND)
        else:
            launch = Launch.implementation(self.VERIFY_IMPL, self.WRITE_IMPL, self.CONFIG if config is None else config)
        return Harness(
            self,
            launch,
            num_slots=num_slots or self.NUM_SLOTS,
            stride=stride or self.SLOT_STRIDE,
            ring=ring or self.RING_CAPACITY,
            sources=sources,
            mode=mode,
            chain_assert=chain_assert,
            buf=buf,
        )
