"""The one-call integration (``canary_jax.integration.CanaryGuard``) on a toy serving stack.

The toy stack (:class:`ToyServer`) is a host-side serving loop: requests with shared prompt prefixes, chunked
prefill, decode, a paged KV pool (page size 2) addressed through a block table, a prefix cache whose finished
sequences keep their KV (orphans: cached, read by no running request) and a sweep source over that cache. Its
model step writes KV bytes that are a function of (token, position), so the canary's records and real-KV
hashes can be checked against the independent Python-int oracle (``tests/helpers/oracle.py``).

Also here: the README's one-call and fault-injection examples run as pasted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from canary_jax.contract import constants, decode
from canary_jax.contract.sources import RealKvSource
from canary_jax.integration import CanaryCapacities, CanaryGuard, normalize_sources, parse_real_kv_hash_mode
from canary_jax.runtime.report import CanaryViolationError
from canary_jax.runtime.sweep import SweepEntries
from helpers import oracle

T = constants.CanaryLaunchTag
PAGE = 2
NUM_PAGES = 96
NUM_SLOTS = NUM_PAGES * PAGE  # slot 0 (page 0) is the padding slot
KV_BYTES = 32
MAX_BS, MAX_LEN = 4, 32
CHUNK = 6
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def kv_rows(tokens, positions):
    """The toy model's layer-0 K bytes of each token: a function of (token, position) (``uint8[T, KV_BYTES]``)."""
    j = jnp.arange(KV_BYTES, dtype=jnp.int32)
    return ((tokens[:, None] * 31 + positions[:, None] * 7 + j[None, :] * 3 + 1) % 251 + 1).astype(jnp.uint8)


def kv_rows_np(tokens, positions):
    j = np.arange(KV_BYTES)
    t, p = np.asarray(tokens, np.int64), np.asarray(positions, np.int64)
    return ((t[:, None] * 31 + p[:, None] * 7 + j[None, :] * 3 + 1) % 251 + 1).astype(np.uint8)


def source(pool):
    return RealKvSource(tensor=pool, page_size=PAGE, num_bytes_per_token=KV_BYTES, read_bytes=KV_BYTES)


