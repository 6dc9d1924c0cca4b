"""The torch interop benchmark's setup (``benchmarks.interop_bench``): a canary, a real-KV source and plans as
torch tensors, stamped chains, the JAX twin of a launch, and the timer.

``Setup(n_slots, cap)`` holds a canary ``uint8[N, 32]``, one real-KV source (layer-0 K as ``bf16[N, 64]``,
128 bytes per slot, PARTIAL mode) and ``REQS`` requests of ``cap / REQS`` random prefix slots plus
``WRITE_TOKENS`` new slots each. ``program_twin`` returns a torch launch's own jitted program, dispatched from
JAX on JAX-side copies of its inputs. ``timeit`` gives ``(us per call over n back-to-back calls then one
sync, median latency of single synced calls)``.

``INTEROP_BENCH_DEVICE=cpu`` puts every tensor on the CPU (dry run); default ``cuda``.
"""

from __future__ import annotations

import os
import statistics
import time

import jax
import jax.numpy as jnp
import torch

import canary_jax
from canary_jax.contract import layout
from canary_jax.planning import plans
from interop import dlpack, runner, sglang

DEV = os.environ.get("INTEROP_BENCH_DEVICE", "cuda")
REQS = 32
WRITE_TOKENS = 8


def sync():
    """Waits for the torch device (a no-op on the CPU)."""
    if DEV == "cuda":
        torch.cuda.synchronize()


def timeit(fn, *, n=100, lat_n=30, warm=5, block=None):
    """``(us per call, median latency us)``: ``n`` back-to-back calls then one sync (and ``block()``), and
    ``lat_n`` single calls each followed by a sync; after ``warm`` warm-up calls."""
    for _ in range(warm):
        fn()
    sync()
    if block:
        block()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    sync()
    if block:
        block()
    thr = (time.perf_counter() - t0) / n * 1e6
    lat = []
    for _ in range(lat_n):
        t0 = time.perf_counter()
        fn()
        sync()
        if block:
            block()
        lat.append((time.perf_counter() - t0) * 1e6)
    return round(thr, 1), round(statistics.median(lat), 1)


class Setup:
    """Torch-side state of one pool size: canary ``buf``, source ``k0``, ``state`` / ``ctx`` of
    ``interop.sglang``, and ``prefix_slots`` (``int64[REQS, cap / REQS]``) / ``new_slots``
    (``int64[REQS, WRITE_TOKENS]``)."""

    def __init__(self, n_slots: int, cap: int, seed: int = 0):
        g = torch.Generator(device=DEV).manual_seed(seed)
        self.n = n_slots
        self.buf = torch.zeros(n_slots, 32, dtype=torch.uint8, device=DEV)
        self.k0 = torch.randn(n_slots, 64, generator=g, device=DEV).to(torch.bfloat16)
        self.state = sglang.CanaryDeviceState.allocate(ring_capacity=1024, device=DEV)
        self.src = sglang.RealKvSource(tensor=self.k0, page_size=1, num_bytes_per_token=128, read_bytes=128)
        self.ctx = self.state.context(
            canary_buf=self.buf,
            kernel_kind=sglang.CanaryLaunchTag.TAIL_K_FULL,
            real_kv_sources=(self.src,),
            real_kv_hash_mode=sglang.RealKvHashMode.PARTIAL,
        )
        per = cap // REQS
        if per % WRITE_TOKENS or per < 64:
            raise ValueError(f"--cap must be a multiple of {REQS * WRITE_TOKENS} and >= {REQS * 64}, got {cap}")
        perm = torch.randperm(n_slots - 1, generator=g, device=DEV)[: cap + REQS * WRITE_TOKENS] + 1
        self.prefix_slots = perm[:cap].reshape(REQS, per)
        self.new_slots = perm[cap:].reshape(REQS, WRITE_TOKENS)
        self.per = per
        self.cap = cap

    def write_args(self, tiny, backend):
        """The case's write tensors (timed launch: new slots after the stamped prefix) and a stamp function
        that writes the verified prefix through the same tensors, i.e. the same compiled program."""
        reqs, tok = (1, 1) if tiny else (REQS, WRITE_TOKENS)
        plen = 64 if tiny else self.per  # stamped positions per request
        wp = sglang.WritePlan.allocate(write_req_capacity=reqs, device=DEV)
        wp.write_offsets.copy_(torch.arange(reqs + 1, device=DEV) * tok)
        wp.write_num_valid_reqs.fill_(reqs)
        kw = dict(
            input_ids=torch.randint(0, 50000, (reqs * tok,), device=DEV),
            positions=torch.zeros(reqs * tok, dtype=torch.int64, device=DEV),
            out_cache_loc=torch.zeros(reqs * tok, dtype=torch.int64, device=DEV),
            enable_write_input_assert=False,
            expected_input_tokens=None,
            expected_input_positions=None,
        )

        def launch():
            sglang.launch_canary_write_kernel(context=self.ctx, plan=wp, backend=backend, **kw)

        def set_chunk(first):
            """Positions first .. first + tok - 1 of requests 0 .. reqs - 1 (first == plen: the new slots)."""
            if first >= plen:
                slots = self.new_slots[:reqs, :tok]
            else:
                slots = self.prefix_slots[:reqs, first : first + tok]
            seeds = self.prefix_slots[:reqs, first - 1] if first > 0 else torch.full((reqs,), -1, device=DEV)
            wp.write_seed_slot_indices.copy_(seeds)
            kw["out_cache_loc"].copy_(slots.reshape(-1))
            kw["positions"].copy_((torch.arange(tok, device=DEV) + first).repeat(reqs))
            kw["input_ids"].copy_(torch.randint(0, 50000, (reqs * tok,), device=DEV))

        def stamp():
            for first in range(0, plen, tok):
                set_chunk(first)
                launch()
            set_chunk(plen)
            sync()

        return launch, stamp, reqs * tok

    def verify_plan(self, tiny):
        """Clean entries: tiny = the first 64 positions of request 0, full = every prefix position."""
        if tiny:
            slots = self.prefix_slots[0, :64]
            prev = torch.cat([torch.tensor([-1], device=DEV), slots[:-1]])
            pos = torch.arange(64, device=DEV)
        else:
            slots = self.prefix_slots.reshape(-1)
            prev = torch.cat(
                [torch.full((REQS, 1), -1, device=DEV, dtype=torch.int64), self.prefix_slots[:, :-1]], 1
            ).reshape(-1)
            pos = torch.arange(self.per, device=DEV).repeat(REQS)
        vp = sglang.VerifyPlan.allocate(verify_capacity=slots.shape[0], device=DEV)
        vp.verify_slot_indices.copy_(slots)
        vp.verify_prev_slot_indices.copy_(prev)
        vp.verify_expected_positions.copy_(pos)
        vp.verify_expected_tokens.fill_(-1)
        vp.verify_num_valid.fill_(slots.shape[0])
        vp.enable.fill_(1)
        return vp

    # --- canary_jax API twins (--api-twin) ----------------------------------------------------------------
    def jax_context(self):
        buf = jnp.array(dlpack.to_jax(self.buf, name="buf"))  # a JAX-owned copy
        k0 = jnp.array(dlpack.to_jax(self.k0.view(torch.uint8), name="k0"))
        src = canary_jax.RealKvSource(tensor=k0, page_size=1, num_bytes_per_token=128, read_bytes=128)
        log = layout.ViolationLog.allocate(ring_capacity=1024)
        return canary_jax.VerifyOrWriteContext(
            canary_buf=buf,
            kernel_kind=canary_jax.CanaryLaunchTag.TAIL_K_FULL,
            log=log,
            real_kv_sources=(src,),
            real_kv_hash_mode=canary_jax.RealKvHashMode.PARTIAL,
        )


