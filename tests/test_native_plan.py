"""The torch plan launch on the native path (its one ``pallas_call``, the Pallas plan kernel, run as a Triton kernel
on CUDA and interpreted on the CPU), byte for byte against canary-jax's jnp plan builder and SGLang's reference.

Every case runs one SGLang-shaped launch through ``interop.sglang.launch_canary_plan_kernels(path="native")`` on
stale outputs, and the jnp builder (``canary_jax.planning.plan_builder.build_plans``, the contract) on copies of
them: every output tensor must then be byte-identical, including what the builder leaves untouched. In-range cases
are also checked against SGLang's torch reference (``helpers.torch_reference.ref_plan``). Shapes come from a few
fixed configurations (each compiles the kernel once) while the values are fuzzed, out-of-range ones included (rows
outside ``req_to_token``, prefixes past its width, negative lengths, slots past the LUT, valid lengths past the pool,
int64 wrap-around of the offsets).
"""

from __future__ import annotations

import random
import zlib

import jax
import numpy as np
import pytest
import torch

from canary_jax.contract import ints, validation
from canary_jax.planning import plan_builder, plans
from helpers.torch_reference import ref_plan
from interop import sglang
from interop.native import launch as native
from interop.native.program import NotNative

# name: shapes and statics (bs, C, Cw, req_to_token rows x width, W, LUT, pool rows x width or None, k)
CONFIGS = {
    "full": dict(bs=5, cap=16, cw=8, rows=6, width=24),
    "full_long_rows": dict(bs=8, cap=512, cw=8, rows=9, width=300),
    "full_lut": dict(bs=4, cap=40, cw=7, rows=5, width=20, lut=True),
    "swa_lut": dict(bs=6, cap=12, cw=6, rows=7, width=24, w=5, lut=True),
    "pool_k0": dict(bs=7, cap=64, cw=8, rows=8, width=30, pool=(8, 32)),
    "pool_eagle_other_rows": dict(bs=6, cap=24, cw=9, rows=7, width=26, pool=(5, 12), k=1),
    "pool_k2_swa": dict(bs=8, cap=20, cw=8, rows=9, width=40, w=3, lut=True, pool=(9, 41), k=2),
    "pool_negative_k": dict(bs=3, cap=10, cw=4, rows=4, width=16, pool=(4, 16), k=-1),
    "bs0": dict(bs=0, cap=6, cw=3, rows=4, width=8, pool=(4, 8)),
    "bs1_cap1": dict(bs=1, cap=1, cw=1, rows=3, width=8, lut=True, w=2),
    "empty_tables": dict(bs=3, cap=8, cw=3, rows=4, width=0, lut=True, pool=(0, 5)),
}
NUM_SLOTS = 60  # slot values drawn below this; the LUT covers [0, NUM_SLOTS]


