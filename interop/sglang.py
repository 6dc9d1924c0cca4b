"""Drop-in replacements for SGLang's kv-canary launchers: canary-jax on torch tensors, in place.

A torch serving engine keeps using its tensors and its calls::

    from interop.sglang import (launch_canary_plan_kernels, launch_canary_verify_kernel,
                                launch_canary_write_kernel, VerifyOrWriteContext, VerifyPlan, WritePlan, ...)

    launch_canary_plan_kernels(verify_plan_out=vp, write_plan_out=wp, req_pool_indices=..., ...)
    launch_canary_verify_kernel(context=ctx, plan=vp, check_verify_expected_token=False)
    launch_canary_write_kernel(context=ctx, plan=wp, input_ids=..., positions=..., out_cache_loc=...,
                               enable_write_input_assert=False, expected_input_tokens=None,
                               expected_input_positions=None)

Names, keyword arguments, field names, shapes and dtypes are SGLang's (``python/sglang/kernels/ops/kv_canary/``
``verify.py``, ``write.py``, ``plan/api.py``; SPEC sections 4 to 7). Any object with those attribute names is
accepted (SGLang's own dataclasses included). After a call the torch tensors hold what SGLang's launchers
would have written (canary buffer, ring, write index, counters, plan outputs); on CUDA without copying
them (donation, see :mod:`interop.inplace`), ordered against torch's current stream.

Errors are SGLang's (SPEC 10), raised before anything runs, so a refused call leaves every tensor untouched:
``len(real_kv_sources) > 4``, ``kv-canary: {name} must be contiguous``, the RealKvSource ABI checks, the
write-input-assert presence checks, the plan's LUT / bs / capacity checks. The interop adds its own, all
naming the argument: wrong dtype (TypeError), wrong shape, device mix (CPU with CUDA, two GPUs), outputs
aliasing other arguments, misaligned pointers, consumed DLPack capsules (ValueError).

Backend: the keyword ``backend=`` (``"reference"`` or ``"pallas"``), else ``$CANARY_JAX_BACKEND``, else Pallas
for CUDA tensors and the jnp reference for CPU tensors (Pallas on CPU runs interpreted).

Where SGLang's CUDA and CPU paths differ, these launchers follow SGLang per device: the plan's ``bs <= 4096``
limit and its kernel-path messages apply to CUDA tensors, the reference's messages to CPU tensors. Verify /
write semantics are canary-jax's (deterministic row order, seeds read before the launch, last writer wins),
which equal SGLang's torch references whenever those are well defined.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch

from canary_jax import backends, constants
from interop import dlpack
from interop import inplace
from interop import kernels

CanaryLaunchTag = constants.CanaryLaunchTag
RealKvHashMode = constants.RealKvHashMode
FailReason = constants.FailReason
MAX_REAL_KV_SOURCES = constants.MAX_REAL_KV_SOURCES
CANARY_SLOT_BYTES = constants.CANARY_SLOT_BYTES
PLAN_BS_BLOCK_SIZE = 4096  # SGLang's _PLAN_BS_BLOCK_SIZE (Triton offsets kernel, CUDA path only)

__all__ = [
    "CANARY_SLOT_BYTES",
    "CanaryDeviceState",
    "CanaryLaunchTag",
    "FailReason",
    "MAX_REAL_KV_SOURCES",
    "RealKvHashMode",
    "RealKvSource",
    "VerifyOrWriteContext",
    "VerifyPlan",
    "WritePlan",
    "launch_canary_plan_kernels",
    "launch_canary_verify_kernel",
    "launch_canary_write_kernel",
]


# --- launch objects (torch side, SGLang's fields) ---------------------------------------------------------
def _validate_source_fields(src: Any) -> None:
    """SGLang's ``RealKvSource.__post_init__`` checks, in its order and with its messages."""
    page_size, nbpt, read_bytes = int(src.page_size), int(src.num_bytes_per_token), int(src.read_bytes)
    tensor = src.tensor
    if page_size < 1:
        raise ValueError(f"kv-canary: RealKvSource.page_size must be >= 1, got {page_size}")
    if nbpt <= 0 or nbpt % 16 != 0:
        raise ValueError(f"kv-canary: RealKvSource.num_bytes_per_token must be a positive multiple of 16, got {nbpt}")
    if read_bytes <= 0 or read_bytes > nbpt or read_bytes % 16 != 0:
        raise ValueError(
            "kv-canary: RealKvSource.read_bytes must be a positive multiple of 16 in "
            f"(0, num_bytes_per_token={nbpt}], got {read_bytes}"
        )
    if tensor.ndim < 2:
        raise ValueError(f"kv-canary: RealKvSource.tensor must be at least 2-D, got shape {tuple(tensor.shape)}")
    row_stride_bytes = int(tensor.stride(0)) * tensor.element_size()
    if row_stride_bytes % 16 != 0:
        raise ValueError(
            "kv-canary: RealKvSource.tensor row stride must be a multiple of 16 bytes, "
            f"got {row_stride_bytes} bytes (shape={tuple(tensor.shape)}, strides={tuple(tensor.stride())}, "
            f"dtype={tensor.dtype})"
        )


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RealKvSource:
    """One piece of real KV folded into the fingerprint (SGLang ``RealKvSource``; SPEC 3).

    Fields:
      tensor: torch tensor, any dtype, at least 2-D; a *view* of the live pool (never a copy). Slot ``idx``
        owns ``tensor.view(uint8)[idx // page_size, (idx % page_size) * num_bytes_per_token :][:nbpt]``.
      page_size: slots per row of dim 0, ``>= 1``.
      num_bytes_per_token: bytes per slot, a positive multiple of 16.
      read_bytes: leading bytes hashed in ALL mode, a positive multiple of 16, ``<= num_bytes_per_token``.

    Raises (``__post_init__``): SGLang's ValueErrors (page_size, num_bytes_per_token, read_bytes, rank, row
    stride), in SGLang's order.
    """

    tensor: torch.Tensor
    page_size: int
    num_bytes_per_token: int
    read_bytes: int

    def __post_init__(self) -> None:
        _validate_source_fields(self)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class VerifyOrWriteContext:
    """SGLang's shared verify/write launch context (SPEC 4.1).

    Fields:
      canary_buf: ``uint8 [num_slots, slot_stride_bytes]``, contiguous, stride >= 32.
      kernel_kind: ``CanaryLaunchTag`` stamped into column 0.
      violation_ring: ``int64 [ring_capacity, 8]`` fill-once sink.
      violation_write_index: ``int32 [1]``.
      slot_run_counter / kernel_run_counter: ``int64 [1]`` (usually ``counters[tag : tag + 1]`` views).
      real_kv_sources: tuple of 0..4 :class:`RealKvSource`.
      real_kv_hash_mode: ``RealKvHashMode``.
      enable_chain_position_assert: ``int32 [1]`` device flag (write only).
    """

    canary_buf: torch.Tensor
    kernel_kind: CanaryLaunchTag
    violation_ring: torch.Tensor
    violation_write_index: torch.Tensor
    slot_run_counter: torch.Tensor
    kernel_run_counter: torch.Tensor
    real_kv_sources: tuple = ()
    real_kv_hash_mode: RealKvHashMode = RealKvHashMode.NONE
    enable_chain_position_assert: torch.Tensor | None = None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class VerifyPlan:
    """SGLang's ``VerifyPlan`` (SPEC 4.2): four ``int64 [C]`` arrays, ``verify_num_valid`` / ``enable``
    ``int32 [1]``. Entries past ``num_valid`` are unspecified and never read."""

    verify_slot_indices: torch.Tensor
    verify_expected_tokens: torch.Tensor
    verify_expected_positions: torch.Tensor
    verify_prev_slot_indices: torch.Tensor
    verify_num_valid: torch.Tensor
    enable: torch.Tensor

    @staticmethod
    def allocation_bytes(verify_capacity: int) -> int:
        return 4 * int(verify_capacity) * 8 + 2 * 4

    @classmethod
    def allocate(cls, *, verify_capacity: int, device: Any = "cpu") -> "VerifyPlan":
        """``empty`` entries and ``num_valid``, ``enable = ones`` (SGLang's allocation).

        Raises:
          ValueError: ``verify_capacity <= 0`` (SGLang's message).
        """
        if verify_capacity <= 0:
            raise ValueError(f"kv-canary: VerifyPlan verify_capacity must be positive, got {verify_capacity}")
        e = lambda: torch.empty(verify_capacity, dtype=torch.int64, device=device)  # noqa: E731
        return cls(
            verify_slot_indices=e(),
            verify_expected_tokens=e(),
            verify_expected_positions=e(),
            verify_prev_slot_indices=e(),
            verify_num_valid=torch.empty(1, dtype=torch.int32, device=device),
            enable=torch.ones(1, dtype=torch.int32, device=device),
        )

    def zero_for_testing_(self) -> "VerifyPlan":
        """SGLang's test helper: zero everything, expected tokens = -1."""
        self.verify_slot_indices.zero_()
        self.verify_expected_tokens.fill_(-1)
        self.verify_expected_positions.zero_()
        self.verify_prev_slot_indices.zero_()
        self.verify_num_valid.zero_()
        self.enable.zero_()
        return self


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class WritePlan:
    """SGLang's ``WritePlan`` (SPEC 4.3): ``write_offsets int64 [Cw + 1]``, ``write_seed_slot_indices
    int64 [Cw]``, ``write_num_valid_reqs int32 [1]``."""

    write_offsets: torch.Tensor
    write_seed_slot_indices: torch.Tensor
    write_num_valid_reqs: torch.Tensor

    @staticmethod
    def allocation_bytes(write_req_capacity: int) -> int:
        return (2 * int(write_req_capacity) + 1) * 8 + 4

    @classmethod
    def allocate(cls, *, write_req_capacity: int, device: Any = "cpu") -> "WritePlan":
        """``empty`` tensors (SGLang's allocation).

        Raises:
          ValueError: ``write_req_capacity <= 0`` (SGLang's message).
        """
        if write_req_capacity <= 0:
            raise ValueError(f"kv-canary: WritePlan write_req_capacity must be positive, got {write_req_capacity}")
        return cls(
            write_offsets=torch.empty(write_req_capacity + 1, dtype=torch.int64, device=device),
            write_seed_slot_indices=torch.empty(write_req_capacity, dtype=torch.int64, device=device),
            write_num_valid_reqs=torch.empty(1, dtype=torch.int32, device=device),
        )

    def zero_for_testing_(self) -> "WritePlan":
        self.write_offsets.zero_()
        self.write_seed_slot_indices.zero_()
        self.write_num_valid_reqs.zero_()
        return self


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CanaryDeviceState:
    """Shared device state of one canary manager (SGLang ``CanaryDeviceState``, SPEC 9): ring, write index,
    per-tag counters and the chain-position assert flag, plus :meth:`context` to build launch contexts."""

    violation_ring: torch.Tensor
    violation_write_index: torch.Tensor
    slot_run_counters: torch.Tensor
    kernel_run_counters: torch.Tensor
    enable_chain_position_assert: torch.Tensor

    @classmethod
    def allocate(cls, *, ring_capacity: int = constants.DEFAULT_RING_CAPACITY, num_tags: int = constants.NUM_LAUNCH_TAGS,
                 device: Any = "cpu") -> "CanaryDeviceState":
        """Zeroed ring ``int64 [R, 8]``, index ``int32 [1]``, counters ``int64 [num_tags]``; flag = 1.

        Raises:
          ValueError: non-positive ``ring_capacity`` / ``num_tags`` (SGLang's messages).
        """
        if ring_capacity <= 0:
            raise ValueError(f"kv-canary: ViolationLog ring_capacity must be positive, got {ring_capacity}")
        if num_tags <= 0:
            raise ValueError(f"kv-canary: CanaryDeviceState num_tags must be positive, got {num_tags}")
        return cls(
            violation_ring=torch.zeros(ring_capacity, constants.VIOLATION_FIELDS, dtype=torch.int64, device=device),
            violation_write_index=torch.zeros(1, dtype=torch.int32, device=device),
            slot_run_counters=torch.zeros(num_tags, dtype=torch.int64, device=device),
            kernel_run_counters=torch.zeros(num_tags, dtype=torch.int64, device=device),
            enable_chain_position_assert=torch.ones(1, dtype=torch.int32, device=device),
        )

    def context(self, *, canary_buf: torch.Tensor, kernel_kind: CanaryLaunchTag, real_kv_sources: tuple = (),
                real_kv_hash_mode: RealKvHashMode = RealKvHashMode.NONE) -> VerifyOrWriteContext:
        """A launch context whose counters are ``counters[tag : tag + 1]`` views, as SGLang's endpoints build."""
        tag = int(kernel_kind)
        return VerifyOrWriteContext(
            canary_buf=canary_buf,
            kernel_kind=CanaryLaunchTag(tag),
            violation_ring=self.violation_ring,
            violation_write_index=self.violation_write_index,
            slot_run_counter=self.slot_run_counters[tag : tag + 1],
            kernel_run_counter=self.kernel_run_counters[tag : tag + 1],
            real_kv_sources=tuple(real_kv_sources),
            real_kv_hash_mode=RealKvHashMode(int(real_kv_hash_mode)),
            enable_chain_position_assert=self.enable_chain_position_assert,
        )