def jax_pairs(t):
    """A torch int64 tensor as JAX ``uint32[..., 2]`` pairs (a JAX-owned copy)."""
    return jax.lax.bitcast_convert_type(jnp.array(dlpack.to_jax(t, name="t")), jnp.uint32)


def jax_verify_plan(vp):
    return plans.VerifyPlan(
        verify_slot_indices=jax_pairs(vp.verify_slot_indices),
        verify_expected_tokens=jax_pairs(vp.verify_expected_tokens),
        verify_expected_positions=jax_pairs(vp.verify_expected_positions),
        verify_prev_slot_indices=jax_pairs(vp.verify_prev_slot_indices),
        verify_num_valid=jnp.array(dlpack.to_jax(vp.verify_num_valid, name="nv")),
        enable=jnp.array(dlpack.to_jax(vp.enable, name="en")),
    )


_TWIN_FENCE = []


def program_twin(torch_launch):
    """Runs ``torch_launch`` once, then returns ``(step, block)``: the launch's own jitted program dispatched
    from JAX on JAX-side copies of its inputs (mutable ones donated and carried from call to call)."""
    torch_launch()
    sync()
    fn, mut, views, _dev = runner.last_launch_program()
    if not _TWIN_FENCE:
        t = torch.zeros(64 if DEV == "cuda" else 16, dtype=torch.uint8, device=DEV)
        _TWIN_FENCE.append((t, dlpack._import_exact(t, name="fence")))
    fence = _TWIN_FENCE[0][1]
    copies = [v.clone() for v in views]  # keeps the torch memory alive for the imports
    state = [dlpack._import_exact(c, name="twin") for c in copies]

    def step():
        outs = fn(fence, *state)
        for i, o in zip(mut, outs):
            state[i] = o

    def block():
        jax.block_until_ready([state[i] for i in mut])

    step.copies = copies  # lifetime
    return step, block


def tee_log(path: str, mode: str):
    """``log(msg)``: prints ``msg`` and appends it as a line to the file at ``path`` (opened with ``mode``,
    flushed after each line)."""
    logf = open(path, mode)

    def log(msg):
        print(msg, flush=True)
        logf.write(msg + "\n")
        logf.flush()

    return log
