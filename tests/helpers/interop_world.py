"""Shared fixtures for the interop tests: an SGLang-shaped torch canary state and random launches.

``World`` holds one canary buffer, a ``CanaryDeviceState`` (ring, write index, per-tag
counters as in SGLang) and real-KV source tensors on one device; ``clone()`` gives an identical independent
copy so a launcher and the reference re-implementation can run side by side and be compared byte for byte.
"""

from __future__ import annotations

import dataclasses
import random

import torch

from interop import sglang

MASK = (1 << 64) - 1


def s64(v: int) -> int:
    v &= MASK
    return v - (1 << 64) if v >> 63 else v


@dataclasses.dataclass
class World:
    buf: torch.Tensor
    state: sglang.CanaryDeviceState
    kv: list  # source tensors
    source_meta: list  # (page_size, nbpt, read_bytes)
    mode: int

    @classmethod
    def make(
        cls,
        rng: random.Random,
        *,
        num_slots: int = 61,
        stride: int = 32,
        ring: int = 6,
        sources: tuple = (),
        mode: int = 0,
        device="cpu",
    ) -> World:
        """sources: tuples (dtype, page_size, nbpt, read_bytes, extra_row_bytes)."""
        buf = torch.zeros(num_slots, stride, dtype=torch.uint8, device=device)
        state = sglang.CanaryDeviceState.allocate(ring_capacity=ring, device=device)
        kv, meta = [], []
        for dtype, page, nbpt, rb, extra in sources:
            rows = (num_slots + page - 1) // page
            row_bytes = page * nbpt + extra
            esize = torch.empty((), dtype=dtype).element_size()
            raw = torch.randint(
                0,
                256,
                (rows, row_bytes),
                dtype=torch.uint8,
                generator=torch.Generator().manual_seed(rng.randrange(1 << 30)),
            )
            kv.append(raw.view(dtype).reshape(rows, row_bytes // esize).to(device))
            meta.append((page, nbpt, rb))
        return cls(buf, state, kv, meta, mode)

    def clone(self) -> World:
        st = self.state
        state = sglang.CanaryDeviceState(
            violation_ring=st.violation_ring.clone(),
            violation_write_index=st.violation_write_index.clone(),
            slot_run_counters=st.slot_run_counters.clone(),
            kernel_run_counters=st.kernel_run_counters.clone(),
            enable_chain_position_assert=st.enable_chain_position_assert.clone(),
        )
        return World(self.buf.clone(), state, [t.clone() for t in self.kv], list(self.source_meta), self.mode)

    def sources(self) -> tuple:
        return tuple(
            sglang.RealKvSource(tensor=t, page_size=p, num_bytes_per_token=n, read_bytes=r)
            for t, (p, n, r) in zip(self.kv, self.source_meta)
        )

    def context(self, tag: int) -> sglang.VerifyOrWriteContext:
        return self.state.context(
            canary_buf=self.buf,
            kernel_kind=sglang.CanaryLaunchTag(tag),
            real_kv_sources=self.sources(),
            real_kv_hash_mode=sglang.RealKvHashMode(self.mode),
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        st = self.state
        return {
            "canary_buf": self.buf,
            "ring": st.violation_ring,
            "write_index": st.violation_write_index,
            "slot_run_counters": st.slot_run_counters,
            "kernel_run_counters": st.kernel_run_counters,
            **{f"kv{i}": t for i, t in enumerate(self.kv)},
        }


def assert_same_bytes(a: dict, b: dict, what: str = "") -> None:
    assert a.keys() == b.keys()
    for k in a:
        x = a[k].detach().cpu().contiguous().view(torch.uint8).reshape(-1)
        y = b[k].detach().cpu().contiguous().view(torch.uint8).reshape(-1)
        if not torch.equal(x, y):
            diff = (x != y).nonzero().reshape(-1)[:8].tolist()
            raise AssertionError(f"{what}: {k} differs at bytes {diff}")


def random_write_args(rng: random.Random, w: World, *, cw: int = 4, t: int = 12, device="cpu"):
    """A random WritePlan plus token arrays of fixed shapes (Cw, T): duplicates, skips, seeds anywhere."""
    n = w.buf.shape[0]
    plan = sglang.WritePlan.allocate(write_req_capacity=cw, device=device)
    bs = rng.randint(0, cw)
    counts = [rng.randint(0, 4) for _ in range(bs)]
    while sum(counts) > t:
        counts[rng.randrange(bs)] -= 1
        counts = [max(0, c) for c in counts]
    off = [0]
    for c in counts:
        off.append(off[-1] + c)
    off += [0] * (cw + 1 - len(off))
    seeds = [rng.choice([-1, rng.randrange(n), rng.randrange(1, n)]) for _ in range(cw)]
    plan.write_offsets.copy_(torch.tensor(off))
    plan.write_seed_slot_indices.copy_(torch.tensor(seeds))
    plan.write_num_valid_reqs.fill_(rng.choice([bs, bs, max(0, bs - 1)]))
    pool = [rng.randrange(1, n) for _ in range(4)]  # small pool -> duplicate slots
    loc = [rng.choice([rng.randrange(n), rng.choice(pool), -1, -7]) if rng.random() < 0.9 else 0 for _ in range(t)]
    ids = [rng.choice([rng.randrange(1000), s64(rng.getrandbits(64)), -1, 2**31]) for _ in range(t)]
    pos = []
    for r in range(bs):
        base = rng.randrange(0, 50)
        for j in range(counts[r]):
            pos.append(base + j if rng.random() < 0.8 else rng.randrange(100))
    pos += [rng.randrange(100) for _ in range(t - len(pos))]
    flag = rng.random() < 0.5
    kw = dict(
        input_ids=torch.tensor(ids, device=device),
        positions=torch.tensor(pos, device=device),
        out_cache_loc=torch.tensor(loc, device=device),
        enable_write_input_assert=flag,
        expected_input_tokens=None,
        expected_input_positions=None,
    )
    if flag:
        kw["expected_input_tokens"] = torch.tensor([v if rng.random() < 0.8 else v + 1 for v in ids], device=device)
        kw["expected_input_positions"] = torch.tensor([v if rng.random() < 0.8 else v - 1 for v in pos], device=device)
    return plan, kw


def random_verify_plan(rng: random.Random, w: World, *, cap: int = 10, device="cpu"):
    """A random VerifyPlan: stored/wrong positions, prev -1 / 0 / a slot / its real predecessor, tokens."""
    n = w.buf.shape[0]
    rows = w.buf.view(torch.int64)[:, :4].tolist()
    plan = sglang.VerifyPlan.allocate(verify_capacity=cap, device=device)
    slots, toks, poss, prevs = [], [], [], []
    for _ in range(cap):
        s = rng.randrange(n) if rng.random() < 0.9 else 0
        tok, pos = rows[s][0], rows[s][1]
        slots.append(s)
        poss.append(pos if rng.random() < 0.8 else pos + 1)
        toks.append(rng.choice([-1, tok, tok, tok + 3]))
        prevs.append(rng.choice([-1, 0, rng.randrange(n), max(0, s - 1)]))
    plan.verify_slot_indices.copy_(torch.tensor(slots))
    plan.verify_expected_tokens.copy_(torch.tensor(toks))
    plan.verify_expected_positions.copy_(torch.tensor(poss))
    plan.verify_prev_slot_indices.copy_(torch.tensor(prevs))
    plan.verify_num_valid.fill_(rng.choice([cap, rng.randrange(cap + 1), cap + 3]))
    plan.enable.fill_(1 if rng.random() < 0.85 else 0)
    return plan
