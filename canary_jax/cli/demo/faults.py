"""Fault kinds the demo injects into a running engine, and what should catch each one.

Every fault models a real serving bug class (SGLang's perturbation hooks and the bugs its canary caught) and
is injected after scheduling, before the step's canary HEAD launch, so the step's plans, model forward and
canary launches all see it. ``expected(cfg)`` says whether the engine's canary configuration must detect it
(the CLI fails the run when an expected detection is missed) and, when not, why not.

=================  =============================================================  ===============================
kind               what is broken                                                 what catches it
=================  =============================================================  ===============================
kv_flip_lo         one bit in bytes [0, 16) of a used slot's layer-0 K            TAIL verify real_kv (PARTIAL, ALL)
kv_flip_hi         one bit in bytes [16, kv_bytes) of a used slot's layer-0 K     TAIL verify real_kv (ALL only)
r2t_remap          req_to_token entry of a running request -> another live slot   HEAD/TAIL verify position + chain
page_reuse         allocator frees a page a running request still reads; the      verify position / chain of the
                   page is handed to the next allocation and overwritten          reader (next step it runs)
pos_shift          one token is fed (to the model and canary) at position + 1     write position (input assert and
                                                                                  chain-position assert), then verify
                                                                                  position on the next step
token_swap         one token fed to the model differs from the request's history  write token (input assert), then
                                                                                  verify token (token oracle only)
canary_corrupt     one field (token / position / prev_hash) of a canary record    verify chain on the successor /
                   in the HEAD or TAIL buffer                                     position / chain on the slot
orphan_flip        one bit in bytes [0, 16) of a cached prefix slot that no       SWEEP verify real_kv
                   running request reads                                          (PARTIAL, ALL; sweep on)
=================  =============================================================  ===============================

The array edits are the public pure functions of :mod:`canary_jax.tools.faults` (``flip_kv_bits``,
``flip_canary_bits``, ``remap_req_to_token``, ``shift_position``, ``swap_token``); this module only picks the
demo engine's targets (it knows its scheduler, prefix cache and pools) and records what it broke. The base class,
the workload trace and the shared pickers are :mod:`canary_jax.cli.demo.fault_base` (re-exported here).
"""

from __future__ import annotations

from canary_jax.cli.demo.fault_base import (
    Expectation,
    Fault,
    _flip_canary_field,
    _flip_k_bit,
    _pick_verified_position,
    _verified_prefix_candidates,
)
from canary_jax.cli.demo.fault_base import WorkloadTrace as WorkloadTrace
from canary_jax.contract import constants
from canary_jax.tools import faults as faults_lib


# --- the kinds -------------------------------------------------------------------------------------------
class KvFlip(Fault):
    def __init__(self, kind: str, lo: int, hi: int | None):
        self.kind = kind
        self._lo, self._hi = lo, hi
        rng = f"[{lo}, {'kv_bytes' if hi is None else hi})"
        self.summary = f"one bit in bytes {rng} of a used slot's layer-0 K"
        self.caught_by = "TAIL verify real_kv (PARTIAL and ALL)" if hi == 16 else "TAIL verify real_kv (ALL only)"

    def expected(self, cfg) -> Expectation:
        mode = constants.RealKvHashMode(int(cfg.real_kv_hash_mode))
        if mode == constants.RealKvHashMode.NONE:
            return Expectation(False, "real-KV hashing is off (NONE)")
        if self._lo >= constants.PARTIAL_READ_BYTES and mode == constants.RealKvHashMode.PARTIAL:
            return Expectation(False, "PARTIAL hashes only the first 16 bytes of a slot")
        return Expectation(True)

    def not_applicable(self, model_cfg) -> str:
        if self._hi is None and model_cfg.kv_bytes_per_token <= self._lo:
            return (
                f"a slot's K row has only {model_cfg.kv_bytes_per_token} bytes (--kv-heads "
                f"{model_cfg.num_kv_heads} x --head-dim {model_cfg.head_dim} x 2), none beyond byte {self._lo}"
            )
        return ""

    def try_inject(self, engine, batch, rng, trial):
        picked = _pick_verified_position(batch, rng)
        if picked is None:
            return None
        row, p = picked
        slot = int(engine.scheduler.req_to_token[row.req.row, p])
        hi = engine.model_cfg.kv_bytes_per_token if self._hi is None else self._hi
        if hi <= self._lo:
            raise ValueError(f"{self.kind}: {self.not_applicable(engine.model_cfg)}")
        byte, bit = int(rng.integers(self._lo, hi)), int(rng.integers(8))
        _flip_k_bit(engine, slot, byte, bit)
        return dict(rid=row.req.rid, position=p, slot=slot, byte=byte, bit=bit)