# --- argument handling --------------------------------------------------------------------------------------
def _tensor(x: Any, name: str) -> torch.Tensor:
    if x is None:
        raise TypeError(f"kv-canary: {name} must be a torch.Tensor, got None")
    return dlpack.as_torch_tensor(x, name=name)


def _want(t: torch.Tensor, name: str, dtype: torch.dtype, shape: Sequence[int | None]) -> None:
    if t.dtype != dtype:
        raise TypeError(f"kv-canary: {name} must have dtype {dtype}, got {t.dtype}")
    got = tuple(t.shape)
    if len(got) != len(shape) or any(w is not None and w != g for w, g in zip(shape, got)):
        want = tuple("*" if w is None else w for w in shape)
        raise ValueError(f"kv-canary: {name} must have shape {want}, got {got}")


def _tag(kernel_kind: Any) -> int:
    try:
        return int(constants.CanaryLaunchTag(int(kernel_kind)))
    except (TypeError, ValueError):
        raise ValueError(f"kv-canary: kernel_kind must be a CanaryLaunchTag (0..11), got {kernel_kind!r}") from None


def _mode(mode: Any) -> int:
    try:
        return int(constants.RealKvHashMode(int(mode)))
    except (TypeError, ValueError):
        raise ValueError(f"kv-canary: real_kv_hash_mode must be a RealKvHashMode, got {mode!r}") from None