def step_fn(pool, b):
    """The toy model step: writes every token's KV into its slot of the paged pool (padding into slot 0) and
    returns its "logits" (``2 * id + position`` per token)."""
    loc = b.out_cache_loc
    cols = (loc % PAGE)[:, None] * KV_BYTES + jnp.arange(KV_BYTES, dtype=jnp.int32)[None, :]
    pool = pool.at[(loc // PAGE)[:, None], cols].set(kv_rows(b.input_ids, b.positions))
    return pool, source(pool), b.input_ids * 2 + b.positions


def new_pool():
    return jnp.zeros((NUM_PAGES, PAGE * KV_BYTES), jnp.uint8)


@dataclasses.dataclass
class Req:
    row: int
    tokens: list
    prompt_len: int
    max_new: int
    pages: list = dataclasses.field(default_factory=list)
    computed: int = 0

    @property
    def done(self):
        return len(self.tokens) - self.prompt_len >= self.max_new


class ToyServer:
    """Requests, a block table (page size 2), a page allocator and a prefix cache of finished sequences."""

    ARRIVALS = {
        0: [(list(range(1, 9)), 12), (list(range(40, 47)), 3)],  # request 0 runs until step ~13
        1: [(list(range(1, 7)) + [90, 91, 92], 4)],  # shares 6 tokens (3 pages) with request 0
        3: [(list(range(200, 215)), 3)],  # chunked prefill
        6: [(list(range(1, 9)) + [55], 4)],  # shares request 0's prompt
        9: [(list(range(40, 46)) + [77, 78], 6)],  # shares the finished request 1's pages
        12: [([300, 301, 302], 9)],
    }

    def __init__(self):
        self.block_table = np.zeros((MAX_BS + 1, MAX_LEN // PAGE), np.int32)
        self.free_pages = list(range(1, NUM_PAGES))
        self.free_rows = list(range(1, MAX_BS + 1))
        self.running: list[Req] = []
        self.waiting: list = []
        self.cache: list[tuple[list, list]] = []  # finished sequences: (tokens with KV, pages)
        self.step_no = 0
        self.prefix_hits = 0
        self.last = None

    @property
    def req_to_token(self):
        """``int32[rows, MAX_LEN]`` slot of every position, from the block table."""
        p = np.arange(MAX_LEN)
        pages = self.block_table[:, p // PAGE]
        return ((pages * PAGE + p % PAGE) * (pages > 0)).astype(np.int32)

    def admit(self):
        self.waiting += self.ARRIVALS.get(self.step_no, [])
        while self.waiting and len(self.running) < MAX_BS and self.free_rows:
            prompt, max_new = self.waiting.pop(0)
            req = Req(row=self.free_rows.pop(0), tokens=list(prompt), prompt_len=len(prompt), max_new=max_new)
            best = []  # whole shared pages of a cached or running sequence
            for toks, pages in self.cache + [(r.tokens[: r.computed], r.pages) for r in self.running]:
                m = 0
                while m < min(len(toks), len(prompt) - 1) and toks[m] == prompt[m]:
                    m += 1
                m -= m % PAGE
                if m > PAGE * len(best):
                    best = pages[: m // PAGE]
            req.pages, req.computed = list(best), PAGE * len(best)
            self.prefix_hits += req.computed
            self.block_table[req.row, : len(best)] = best
            self.running.append(req)

    def batch(self):
        """This step's batch fields (host arrays) and the rows / extends it covers."""
        rpi, prefix, extend, ids, pos, loc, plan = [], [], [], [], [], [], []
        for req in self.running:
            n = min(len(req.tokens) - req.computed, CHUNK)
            for p in range(req.computed, req.computed + n):
                if p // PAGE >= len(req.pages):
                    req.pages.append(self.free_pages.pop(0))
                    self.block_table[req.row, p // PAGE] = req.pages[-1]
                ids.append(req.tokens[p])
                pos.append(p)
                loc.append(req.pages[p // PAGE] * PAGE + p % PAGE)
            rpi.append(req.row)
            prefix.append(req.computed)
            extend.append(n)
            plan.append((req, n))
        self.last = dict(
            req_pool_indices=np.array(rpi, np.int64),
            prefix_lens=np.array(prefix, np.int64),
            extend_seq_lens=np.array(extend, np.int64),
            input_ids=np.array(ids, np.int64),
            positions=np.array(pos, np.int64),
            out_cache_loc=np.array(loc, np.int64),
            req_to_token=self.req_to_token,
        )
        return self.last, plan

    def finish(self, plan):
        for req, n in plan:
            req.computed += n
            if req.computed == len(req.tokens):  # the model "sampled" the next token
                t = req.tokens
                req.tokens.append((t[-1] * 13 + t[-2] * 7 + len(t)) % 1000 + 1)
        for req in list(self.running):
            if req.done:
                self.running.remove(req)
                self.cache.append((req.tokens[: req.computed], list(req.pages)))
                self.block_table[req.row] = 0
                self.free_rows.append(req.row)
        self.step_no += 1

    def sweep_entries(self) -> SweepEntries:
        """Every cached slot once: its position and predecessor slot (the sweep source)."""
        seen: dict[int, tuple[int, int]] = {}
        for toks, pages in self.cache:
            prev = -1
            for p in range(len(toks)):
                s = pages[p // PAGE] * PAGE + p % PAGE
                seen.setdefault(s, (p, prev))
                prev = s
        slots = sorted(seen)
        return SweepEntries(
            np.array(slots, np.int64),
            np.array([seen[s][0] for s in slots], np.int64),
            np.array([seen[s][1] for s in slots], np.int64),
        )

    def live_slots(self) -> set:
        return {pg * PAGE + o for r in self.running for pg in r.pages for o in range(PAGE)}

    def cached_slots(self) -> list:
        return [int(s) for s in self.sweep_entries().slots]

    def written(self):
        """``slot -> (token, position, prev_slot)`` of every slot whose KV was written (running + cached)."""
        out = {}
        seqs = [(r.tokens[: r.computed], r.pages) for r in self.running] + self.cache
        for toks, pages in seqs:
            prev = -1
            for p in range(len(toks)):
                s = pages[p // PAGE] * PAGE + p % PAGE
                out[s] = (toks[p], p, prev)
                prev = s
        return out


def make_guard(**kw):
    """A guard over the toy pool. By default it sweeps every 4 steps whatever ``sweep_source`` returns (here:
    nothing), so most tests share one compiled program per bucket (the program depends on the step function
    and the config, not on the mode or the sweep source)."""
    kw.setdefault("backend", "reference")
    if "capacities" not in kw:
        kw.setdefault("sweep_interval", 4)
        kw.setdefault("sweep_source", lambda: None)
    return CanaryGuard(
        kw.pop("step_fn", step_fn), num_slots=NUM_SLOTS, max_batch_size=MAX_BS, max_seq_len=MAX_LEN, **kw
    )


def serve(guard, server, pool, steps, *, before=None):
    """Runs ``steps`` toy steps through the guard; ``before(step, pool, fields) -> (pool, fields)`` may inject."""
    for _ in range(steps):
        server.admit()
        fields, plan = server.batch()
        if before is not None:
            pool, fields = before(guard.step_index, pool, fields)
        pool, _ = guard.step(pool, **fields)
        server.finish(plan)
    return pool


def assert_records_match_oracle(guard, server, pool):
    """Every written slot's TAIL record is (token, position, chain hash, real-KV hash of its bytes), computed
    independently with Python ints; every HEAD record the same with real-KV hash 0."""
    tail = np.asarray(guard.state.groups[0].k_tail)
    head = np.asarray(guard.state.groups[0].k_head)
    src = oracle.Source.of(np.asarray(pool), PAGE, KV_BYTES, KV_BYTES)
    written = server.written()
    assert len(written) > 20
    for s, (tok, p, prev) in written.items():
        want_prev = oracle.ANCHOR_HASH if prev < 0 else oracle.slot_hash(tail, prev)
        rkv = oracle.real_kv_hash([src], oracle.ALL, s)
        assert oracle.read_record(tail, s) == (tok, p, oracle.s64(want_prev), oracle.s64(rkv)), s
        assert oracle.read_record(head, s) == (tok, p, oracle.s64(want_prev), 0), s
        # and the pool holds the model's bytes for (token, position)
        got = src.data[s // PAGE, (s % PAGE) * KV_BYTES :][:KV_BYTES]
        np.testing.assert_array_equal(got, kv_rows_np([tok], [p])[0])


# --- a clean run ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def clean_run():
    server = ToyServer()
    guard = make_guard(sweep_source=lambda: server.sweep_entries(), mode="raise")
    pool = serve(guard, server, new_pool(), 30)
    return guard, server, pool


def test_clean_run_prefill_decode_prefix_sharing(clean_run):
    guard, server, pool = clean_run
    assert server.prefix_hits >= 12 and len(server.cache) >= 4  # prefixes were shared, sequences cached
    assert guard.flush() == [] and guard.violations() == []
    log = guard.state.log
    # Every step launched HEAD and TAIL verify + write (two kernels each); every 4th step (0, 4, ..., 28) swept.
    assert log.kernel_run_counter(T.HEAD_K_FULL) == log.kernel_run_counter(T.TAIL_K_FULL) == 2 * 30
    assert log.kernel_run_counter(T.SWEEP_K_FULL) == guard.sweep_passes == 8
    assert guard.num_compiles <= 2  # token buckets 16 and 32, one row bucket
    assert_records_match_oracle(guard, server, pool)
    st = guard.stats()
    assert st.violations == 0 and st.launch_tags_active == 3 and st.protected_tokens == int(st.slot_runs.sum())
    assert re.fullmatch(
        r"\[canary\] step=30 protected_tokens=\d+ sweep_passes=8 violations=0 launch_tags_active=3/12",
        guard.stats_line(),
    )


def test_capacities_follow_sglangs_rule():
    # SGLang's CanaryLaunchCapacities.from_args: verify = 3 x pool slots (its own tests: 100 -> 300, 7 -> 21).
    c = CanaryCapacities.from_pool(num_slots=100, max_batch_size=512, max_seq_len=2048)
    assert (c.verify_capacity, c.write_req_capacity, c.sweep_capacity) == (300, 512, 100)
    assert CanaryCapacities.from_pool(num_slots=7, max_batch_size=4, max_seq_len=64).verify_capacity == 21
    # capped by the most a batch can plan: 2 rows x 16 positions
    assert CanaryCapacities.from_pool(num_slots=1000, max_batch_size=2, max_seq_len=16).verify_capacity == 32
    with pytest.raises(ValueError, match="kv-canary: max_batch_size must be positive, got 0"):
        CanaryCapacities.from_pool(num_slots=8, max_batch_size=0, max_seq_len=4)
    with pytest.raises(ValueError, match="kv-canary: sweep_capacity must be positive, got -1"):
        CanaryCapacities(verify_capacity=1, write_req_capacity=1, sweep_capacity=-1)
    g = make_guard()
    assert g.capacities == CanaryCapacities(verify_capacity=MAX_BS * MAX_LEN, write_req_capacity=4, sweep_capacity=192)
    assert g.active_tags == (T.HEAD_K_FULL, T.TAIL_K_FULL, T.SWEEP_K_FULL)


def test_constructor_refusals_name_the_argument():
    with pytest.raises(ValueError, match="sweep_interval=2 needs a sweep_source"):
        make_guard(sweep_interval=2, sweep_source=None)
    with pytest.raises(ValueError, match="kv-canary: kv_canary must be one of none/log/raise, got 'loud'"):
        make_guard(mode="loud")
    with pytest.raises(ValueError, match="real_kv_hash_mode must be one of none/partial/all, got 'some'"):
        make_guard(real_kv_hash_mode="some")
    with pytest.raises(TypeError, match="step_fn must be callable"):
        CanaryGuard(None, num_slots=8, max_batch_size=1, max_seq_len=4)
    assert parse_real_kv_hash_mode("Partial") is constants.RealKvHashMode.PARTIAL
    assert parse_real_kv_hash_mode(2) is constants.RealKvHashMode.ALL


def test_short_source_forms():
    s = source(new_pool())
    ((k, v),) = normalize_sources(s, 1)
    assert len(k) == 1 and k[0] is s and v == ()
    ((k, v),) = normalize_sources([s, s], 1)
    assert len(k) == 2 and k[0] is s and k[1] is s and v == ()
    assert normalize_sources(None, 1) is None
    pairs = (((s,), ()), ((), ()))
    assert normalize_sources(pairs, 2) is pairs
    with pytest.raises(TypeError, match="the guard has 2 buffer groups"):
        normalize_sources(s, 2)


# --- compile count, donation, refusals -----------------------------------------------------------------------
def prefill_fields(n, row=1):
    """One request of ``n`` fresh tokens in row ``row`` at positions 0..n-1, slots 2..n+1."""
    r2t = np.zeros((MAX_BS + 1, MAX_LEN), np.int32)
    r2t[row, :n] = np.arange(2, n + 2)
    return dict(
        req_pool_indices=[row],
        prefix_lens=[0],
        extend_seq_lens=[n],
        input_ids=np.arange(100, 100 + n),
        positions=np.arange(n),
        out_cache_loc=np.arange(2, n + 2),
        req_to_token=r2t,
    )


def test_compile_count_bounded_over_many_token_counts():
    guard = make_guard()
    pool = new_pool()
    for n in range(1, MAX_LEN + 1):  # 32 token counts -> buckets 16 and 32 (one row bucket)
        pool, _ = guard.step(pool, **prefill_fields(n))
    assert guard.num_compiles <= 2  # none if an earlier guard with this step_fn and config compiled both
    assert guard.step_index == MAX_LEN and guard.flush() == []
    log = guard.state.log
    assert log.slot_run_counter(T.TAIL_K_FULL) == sum(range(1, MAX_LEN + 1))  # padding never counted
    assert log.slot_run_counter(T.HEAD_K_FULL) == sum(range(1, MAX_LEN + 1))


def test_state_and_kv_are_donated_the_log_is_not():
    guard = make_guard()
    pool = new_pool()
    pool, _ = guard.step(pool, **prefill_fields(5))
    old_state, old_pool = guard.state, pool
    pool, _ = guard.step(pool, **prefill_fields(6, row=2))
    assert old_pool.is_deleted()
    assert old_state.groups[0].k_tail.is_deleted() and old_state.groups[0].k_head.is_deleted()
    assert not old_state.log.write_index.is_deleted()  # the one-step-late pump reads it
    assert not pool.is_deleted() and not guard.state.groups[0].k_tail.is_deleted()


def test_refused_calls_change_nothing():
    guard = make_guard()
    pool, _ = guard.step(new_pool(), **prefill_fields(4))
    state = guard.state
    bad = prefill_fields(3)
    bad.update(
        req_pool_indices=[1, 0, 0, 0, 0], prefix_lens=[0] * 5, extend_seq_lens=[3, 0, 0, 0, 0]
    )  # 5 rows > max_batch_size 4
    with pytest.raises(ValueError, match="the batch has 5 rows but max_batch_size"):
        guard.step(pool, **bad)
    narrow = prefill_fields(3)
    narrow["req_to_token"] = narrow["req_to_token"][:, :16]
    with pytest.raises(ValueError, match="req_to_token has 16 columns but the guard was built with max_seq_len=32"):
        guard.step(pool, **narrow)
    taller = prefill_fields(3)
    taller["req_to_token"] = np.zeros((8, MAX_LEN), np.int32)
    with pytest.raises(ValueError, match=r"req_to_token must keep one shape .*got \(8, 32\) after \(5, 32\)"):
        guard.step(pool, **taller)
    with pytest.raises(TypeError, match="pass the batch either as a CanaryBatch / mapping or as keywords"):
        guard.step(pool, prefill_fields(3), input_ids=[1])
    assert guard.step_index == 1 and guard.state is state
    assert not pool.is_deleted() and not state.groups[0].k_tail.is_deleted()
    # A step_fn of the wrong form, or sources that do not fit the hashing mode: refused while tracing.
    for fn, exc, msg in (
        (lambda kv, b: kv, TypeError, "step_fn must return \\(kv_state, real_kv_sources\\)"),
        (lambda kv, b: (kv, None), ValueError, "real_kv_hash_mode=ALL hashes the real KV"),
    ):
        g = make_guard(step_fn=fn)
        p = new_pool()
        with pytest.raises(exc, match=msg):
            g.step(p, **prefill_fields(2))
        assert g.step_index == 0 and not p.is_deleted() and not g.state.groups[0].k_tail.is_deleted()


def test_guard_refuses_host_values_step_fn_would_see_truncated():
    guard = make_guard()
    pool, _ = guard.step(new_pool(), **prefill_fields(2))
    state = guard.state
    for name, value in (("positions", 2**32 + 4), ("input_ids", 2**40 + 5), ("out_cache_loc", 2**32 + 6)):
        bad = prefill_fields(2)
        bad[name] = np.array([bad[name][0], value], np.int64)
        msg = (
            rf"^kv-canary: {name}\[1\] = {value} is outside int32, but step_fn receives {name} as int32 "
            r"\(StepInputs\); refusing to truncate$"
        )
        with pytest.raises(ValueError, match=msg):
            guard.step(pool, **bad)
    assert guard.step_index == 1 and guard.state is state
    assert not pool.is_deleted() and not state.groups[0].k_tail.is_deleted()


def test_guard_refuses_host_values_that_break_sglangs_batch_contract():
    guard = make_guard()
    pool, _ = guard.step(new_pool(), **prefill_fields(2))
    state = guard.state
    bad = prefill_fields(3)
    bad["out_cache_loc"] = np.array([2, NUM_SLOTS + 5, 4])
    msg = (
        rf"^kv-canary: out_cache_loc\[1\] = {NUM_SLOTS + 5} is outside \[0, {NUM_SLOTS}\) \(num_slots of group 0's "
        r"\(FULL\) canary buffers\); token 1 is written by row 0"
    )
    with pytest.raises(ValueError, match=msg):
        guard.step(pool, **bad)
    bad = prefill_fields(3)
    bad["extend_seq_lens"] = [4]
    with pytest.raises(ValueError, match=r"^kv-canary: the non-padding rows' extend_seq_lens sum to 4 but the batch"):
        guard.step(pool, **bad)
    assert guard.step_index == 1 and guard.state is state
    assert not pool.is_deleted() and not state.groups[0].k_tail.is_deleted()


def test_guard_names_step_fn_when_its_sources_do_not_fit_the_mode():
    g = make_guard(step_fn=lambda kv, b: (kv, None))
    p = new_pool()
    with pytest.raises(
        ValueError,
        match=r"^kv-canary: real_kv_hash_mode=ALL hashes the real KV, but step_fn's result got no real_kv_sources; ",
    ):
        g.step(p, **prefill_fields(2))
    assert g.step_index == 0 and not p.is_deleted() and not g.state.groups[0].k_tail.is_deleted()


def test_guard_warns_once_that_sources_are_not_hashed_in_none_mode():
    from canary_jax.contract import validation

    def none_mode_step_fn(pool, b):  # its own function: its programs are traced here
        return step_fn(pool, b)

    validation._WARNED_UNHASHED.clear()
    guard = make_guard(step_fn=none_mode_step_fn, real_kv_hash_mode="none")
    pool = new_pool()
    with pytest.warns(UserWarning) as got:
        for n in (2, 20):  # two token buckets: two traces, one warning
            pool, _ = guard.step(pool, **prefill_fields(n))
    mine = [str(w.message) for w in got if "real_kv_hash_mode is NONE" in str(w.message)]
    assert len(mine) == 1, mine
    assert re.match(
        r"^kv-canary: CanaryGuard got 1 real-KV source\(s\) but real_kv_hash_mode is NONE, so the real KV is not "
        r"hashed \(only the bookkeeping is checked\); set real_kv_hash_mode to PARTIAL or ALL",
        mine[0],
    )
    assert guard.flush() == []


def test_outputs_variant_returns_the_models_outputs():
    guard = make_guard()
    pool, logits = guard.step(new_pool(), **prefill_fields(5))
    out = np.asarray(logits)
    assert out.shape == (16,)  # the token bucket; rows [:5] are the batch's
    np.testing.assert_array_equal(out[:5], np.arange(100, 105) * 2 + np.arange(5))
    np.testing.assert_array_equal(out[5:], 0)  # padding tokens: id 0, position 0
    assert isinstance(pool, jax.Array)


# --- reporting: raise one step late, log, collapse, stats, overflow --------------------------------------------
def flip_used(step_at):
    """A ``before`` hook: at step ``step_at`` flip byte 0 of a slot the step's batch verifies."""
    hit = {}

    def before(step, pool, fields):
        if step == step_at:
            r2t = fields["req_to_token"]
            row = int(fields["req_pool_indices"][0])
            slot = int(r2t[row, int(fields["prefix_lens"][0]) - 1])
            at = (slot // PAGE, (slot % PAGE) * KV_BYTES)
            pool = pool.at[at].set(pool[at] ^ 0xFF)
            hit.update(slot=slot, position=int(fields["prefix_lens"][0]) - 1)
        return pool, fields

    return before, hit


def test_raise_mode_raises_one_step_late_with_sglangs_text():
    server = ToyServer()
    guard = make_guard()
    before, hit = flip_used(5)
    pool = serve(guard, server, new_pool(), 6, before=before)  # step 5 records the violation, returns normally
    server.admit()
    fields, _ = server.batch()
    with pytest.raises(CanaryViolationError) as ei:
        guard.step(pool, **fields)  # step 6 pumps step 5's log and raises
    e = ei.value
    assert e.recorded_step == 5 and e.step == 7  # SGLang's outer counter at the pump: 7 steps done
    assert isinstance(e.kv_state, jax.Array) and not e.kv_state.is_deleted() and guard.step_index == 7
    assert [(r.tag, r.slot_idx, r.position, r.reasons) for r in e.records] == [
        ("TAIL_K_FULL", hit["slot"], hit["position"], ["verify_real_kv_hash"])
    ]
    assert str(e) == decode.format_violation(e.records[0], total=1, ring_overflow=False, step_when_pumped=7)
    assert str(e).startswith(
        f"kv_canary violation: launch_tag=TAIL_K_FULL fail_reason=verify_real_kv_hash slot_idx={hit['slot']} "
        f"position={hit['position']} "
    )
    assert str(e).endswith("  total_violations=1 ring_overflow=False step_when_pumped=7")
    # Raised once; the guard keeps its state and goes on without raising again.
    server.finish(_)
    serve(guard, server, e.kv_state, 2)
    assert guard.step_index == 9


def test_log_mode_logs_once_and_collapses_repeats(caplog):
    server = ToyServer()
    seen = []
    guard = make_guard(mode="log", on_violations=lambda recs, step: seen.append((step, recs)))
    before, hit = flip_used(5)
    with caplog.at_level(logging.WARNING, logger="canary_jax"):
        pool = serve(guard, server, new_pool(), 12, before=before)
        guard.flush()  # step 11's rows (no one-step delay at shutdown)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1  # the same row again at later steps is counted, not logged again
    assert warnings[0].startswith("kv_canary violation: launch_tag=TAIL_K_FULL fail_reason=verify_real_kv_hash")
    assert "step_when_pumped=7" in warnings[0]
    (c,) = guard.repeats()
    rows = guard.violations()
    assert c.count == len(rows) >= 3 and c.first == 7 and c.last > c.first
    assert rows[0].slot_idx == hit["slot"] and all(r.key == rows[0].key for r in rows)
    assert guard.reporter.repeat_lines() == [decode.format_repeat(c)]
    # on_violations got every row once, with the step that recorded it (steps 5.., one late).
    assert [s for s, _ in seen] == list(range(5, 5 + len(seen))) and seen[-1][0] == 11
    assert sum(len(r) for _, r in seen) == len(rows)
    assert isinstance(pool, jax.Array)


def test_collapse_off_logs_every_row_like_sglang(caplog):
    server = ToyServer()
    guard = make_guard(mode="log", collapse=False)
    before, _ = flip_used(5)
    with caplog.at_level(logging.WARNING, logger="canary_jax"):
        serve(guard, server, new_pool(), 9, before=before)
        guard.flush()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == len(guard.violations()) >= 3


def test_stats_line_and_overflow_warning(caplog):
    caps = CanaryCapacities(verify_capacity=4, write_req_capacity=MAX_BS, sweep_capacity=NUM_SLOTS)
    guard = make_guard(capacities=caps, stats_every_n_steps=2)
    pool = new_pool()
    with caplog.at_level(logging.INFO, logger="canary_jax"):
        pool, _ = guard.step(pool, **prefill_fields(6))
        decode_step = prefill_fields(7)  # prefix 6 > capacity 4: the verify overflows and checks nothing
        decode_step.update(prefix_lens=[6], extend_seq_lens=[1], input_ids=[106], positions=[6], out_cache_loc=[8])
        pool, _ = guard.step(pool, **decode_step)
        pool, _ = guard.step(pool, **prefill_fields(3, row=2))
        pool, _ = guard.step(pool, **prefill_fields(3, row=3))
    msgs = [r.getMessage() for r in caplog.records]
    assert (
        "kv-canary: per-forward verify skipped this step due to overflow (total=1, capacity=4); "
        "check ServerArgs / pool sizing"
    ) in msgs
    assert guard.overflowed_steps == 1
    stats = [m for m in msgs if m.startswith("[canary] step=")]
    # after 2 steps: HEAD and TAIL wrote 6 then 1 slots each; the skipped verify counted nothing
    want = f"[canary] step=2 protected_tokens={6 + 6 + 1 + 1} sweep_passes=0 violations=0 launch_tags_active=2/12"
    assert stats == [want]


# --- the README's one-call example ---------------------------------------------------------------------------
SECTIONS = ("## One call: guard your step function", "## Fault injection (`canary_jax.tools.faults`)")


def readme_blocks() -> tuple[str, list[str]]:
    """The python block of each section of :data:`SECTIONS` in README.md."""
    path = os.path.join(ROOT, "README.md")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    blocks = []
    for head in SECTIONS:
        assert head in text, f"no README section {head!r}"
        section = text.split(head, 1)[1].split("\n## ", 1)[0]
        found = re.findall(r"```python\n(.*?)```", section, flags=re.S)
        assert len(found) == 1, (path, head, len(found))
        blocks += found
    return path, blocks


def test_readme_one_call_example_runs_as_pasted(tmp_path, monkeypatch):
    path, blocks = readme_blocks()
    assert len(blocks) == 2, path
    assert len(blocks[0].strip().splitlines()) < 20  # the promise: under 20 lines
    monkeypatch.chdir(tmp_path)
    ns = {"__name__": "__readme__"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(blocks[0], path, "exec"), ns)  # noqa: S102 - our own README
    first = out.getvalue()
    assert re.fullmatch(
        r"\[canary\] step=8 protected_tokens=\d+ sweep_passes=0 violations=0 launch_tags_active=2/12\n", first
    ), first
    with contextlib.redirect_stdout(out):
        exec(compile(blocks[1], path, "exec"), ns)  # noqa: S102
    text = out.getvalue()[len(first) :]
    assert text.startswith("8\nkv_canary violation: launch_tag=TAIL_K_FULL fail_reason=verify_real_kv_hash slot_idx=3 ")
    assert os.path.isfile(tmp_path / "canary_state.npz")


# --- the Pallas kernels (interpreted on the CPU) -------------------------------------------------------------
def decode_fields(n):
    """Request row 1 after ``n`` tokens (slots 2..n+1): decode token 100 + n at position n into slot n + 2."""
    f = prefill_fields(n + 1)
    f.update(prefix_lens=[n], extend_seq_lens=[1], input_ids=[100 + n], positions=[n], out_cache_loc=[n + 2])
    return f


@pytest.mark.parametrize("backend", ["pallas", "pallas_tpu"])  # the GPU kernels and the TPU kernels, interpreted
def test_pallas_backend_guard_matches_the_oracle(backend):
    guard = make_guard(backend=backend, sweep_interval=0, sweep_source=None, mode="none")
    pool, _ = guard.step(new_pool(), **prefill_fields(5))  # tokens 100..104 at positions 0..4, slots 2..6
    pool, _ = guard.step(pool, **decode_fields(5))
    before = np.asarray(pool).copy()
    pool = pool.at[3 // PAGE, (3 % PAGE) * KV_BYTES].set(pool[3 // PAGE, (3 % PAGE) * KV_BYTES] ^ 0xFF)
    pool, _ = guard.step(pool, **decode_fields(6))
    guard.flush()
    chain = oracle.chain_prev_hashes(range(100, 107), range(7))
    tail = np.asarray(guard.state.groups[0].k_tail)
    for p in range(7):
        slot = p + 2
        written = before if slot == 3 else np.asarray(pool)  # slot 3's record keeps the bytes before the flip
        rkv = oracle.real_kv_hash([oracle.Source.of(written, PAGE, KV_BYTES, KV_BYTES)], oracle.ALL, slot)
        assert oracle.read_record(tail, slot) == (100 + p, p, oracle.s64(chain[p]), oracle.s64(rkv)), slot
    # Step 2's TAIL verify saw slot 3's flipped byte: one row, the stored record and the expected chain hash.
    want = [int(T.TAIL_K_FULL), 3, 1, 101, -1, oracle.s64(chain[1]), oracle.s64(chain[1]), 4]
    assert guard.state.log.ring_rows().tolist() == [want]


# --- a block-table stack (the batch's slot table instead of req_to_token) ---------------------------------
def test_block_table_batches_give_the_same_canary_state_and_dump(tmp_path):
    from canary_jax.planning.plan_builder import BlockTable
    from canary_jax.runtime import dump

    runs = {}
    for kind in ("dense", "blocks"):
        server = ToyServer()
        guard = make_guard(mode="none")
        pool = new_pool()
        for _ in range(8):
            server.admit()
            fields, plan = server.batch()
            if kind == "blocks":  # vLLM style: one block-table row per batch row, padded to max_batch_size rows
                rows = np.zeros((MAX_BS, server.block_table.shape[1]), np.int32)
                rows[: len(fields["req_pool_indices"])] = server.block_table[fields["req_pool_indices"]]
                fields["req_to_token"] = BlockTable(block_table=rows, block_size=PAGE)
            pool, _ = guard.step(pool, **fields)
            server.finish(plan)
        guard.flush()
        runs[kind] = (guard, server.last, pool)
    (dense, last, _), (blocks, _, pool) = runs["dense"], runs["blocks"]
    assert blocks.violations() == [] and blocks.num_compiles <= 1
    for name in ("k_head", "k_tail"):
        np.testing.assert_array_equal(
            np.asarray(getattr(blocks.state.groups[0], name)), np.asarray(getattr(dense.state.groups[0], name))
        )
    for name in ("ring", "write_index", "slot_run_counters", "kernel_run_counters"):
        got, want = getattr(blocks.state.log, name), getattr(dense.state.log, name)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # The dump materialises the last batch's rows of the block table as req_to_token.
    d = dump.load_dump(blocks.dump(str(tmp_path / "blocks.npz"), real_kv_sources=source(pool)))
    assert d.req_pool_indices.tolist() == last["req_pool_indices"].tolist()
    for r, n in zip(d.req_pool_indices.tolist(), d.seq_lens.tolist()):
        assert n > 0
        np.testing.assert_array_equal(d.req_to_token[r, :n], last["req_to_token"][r, :n])