def _inputs(rng: random.Random, cfg: dict, *, wild: bool) -> dict:
    """Keyword arguments of ``launch_canary_plan_kernels`` (plans excluded) for one random case.

    ``wild`` mixes in the values the builder defines but SGLang's reference does not (see the module doc).
    """
    bs, rows, width = cfg["bs"], cfg["rows"], cfg["width"]
    hi = NUM_SLOTS + (20 if wild else 0)  # wild slots run past the LUT (clamped to its last entry)
    r2t = torch.tensor([[rng.randrange(-3 if wild else 1, hi) for _ in range(width)] for _ in range(rows)])
    r2t = r2t.to(torch.int32).reshape(rows, width)
    if rows and width:
        r2t[0] = 0  # SGLang's padding row
    n_real = rng.randrange(0, bs + 1)
    rpi = [rng.randrange(1, rows) for _ in range(n_real)] + [0] * (bs - n_real)  # padding rows at the end
    cap = cfg["cap"]
    # prefixes around the row width and the capacity: short ones, long ones and overflowing totals
    plen = [rng.choice([0, 1, rng.randrange(0, max(width, 1) + 1), rng.randrange(0, cap + 2)]) for _ in rpi]
    elen = [rng.choice([0, 1, 2, rng.randrange(0, 9)]) for _ in rpi]
    if wild and bs:
        for _ in range(rng.randrange(1, 4)):
            j = rng.randrange(bs)
            rpi[j] = rng.choice([rpi[j], -1, -(2**40), rows, rows + 3, 2**40])
            plen[j] = rng.choice([plen[j], -1, -(2**62), width + rng.randrange(1, 9), 2**62, 2**63 - 1])
            elen[j] = rng.choice([elen[j], -3, 2**62, -(2**63)])
        if rng.random() < 0.3:
            rng.shuffle(rpi)  # padding rows anywhere: the builder skips each one where it is
    kw = dict(
        req_pool_indices=torch.tensor(rpi, dtype=torch.int64),
        prefix_lens=torch.tensor(plen, dtype=torch.int64),
        extend_seq_lens=torch.tensor(elen, dtype=torch.int64),
        req_to_token=r2t,
        swa_window_size=cfg.get("w", 0),
        full_to_swa_index_mapping=None,
        req_to_verify_expected_tokens=None,
        req_to_verify_expected_tokens_valid_lens=None,
        kv_token_id_vs_position_offset=cfg.get("k", 0),
    )
    if cfg.get("lut"):
        lut = [0] + [rng.choice([0, rng.randrange(1, 40)]) for _ in range(NUM_SLOTS)]
        if wild:
            lut = [rng.choice([v, -7]) for v in lut]
        kw["full_to_swa_index_mapping"] = torch.tensor(lut, dtype=torch.int64)
    if cfg.get("pool"):
        p_rows, p_cols = cfg["pool"]
        kw["req_to_verify_expected_tokens"] = torch.randint(
            -5, 1000, (p_rows, p_cols), dtype=torch.int32, generator=torch.Generator().manual_seed(rng.randrange(99))
        )
        top = p_cols + (6 if wild else 0)
        lens = [rng.choice([0, p_cols, rng.randrange(0, top + 1)]) for _ in rpi]
        if wild and bs:
            lens[rng.randrange(bs)] = rng.choice([-4, -(2**63), 2**62])
        kw["req_to_verify_expected_tokens_valid_lens"] = torch.tensor(lens, dtype=torch.int64)
    return kw


def _stale_plans(rng: random.Random, cap: int, cw: int) -> tuple:
    """Plans full of stale values (77 and random ones) that must survive where the builder leaves them."""

    def stale(n, dtype):
        t = torch.full((n,), 77, dtype=dtype)
        if n and rng.random() < 0.5:
            t[rng.randrange(n)] = rng.randrange(-(2**31), 2**31)
        return t

    vp = sglang.VerifyPlan(
        **{f: stale(cap, torch.int64) for f in validation.VERIFY_PLAN_FIELDS[:4]},
        verify_num_valid=stale(1, torch.int32),
        enable=stale(1, torch.int32),
    )
    wp = sglang.WritePlan(
        write_offsets=stale(cw + 1, torch.int64),
        write_seed_slot_indices=stale(cw, torch.int64),
        write_num_valid_reqs=stale(1, torch.int32),
    )
    return vp, wp


def _clone(p):
    return type(p)(**{f: getattr(p, f).clone() for f in p.__dataclass_fields__})


def _kernel_takes(kw: dict) -> bool:
    """Whether the plan kernel takes the launch: request rows, and no empty slot table, LUT or pool."""
    tables = [kw["req_to_token"], kw["full_to_swa_index_mapping"], kw["req_to_verify_expected_tokens"]]
    return kw["req_pool_indices"].shape[0] > 0 and all(t is None or t.numel() > 0 for t in tables)


def _launch(kw: dict, vp, wp, cap: int) -> None:
    """The launch on the native path; one the plan kernel does not take is refused there (naming the
    ``pallas_call``-free builder's first primitive, nothing written) and runs on the DLPack path instead."""
    run = dict(verify_plan_out=vp, write_plan_out=wp, verify_capacity=cap, **kw)
    if _kernel_takes(kw):
        sglang.launch_canary_plan_kernels(path="native", **run)
        return
    outs = [getattr(p, f) for p in (vp, wp) for f in p.__dataclass_fields__]
    before = [t.clone() for t in outs]
    why = r"the plan launch \(pallas\) cannot take the native torch path \(the plan kernel takes no launch without "
    with pytest.raises(NotNative, match=why + r"request rows or with an empty table or pool\): .* outside"):
        sglang.launch_canary_plan_kernels(path="native", **run)
    assert all(torch.equal(a, b) for a, b in zip(before, outs))
    sglang.launch_canary_plan_kernels(path="dlpack", **run)


def _pairs(t: torch.Tensor) -> np.ndarray:
    return ints.int64_to_pairs_np(t.numpy())