def _check_source_count(sources: tuple) -> None:
    if len(sources) > constants.MAX_REAL_KV_SOURCES:
        raise ValueError(
            f"kv-canary: at most {constants.MAX_REAL_KV_SOURCES} RealKvSource entries supported by the CUDA ABI, "
            f"got {len(sources)}"
        )


def _source_abi(sources: tuple) -> list[tuple[torch.Tensor, torch.Tensor, tuple[int, int, int]]]:
    """SGLang's ``_build_real_kv_source_abi`` checks; returns ``(owner, uint8 2-D view, (p, nbpt, rb))``."""
    out = []
    for i, s in enumerate(sources):
        t = _tensor(getattr(s, "tensor", None), f"real_kv_sources[{i}].tensor")
        _validate_source_fields(_SourceView(t, s))
        dlpack.check_contiguous(t, f"real_kv_sources[{i}].tensor")
        u8 = t.view(torch.uint8)
        if u8.dim() != 2:
            raise ValueError(f"kv-canary: real_kv_sources[{i}].tensor (viewed as uint8) must be 2-D, got {u8.dim()}-D")
        out.append((t, u8, (int(s.page_size), int(s.num_bytes_per_token), int(s.read_bytes))))
    return out


class _SourceView:
    __slots__ = ("tensor", "page_size", "num_bytes_per_token", "read_bytes")

    def __init__(self, t, s):
        self.tensor = t
        self.page_size, self.num_bytes_per_token, self.read_bytes = s.page_size, s.num_bytes_per_token, s.read_bytes


