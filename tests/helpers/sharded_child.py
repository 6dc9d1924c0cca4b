"""Child process of ``tests/test_sharded.py`` and ``tests/test_multiprocess.py``: the sharded canary on forced
CPU devices (the parent keeps one device).

``python -m tests.helpers.sharded_child mesh OUT.npz [--x64]``: one process, 4 forced devices, a 2x2 (dp, tp)
mesh. Runs a small serving workload on the sharded canary (:mod:`canary_jax.runtime.sharded`) and the same
workload on the single-device canary once per shard (that shard's requests and heads), injects a KV flip into
shard (1, 0) and a canary token flip into shard (0, 1), and saves both runs' canary buffers, rings and counters,
the report, the stats, the consistency check and the compiled HLO's collectives for the parent to assert on.

``python -m tests.helpers.sharded_child multi OUT.npz PROCESS_ID PORT``: one of 2 processes
(``jax.distributed``, 2 forced CPU devices each, localhost coordinator, gloo collectives), a 2x2 global mesh with
dp row ``PROCESS_ID`` on this process; a KV flip into shard (1, 1) (process 1). Saves this process's report.

``python -m tests.helpers.sharded_child errors OUT.npz``: 4 forced devices; the programs' refusals (mis-sharded
pools, unsharded states and batches, bad live token counts), saved as ``{case: [error type, text] or None}``.
"""

from __future__ import annotations

import os
import sys

MODE = sys.argv[1]
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={2 if MODE == 'multi' else 4}"
)

import json  # noqa: E402
import re  # noqa: E402

import jax  # noqa: E402

if "--x64" in sys.argv:
    jax.config.update("jax_enable_x64", True)
if MODE == "multi":
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"localhost:{sys.argv[4]}",
        num_processes=2,
        process_id=int(sys.argv[3]),
        initialization_timeout=60,
    )

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import canary_jax as cj  # noqa: E402
from canary_jax.runtime import sharded  # noqa: E402
from canary_jax.runtime.groups import CanaryBufferGroup, PoolKind  # noqa: E402
from canary_jax.runtime.report import ViolationReporter  # noqa: E402
from canary_jax.runtime.state import CanaryBatch, CanaryState, CanaryStepConfig, active_tags  # noqa: E402
from canary_jax.runtime.step import canary_step, canary_sweep  # noqa: E402
from canary_jax.runtime.sweep import build_sweep_plan_from_requests  # noqa: E402

DP, TP = 2, 2
SLOTS, HEADS, DIM = 48, 4, 8  # bf16: 16 bytes per head, 32 bytes per head shard's slot row
HL = HEADS // TP
ROW_BYTES = HL * DIM * 2
MAX_REQS, MAX_LEN = 4, 16
CONFIG = CanaryStepConfig(
    verify_capacity=64, write_req_capacity=4, real_kv_hash_mode=cj.RealKvHashMode.ALL, backend="reference"
)
SWEEP_CAPACITY = 64
KV_SPECS = P("dp", None, "tp", None)  # pool [dp, slots, heads, dim]: requests over dp, heads over tp
PROMPTS = {0: {1: [101, 7, 42, 9, 13], 2: [5, 6, 7]}, 1: {1: [11, 12, 13, 14], 2: [900, 901, 902, 903, 904, 905]}}
DECODES = 3


def slot_of(row: int, pos: int) -> int:
    """Each dp shard's own slot space: request row r's position p lives in slot 1 + (r - 1) * 16 + p."""
    return 1 + (row - 1) * MAX_LEN + pos


def write_rows(kv3, b, head0):
    """The model's KV write on one head shard: ``kv3`` ``bf16[slots, HL, DIM]``, heads ``head0 ..``."""
    ids = b.input_ids[:, 0].astype(jnp.int32)
    pos = b.positions[:, 0].astype(jnp.int32)
    loc = b.out_cache_loc[:, 0].astype(jnp.int32)
    heads = head0 + jnp.arange(kv3.shape[1], dtype=jnp.int32)
    vals = (ids[:, None, None] * 3 + pos[:, None, None] * 5 + heads[None, :, None] * 7 + jnp.arange(DIM)) % 251
    return kv3.at[loc].set(vals.astype(jnp.bfloat16))