def _jnp_builder(kw: dict, vp, wp, cap: int) -> None:
    """The contract: canary-jax's jnp builder over the same stale plans, written back into ``vp`` / ``wp``."""
    fields = validation.VERIFY_PLAN_FIELDS[:4]
    old_v = plans.VerifyPlan(
        **{f: _pairs(getattr(vp, f)) for f in fields},
        verify_num_valid=vp.verify_num_valid.numpy(),
        enable=vp.enable.numpy(),
    )
    old_w = plans.WritePlan(
        write_offsets=_pairs(wp.write_offsets),
        write_seed_slot_indices=_pairs(wp.write_seed_slot_indices),
        write_num_valid_reqs=wp.write_num_valid_reqs.numpy(),
    )
    opt = {k: (None if v is None else v.numpy()) for k, v in kw.items() if isinstance(v, torch.Tensor) or v is None}
    new_v, new_w = plan_builder.build_plans(
        **{k: v for k, v in opt.items()},
        swa_window_size=kw["swa_window_size"],
        kv_token_id_vs_position_offset=kw["kv_token_id_vs_position_offset"],
        verify_capacity=cap,
        verify_plan_out=old_v,
        write_plan_out=old_w,
    )
    for f in fields:
        getattr(vp, f).copy_(torch.from_numpy(ints.pairs_to_int64_np(getattr(new_v, f))))
    vp.verify_num_valid.copy_(torch.from_numpy(np.array(new_v.verify_num_valid)))
    vp.enable.copy_(torch.from_numpy(np.array(new_v.enable)))
    wp.write_offsets.copy_(torch.from_numpy(ints.pairs_to_int64_np(new_w.write_offsets)))
    wp.write_seed_slot_indices.copy_(torch.from_numpy(ints.pairs_to_int64_np(new_w.write_seed_slot_indices)))
    wp.write_num_valid_reqs.copy_(torch.from_numpy(np.array(new_w.write_num_valid_reqs)))


def _assert_same(a, b, label) -> None:
    for f in a.__dataclass_fields__:
        x, y = getattr(a, f), getattr(b, f)
        assert x.dtype == y.dtype and x.shape == y.shape, (label, f)
        assert torch.equal(x, y), (label, f, x, y)


@pytest.mark.parametrize("x64", [False, True])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_jnp_builder_bytes(name, x64):
    cfg = CONFIGS[name]
    rng = random.Random(zlib.crc32(f"{name}/{x64}".encode()))
    trials = 8 if not x64 else 3
    with jax.enable_x64(x64):
        for trial in range(trials):
            kw = _inputs(rng, cfg, wild=trial % 2 == 1)
            vp, wp = _stale_plans(rng, cfg["cap"], cfg["cw"])
            vp_n, wp_n = _clone(vp), _clone(wp)
            _jnp_builder(kw, vp, wp, cfg["cap"])
            _launch(kw, vp_n, wp_n, cfg["cap"])
            _assert_same(vp, vp_n, (name, trial))
            _assert_same(wp, wp_n, (name, trial))


def test_matches_sglang_reference_sweep():
    """In-range inputs over many shapes (no builder compile): SGLang's torch reference re-implemented."""
    rng = random.Random(7)
    for trial in range(24):
        cfg = dict(
            bs=rng.randrange(0, 9),
            cap=rng.choice([1, 2, 5, 16, 40, 97]),
            rows=rng.randrange(2, 10),
            width=rng.choice([1, 3, 24, 130]),
            w=rng.choice([0, 0, 1, 4, 9]),
            k=rng.choice([0, 1, 2]),
        )
        cfg["cw"] = cfg["bs"] + rng.randrange(0, 3) or 1
        cfg["lut"] = cfg["w"] > 0 or rng.random() < 0.3
        if rng.random() < 0.5:
            cfg["pool"] = (cfg["rows"], cfg["width"] + rng.randrange(0, 4))
        kw = _inputs(rng, cfg, wild=False)
        kw["prefix_lens"] = kw["prefix_lens"].clamp(max=cfg["width"])  # the reference reads only in range
        if cfg.get("pool"):
            lens = kw["req_to_verify_expected_tokens_valid_lens"]
            kw["req_to_verify_expected_tokens_valid_lens"] = lens.clamp(max=cfg["pool"][1])
        vp, wp = _stale_plans(rng, cfg["cap"], cfg["cw"])
        vp_r, wp_r = _clone(vp), _clone(wp)
        _launch(kw, vp, wp, cfg["cap"])
        ref_plan(verify_plan_out=vp_r, write_plan_out=wp_r, verify_capacity=cfg["cap"], **kw)
        _assert_same(vp, vp_r, (trial, cfg))
        _assert_same(wp, wp_r, (trial, cfg))


