"""The donated loop state of every mode (one shared KV pool, the canary states, sampled tokens, the last step
summary) and the fault check on it: a flipped bit in layer 0's K between steps must show as a real-KV hash
violation in PARTIAL and ALL."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import canary_jax as cj
from benchmarks.serving_step.timing import wall
from canary_jax.contract.constants import FailReason


class Carry:
    """The donated loop state of every mode: one shared KV pool, a canary state, sampled tokens and the last
    step summary per mode. A call hands the pool from mode to mode (the modes write the same slots)."""

    def __init__(self, kv, states, toks, summ):
        self.kv, self.states, self.toks, self.summ = kv, states, toks, summ

    def of(self, x):
        return (self.kv, self.states.get(x), self.toks[x], self.summ[x])

    def call(self, fn, x, consts) -> float:
        dt, out = wall(fn, self.of(x), consts)
        self.kv, st, self.toks[x], self.summ[x] = out
        if st is not None:
            self.states[x] = st
        return dt

    def flip(self, row, col) -> None:
        ks = list(self.kv[0])
        ks[0] = _flip(ks[0], row, col)
        self.kv = (tuple(ks), self.kv[1])


@functools.partial(jax.jit, donate_argnums=(0,))
def _flip(arr, row, col):
    x = jax.lax.bitcast_convert_type(arr[row, col], jnp.uint16) ^ jnp.uint16(1)
    return arr.at[row, col].set(jax.lax.bitcast_convert_type(x, jnp.bfloat16))


def fault_check(cs: Carry, run, consts, pop, ps, m) -> dict:
    """Per canary mode: flips bit 0 of the first K element (byte 0, hashed by PARTIAL and ALL) of request 1's
    position-1 slot in layer 0, runs one call, decodes the new violations, flips the bit back."""
    out = {}
    slot = int(pop["r2t"][1, 1])
    row, col = slot // ps, (slot % ps) * m.kv_dim
    for x in cs.states:
        if x not in run:
            continue
        before = int(cs.states[x].log.write_index[0])
        cs.flip(row, col)
        cs.call(run[x], x, consts)
        cs.flip(row, col)
        after = int(cs.states[x].log.write_index[0])
        recs = cj.decode_violations(cs.states[x].log, start=before)
        real_kv = [r for r in recs if r.fail_reason_bits & int(FailReason.VERIFY_REAL_KV_HASH_MISMATCH)]
        out[x] = {
            "slot": slot,
            "new_violations": after - before,
            "real_kv_hash_rows": len(real_kv),
            "detected": bool(real_kv),
            "expected": x != "none",
            "tags": sorted({r.tag for r in recs}),
        }
    return out