def source_of(kv3):
    src = cj.RealKvSource(
        tensor=kv3.reshape(kv3.shape[0], HL * DIM), page_size=1, num_bytes_per_token=ROW_BYTES, read_bytes=ROW_BYTES
    )
    return (((src,), ()),)


def sharded_sources(kv_local):
    return source_of(kv_local[0])


def sharded_write(kv_local, b):
    head0 = jax.lax.axis_index("tp") * HL
    kv3 = write_rows(kv_local[0], b, head0)
    return kv3[None], source_of(kv3)


def single_write(kv, b):
    pool, head0 = kv
    pool = write_rows(pool, b, head0[0])
    return (pool, head0), source_of(pool)


def single_sweep_sources(pool):
    return source_of(pool)


class Workload:
    """Each dp shard's requests, one step at a time (host-side bookkeeping)."""

    def __init__(self):
        self.tokens = {d: {r: list(p) for r, p in PROMPTS[d].items()} for d in range(DP)}
        self.written = {d: {r: 0 for r in PROMPTS[d]} for d in range(DP)}
        self.r2t = {d: np.zeros((MAX_REQS, MAX_LEN), np.int32) for d in range(DP)}

    def batch(self, d: int) -> CanaryBatch:
        rows, pre, ext, ids, pos, loc = [], [], [], [], [], []
        for r, toks in self.tokens[d].items():
            w = self.written[d][r]
            new = toks[w:]
            slots = [slot_of(r, p) for p in range(w, len(toks))]
            self.r2t[d][r, w : len(toks)] = slots
            rows.append(r), pre.append(w), ext.append(len(new))
            ids += new
            pos += list(range(w, len(toks)))
            loc += slots
        return CanaryBatch(
            req_pool_indices=np.array(rows, np.int64),
            prefix_lens=np.array(pre, np.int64),
            extend_seq_lens=np.array(ext, np.int64),
            input_ids=np.array(ids, np.int64),
            positions=np.array(pos, np.int64),
            out_cache_loc=np.array(loc, np.int64),
            req_to_token=self.r2t[d].copy(),
        )

    def advance(self, d: int) -> None:
        for r, toks in self.tokens[d].items():
            self.written[d][r] = len(toks)
            toks.append((toks[-1] * 31 + 7 + d) % 1000)

    def sweep_plan(self, d: int):
        rows = list(self.tokens[d])
        return build_sweep_plan_from_requests(
            req_to_token=self.r2t[d],
            req_pool_indices=np.array(rows, np.int64),
            seq_lens=np.array([self.written[d][r] for r in rows], np.int64),
            verify_capacity=SWEEP_CAPACITY,
        )


def fresh_state() -> CanaryState:
    group = CanaryBufferGroup.allocate(kind=PoolKind.FULL, num_slots=SLOTS, has_v_half=False)
    return CanaryState.create([group], ring_capacity=16)


COLLECTIVE = re.compile(r"=\s*(\S+)\s+(all-gather|all-reduce|collective-permute|all-to-all|reduce-scatter)[-\w]*\(")


def collectives(hlo: str) -> list[list]:
    """``[op, result_type]`` of every collective in compiled HLO text."""
    return [[m.group(2), m.group(1)] for m in COLLECTIVE.finditer(hlo)]


def flip_kv(pool, d, slot, head, sharding):
    """bf16 bit flip of pool[d, slot, head, 0] (the fault; host-side, between steps)."""
    host = np.asarray(jax.device_get(pool)).copy()
    u = host.view(np.uint16)
    u[d, slot, head, 0] ^= 0x0100
    return jax.device_put(host, sharding)