def _check_row_width(abi) -> None:
    for _, u8, (p, n, _r) in abi:
        if int(u8.shape[1]) < p * n:
            raise ValueError(
                "kv-canary: RealKvSource row is too narrow for its slot layout: "
                f"dim-1 is {int(u8.shape[1])} bytes but page_size={p} x num_bytes_per_token={n} needs {p * n}"
            )


def _check_canary_buf(buf: torch.Tensor) -> None:
    if buf.dtype != torch.uint8:
        raise TypeError(f"kv-canary: canary_buf must have dtype torch.uint8, got {buf.dtype}")
    if buf.dim() != 2:
        raise ValueError(f"kv-canary: canary_buf must be 2-D [num_slots, slot_stride_bytes], got shape {tuple(buf.shape)}")
    stride = int(buf.shape[1])
    if stride < constants.CANARY_SLOT_BYTES:
        raise ValueError(f"kv-canary: canary_buf slot stride must hold at least 4 int64 fields, got {stride // 8}")
    if stride % 8:
        raise ValueError(f"kv-canary: canary_buf slot stride must be a multiple of 8 bytes, got {stride}")
    if int(buf.shape[0]) < 1 or int(buf.shape[0]) >= 2**31:
        raise ValueError(f"kv-canary: canary_buf must have between 1 and 2**31 - 1 slots, got {buf.shape[0]}")