class ReqToTokenRemap(Fault):
    kind = "r2t_remap"
    summary = "req_to_token entry of a running request remapped to another live slot"
    caught_by = "HEAD/TAIL verify position + chain"
    needs = "a request with a verified prefix and another live slot"

    def ready(self, sched, batch) -> bool:
        # Approximate (the exact candidates depend on the drawn position): another request has KV, or the
        # prefix cache holds slots.
        if not _verified_prefix_candidates(batch):
            return False
        return sum(1 for r in sched.running if r.kv_len > 0) > 1 or sched.tree.total_pages() > 0

    def try_inject(self, engine, batch, rng, trial):
        sched = engine.scheduler
        picked = _pick_verified_position(batch, rng)
        if picked is None:
            return None
        row, p = picked
        own = set(int(s) for s in sched.req_to_token[row.req.row, : row.start])
        others = []
        for req in sched.running:  # slots other running requests have written
            if req is row.req:
                continue
            for q in range(req.kv_len):
                s = int(sched.req_to_token[req.row, q])
                if q != p and s not in own:
                    others.append((s, q))
        if not others:  # else slots of cached prefixes (live records too)
            slots, positions, _ = sched.tree.sweep_entries()
            others = [(int(s), int(q)) for s, q in zip(slots, positions) if q != p and int(s) not in own]
        if not others:
            return None
        slot, q = others[rng.integers(len(others))]
        old = int(sched.req_to_token[row.req.row, p])
        sched.req_to_token = faults_lib.remap_req_to_token(sched.req_to_token, row=row.req.row, position=p, slot=slot)
        return dict(rid=row.req.rid, position=p, old_slot=old, new_slot=slot, new_slot_position=q)


class FreedPageReuse(Fault):
    kind = "page_reuse"
    summary = "a page still read by a running request goes back on the free list and is reallocated"
    caught_by = "verify position / chain of the reader"
    needs = "a request with >= 2 tokens left that owns a written page, then a later page allocation"

    @staticmethod
    def _candidates(sched, ps: int):
        best = None
        for req in sched.running:
            remaining = req.max_new_tokens - req.num_generated
            if remaining < 2:
                continue
            n_prompt = len(req.prompt)
            for i, (page, own) in enumerate(zip(req.pages, req.owned)):
                lo, hi = i * ps, (i + 1) * ps
                if not own or lo >= req.kv_len:
                    continue
                # Prefer a private, fully written page of generated text: a page of a shared prompt prefix
                # could be rewritten with identical records by a request with the same prefix (harmless and
                # undetectable by design).
                tier = 0 if (lo >= n_prompt and hi <= req.kv_len) else (1 if hi > n_prompt else 2)
                key = (tier, -remaining)
                if best is None or key < best[0]:
                    best = (key, [(req, i, page)])
                elif key == best[0]:
                    best[1].append((req, i, page))
        return [] if best is None else best[1]

    def ready(self, sched, batch) -> bool:
        return bool(self._candidates(sched, sched.cfg.page_size))

    def detectable_after(self, trace, step) -> bool:
        # The freed page must be handed out again (a later step allocates) and the reader verify it after.
        return any(step < s < trace.num_steps - 1 for s in trace.alloc_steps)

    def try_inject(self, engine, batch, rng, trial):
        sched = engine.scheduler
        ps = engine.cfg.page_size
        cands = self._candidates(sched, ps)
        if not cands:
            return None
        req, i, page = cands[rng.integers(len(cands))]
        sched.allocator.free_pages.appendleft(page)  # the bug: freed while still owned and read
        return dict(rid=req.rid, page=int(page), positions=[i * ps, min((i + 1) * ps, req.kv_len) - 1])


class PositionShift(Fault):
    kind = "pos_shift"
    summary = "one token fed at position + 1 (the EAGLE draft-position bug class)"
    caught_by = "write position (input + chain-position assert), verify position next step"

    def ready(self, sched, batch) -> bool:
        return any(r.start >= 1 for r in batch.rows)

    def try_inject(self, engine, batch, rng, trial):
        rows = [r for r in batch.rows if r.start >= 1]
        decodes = [r for r in rows if r.count == 1]
        rows = decodes or rows
        if not rows:
            return None
        row = rows[rng.integers(len(rows))]
        j = int(rng.integers(row.count))
        t = row.token_offset + j
        old = int(batch.positions[t])
        batch.positions = faults_lib.shift_position(batch.positions, index=t, delta=1)
        return dict(rid=row.req.rid, position=old, fed_position=old + 1)


class TokenSwap(Fault):
    kind = "token_swap"
    summary = "one token fed to the model differs from the request's token history"
    caught_by = "write token (input assert), verify token next step (token oracle)"
    needs = "a batch"

    def ready(self, sched, batch) -> bool:
        return bool(batch.rows)

    def expected(self, cfg) -> Expectation:
        if not cfg.token_oracle:
            return Expectation(False, "no token oracle (write-input / verify-token asserts off)")
        return Expectation(True)

    def try_inject(self, engine, batch, rng, trial):
        if not batch.rows:
            return None
        row = batch.rows[rng.integers(len(batch.rows))]
        j = int(rng.integers(row.count))
        t = row.token_offset + j
        old = int(batch.input_ids[t])
        others = [int(batch.input_ids[r.token_offset]) for r in batch.rows if r is not row]
        others = [x for x in others if x != old]
        new = others[rng.integers(len(others))] if others else (old + 1) % 256
        batch.input_ids = faults_lib.swap_token(batch.input_ids, index=t, token=new)
        return dict(rid=row.req.rid, position=int(batch.positions[t]), token=old, fed_token=new)