def run_mesh(out: str) -> None:
    lay = sharded.ShardLayout.create(dp=DP, tp=TP)
    canary = sharded.ShardedCanary(lay, CONFIG, kv_specs=KV_SPECS, sources_fn=sharded_sources)
    kv_sharding = NamedSharding(lay.mesh, KV_SPECS)
    state = lay.shard_state(fresh_state())
    pool = jax.device_put(jnp.zeros((DP, SLOTS, HEADS, DIM), jnp.bfloat16), kv_sharding)
    reporter = sharded.ShardedViolationReporter("log")
    monitor = sharded.ShardedViolationMonitor(reporter, delayed=True)
    wl = Workload()
    result: dict = {"messages": [], "records": []}
    # single-device runs, one per shard (its dp shard's requests, its heads)
    single = {(d, t): fresh_state() for d in range(DP) for t in range(TP)}
    spool = {(d, t): jnp.zeros((SLOTS, HL, DIM), jnp.bfloat16) for d in range(DP) for t in range(TP)}

    def pump(step):
        result["messages"] += monitor.step(state.log, step=step)
        result["records"] += [r.as_dict() for r in monitor.last_records]

    step = 0
    hlo_done = False
    for _ in range(1 + DECODES):
        batches = [wl.batch(d) for d in range(DP)]
        sb, n = lay.shard_batch(batches, CONFIG)
        if not hlo_done:
            hlo = jax.jit(lambda s, b, nn, kv: canary.step(s, b, nn, sharded_write, kv)).lower(state, sb, n, pool)
            result["hlo_step"] = collectives(hlo.compile().as_text())

            def head_tail(s, b, nn, kv):
                s, plans = canary.head(s, b, nn, plans=canary.plan(s, b))
                return canary.tail(s, plans, b, nn, kv)

            result["hlo_head_tail"] = collectives(jax.jit(head_tail).lower(state, sb, n, pool).compile().as_text())
            hlo_done = True
        state, pool, summary = canary.step(state, sb, n, sharded_write, pool)
        for (d, t), st in single.items():
            kv = (spool[(d, t)], jnp.array([t * HL], jnp.int32))
            st, kv, _ = canary_step(st, batches[d], single_write, kv, config=CONFIG)
            single[(d, t)], spool[(d, t)] = st, kv[0]
        for d in range(DP):
            wl.advance(d)
        pump(step)
        step += 1

    def sweep_all():
        nonlocal state
        plans = [wl.sweep_plan(d) for d in range(DP)]
        state = canary.sweep(state, (lay.shard_per_dp(plans),), pool)
        for (d, t), st in single.items():
            single[(d, t)] = canary_sweep(
                st, (plans[d],), config=CONFIG, real_kv_sources=single_sweep_sources(spool[(d, t)])
            )
        return plans

    plans = sweep_all()
    result["hlo_sweep"] = collectives(
        jax.jit(lambda s, p, kv: canary.sweep(s, (p,), kv))
        .lower(state, lay.shard_per_dp(plans), pool)
        .compile()
        .as_text()
    )
    result["hlo_consistency"] = collectives(jax.jit(canary.consistency).lower(state).compile().as_text())
    pump(step)
    step += 1
    result["consistency_clean"] = np.asarray(canary.consistency(state)).tolist()

    # fault 1: a KV bit flip in dp shard 1, head 1 (tp shard 0), slot of request 2 position 1
    kv_slot = slot_of(2, 1)
    pool = flip_kv(pool, 1, kv_slot, 1, kv_sharding)
    host = np.asarray(spool[(1, 0)]).copy()
    host.view(np.uint16)[kv_slot, 1, 0] ^= 0x0100
    spool[(1, 0)] = jnp.asarray(host)
    result["kv_fault"] = [1, 0, kv_slot]
    sweep_all()
    pump(step)
    step += 1

    # fault 2: a token flip in shard (0, 1)'s TAIL canary record of request 1 position 2 (bookkeeping on one
    # head shard only: the shard disagrees with its peer)
    tok_slot = slot_of(1, 2)
    k_tail = np.asarray(jax.device_get(state.groups[0].k_tail)).copy()
    k_tail[0, 1, tok_slot, 0] ^= 0x04
    state = state.replace(
        groups=(state.groups[0].with_buffers(k_tail=jax.device_put(k_tail, NamedSharding(lay.mesh, lay.state_spec))),)
    )
    st = single[(0, 1)]
    kt = np.asarray(st.groups[0].k_tail).copy()
    kt[tok_slot, 0] ^= 0x04
    single[(0, 1)] = st.replace(groups=(st.groups[0].with_buffers(k_tail=jnp.asarray(kt)),))
    result["token_fault"] = [0, 1, tok_slot]
    result["consistency_fault"] = np.asarray(canary.consistency(state)).tolist()
    result["disagreement"] = reporter.report_disagreement(canary.consistency(state), step=step)
    batches = [wl.batch(d) for d in range(DP)]
    sb, n = lay.shard_batch(batches, CONFIG)
    state, pool, summary = canary.step(state, sb, n, sharded_write, pool)
    for (d, t), st in single.items():
        kv = (spool[(d, t)], jnp.array([t * HL], jnp.int32))
        st, kv, _ = canary_step(st, batches[d], single_write, kv, config=CONFIG)
        single[(d, t)], spool[(d, t)] = st, kv[0]
    pump(step)
    step += 1
    result["messages"] += monitor.flush(state.log, step=step)
    result["records"] += [r.as_dict() for r in monitor.last_records]

    stats = sharded.sharded_stats(state.log, step=step, sweep_passes=2, active_tags=active_tags(state, sweep=True))
    result["stats_lines"] = stats.lines()
    result["single_messages"] = {
        f"{d},{t}": ViolationReporter("none").messages(st.log, step=0) for (d, t), st in single.items()
    }
    arrays = {}
    for name in ("k_head", "k_tail"):
        glob = np.asarray(jax.device_get(getattr(state.groups[0], name)))
        for (d, t), st in single.items():
            arrays[f"sharded_{name}_{d}{t}"] = glob[d, t]
            arrays[f"single_{name}_{d}{t}"] = np.asarray(getattr(st.groups[0], name))
    for field in ("ring", "write_index", "slot_run_counters", "kernel_run_counters"):
        glob = np.asarray(jax.device_get(getattr(state.log, field)))
        for (d, t), st in single.items():
            arrays[f"sharded_{field}_{d}{t}"] = glob[d, t]
            arrays[f"single_{field}_{d}{t}"] = np.asarray(getattr(st.log, field))
    gpool = np.asarray(jax.device_get(pool))
    for d, t in single:
        arrays[f"sharded_pool_{d}{t}"] = gpool[d, :, t * HL : (t + 1) * HL]
        arrays[f"single_pool_{d}{t}"] = np.asarray(spool[(d, t)])
    # the control: the single-device step under a plain jit on a head-sharded pool (no shard_map)
    lay1 = sharded.ShardLayout.create(dp=1, tp=4)
    hs = NamedSharding(lay1.mesh, P(None, "tp", None))
    pool4 = jax.device_put(jnp.zeros((SLOTS, HEADS, DIM), jnp.bfloat16), hs)
    b0 = Workload().batch(0)

    def plain(st, b, kv):
        def w(kv, b):
            kv = write_rows(kv, b, 0)
            src = cj.RealKvSource(
                tensor=kv.reshape(SLOTS, HEADS * DIM), page_size=1, num_bytes_per_token=HEADS * DIM * 2, read_bytes=32
            )
            return kv, (((src,), ()),)

        return canary_step(st, b, w, kv, config=CONFIG)

    result["hlo_plain_jit"] = collectives(jax.jit(plain).lower(fresh_state(), b0, pool4).compile().as_text())
    result["x64"] = bool(jax.config.jax_enable_x64)
    np.savez(out, json=np.array(json.dumps(result)), **arrays)


