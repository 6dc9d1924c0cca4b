"""SGLang's ``launch_canary_plan_kernels`` on torch tensors (SPEC 7): the plan launcher of :mod:`interop.sglang`,
which re-exports it.

One program around the Pallas plan kernel (:func:`canary_jax.ops.plan_launch.build_plans`, built by
:func:`interop.kernels.plan_body_factory`): JAX runs it on the DLPack path, the native path runs its one
``pallas_call`` as a Triton kernel (:func:`interop.sglang_launch._run`). The launch is not padded to buckets (its
outputs' shapes are the caller's). Device-specific checks follow SGLang: CUDA tensors get the kernel path's
``bs <= 4096`` limit and messages, CPU tensors the reference's.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from canary_jax.contract import validation
from interop import arguments, kernels
from interop.arguments import TORCH_DTYPES, check, tensor
from interop.native import replay
from interop.runner import TensorArg
from interop.sglang_launch import PLAN_BS_BLOCK_SIZE, _checked, _int, _replay_key, _run, stable


# --- plan ------------------------------------------------------------------------------------------------
def launch_canary_plan_kernels(
    *,
    verify_plan_out: Any,
    write_plan_out: Any,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    req_to_token: torch.Tensor,
    swa_window_size: int,
    full_to_swa_index_mapping: torch.Tensor | None,
    verify_capacity: int,
    req_to_verify_expected_tokens: torch.Tensor | None,
    req_to_verify_expected_tokens_valid_lens: torch.Tensor | None,
    kv_token_id_vs_position_offset: int,
    backend: str | None = None,
    path: str | None = None,
) -> None:
    """SGLang's ``launch_canary_plan_kernels`` on torch tensors (SPEC 7; canary-jax ``build_plans``).

    Fills ``verify_plan_out`` and ``write_plan_out`` in place. Regions SGLang leaves untouched keep their
    contents: verify entries past ``num_valid`` (all of them on overflow) and seeds past ``bs``;
    ``write_offsets`` past ``bs`` become zero. ``backend`` is accepted for symmetry (one implementation).

    Raises:
      ValueError / TypeError: SGLang's errors (device-specific like SGLang: CUDA tensors get the kernel
        path's checks and messages, CPU tensors the reference's) and the interop's; nothing runs.
    """
    del backend
    verify_plan_out = stable(verify_plan_out, validation.VERIFY_PLAN_FIELDS)  # read once: keyed, checked, launched
    write_plan_out = stable(write_plan_out, validation.WRITE_PLAN_FIELDS)
    scalars = (swa_window_size, verify_capacity, kv_token_id_vs_position_offset)
    raw = (
        req_pool_indices,
        prefix_lens,
        extend_seq_lens,
        req_to_token,
        full_to_swa_index_mapping,
        req_to_verify_expected_tokens,
        # SGLang reads the valid lengths only with the pool
        req_to_verify_expected_tokens_valid_lens if req_to_verify_expected_tokens is not None else None,
    )

    def key_of(layout: bool = False):
        return _replay_key(
            "plan",
            path,
            None,
            getattr(verify_plan_out, "verify_slot_indices", None),
            lambda k: (
                replay.fields_sig(verify_plan_out, validation.VERIFY_PLAN_FIELDS, (), k),
                replay.fields_sig(write_plan_out, validation.WRITE_PLAN_FIELDS, (), k),
                replay.tensors_sig(raw, k),
                *[replay.value_sig(x) for x in scalars],
            ),
            layout,
        )

    key = key_of()
    if replay.GRAPHS.replay(key):
        return
    statics, checked, key = _checked(
        key, lambda: key_of(layout=True), lambda: _check_plan(verify_plan_out, write_plan_out, raw, *scalars)
    )
    if checked is not None:
        _, vp, wp, ins, _ = checked
    else:  # the same facts passed the checks: gather the tensors
        vp = dict(zip(_VP_NAMES, _VP_GET(verify_plan_out)))
        wp = dict(zip(_WP_NAMES, _WP_GET(write_plan_out)))
        ins = {n: x for n, x in zip(_INPUTS, raw) if x is not None}
    args = [TensorArg(n, t) for n, t in ins.items()]
    args += [TensorArg(n, t, True) for n, t in {**vp, **wp}.items()]
    replay.GRAPHS.run(key, lambda: (_run("plan", statics, kernels.plan_body_factory, args, path, key), ()))


_INPUTS = (
    "req_pool_indices",
    "prefix_lens",
    "extend_seq_lens",
    "req_to_token",
    "full_to_swa_index_mapping",
    "req_to_verify_expected_tokens",
    "req_to_verify_expected_tokens_valid_lens",
)
_VP_NAMES = tuple("verify_plan_out." + f for f in validation.VERIFY_PLAN_FIELDS)
_VP_GET = operator.attrgetter(*validation.VERIFY_PLAN_FIELDS)
_WP_NAMES = tuple("write_plan_out." + f for f in validation.WRITE_PLAN_FIELDS)
_WP_GET = operator.attrgetter(*validation.WRITE_PLAN_FIELDS)


def _check_plan(
    verify_plan_out: Any,
    write_plan_out: Any,
    raw: tuple,
    swa_window_size: Any,
    verify_capacity: Any,
    kv_token_id_vs_position_offset: Any,
) -> tuple:
    """A plan launch's checks: ``(statics, verify plan tensors, write plan tensors, input tensors, False)`` (a plan
    launch reads no slots on the host); ``raw``: the inputs in :data:`_INPUTS` order."""
    vp = arguments.tensors(verify_plan_out, validation.VERIFY_PLAN_FIELDS, "verify_plan_out.")
    wp = arguments.tensors(write_plan_out, validation.WRITE_PLAN_FIELDS, "write_plan_out.")
    ins = {n: tensor(x, n) for n, x in zip(_INPUTS, raw) if x is not None or n in _INPUTS[:4]}
    has_lut = "full_to_swa_index_mapping" in ins
    has_pool = "req_to_verify_expected_tokens" in ins
    on_cuda = vp["verify_plan_out.verify_slot_indices"].device.type == "cuda"
    bs = int(ins["req_pool_indices"].shape[0]) if ins["req_pool_indices"].dim() >= 1 else 0
    arguments.check_contiguous({**ins, **vp, **wp})
    for n in ("req_pool_indices", "prefix_lens", "extend_seq_lens"):
        check(ins[n], n, torch.int64, (bs,))
    check(ins["req_to_token"], "req_to_token", torch.int32, (None, None))
    if has_lut:
        check(ins["full_to_swa_index_mapping"], "full_to_swa_index_mapping", torch.int64, (None,))
    if has_pool:
        check(ins["req_to_verify_expected_tokens"], "req_to_verify_expected_tokens", torch.int32, (None, None))
    if "req_to_verify_expected_tokens_valid_lens" in ins:
        check(
            ins["req_to_verify_expected_tokens_valid_lens"],
            "req_to_verify_expected_tokens_valid_lens",
            torch.int64,
            (bs,),
        )
    plan_cap = int(vp["verify_plan_out.verify_slot_indices"].shape[0])
    validation.check_verify_plan(
        arguments.fields_facts(vp, "verify_plan_out."), TORCH_DTYPES, prefix="verify_plan_out.", capacity=plan_cap
    )
    cw = validation.check_write_plan(
        arguments.fields_facts(wp, "write_plan_out."), TORCH_DTYPES, prefix="write_plan_out.", offsets_message=False
    )
    validation.check_plan_launch(
        swa_window_size=_int(swa_window_size, "swa_window_size"),
        has_lut=has_lut,
        lut_len=int(ins["full_to_swa_index_mapping"].shape[0]) if has_lut else 0,
        verify_capacity=_int(verify_capacity, "verify_capacity"),
        plan_capacity=plan_cap,
        bs=bs,
        write_req_capacity=cw,
        has_pool=has_pool,
        has_valid_lens="req_to_verify_expected_tokens_valid_lens" in ins,
        path=validation.PLAN_KERNEL_PATH if on_cuda else validation.PLAN_REFERENCE_PATH,
        max_bs=PLAN_BS_BLOCK_SIZE,
    )
    arguments.check_devices({**vp, **wp, **ins}, "verify_plan_out.verify_slot_indices")
    offset = _int(kv_token_id_vs_position_offset, "kv_token_id_vs_position_offset")
    platform = vp["verify_plan_out.verify_slot_indices"].device.type  # the plan kernel compiled on CUDA only
    statics = ("pallas", platform, int(swa_window_size), offset, has_lut, has_pool)
    return statics, vp, wp, ins, False