class CanaryFieldCorruption(Fault):
    kind = "canary_corrupt"
    summary = "one field of a canary record (token / position / prev_hash) in the HEAD or TAIL buffer"
    caught_by = "verify chain (successor) / position / chain"
    needs = "a request with a verified prefix of >= 2 tokens"

    def ready(self, sched, batch) -> bool:
        return bool(_verified_prefix_candidates(batch, min_prefix=2))

    FIELDS = (
        (constants.CANARY_FIELD_TOKEN, "token"),
        (constants.CANARY_FIELD_POSITION, "position"),
        (constants.CANARY_FIELD_PREV_HASH, "prev_hash"),
    )

    def try_inject(self, engine, batch, rng, trial):
        rows = _verified_prefix_candidates(batch, min_prefix=2)
        if not rows:
            return None
        row = rows[rng.integers(len(rows))]
        p = int(rng.integers(row.start - 1))  # leaves a verified successor at p + 1
        slot = int(engine.scheduler.req_to_token[row.req.row, p])
        field, fname = self.FIELDS[trial % len(self.FIELDS)]
        buffer = ("TAIL", "HEAD")[trial % 2]
        bit = int(rng.integers(0, 48))
        _flip_canary_field(engine, buffer, slot, field, bit)
        return dict(rid=row.req.rid, position=p, slot=slot, buffer=buffer, field=fname, bit=bit)


class OrphanPrefixFlip(Fault):
    kind = "orphan_flip"
    summary = "one bit in bytes [0, 16) of a cached prefix slot that no running request reads"
    caught_by = "SWEEP verify real_kv"
    needs = "a finished request's cached prefix that no running request reads, then a sweep"

    def ready(self, sched, batch) -> bool:
        return bool(sched.tree.unlocked_nodes())

    def detectable_after(self, trace, step) -> bool:
        return any(s >= step for s in trace.sweep_steps)

    def expected(self, cfg) -> Expectation:
        if cfg.sweep_interval <= 0:
            return Expectation(False, "sweep is off (sweep_interval 0)")
        if constants.RealKvHashMode(int(cfg.real_kv_hash_mode)) == constants.RealKvHashMode.NONE:
            return Expectation(False, "real-KV hashing is off (NONE)")
        return Expectation(True)

    def try_inject(self, engine, batch, rng, trial):
        nodes = engine.scheduler.tree.unlocked_nodes()
        if not nodes:
            return None
        node = max(nodes, key=lambda n: n.last_access)  # most recent: last in line for eviction
        node.pinned = True  # keep it cached until the episode ends (eviction would hide the fault)
        j = int(rng.integers(len(node.value)))
        slot = int(node.value[j])
        byte, bit = int(rng.integers(0, constants.PARTIAL_READ_BYTES)), int(rng.integers(8))
        _flip_k_bit(engine, slot, byte, bit)
        return dict(slot=slot, byte=byte, bit=bit, node_tokens=len(node.key))


ALL_FAULTS: tuple[Fault, ...] = (
    KvFlip("kv_flip_lo", 0, 16),
    KvFlip("kv_flip_hi", 16, None),
    ReqToTokenRemap(),
    FreedPageReuse(),
    PositionShift(),
    TokenSwap(),
    CanaryFieldCorruption(),
    OrphanPrefixFlip(),
)
FAULTS_BY_KIND = {f.kind: f for f in ALL_FAULTS}
FAULT_KINDS = tuple(FAULTS_BY_KIND)


def parse_kinds(spec: str) -> list[Fault]:
    """``"all"``, ``"none"`` or a comma list of kinds.

    Raises:
      ValueError: an empty spec, or an unknown kind (the message lists the known ones).
    """
    spec = (spec or "").strip()
    if not spec.replace(",", "").strip():
        raise ValueError(f"--inject is empty; give all, none, or a comma list of {', '.join(FAULT_KINDS)}")
    if spec.lower() == "all":
        return list(ALL_FAULTS)
    if spec.lower() == "none":
        return []
    out = []
    for k in spec.split(","):
        k = k.strip()
        if not k:
            continue
        if k not in FAULTS_BY_KIND:
            raise ValueError(f"unknown fault kind {k!r}; known kinds: {', '.join(FAULT_KINDS)} (or all / none)")
        if FAULTS_BY_KIND[k] not in out:
            out.append(FAULTS_BY_KIND[k])
    return out