def run_multi(out: str, pid: int) -> None:
    lay = sharded.ShardLayout.create(dp=DP, tp=TP)  # jax.devices(): process 0's two devices are dp row 0
    canary = sharded.ShardedCanary(lay, CONFIG, kv_specs=KV_SPECS, sources_fn=sharded_sources)
    kv_sharding = NamedSharding(lay.mesh, KV_SPECS)
    state = lay.shard_state(fresh_state())
    pool = jax.make_array_from_callback(
        (DP, SLOTS, HEADS, DIM), kv_sharding, lambda idx: np.zeros((1, SLOTS, HL, DIM), jnp.bfloat16)
    )
    reporter = sharded.ShardedViolationReporter("log")
    monitor = sharded.ShardedViolationMonitor(reporter, delayed=True)
    wl = Workload()
    msgs: list[str] = []
    records: list = []
    mine = [d for d in range(DP) if any(s[0] == d for s in lay.local_shards())]
    step = 0
    for _ in range(1 + DECODES):
        batches = [wl.batch(d) if d in mine else None for d in range(DP)]
        sb, n = lay.shard_batch(batches, CONFIG, num_tokens=16, num_rows=4)
        state, pool, _ = canary.step(state, sb, n, sharded_write, pool)
        for d in range(DP):
            wl.advance(d)
        msgs += monitor.step(state.log, step=step)
        step += 1
    kv_slot = slot_of(1, 3)
    if pid == 1:  # the fault: a KV bit flip in shard (1, 1)'s heads, made by the process that holds it
        blocks = []
        for s in pool.addressable_shards:
            host = np.asarray(s.data).copy()
            if (s.index[0].start, s.index[2].start) == (1, HL):
                host.view(np.uint16)[0, kv_slot, 0, 3] ^= 0x0001
            blocks.append(jax.device_put(host, s.device))
        pool = jax.make_array_from_single_device_arrays(pool.shape, kv_sharding, blocks)
    else:
        blocks = [s.data for s in pool.addressable_shards]
        pool = jax.make_array_from_single_device_arrays(pool.shape, kv_sharding, blocks)
    plans = [wl.sweep_plan(d) if d in mine else None for d in range(DP)]
    state = canary.sweep(state, (lay.shard_per_dp(plans),), pool)
    msgs += monitor.step(state.log, step=step)
    records += [r.as_dict() for r in monitor.last_records]
    msgs += monitor.flush(state.log, step=step + 1)
    records += [r.as_dict() for r in monitor.last_records]
    stats = sharded.sharded_stats(state.log, step=step, all_processes=True)
    result = {
        "pid": pid,
        "local_shards": [list(s) for s in lay.local_shards()],
        "messages": msgs,
        "records": records,
        "total_line": stats.lines()[-1],
        "kv_fault": [1, 1, kv_slot],
    }
    np.savez(out, json=np.array(json.dumps(result)))
    jax.distributed.shutdown()


