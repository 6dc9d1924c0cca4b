"""Multi-step scenario: a small paged KV pool driven through prefill / chunked prefill / decode with shared
prefixes stays violation-free for 20 steps, then each injected fault is reported with the right tag and reason.

The serving loop is a tiny host-side simulator (requests, req_to_token rows, slot allocation, prefix sharing,
a radix tree of finished sequences); the canary runs through the jitted ``canary_step`` (one compile for the
whole run), with a FULL group and an SWA group, both write and verify-token asserts on, and PARTIAL real-KV
fingerprints of a paged K pool (page size 4) and an SWA K pool.
"""

from __future__ import annotations

import copy
import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

from canary_jax.contract import constants, decode
from canary_jax.contract.sources import RealKvSource
from canary_jax.planning.plan_builder import scatter_req_token_ids
from canary_jax.runtime.endpoints import ExpectedInputs
from canary_jax.runtime.groups import CanaryBufferGroup, PoolKind
from canary_jax.runtime.report import HealthChecker, ViolationMonitor, ViolationReporter, canary_stats
from canary_jax.runtime.state import CanaryBatch, CanaryState, CanaryStepConfig, active_tags
from canary_jax.runtime.step import canary_head, canary_step, canary_sweep, canary_tail
from canary_jax.runtime.sweep import RadixNode, build_sweep_plan_from_radix

T = constants.CanaryLaunchTag
NUM_SLOTS = 256  # full pool slots; slot 0 is the padding slot
PAGE = 4
KV_BYTES = 16
MAX_REQS, MAX_SEQ = 8, 48
BS, NUM_TOKENS = 4, 32
CHUNK = 12
SWA_WINDOW = 6
RING = 64
CONFIG = CanaryStepConfig(
    verify_capacity=160,
    write_req_capacity=BS,
    real_kv_hash_mode=constants.RealKvHashMode.PARTIAL,
    enable_write_input_assert=True,
    enable_verify_token_assert=True,
    backend="reference",
)
SWEEP_CAPACITY = 256
# Full slot s lives at SWA slot LUT[s] (a permutation; 0 stays the padding slot).
LUT = np.array([0] + [NUM_SLOTS - s for s in range(1, NUM_SLOTS)], np.int64)
TRACES = []


def kv_bytes(token, position):
    j = jnp.arange(KV_BYTES, dtype=jnp.int32)
    return ((token[:, None] * 31 + position[:, None] * 7 + j[None, :] * 3 + 1) % 251 + 1).astype(jnp.uint8)


def sources(kv):
    k_full, k_swa = kv
    return (
        ((RealKvSource(tensor=k_full, page_size=PAGE, num_bytes_per_token=KV_BYTES, read_bytes=KV_BYTES),), None),
        ((RealKvSource(tensor=k_swa, page_size=1, num_bytes_per_token=KV_BYTES, read_bytes=KV_BYTES),), None),
    )


def low(pairs):
    """The low int32 word of int64 pairs (the batch's fields are ``uint32[T, 2]``; these values fit int32)."""
    return pairs[..., 0].astype(jnp.int32)


def kv_write_fn(kv, batch):
    """The "model": writes layer-0 K bytes for every token at its slot (full pool paged, SWA pool via LUT)."""
    TRACES.append(1)
    k_full, k_swa = kv
    loc = low(batch.out_cache_loc)
    vals = kv_bytes(low(batch.input_ids), low(batch.positions))
    row, col0 = loc // PAGE, (loc % PAGE) * KV_BYTES
    cols = col0[:, None] + jnp.arange(KV_BYTES, dtype=jnp.int32)[None, :]
    k_full = k_full.at[row[:, None], cols].set(vals)
    k_swa = k_swa.at[jnp.asarray(LUT, jnp.int32)[loc]].set(vals)
    kv = (k_full, k_swa)
    return kv, sources(kv)


@dataclasses.dataclass
class Req:
    row: int
    tokens: list
    prompt_len: int
    max_new: int
    slots: list = dataclasses.field(default_factory=list)  # slot of each position with KV (or allocated)
    computed: int = 0

    @property
    def done(self):
        return len(self.tokens) - self.prompt_len >= self.max_new