def _context_tensors(context: Any, *, with_flag: bool) -> dict[str, torch.Tensor]:
    names = ["canary_buf", "violation_ring", "violation_write_index", "slot_run_counter", "kernel_run_counter"]
    if with_flag:
        names.append("enable_chain_position_assert")
    return {n: _tensor(getattr(context, n, None), n) for n in names}


def _check_log(t: dict[str, torch.Tensor]) -> None:
    _want(t["violation_ring"], "violation_ring", torch.int64, (None, constants.VIOLATION_FIELDS))
    if t["violation_ring"].shape[0] < 1:
        raise ValueError("kv-canary: violation_ring must have at least one row")
    _want(t["violation_write_index"], "violation_write_index", torch.int32, (1,))
    _want(t["slot_run_counter"], "slot_run_counter", torch.int64, (1,))
    _want(t["kernel_run_counter"], "kernel_run_counter", torch.int64, (1,))


def _source_args(abi, mode: int) -> tuple[list[inplace.TensorArg], tuple]:
    if mode == int(constants.RealKvHashMode.NONE) or not abi:
        return [], ()  # never dereferenced (SGLang: NONE ignores sources)
    args = [inplace.TensorArg(f"real_kv_sources[{i}].tensor", u8, False, owner) for i, (owner, u8, _) in enumerate(abi)]
    return args, tuple(meta for _, _, meta in abi)


def _check_devices(named: dict[str, torch.Tensor], ref: str) -> None:
    dev = named[ref].device
    for n, t in named.items():
        if t.device != dev:
            raise ValueError(
                f"kv-canary: {n} must be on {ref}'s device {dev}, got {t.device} (a launch cannot mix devices)"
            )


# --- verify ----------------------------------------------------------------------------------------------
def launch_canary_verify_kernel(*, context: Any, plan: Any, check_verify_expected_token: bool,
                                backend: str | None = None) -> None:
    """SGLang's ``launch_canary_verify_kernel`` on torch tensors (SPEC 5; canary-jax ``verify_reference``).

    Calling contract: ``kernel_run_counter += 1`` always; with ``plan.enable[0] != 0``:
    ``slot_run_counter += min(num_valid, C)`` and each failing entry appends a row to ``violation_ring`` (in
    entry order) and bumps ``violation_write_index``. ``canary_buf``, the plan and the sources are read-only.

    Raises:
      ValueError / TypeError: SGLang's errors and the interop's (see the module docstring); nothing runs.
    """
    sources = tuple(getattr(context, "real_kv_sources", ()) or ())
    _check_source_count(sources)
    ctx = _context_tensors(context, with_flag=False)
    pl = {f"plan.{f}": _tensor(getattr(plan, f, None), f"plan.{f}") for f in kernels.VERIFY_PLAN_FIELDS}
    order = ["canary_buf", *pl, "violation_ring", "violation_write_index", "slot_run_counter", "kernel_run_counter"]
    named = {**ctx, **pl}
    for n in order:
        dlpack.check_contiguous(named[n], n)
    abi = _source_abi(sources)
    tag, mode = _tag(context.kernel_kind), _mode(getattr(context, "real_kv_hash_mode", 0))
    _check_canary_buf(ctx["canary_buf"])
    cap = pl["plan.verify_slot_indices"].shape[0] if pl["plan.verify_slot_indices"].dim() == 1 else None
    for f in kernels.VERIFY_PLAN_FIELDS[:4]:
        _want(pl[f"plan.{f}"], f"plan.{f}", torch.int64, (cap,))
    _want(pl["plan.verify_num_valid"], "plan.verify_num_valid", torch.int32, (1,))
    _want(pl["plan.enable"], "plan.enable", torch.int32, (1,))
    _check_log(ctx)
    if mode != int(constants.RealKvHashMode.NONE):
        _check_row_width(abi)
    src_args, meta = _source_args(abi, mode)
    _check_devices({**named, **{a.name: a.tensor for a in src_args}}, "canary_buf")
    args = [inplace.TensorArg("canary_buf", ctx["canary_buf"])]
    args += [inplace.TensorArg(n, t) for n, t in pl.items()]
    args += [inplace.TensorArg(n, ctx[n], True) for n in order[-4:]]
    args += src_args
    backend = backends.resolve_backend(backend, platform=ctx["canary_buf"].device.type)
    statics = (backend, tag, mode, meta, bool(check_verify_expected_token))
    inplace.run_in_place("verify", statics, kernels.verify_body_factory, args)