def run_errors(out: str) -> None:
    """Refusals before any shard_map error (issue #14): mis-sharded pools, unsharded or foreign states and
    batches, bad live token counts, None for a held dp shard, no KV in a hashing mode."""
    lay = sharded.ShardLayout.create(dp=DP, tp=TP)
    canary = sharded.ShardedCanary(lay, CONFIG, kv_specs=KV_SPECS, sources_fn=sharded_sources)
    wl = Workload()
    batches = [wl.batch(d) for d in range(DP)]
    sb, n = lay.shard_batch(batches, CONFIG)
    sweep = lay.shard_per_dp([wl.sweep_plan(d) for d in range(DP)])
    zeros = jnp.zeros((DP, SLOTS, HEADS, DIM), jnp.bfloat16)
    good = jax.device_put(zeros, NamedSharding(lay.mesh, KV_SPECS))
    result: dict = {}

    def refused(name, fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the parent asserts the type and text
            result[name] = [type(e).__name__, str(e)]
        else:
            result[name] = None

    state = lay.shard_state(fresh_state())
    state, plans = canary.head(state, sb, n)
    before = jax.tree_util.tree_map(lambda x: np.asarray(jax.device_get(x)), state)
    wrong = {
        "replicated": P(),
        "transposed": P("tp", None, "dp", None),
        "slots_over_tp": P("dp", "tp", None, None),
    }
    for name, spec in wrong.items():
        pool = jax.device_put(zeros, NamedSharding(lay.mesh, spec))
        refused(f"tail_{name}", lambda pool=pool: canary.tail(state, plans, sb, n, pool))
        refused(f"step_{name}", lambda pool=pool: canary.step(state, sb, n, sharded_write, pool))
        refused(f"sweep_{name}", lambda pool=pool: canary.sweep(state, (sweep,), pool))
        result[f"pool_alive_{name}"] = not pool.is_deleted()
    refused("tail_tree", lambda: canary.tail(state, plans, sb, n, {"k": zeros}))
    after = jax.tree_util.tree_map(lambda x: np.asarray(jax.device_get(x)), state)
    result["state_unchanged"] = all(
        np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(before), jax.tree_util.tree_leaves(after))
    )
    # the correctly sharded pool still runs (tail, then step, then sweep)
    state, _ = canary.tail(state, plans, sb, n, good)
    state, good, _ = canary.step(state, sb, n, sharded_write, good)
    state = canary.sweep(state, (sweep,), good)
    result["good_ran"] = int(np.asarray(jax.device_get(state.log.kernel_run_counters)).sum()) > 0
    # state / batch / num_tokens refusals
    single = fresh_state()
    refused("head_unsharded_state", lambda: canary.head(single, sb, n))
    refused("plan_unsharded_state", lambda: canary.plan(single, sb))
    refused("consistency_unsharded_state", lambda: canary.consistency(single))
    lay41 = sharded.ShardLayout.create(dp=4, tp=1)
    c41 = sharded.ShardedCanary(lay41, CONFIG, kv_specs=KV_SPECS, sources_fn=sharded_sources)
    refused("head_other_layout", lambda: c41.head(lay.shard_state(fresh_state()), sb, n))
    refused("head_unsharded_batch", lambda: canary.head(lay.shard_state(fresh_state()), batches[0], n))
    refused("head_num_tokens_list", lambda: canary.head(lay.shard_state(fresh_state()), sb, [5, 3]))
    refused("head_num_tokens_len3", lambda: canary.head(lay.shard_state(fresh_state()), sb, jnp.zeros(3, jnp.int32)))
    refused("head_num_tokens_scalar", lambda: canary.head(lay.shard_state(fresh_state()), sb, jnp.int32(5)))
    refused("head_num_tokens_float", lambda: canary.head(lay.shard_state(fresh_state()), sb, jnp.zeros(2)))
    refused("shard_batch_none_held", lambda: lay.shard_batch([batches[0], None], CONFIG))
    refused("shard_per_dp_none_held", lambda: lay.shard_per_dp([wl.sweep_plan(0), None]))
    refused("sweep_kv_none", lambda: canary.sweep(lay.shard_state(fresh_state()), (sweep,), None))
    refused("sweep_unsharded_plan", lambda: canary.sweep(lay.shard_state(fresh_state()), (wl.sweep_plan(0),), good))
    s2 = lay.shard_state(fresh_state())
    s2, p2 = canary.head(s2, sb, n)
    refused("tail_kv_none", lambda: canary.tail(s2, p2, sb, n, None))
    np.savez(out, json=np.array(json.dumps(result)))


if __name__ == "__main__":
    if MODE == "mesh":
        run_mesh(sys.argv[2])
    elif MODE == "errors":
        run_errors(sys.argv[2])
    else:
        run_multi(sys.argv[2], int(sys.argv[3]))
