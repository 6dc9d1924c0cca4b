"""Fixed verify / write scenarios for the x64-mode test (``tests/test_x64_modes.py``).

Scenarios are plain data built from seeds with Python's ``random`` (no jax at import time), so the test
process can run them through the oracle while subprocesses run them through ``canary_jax`` with
``JAX_ENABLE_X64`` on and off:

    python tests/x64_scenarios.py OUT.npz [--int64-inputs]

writes, per scenario ``i``, ``{i}_buf`` (canary bytes), ``{i}_ring`` (int64[R, 8]), ``{i}_wi``,
``{i}_slot``, ``{i}_kernel`` (int64 counters) and ``{i}_trace`` (write_index after every launch).
``--int64-inputs`` (x64 on only) passes token arrays and real-KV tensors as JAX int64 arrays instead of numpy.
"""

from __future__ import annotations

import random
import sys

import numpy as np

NUM_SLOTS = 64
STRIDE = 32
VCAP = 32
WCAP = 4
NTOK = 32
RING = 8
TAIL_K_FULL = 2

ANCHOR_HASH = 0xDE7FAE23A9A1B716


def _source_bytes(seed: int, rows: int, width: int) -> np.ndarray:
    return np.frombuffer(random.Random(seed).randbytes(rows * width), np.uint8).reshape(rows, width).copy()


def _fuzz_ops(rnd: random.Random, launches: int, flags: bool | None = None) -> list[dict]:
    """Random pipeline; ``flags`` fixes both the write input assert and the verify token check (fewer
    compiled variants), ``None`` draws them per launch."""
    ops = []
    n = NUM_SLOTS
    free = list(range(1, n))
    rnd.shuffle(free)
    chains = [dict(slots=[], toks=[]) for _ in range(rnd.randint(1, WCAP))]
    for _ in range(launches):
        offsets, seeds, ids, pos, loc, etok, epos = [0], [], [], [], [], [], []
        for ch in chains:
            k = min(rnd.choice([0, 1, 2, 5]), len(free), NTOK - len(ids))
            seeds.append(ch["slots"][-1] if ch["slots"] and rnd.random() < 0.9 else rnd.choice([-1, n + 1, 3]))
            for _j in range(k):
                slot = free.pop() if rnd.random() > 0.1 else rnd.choice([-1, 0, n])
                t = rnd.choice([rnd.randrange(1 << 20), -1, 2**31, 2**40 + 3, -(2**63)])
                p = len(ch["slots"]) + rnd.choice([0] * 6 + [1])
                ids.append(t)
                pos.append(p)
                loc.append(slot)
                etok.append(t if rnd.random() < 0.8 else t ^ 1)
                epos.append(p if rnd.random() < 0.8 else p + 2)
                if 0 <= slot < n:
                    ch["slots"].append(slot)
                    ch["toks"].append(t)
            offsets.append(len(ids))
        pad = NTOK - len(ids)
        ids += [5] * pad
        pos += [5] * pad
        loc += [1] * pad
        etok += [0] * pad
        epos += [0] * pad
        offsets += [0] * (WCAP + 1 - len(offsets))
        seeds += [-1] * (WCAP - len(seeds))
        ops.append(
            dict(
                kind="write",
                offsets=offsets,
                seeds=seeds,
                nvr=len(chains),
                ids=ids,
                pos=pos,
                loc=loc,
                input_assert=rnd.random() < 0.5 if flags is None else flags,
                etok=etok,
                epos=epos,
                tag=TAIL_K_FULL,
            )
        )
        if rnd.random() < 0.5:
            ops.append(dict(kind="poke", slot=rnd.randrange(1, n), field=rnd.randrange(4), bit=rnd.randrange(64)))
        ents = []
        for ch in chains:
            for k, slot in enumerate(ch["slots"]):
                prev = 0 if rnd.random() < 0.15 else (ch["slots"][k - 1] if k else -1)
                r = rnd.random()
                tokv = -1 if r < 0.3 else (ch["toks"][k] if r < 0.85 else ch["toks"][k] + 1)
                ents.append((slot, k if rnd.random() < 0.95 else k + 1, prev, tokv))
        rnd.shuffle(ents)
        ents = ents[:VCAP]
        nv = len(ents)
        ents += [(rnd.randrange(n), 1, 0, 2)] * (VCAP - len(ents))
        ops.append(
            dict(
                kind="verify",
                slots=[e[0] for e in ents],
                positions=[e[1] for e in ents],
                prevs=[e[2] for e in ents],
                tokens=[e[3] for e in ents],
                num_valid=nv,
                enable=int(rnd.random() < 0.9),
                check=rnd.random() < 0.5 if flags is None else flags,
                tag=TAIL_K_FULL,
            )
        )
    return ops