# --- write -----------------------------------------------------------------------------------------------
def launch_canary_write_kernel(*, context: Any, plan: Any, input_ids: torch.Tensor, positions: torch.Tensor,
                               out_cache_loc: torch.Tensor, enable_write_input_assert: bool,
                               expected_input_tokens: torch.Tensor | None,
                               expected_input_positions: torch.Tensor | None, backend: str | None = None) -> None:
    """SGLang's ``launch_canary_write_kernel`` on torch tensors (SPEC 6; canary-jax ``write_reference``).

    Calling contract: ``kernel_run_counter += 1`` always; every live entry with ``out_cache_loc >= 0`` stores
    ``(token, position, running prev_hash, real_kv_hash)`` into its slot of ``canary_buf`` and counts in
    ``slot_run_counter``; input-assert and chain-position mismatches append rows (request-major, entry order).

    Raises:
      ValueError / TypeError: SGLang's errors and the interop's (see the module docstring); nothing runs.
    """
    sources = tuple(getattr(context, "real_kv_sources", ()) or ())
    _check_source_count(sources)
    ctx = _context_tensors(context, with_flag=True)
    pl = {f"plan.{f}": _tensor(getattr(plan, f, None), f"plan.{f}") for f in kernels.WRITE_PLAN_FIELDS}
    toks = {"input_ids": _tensor(input_ids, "input_ids"), "positions": _tensor(positions, "positions"),
            "out_cache_loc": _tensor(out_cache_loc, "out_cache_loc")}
    for n, t in [("canary_buf", ctx["canary_buf"]), *pl.items(), *toks.items()]:
        dlpack.check_contiguous(t, n)
    flag = bool(enable_write_input_assert)
    if flag:
        if expected_input_tokens is None or expected_input_positions is None:
            raise ValueError("kv-canary: expected input tensors are required when enable_write_input_assert=True")
        toks["expected_input_tokens"] = _tensor(expected_input_tokens, "expected_input_tokens")
        toks["expected_input_positions"] = _tensor(expected_input_positions, "expected_input_positions")
        dlpack.check_contiguous(toks["expected_input_tokens"], "expected_input_tokens")
        dlpack.check_contiguous(toks["expected_input_positions"], "expected_input_positions")
    elif expected_input_tokens is not None or expected_input_positions is not None:
        raise ValueError("kv-canary: expected input tensors must be None when enable_write_input_assert=False")
    for n in ("violation_ring", "violation_write_index", "slot_run_counter", "kernel_run_counter",
              "enable_chain_position_assert"):
        dlpack.check_contiguous(ctx[n], n)
    abi = _source_abi(sources)
    tag, mode = _tag(context.kernel_kind), _mode(getattr(context, "real_kv_hash_mode", 0))
    _check_canary_buf(ctx["canary_buf"])
    seeds = pl["plan.write_seed_slot_indices"]
    _want(seeds, "plan.write_seed_slot_indices", torch.int64, (None,))
    cw = int(seeds.shape[0])
    off = pl["plan.write_offsets"]
    if off.dim() != 1 or off.shape[0] != cw + 1:
        raise ValueError(
            f"canary_write: write_offsets.size(0) must equal write_req_capacity + 1 ({cw + 1}), "
            f"got {off.shape[0] if off.dim() else 0}"
        )
    _want(off, "plan.write_offsets", torch.int64, (cw + 1,))
    _want(pl["plan.write_num_valid_reqs"], "plan.write_num_valid_reqs", torch.int32, (1,))
    t_len = toks["input_ids"].shape[0] if toks["input_ids"].dim() == 1 else None
    for n, t in toks.items():
        _want(t, n, torch.int64, (t_len,))
    _check_log(ctx)
    _want(ctx["enable_chain_position_assert"], "enable_chain_position_assert", torch.int32, (1,))
    if mode != int(constants.RealKvHashMode.NONE):
        _check_row_width(abi)
    src_args, meta = _source_args(abi, mode)
    _check_devices({**ctx, **pl, **toks, **{a.name: a.tensor for a in src_args}}, "canary_buf")
    args = [inplace.TensorArg("canary_buf", ctx["canary_buf"], True)]
    args += [inplace.TensorArg(n, t) for n, t in pl.items()]
    args += [inplace.TensorArg(n, t) for n, t in toks.items()]
    args += [inplace.TensorArg(n, ctx[n], True)
             for n in ("violation_ring", "violation_write_index", "slot_run_counter", "kernel_run_counter")]
    args += [inplace.TensorArg("enable_chain_position_assert", ctx["enable_chain_position_assert"])]
    args += src_args
    backend = backends.resolve_backend(backend, platform=ctx["canary_buf"].device.type)
    statics = (backend, tag, mode, meta, flag)
    inplace.run_in_place("write", statics, kernels.write_body_factory, args)


