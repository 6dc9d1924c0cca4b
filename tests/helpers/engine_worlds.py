"""What the torch engine tests (SGLang layout, vLLM layout, CUDA graphs) share: one forward phase run on the
launchers' world and on the re-implemented SGLang references' world, and their byte parity.

A *world* is a dict with the canary ``state`` (``CanaryDeviceState``), the HEAD / TAIL canary buffers ``k_head`` /
``k_tail`` and the plans ``vp`` / ``wp``; ``worlds = {"ours": ..., "ref": ...}`` and ``contexts[who][tag]`` the
launch contexts over them.
"""

from __future__ import annotations

import torch

from helpers.torch_reference import ref_verify, ref_write
from interop import sglang


def make_worlds(*, num_slots: int, ring: int, verify_cap: int, bs_cap: int, k0_source, device) -> tuple[dict, dict]:
    """``(worlds, contexts)``: two identical zeroed canary worlds, ``"ours"`` (the launchers) and ``"ref"`` (the
    references), each with a HEAD context (no real KV) and a TAIL context hashing ``k0_source`` in ALL mode."""
    worlds, contexts = {}, {}
    for who in ("ours", "ref"):
        st = sglang.CanaryDeviceState.allocate(ring_capacity=ring, device=device)
        w = worlds[who] = dict(
            state=st,
            k_head=torch.zeros(num_slots, 32, dtype=torch.uint8, device=device),
            k_tail=torch.zeros(num_slots, 32, dtype=torch.uint8, device=device),
            vp=sglang.VerifyPlan.allocate(verify_capacity=verify_cap, device=device).zero_for_testing_(),
            wp=sglang.WritePlan.allocate(write_req_capacity=bs_cap, device=device).zero_for_testing_(),
        )
        tag = sglang.CanaryLaunchTag
        contexts[who] = {
            tag.HEAD_K_FULL: st.context(canary_buf=w["k_head"], kernel_kind=tag.HEAD_K_FULL),
            tag.TAIL_K_FULL: st.context(
                canary_buf=w["k_tail"],
                kernel_kind=tag.TAIL_K_FULL,
                real_kv_sources=(k0_source,),
                real_kv_hash_mode=sglang.RealKvHashMode.ALL,
            ),
        }
    return worlds, contexts


def run_phase(worlds: dict, contexts: dict, tag, write_kw: dict, **launch_kw) -> None:
    """HEAD or TAIL of one forward: verify then write, through the launchers on ``worlds["ours"]`` (with
    ``launch_kw``: ``backend``, ``path``) and through the references on ``worlds["ref"]``."""
    for who, w in worlds.items():
        ctx = contexts[who][tag]
        if who == "ours":
            sglang.launch_canary_verify_kernel(context=ctx, plan=w["vp"], check_verify_expected_token=True, **launch_kw)
            sglang.launch_canary_write_kernel(context=ctx, plan=w["wp"], **write_kw, **launch_kw)
        else:
            ref_verify(context=ctx, plan=w["vp"], check_verify_expected_token=True)
            ref_write(context=ctx, plan=w["wp"], **write_kw)


def assert_parity(worlds: dict, step: int) -> None:
    """Every canary tensor of the two worlds is byte-identical (canary buffers, ring, write index, counters,
    plans); the failure names the step and the tensor."""
    a, b = worlds["ours"], worlds["ref"]
    for name in ("k_head", "k_tail"):
        assert torch.equal(a[name], b[name]), (step, name)
    for f in ("violation_ring", "violation_write_index", "slot_run_counters", "kernel_run_counters"):
        assert torch.equal(getattr(a["state"], f), getattr(b["state"], f)), (step, f)
    for p in ("vp", "wp"):
        for f in a[p].__dataclass_fields__:
            assert torch.equal(getattr(a[p], f), getattr(b[p], f)), (step, p, f)