def scenarios() -> list[dict]:
    """The fixed scenario list (deterministic)."""
    out = []
    # 1. SPEC 2.6 five-step chain, resumed, then verified; plus boundary tokens / positions.
    chain = [101, 202, 303, 404, 505]
    ids = chain + [0, 1, 0xFFFFFFFF, -1, 2**31, 2**31 - 1, 2**63 - 1] + [0] * (NTOK - 12)
    pos = list(range(5)) + [0, 1, 2**31 - 1, 2**31, 2**32, 2**62, 2**63 - 1] + [0] * (NTOK - 12)
    loc = [3, 4, 5, 6, 7] + list(range(20, 27)) + [-1] * (NTOK - 12)
    out.append(
        dict(
            mode=0,
            sources=[],
            ops=[
                dict(
                    kind="write",
                    offsets=[0, 5, 12, 12, 12],
                    seeds=[-1, -1, -1, -1],
                    nvr=2,
                    ids=ids,
                    pos=pos,
                    loc=loc,
                    input_assert=False,
                    etok=ids,
                    epos=pos,
                    tag=TAIL_K_FULL,
                ),
                dict(
                    kind="verify",
                    slots=[3, 4, 5, 6, 7, 20, 21] + [0] * (VCAP - 7),
                    positions=[0, 1, 2, 3, 9, 0, 1] + [0] * (VCAP - 7),
                    prevs=[-1, 3, 4, 5, 6, -1, 20] + [0] * (VCAP - 7),
                    tokens=[101, 202, 300, -1, 505, 0, 1] + [-1] * (VCAP - 7),
                    num_valid=7,
                    enable=1,
                    check=True,
                    tag=2,
                ),
            ],
        )
    )
    # 2..: seeded fuzz pipelines, without and with real-KV sources.
    for seed in range(4):
        out.append(dict(mode=0, sources=[], ops=_fuzz_ops(random.Random(seed), 5)))
    srcs = [
        dict(seed=11, rows=NUM_SLOTS // 4, width=4 * 32 + 16, page=4, nbpt=32, read=32),
        dict(seed=12, rows=NUM_SLOTS, width=16, page=1, nbpt=16, read=16),
    ]
    out.append(dict(mode=2, sources=srcs, ops=_fuzz_ops(random.Random(50), 5, flags=True)))
    return out


def source_arrays(sc: dict) -> list[np.ndarray]:
    return [_source_bytes(s["seed"], s["rows"], s["width"]) for s in sc["sources"]]


# --- oracle side ---------------------------------------------------------------------------------------------
def run_oracle(sc: dict) -> dict:
    from helpers import oracle

    st = oracle.State.fresh(NUM_SLOTS, STRIDE, RING)
    osrcs = [
        oracle.Source.of(a, s["page"], s["nbpt"], s["read"])
        for a, s in zip(source_arrays(sc), sc["sources"], strict=True)
    ]
    trace = []
    for op in sc["ops"]:
        if op["kind"] == "poke":
            rec = list(oracle.read_record(st.buf, op["slot"]))
            rec[op["field"]] ^= 1 << op["bit"]
            oracle.write_record(st.buf, op["slot"], rec)
            continue
        if op["kind"] == "write":
            oracle.write(
                st,
                tag=op["tag"],
                offsets=op["offsets"],
                seeds=op["seeds"],
                input_ids=op["ids"],
                positions=op["pos"],
                out_cache_loc=op["loc"],
                num_valid_reqs=op["nvr"],
                input_assert=op["input_assert"],
                expected_tokens=op["etok"],
                expected_positions=op["epos"],
                sources=osrcs,
                mode=sc["mode"],
            )
        else:
            oracle.verify(
                st,
                tag=op["tag"],
                slots=op["slots"],
                positions=op["positions"],
                prev_slots=op["prevs"],
                expected_tokens=op["tokens"],
                num_valid=op["num_valid"],
                enable=op["enable"],
                check_token=op["check"],
                sources=osrcs,
                mode=sc["mode"],
            )
        trace.append(st.write_index)
    return dict(
        buf=st.buf,
        ring=st.ring,
        wi=np.array([st.write_index]),
        slot=st.slot_counters,
        kernel=st.kernel_counters,
        trace=np.array(trace, np.int64),
    )


# --- canary_jax side -----------------------------------------------------------------------------------------
def run_jax(sc: dict, *, int64_inputs: bool = False) -> dict:
    import jax
    import jax.numpy as jnp

    import canary_jax

    def pairs(v):
        arr = np.array([x & (2**64 - 1) for x in v], np.uint64).astype("<u8")
        return jnp.asarray(arr.view("<u4").reshape(-1, 2).copy())

    def arr64(v):
        a = np.array(v, np.int64)
        return jnp.asarray(a, jnp.int64) if int64_inputs else a

    srcs = []
    for a, s in zip(source_arrays(sc), sc["sources"], strict=True):
        t = jnp.asarray(a.view(np.int64), jnp.int64) if int64_inputs else jnp.asarray(a)
        srcs.append(
            canary_jax.RealKvSource(tensor=t, page_size=s["page"], num_bytes_per_token=s["nbpt"], read_bytes=s["read"])
        )
    ctx = canary_jax.VerifyOrWriteContext(
        canary_buf=canary_jax.allocate_canary_buffer(NUM_SLOTS, STRIDE),
        kernel_kind=TAIL_K_FULL,
        log=canary_jax.ViolationLog.allocate(ring_capacity=RING),
        real_kv_sources=tuple(srcs),
        real_kv_hash_mode=sc["mode"],
    )
    trace = []
    for op in sc["ops"]:
        if op["kind"] == "poke":
            buf = np.array(ctx.canary_buf)
            f = buf[op["slot"], :32].view("<u8").copy()
            f[op["field"]] ^= np.uint64(1 << op["bit"])
            buf[op["slot"], :32] = f.view(np.uint8)
            ctx = ctx.replace(canary_buf=jnp.asarray(buf))
            continue
        ctx = ctx.replace(kernel_kind=op["tag"])
        if op["kind"] == "write":
            plan = canary_jax.WritePlan(
                write_offsets=pairs(op["offsets"]),
                write_seed_slot_indices=pairs(op["seeds"]),
                write_num_valid_reqs=jnp.asarray(np.array([op["nvr"]], np.int32)),
            )
            kw = {}
            if op["input_assert"]:
                kw = dict(expected_input_tokens=arr64(op["etok"]), expected_input_positions=arr64(op["epos"]))
            ctx = canary_jax.write(
                ctx,
                plan,
                arr64(op["ids"]),
                arr64(op["pos"]),
                arr64(op["loc"]),
                enable_write_input_assert=op["input_assert"],
                backend="reference",
                **kw,
            )
        else:
            plan = canary_jax.VerifyPlan(
                verify_slot_indices=pairs(op["slots"]),
                verify_expected_tokens=pairs(op["tokens"]),
                verify_expected_positions=pairs(op["positions"]),
                verify_prev_slot_indices=pairs(op["prevs"]),
                verify_num_valid=jnp.asarray(np.array([op["num_valid"]], np.int32)),
                enable=jnp.asarray(np.array([op["enable"]], np.int32)),
            )
            ctx = canary_jax.verify(ctx, plan, check_verify_expected_token=op["check"], backend="reference")
        trace.append(int(np.asarray(ctx.log.write_index)[0]))

    def i64(x):
        a = np.ascontiguousarray(np.asarray(x), dtype="<u4")
        return a.view("<i8").reshape(a.shape[:-1])

    return dict(
        buf=np.asarray(ctx.canary_buf),
        ring=i64(ctx.log.ring),
        wi=np.asarray(ctx.log.write_index),
        slot=i64(ctx.log.slot_run_counters),
        kernel=i64(ctx.log.kernel_run_counters),
        trace=np.array(trace, np.int64),
        x64=np.array([bool(jax.config.read("jax_enable_x64"))]),
    )


def main(argv: list[str]) -> int:
    out_path = argv[1]
    int64_inputs = "--int64-inputs" in argv
    dump = {}
    for i, sc in enumerate(scenarios()):
        for k, v in run_jax(sc).items():
            dump[f"{i}_{k}"] = v
        if int64_inputs:
            for k, v in run_jax(sc, int64_inputs=True).items():
                dump[f"{i}_int64_{k}"] = v
    np.savez(out_path, **dump)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