class Sim:
    """Host-side serving loop state: requests, req_to_token, slot allocator, prefix cache."""

    ARRIVALS = {
        0: [(list(range(1, 11)), 6)],
        1: [(list(range(1, 9)) + [90, 91, 92, 93], 5)],  # shares 8 tokens with request 0
        2: [(list(range(200, 230)), 3)],  # long prompt: chunked prefill
        5: [(list(range(1, 11)) + [55, 56], 4)],  # shares request 0's prompt
        9: [(list(range(200, 215)) + [7, 8], 4), ([300, 301, 302], 14)],
        14: [(list(range(1, 9)) + [90, 91, 92, 93, 5, 6], 10)],  # shares finished request 1
        17: [(list(range(1, 11)) + [77], 8)],
    }

    def __init__(self):
        self.req_to_token = np.zeros((MAX_REQS, MAX_SEQ), np.int32)
        self.next_slot = 1
        self.free_rows = list(range(1, MAX_REQS))
        self.running: list[Req] = []
        self.waiting: list = []
        self.finished: list[Req] = []
        self.step_no = 0

    def alloc(self):
        s = self.next_slot
        self.next_slot += 1
        assert s < NUM_SLOTS
        return s

    def cached(self):
        for r in self.running + self.finished:
            yield r.tokens[: r.computed], r.slots[: r.computed]

    def admit(self):
        self.waiting += self.ARRIVALS.get(self.step_no, [])
        while self.waiting and len(self.running) < BS and self.free_rows:
            prompt, max_new = self.waiting.pop(0)
            req = Req(row=self.free_rows.pop(0), tokens=list(prompt), prompt_len=len(prompt), max_new=max_new)
            best = []
            for toks, slots in self.cached():
                m = 0
                while m < min(len(toks), len(prompt) - 1) and toks[m] == prompt[m]:
                    m += 1
                if m > len(best):
                    best = slots[:m]
            req.slots = list(best)
            req.computed = len(best)
            self.req_to_token[req.row, : len(best)] = best
            self.running.append(req)

    def batch(self):
        """This step's batch (host arrays) and the rows / extends it covers."""
        rpi, prefix, extend = [], [], []
        ids, pos, loc = [], [], []
        budget = NUM_TOKENS
        plan = []
        for req in self.running:
            n = min(len(req.tokens) - req.computed, CHUNK, budget)
            if n <= 0:
                continue
            budget -= n
            for p in range(req.computed, req.computed + n):
                if p >= len(req.slots):
                    req.slots.append(self.alloc())
                self.req_to_token[req.row, p] = req.slots[p]
                ids.append(req.tokens[p])
                pos.append(p)
                loc.append(req.slots[p])
            rpi.append(req.row)
            prefix.append(req.computed)
            extend.append(n)
            plan.append((req, n))
        pad_rows = BS - len(rpi)
        rpi += [0] * pad_rows
        prefix += [0] * pad_rows
        extend += [0] * pad_rows
        pad = NUM_TOKENS - len(ids)
        ids += [0] * pad
        pos += [0] * pad
        loc += [0] * pad
        return dict(rpi=rpi, prefix=prefix, extend=extend, ids=ids, pos=pos, loc=loc), plan

    def finish_step(self, plan):
        for req, n in plan:
            req.computed += n
            if req.computed == len(req.tokens):  # sampled a new token
                t = req.tokens
                req.tokens.append((t[-1] * 13 + t[-2] * 7 + len(t)) % 1000 + 1)
        for req in list(self.running):
            if req.done:
                self.running.remove(req)
                self.finished.append(req)
                self.req_to_token[req.row] = 0
                self.free_rows.append(req.row)
        self.step_no += 1

    def token_pool_inputs(self):
        """Every batch row's full token list (origin + output) for scatter_req_token_ids."""
        flat, offsets, rows = [], [0], []
        for req in self.running:
            flat += req.tokens
            offsets.append(len(flat))
            rows.append(req.row)
        while len(rows) < BS:
            offsets.append(len(flat))
            rows.append(0)
        flat += [0] * (MAX_SEQ * BS - len(flat))
        valid = {req.row: len(req.tokens) for req in self.running}
        return flat, offsets, rows, valid

    def radix_tree(self):
        """A radix tree of the finished sequences (slots with KV), shared prefixes as shared nodes."""
        root = RadixNode(value=[], children={})

        def insert(node, toks, slots):
            while toks:
                child = node.children.get(toks[0])
                if child is None:
                    node.children[toks[0]] = RadixNode(value=list(slots), children={})
                    node.children[toks[0]].tokens = list(toks)
                    return
                m = 0
                while m < min(len(child.tokens), len(toks)) and child.tokens[m] == toks[m]:
                    m += 1
                if m < len(child.tokens):  # split the child
                    tail = RadixNode(value=child.value[m:], children=child.children)
                    tail.tokens = child.tokens[m:]
                    child.value, child.tokens = child.value[:m], child.tokens[:m]
                    child.children = {tail.tokens[0]: tail}
                node, toks, slots = child, toks[m:], slots[m:]

        for req in self.finished:
            insert(root, req.tokens[: req.computed], req.slots[: req.computed])
        return root


