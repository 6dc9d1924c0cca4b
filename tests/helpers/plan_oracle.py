"""Independent Python-int oracle of SGLang's plan reference (SPEC 7), for tests only.

Written from SPEC section 7, not from ``canary_jax.planning.plan_builder``: plain loops over requests and positions
on Python ints. It never imports jax or canary_jax.

``strict=True`` behaves like SGLang's torch reference on bad indices (raises ``ValueError`` for an SWA slot
outside the LUT, ``IndexError`` for reads outside ``req_to_token`` or the expected-token pool).
``strict=False`` applies canary-jax's documented decisions instead:

* SWA slot ``x >= len(LUT)`` -> ``LUT[len - 1]`` (SGLang's kernels clamp);
* ``req_to_token`` read outside the table -> 0 (TOKEN_TO_KV_SLOT_PADDING), then translated;
* expected-token pool read outside the pool -> -1;
* seed column clamped to ``max_seq_len - 1`` (both modes, like the reference).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class PlanResult:
    """What the oracle produces; ``entries`` only when ``enable == 1``."""

    def __init__(self, *, num_valid, enable, slots, tokens, positions, prevs, write_offsets, seeds, num_valid_reqs):
        self.num_valid = num_valid
        self.enable = enable
        self.slots = slots
        self.tokens = tokens
        self.positions = positions
        self.prevs = prevs
        self.write_offsets = write_offsets
        self.seeds = seeds
        self.num_valid_reqs = num_valid_reqs


def _translate(x: int, lut: Sequence[int] | None, strict: bool) -> int:
    if lut is None or x < 0:
        return x
    n = len(lut)
    if x >= n:
        if strict:
            raise ValueError(f"kv-canary: SWA slot {x} is outside full_to_swa_index_mapping length {n}")
        x = n - 1
    return int(lut[x])


def _read(table: np.ndarray, row: int, col: int, fill: int, strict: bool) -> int:
    rows, cols = table.shape
    if 0 <= row < rows and 0 <= col < cols:
        return int(table[row, col])
    if strict:
        raise IndexError(f"read ({row}, {col}) outside table of shape {table.shape}")
    return fill


def plan_oracle(
    *,
    req_pool_indices: Sequence[int],
    prefix_lens: Sequence[int],
    extend_seq_lens: Sequence[int],
    req_to_token: np.ndarray,
    verify_capacity: int,
    write_req_capacity: int,
    swa_window_size: int = 0,
    lut: Sequence[int] | None = None,
    pool: np.ndarray | None = None,
    valid_lens: Sequence[int] | None = None,
    k: int = 0,
    strict: bool = False,
) -> PlanResult:
    rpis = [int(v) for v in req_pool_indices]
    prefixes = [int(v) for v in prefix_lens]
    extends = [int(v) for v in extend_seq_lens]
    bs = len(rpis)
    r2t = np.asarray(req_to_token)
    max_seq_len = r2t.shape[1]

    def window_start(r: int) -> int:
        return max(0, prefixes[r] - swa_window_size) if swa_window_size > 0 else 0

    # Count first: a huge prefix must overflow without materialising its entries.
    total = sum(max(0, prefixes[r] - window_start(r)) for r in range(bs) if rpis[r] != 0)
    slots, tokens, positions, prevs = [], [], [], []
    for r in range(bs if total <= verify_capacity else 0):
        rpi = rpis[r]
        if rpi == 0:
            continue
        big_p = prefixes[r]
        ws = window_start(r)
        for p in range(ws, big_p):
            slot = _translate(_read(r2t, rpi, p, 0, strict), lut, strict)
            if p == 0:
                prev = -1
            else:
                prev = _translate(_read(r2t, rpi, p - 1, 0, strict), lut, strict)
            tok = -1
            if pool is not None:
                sot = p + k
                if 0 <= sot < int(valid_lens[r]):
                    tok = _read(np.asarray(pool), rpi, sot, -1, strict)
            slots.append(slot)
            tokens.append(tok)
            positions.append(p)
            prevs.append(prev)
    if total > verify_capacity:
        enable, num_valid = 0, verify_capacity
        slots = tokens = positions = prevs = None
    else:
        enable, num_valid = 1, total

    offsets = [0]
    for r in range(bs):
        wlen = extends[r] if (rpis[r] != 0 and extends[r] > 0) else 0
        offsets.append(offsets[-1] + wlen)
    seeds = []
    for r in range(min(bs, write_req_capacity)):
        if rpis[r] == 0 or extends[r] <= 0 or prefixes[r] <= 0:
            seeds.append(-1)
            continue
        col = min(prefixes[r] - 1, max(max_seq_len - 1, 0))
        seeds.append(_translate(_read(r2t, rpis[r], col, 0, strict), lut, strict))
    return PlanResult(
        num_valid=num_valid,
        enable=enable,
        slots=slots,
        tokens=tokens,
        positions=positions,
        prevs=prevs,
        write_offsets=offsets,
        seeds=seeds,
        num_valid_reqs=bs,
    )


def scatter_oracle(
    *, flat_in: Sequence[int], offsets: Sequence[int], req_pool_indices: Sequence[int], pool_out: np.ndarray
) -> np.ndarray:
    """SPEC 7.4 with masked loads; rows outside the pool write nothing; later requests win."""
    pool = np.array(pool_out, dtype=np.int32, copy=True)
    rows, width = pool.shape
    n_tok = len(flat_in)
    cols = min(width, n_tok)
    for r in range(len(req_pool_indices)):
        start, end = int(offsets[r]), int(offsets[r + 1])
        n = min(end - start, cols)
        rp = int(req_pool_indices[r])
        if not 0 <= rp < rows:
            continue
        for c in range(max(0, n)):
            idx = start + c
            if 0 <= idx < n_tok:
                v = int(flat_in[idx]) & 0xFFFFFFFF
                pool[rp, c] = v - (1 << 32) if v >> 31 else v
    return pool