# --- plan ------------------------------------------------------------------------------------------------
def launch_canary_plan_kernels(*, verify_plan_out: Any, write_plan_out: Any, req_pool_indices: torch.Tensor,
                               prefix_lens: torch.Tensor, extend_seq_lens: torch.Tensor, req_to_token: torch.Tensor,
                               swa_window_size: int, full_to_swa_index_mapping: torch.Tensor | None,
                               verify_capacity: int, req_to_verify_expected_tokens: torch.Tensor | None,
                               req_to_verify_expected_tokens_valid_lens: torch.Tensor | None,
                               kv_token_id_vs_position_offset: int, backend: str | None = None) -> None:
    """SGLang's ``launch_canary_plan_kernels`` on torch tensors (SPEC 7; canary-jax ``build_plans``).

    Fills ``verify_plan_out`` and ``write_plan_out`` in place. Regions SGLang leaves untouched keep their
    contents: verify entries past ``num_valid`` (all of them on overflow) and seeds past ``bs``;
    ``write_offsets`` past ``bs`` become zero. ``backend`` is accepted for symmetry (one implementation).

    Raises:
      ValueError / TypeError: SGLang's errors (device-specific like SGLang: CUDA tensors get the kernel
        path's checks and messages, CPU tensors the reference's) and the interop's; nothing runs.
    """
    del backend
    if swa_window_size > 0 and full_to_swa_index_mapping is None:
        raise ValueError(
            "kv-canary: launch_canary_plan_kernels requires full_to_swa_index_mapping when swa_window_size > 0"
        )
    vp = {f"verify_plan_out.{f}": _tensor(getattr(verify_plan_out, f, None), f"verify_plan_out.{f}")
          for f in kernels.VERIFY_PLAN_FIELDS}
    wp = {f"write_plan_out.{f}": _tensor(getattr(write_plan_out, f, None), f"write_plan_out.{f}")
          for f in kernels.WRITE_PLAN_FIELDS}
    ins = {"req_pool_indices": _tensor(req_pool_indices, "req_pool_indices"),
           "prefix_lens": _tensor(prefix_lens, "prefix_lens"),
           "extend_seq_lens": _tensor(extend_seq_lens, "extend_seq_lens"),
           "req_to_token": _tensor(req_to_token, "req_to_token")}
    on_cuda = vp["verify_plan_out.verify_slot_indices"].device.type == "cuda"
    bs = int(ins["req_pool_indices"].shape[0]) if ins["req_pool_indices"].dim() >= 1 else 0
    if on_cuda and bs > PLAN_BS_BLOCK_SIZE:
        raise ValueError(
            f"kv-canary: launch_canary_plan_kernels supports at most bs={PLAN_BS_BLOCK_SIZE} reqs per launch, "
            f"got bs={bs}. Bump _PLAN_BS_BLOCK_SIZE if real workloads need this."
        )
    plan_cap = int(vp["verify_plan_out.verify_slot_indices"].shape[0])
    if int(verify_capacity) != plan_cap:
        who = "launch_canary_plan_kernels" if on_cuda else "launch_canary_plan_kernels_torch_reference"
        raise ValueError(
            f"kv-canary: {who} verify_capacity={verify_capacity} does not match "
            f"verify_plan_out.verify_slot_indices.shape[0]={plan_cap}"
        )
    if full_to_swa_index_mapping is not None:
        ins["full_to_swa_index_mapping"] = _tensor(full_to_swa_index_mapping, "full_to_swa_index_mapping")
    has_pool = req_to_verify_expected_tokens is not None
    if has_pool:
        if req_to_verify_expected_tokens_valid_lens is None:
            who = "launch_plan_entries_kernel" if on_cuda else "launch_canary_plan_kernels_torch_reference"
            raise ValueError(
                f"kv-canary: {who} requires req_to_verify_expected_tokens_valid_lens when "
                "req_to_verify_expected_tokens is set"
            )
        ins["req_to_verify_expected_tokens"] = _tensor(req_to_verify_expected_tokens, "req_to_verify_expected_tokens")
        ins["req_to_verify_expected_tokens_valid_lens"] = _tensor(
            req_to_verify_expected_tokens_valid_lens, "req_to_verify_expected_tokens_valid_lens")
    for n, t in {**ins, **vp, **wp}.items():
        dlpack.check_contiguous(t, n)
    for n in ("req_pool_indices", "prefix_lens", "extend_seq_lens"):
        _want(ins[n], n, torch.int64, (bs,))
    _want(ins["req_to_token"], "req_to_token", torch.int32, (None, None))
    if "full_to_swa_index_mapping" in ins:
        _want(ins["full_to_swa_index_mapping"], "full_to_swa_index_mapping", torch.int64, (None,))
        if ins["full_to_swa_index_mapping"].shape[0] < 1:
            raise ValueError("kv-canary: lut_len must be positive when has_swa_lut is True, got 0")
    if has_pool:
        _want(ins["req_to_verify_expected_tokens"], "req_to_verify_expected_tokens", torch.int32, (None, None))
        _want(ins["req_to_verify_expected_tokens_valid_lens"], "req_to_verify_expected_tokens_valid_lens",
              torch.int64, (bs,))
    for f in kernels.VERIFY_PLAN_FIELDS[:4]:
        _want(vp[f"verify_plan_out.{f}"], f"verify_plan_out.{f}", torch.int64, (plan_cap,))
    _want(vp["verify_plan_out.verify_num_valid"], "verify_plan_out.verify_num_valid", torch.int32, (1,))
    _want(vp["verify_plan_out.enable"], "verify_plan_out.enable", torch.int32, (1,))
    seeds = wp["write_plan_out.write_seed_slot_indices"]
    _want(seeds, "write_plan_out.write_seed_slot_indices", torch.int64, (None,))
    cw = int(seeds.shape[0])
    _want(wp["write_plan_out.write_offsets"], "write_plan_out.write_offsets", torch.int64, (cw + 1,))
    _want(wp["write_plan_out.write_num_valid_reqs"], "write_plan_out.write_num_valid_reqs", torch.int32, (1,))
    if bs > cw:
        raise ValueError(f"kv-canary: bs={bs} exceeds write_req_capacity={cw}")
    _check_devices({**vp, **wp, **ins}, "verify_plan_out.verify_slot_indices")
    args = [inplace.TensorArg(n, t) for n, t in ins.items()]
    args += [inplace.TensorArg(n, t, True) for n, t in {**vp, **wp}.items()]
    statics = (int(swa_window_size), int(kv_token_id_vs_position_offset), "full_to_swa_index_mapping" in ins, has_pool)
    inplace.run_in_place("plan", statics, kernels.plan_body_factory, args)