def new_state():
    full = CanaryBufferGroup.allocate(kind=PoolKind.FULL, num_slots=NUM_SLOTS, has_v_half=False)
    swa = CanaryBufferGroup.allocate(
        kind=PoolKind.SWA, num_slots=NUM_SLOTS, has_v_half=False, swa_index_lut=LUT, swa_window_size=SWA_WINDOW
    )
    kv = (jnp.zeros((NUM_SLOTS // PAGE, PAGE * KV_BYTES), jnp.uint8), jnp.zeros((NUM_SLOTS, KV_BYTES), jnp.uint8))
    state = CanaryState.create([full, swa], ring_capacity=RING)
    return state, kv


def copied(tree):
    """A copy of every array (eager step calls donate the canary buffers and the KV state)."""
    return jax.tree_util.tree_map(jnp.array, tree)


def make_batch(sim, token_pool, *, mutate=None):
    h, plan = sim.batch()
    flat, offsets, rows, valid = sim.token_pool_inputs()
    token_pool = scatter_req_token_ids(
        flat_in=np.asarray(flat, np.int64),
        offsets=np.asarray(offsets, np.int64),
        req_pool_indices=np.asarray(rows, np.int64),
        pool_out=token_pool,
    )
    h["exp_ids"], h["exp_pos"] = list(h["ids"]), list(h["pos"])
    h["r2t"] = sim.req_to_token.copy()
    h["pool"] = np.array(token_pool)
    if mutate is not None:
        mutate(h)
    i32 = lambda x: jnp.asarray(np.asarray(x, np.int32))  # noqa: E731
    batch = CanaryBatch(
        req_pool_indices=i32(h["rpi"]),
        prefix_lens=i32(h["prefix"]),
        extend_seq_lens=i32(h["extend"]),
        input_ids=i32(h["ids"]),
        positions=i32(h["pos"]),
        out_cache_loc=i32(h["loc"]),
        req_to_token=i32(h["r2t"]),
        expected_inputs=ExpectedInputs(tokens=i32(h["exp_ids"]), positions=i32(h["exp_pos"])),
        req_to_verify_expected_tokens=i32(h["pool"]),
        req_to_verify_expected_tokens_valid_lens=i32([valid.get(r, 0) for r in h["rpi"]]),
    )
    return batch, plan, token_pool


def run_steps(n, state=None, kv=None, sim=None, token_pool=None):
    if state is None:
        state, kv = new_state()
        sim = Sim()
        token_pool = jnp.zeros((MAX_REQS, MAX_SEQ), jnp.int32)
    summaries = []
    for _ in range(n):
        sim.admit()
        batch, plan, token_pool = make_batch(sim, token_pool)
        state, kv, summary = canary_step(state, batch, kv_write_fn, kv, config=CONFIG)
        summaries.append(jax.tree_util.tree_map(np.asarray, summary))
        sim.finish_step(plan)
    return state, kv, sim, token_pool, summaries


def records(state):
    return decode.decode_violations(state.log)


class MultiStepTest(absltest.TestCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        TRACES.clear()
        cls.clean = run_steps(20)
        cls.traces_after_clean = len(TRACES)

    def fresh(self):
        state, kv, sim, pool, _ = self.clean
        return copied(state), copied(kv), copy.deepcopy(sim), pool

    def test_twenty_steps_are_violation_free_and_compile_once(self):
        state, kv, sim, _, summaries = self.clean
        self.assertEqual(self.traces_after_clean, 1)  # one trace of kv_write_fn = one compile of canary_step
        self.assertEqual(state.log.num_violations(), 0, "\n".join(decode.format_violations(state.log)))
        for s in summaries:
            np.testing.assert_array_equal(s.verify_enable, [1, 1])
            self.assertEqual(int(s.new_violations), 0)
        # The workload did exercise sharing, chunked prefill, decode and finishing.
        self.assertGreaterEqual(len(sim.finished), 4)
        self.assertTrue(any(s.verify_num_valid[0] > 0 for s in summaries))
        slot_runs, kernel_runs = state.log.counters()
        for tag in (T.HEAD_K_FULL, T.TAIL_K_FULL, T.HEAD_K_SWA, T.TAIL_K_SWA):
            self.assertEqual(kernel_runs[tag], 40)  # 20 steps x (verify + write)
            self.assertGreater(slot_runs[tag], 0)
        for tag in (T.HEAD_V_FULL, T.SWEEP_K_FULL, T.SWEEP_K_SWA):
            self.assertEqual(kernel_runs[tag], 0)
        # SWA verifies at most W entries per request: fewer than FULL.
        self.assertLess(slot_runs[T.HEAD_K_SWA], slot_runs[T.HEAD_K_FULL])
        # Host-side runtime: stats line, health check and a clean pump.
        stats = canary_stats(state.log, step=20, active_tags=active_tags(state))
        self.assertEqual(stats.violations, 0)
        self.assertEqual(stats.protected_tokens, int(slot_runs.sum()))
        self.assertRegex(
            stats.line(),
            r"^\[canary\] step=20 protected_tokens=\d+ sweep_passes=0 violations=0 "
            r"launch_tags_active=4/12$",
        )
        HealthChecker(active_tags(state), warmup_steps=0, every_n_steps=1).check(state.log, step=20)
        self.assertEqual(ViolationMonitor(ViolationReporter("raise"), delayed=False).step(state.log, step=20), [])

    def test_sweep_of_the_prefix_cache_is_clean(self):
        state, kv, sim, _ = self.fresh()
        plans = self.sweep_plans(sim)
        self.assertGreater(int(plans[0].verify_num_valid[0]), 20)
        state = canary_sweep(state, plans, config=CONFIG, real_kv_sources=sources(kv))
        self.assertEqual(state.log.num_violations(), 0, "\n".join(decode.format_violations(state.log)))
        self.assertEqual(state.log.kernel_run_counter(T.SWEEP_K_FULL), 1)
        self.assertEqual(state.log.kernel_run_counter(T.SWEEP_K_SWA), 1)

    def test_head_tail_split_matches_canary_step(self):
        state, kv, sim, pool = self.fresh()
        sim.admit()
        batch, _, _ = make_batch(sim, pool)
        s1, kv1, sum1 = canary_step(copied(state), batch, kv_write_fn, copied(kv), config=CONFIG)
        s2, plans = canary_head(state, batch, config=CONFIG)
        kv2, srcs = kv_write_fn(kv, batch)
        s2, sum2 = canary_tail(s2, plans, batch, config=CONFIG, real_kv_sources=srcs)
        for a, b in zip(jax.tree_util.tree_leaves((s1, sum1)), jax.tree_util.tree_leaves((s2, sum2))):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    # --- faults ---------------------------------------------------------------------------------------------
    def sweep_plans(self, sim):
        root = sim.radix_tree()
        return (
            build_sweep_plan_from_radix(root, verify_capacity=SWEEP_CAPACITY),
            build_sweep_plan_from_radix(root, verify_capacity=SWEEP_CAPACITY, full_to_swa_index_mapping=LUT),
        )

    def step_with(self, mutate=None, *, before=None, fresh=None):
        state, kv, sim, pool = fresh if fresh is not None else self.fresh()
        if before is not None:
            state, kv = before(state, kv, sim)
        sim.admit()
        batch, _, _ = make_batch(sim, pool, mutate=mutate)
        state, kv, summary = canary_step(state, batch, kv_write_fn, kv, config=CONFIG)
        self.assertGreater(int(summary.new_violations), 0)
        return state, sim

    def decode_row(self, sim):
        """A running request in decode with a prefix of at least 4 tokens."""
        for req in sim.running:
            if req.computed >= 4 and req.computed == len(req.tokens) - 1:
                return req
        raise AssertionError("no decoding request")

    def assert_reported(self, state, tag, reason, slot=None):
        recs = records(state)
        hits = [r for r in recs if r.tag == tag.name and reason in r.reasons and (slot is None or r.slot_idx == slot)]
        self.assertTrue(hits, f"no {tag.name} {reason} row in:\n" + "\n".join(decode.format_violations(state.log)))
        with self.assertRaisesRegex(RuntimeError, rf"launch_tag={tag.name} fail_reason=[a-z_+]*{reason}"):
            ViolationMonitor(ViolationReporter("raise"), delayed=False).step(state.log, step=21)
        return hits

    def test_fault_req_to_token_trample_caught_by_head(self):
        fresh = state, kv, sim, pool = self.fresh()
        req = self.decode_row(sim)
        other = next(r for r in sim.finished if r.row != req.row)
        wrong = other.slots[0]  # a real slot of another sequence (position 0, other token)

        def mutate(h):
            h["r2t"][req.row, 2] = wrong

        state, _ = self.step_with(mutate, fresh=fresh)
        hits = self.assert_reported(state, T.HEAD_K_FULL, "verify_position", slot=wrong)
        self.assertEqual(hits[0].position, 0)  # stored position of the wrong slot
        # Position 3's chain check now hashes the wrong predecessor.
        self.assert_reported(state, T.HEAD_K_FULL, "verify_chain_hash", slot=req.slots[3])

    def test_fault_real_kv_of_used_slot_caught_by_tail(self):
        fresh = state, kv, sim, pool = self.fresh()
        req = self.decode_row(sim)
        slot = req.slots[1]

        def before(state, kv, sim):
            k_full, k_swa = kv
            k_full = k_full.at[slot // PAGE, (slot % PAGE) * KV_BYTES].set(
                k_full[slot // PAGE, (slot % PAGE) * KV_BYTES] ^ 0xFF
            )
            return state, (k_full, k_swa)

        state, _ = self.step_with(before=before, fresh=fresh)
        self.assert_reported(state, T.TAIL_K_FULL, "verify_real_kv_hash", slot=slot)
        self.assertFalse([r for r in records(state) if r.tag.startswith("HEAD")])  # HEAD has no real KV

    def test_fault_input_token_mismatch_caught_by_write_assert(self):
        def mutate(h):
            h["exp_ids"][0] += 1

        state, _ = self.step_with(mutate)
        hits = self.assert_reported(state, T.HEAD_K_FULL, "write_token")
        self.assertTrue(hits[0].is_write)
        self.assert_reported(state, T.TAIL_K_SWA, "write_token")

    def test_fault_position_bug_caught_by_chain_position_assert(self):
        fresh = state, kv, sim, pool = self.fresh()
        req = self.decode_row(sim)

        def mutate(h):
            i = h["loc"].index(req.slots[req.computed])
            h["pos"][i] += 1  # EAGLE-style off-by-one that the expected inputs share
            h["exp_pos"][i] += 1

        state, _ = self.step_with(mutate, fresh=fresh)
        hits = self.assert_reported(state, T.HEAD_K_FULL, "write_position")
        self.assertEqual(hits[0].position, req.computed + 1)
        self.assertEqual(hits[0].expected_aux, req.computed)  # running position + 1

    def test_fault_expected_token_pool_caught_by_verify_token(self):
        fresh = state, kv, sim, pool = self.fresh()
        req = self.decode_row(sim)

        def mutate(h):
            h["pool"][req.row, req.computed - 1] += 5

        state, _ = self.step_with(mutate, fresh=fresh)
        self.assert_reported(state, T.HEAD_K_FULL, "verify_token", slot=req.slots[req.computed - 1])
        self.assert_reported(state, T.TAIL_K_SWA, "verify_token", slot=int(LUT[req.slots[req.computed - 1]]))

    def test_fault_cached_slot_real_kv_caught_by_sweep(self):
        state, kv, sim, pool = self.fresh()
        running = {s for r in sim.running for s in r.slots}
        slot = next(s for r in sim.finished for s in r.slots[: r.computed] if s not in running)
        k_full, k_swa = kv
        k_full = k_full.at[slot // PAGE, (slot % PAGE) * KV_BYTES + 3].add(1)
        k_swa = k_swa.at[int(LUT[slot]), 0].add(1)
        kv = (k_full, k_swa)
        state = canary_sweep(state, self.sweep_plans(sim), config=CONFIG, real_kv_sources=sources(kv))
        self.assert_reported(state, T.SWEEP_K_FULL, "verify_real_kv_hash", slot=slot)
        self.assert_reported(state, T.SWEEP_K_SWA, "verify_real_kv_hash", slot=int(LUT[slot]))
        text = decode.format_violations(state.log)[0]
        self.assertIn("canary_kind:       sweep_k_full", text)

    def test_log_mode_keeps_running(self):
        def mutate(h):
            h["exp_ids"][0] += 1

        state, _ = self.step_with(mutate)
        monitor = ViolationMonitor(ViolationReporter("log"), delayed=True)
        self.assertEqual(monitor.step(state.log, step=21), [])  # first pump only stages the snapshot
        with self.assertLogs("canary_jax", level=logging.WARNING) as cm:
            msgs = monitor.step(state.log, step=22)
        self.assertLen(msgs, state.log.num_violations())
        self.assertIn("step_when_pumped=22", cm.output[0])
        self.assertEqual(monitor.step(state.log, step=23), [])  # nothing new


if __name__ == "__main__":
    absltest.main()