def test_hand_built_scenario():
    """One SWA + LUT + EAGLE-pool launch worked by hand (W = 3, k = 1, C = 8, Cw = 4)."""
    r2t = torch.zeros(4, 8, dtype=torch.int32)
    r2t[1] = torch.tensor([10, 11, 12, 13, 14, 15, 16, 17])
    r2t[2] = torch.tensor([20, 21, 22, 23, 24, 25, 26, 27])
    lut = torch.arange(30) + 100
    lut[21] = 0  # slot 21 evicted from the SWA pool
    pool = torch.arange(32, dtype=torch.int32).reshape(4, 8) * 10
    kw = dict(
        req_pool_indices=torch.tensor([1, 2, 0]),  # row 2 is a padding row
        prefix_lens=torch.tensor([5, 2, 4]),
        extend_seq_lens=torch.tensor([2, 0, 3]),
        req_to_token=r2t,
        swa_window_size=3,
        full_to_swa_index_mapping=lut,
        req_to_verify_expected_tokens=pool,
        req_to_verify_expected_tokens_valid_lens=torch.tensor([5, 8, 8]),
        kv_token_id_vs_position_offset=1,
    )
    vp, wp = _stale_plans(random.Random(0), 8, 4)
    vp.verify_slot_indices.fill_(77)
    wp.write_seed_slot_indices.fill_(77)
    _launch(kw, vp, wp, 8)
    # request 0: window [2, 5); request 1: [0, 2) (prev -1 at position 0, slot 21 -> 0); request 2: padding
    assert vp.verify_slot_indices.tolist() == [112, 113, 114, 120, 0, 77, 77, 77]
    assert vp.verify_prev_slot_indices[:5].tolist() == [111, 112, 113, -1, 120]
    assert vp.verify_expected_positions[:5].tolist() == [2, 3, 4, 0, 1]
    # token = pool[rpi, p + 1] while p + 1 < valid_len: request 0 stops at p + 1 = 5
    assert vp.verify_expected_tokens[:5].tolist() == [110, 120, -1, 170, 180]
    assert (vp.verify_num_valid.item(), vp.enable.item()) == (5, 1)
    assert wp.write_offsets.tolist() == [0, 2, 2, 2, 0]
    assert wp.write_seed_slot_indices.tolist() == [114, -1, -1, 77]
    assert wp.write_num_valid_reqs.item() == 3
    # overflow: 5 entries > C = 4: enable 0, num_valid = C, no entry written
    vp4, wp4 = _stale_plans(random.Random(1), 4, 4)
    before = _clone(vp4)
    _launch(kw, vp4, wp4, 4)
    assert (vp4.verify_num_valid.item(), vp4.enable.item()) == (4, 0)
    for f in validation.VERIFY_PLAN_FIELDS[:4]:
        assert torch.equal(getattr(vp4, f), getattr(before, f)), f


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_plan_is_the_triton_kernel_and_matches():
    rng = random.Random(9)
    cfg = CONFIGS["pool_k2_swa"]
    for trial in range(3):
        kw = _inputs(rng, cfg, wild=trial == 1)
        vp, wp = _stale_plans(rng, cfg["cap"], cfg["cw"])
        want_v, want_w = _clone(vp), _clone(wp)
        _jnp_builder(kw, want_v, want_w, cfg["cap"])
        dev = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
        vp_d = type(vp)(**{f: getattr(vp, f).cuda() for f in vp.__dataclass_fields__})
        wp_d = type(wp)(**{f: getattr(wp, f).cuda() for f in wp.__dataclass_fields__})
        _launch(dev, vp_d, wp_d, cfg["cap"])
        torch.cuda.synchronize()
        _assert_same(want_v, type(vp)(**{f: getattr(vp_d, f).cpu() for f in vp.__dataclass_fields__}), trial)
        _assert_same(want_w, type(wp)(**{f: getattr(wp_d, f).cpu() for f in wp.__dataclass_fields__}), trial)
    names = [n for launch in native._PROGRAMS.values() for n in launch.program.kernel_names]
    assert "canary_plan" in names, names
