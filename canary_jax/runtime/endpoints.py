"""Launch endpoints: who verifies and writes which canary buffer, and the dispatch (SPEC 8.2).

Each :class:`~canary_jax.runtime.groups.CanaryBufferGroup` yields up to six :class:`CanaryEndpoint` (HEAD /
TAIL / SWEEP x K / V; no V half for MLA-style pools), built by :func:`build_endpoints_from_group` (SGLang
``endpoint.py``):

* HEAD -> its own buffer (``k_head`` / ``v_head``) and **no real-KV sources** (head records hash 0);
* TAIL -> ``k_tail`` / ``v_tail`` with the real-KV sources of that half (passed in with the launch: a group
  holds no KV data);
* SWEEP -> **shares** the TAIL buffer and the sources of the same half;
* the LUT is the group's ``swa_index_lut`` for SWA groups, None for FULL.

JAX is functional, so an endpoint is a *view* of a group at one moment: a launch returns the updated endpoint
(new ``canary_buf``) and the new :class:`~canary_jax.layout.ViolationLog`, and
:meth:`~canary_jax.runtime.groups.CanaryBufferGroup.with_endpoint` writes the buffer back under the endpoint's
``buffer_name``. Counters need no views: the log holds the per-tag arrays and each launch bumps ``[tag]``.
All endpoints of a manager share one log.

:func:`dispatch` routes any endpoint to the launch its tag allows (``launch_sweep`` for SWEEP tags,
``launch_per_forward`` otherwise); :func:`launch_group` runs a whole phase of a group that way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import jax

from canary_jax import constants, ints, launch, layout, validation
from canary_jax.plans import VerifyOrWriteContext, VerifyPlan, WritePlan
from canary_jax.runtime.groups import CanaryBufferGroup, PoolKind
from canary_jax.slot_tables import swa_translate

__all__ = [
    "CanaryEndpoint",
    "ExpectedInputs",
    "build_endpoints_from_group",
    "dispatch",
    "launch_group",
    "select_endpoints",
    "split_sources",
]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ExpectedInputs:
    """Expected per-token inputs for the write-input assert (SGLang ``ExpectedInputs``), pre-sliced to T.

    Fields:
      tokens: int64-valued ``[T]`` expected input ids.
      positions: int64-valued ``[T]`` expected positions.
    """

    tokens: Any
    positions: Any


jax.tree_util.register_dataclass(ExpectedInputs, data_fields=["tokens", "positions"], meta_fields=[])


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CanaryEndpoint:
    """One launch unit: a tag, its canary buffer, LUT and real-KV sources (SGLang ``CanaryEndpoint``).

    Fields:
      kernel_kind: the CanaryLaunchTag (stamped in column 0, indexes the counters).
      canary_buf: ``uint8[num_slots, slot_stride_bytes]`` this endpoint verifies / writes.
      full_to_swa_index_mapping: ``uint32[L, 2]`` LUT for SWA endpoints, None for FULL.
      real_kv_sources: 0..4 RealKvSource (empty for HEAD).
      buffer_name: which group buffer ``canary_buf`` is (``k_head`` / ``k_tail`` / ``v_head`` / ``v_tail``).
    """

    kernel_kind: constants.CanaryLaunchTag
    canary_buf: Any
    full_to_swa_index_mapping: Any
    real_kv_sources: tuple
    buffer_name: str

    @property
    def is_sweep(self) -> bool:
        return constants.CanaryLaunchTag(int(self.kernel_kind)).is_sweep

    def _context(self, log: layout.ViolationLog, mode) -> VerifyOrWriteContext:
        return VerifyOrWriteContext(
            canary_buf=self.canary_buf,
            kernel_kind=constants.CanaryLaunchTag(int(self.kernel_kind)),
            log=log,
            real_kv_sources=tuple(self.real_kv_sources),
            real_kv_hash_mode=constants.RealKvHashMode(int(mode)),
        )

    def launch_per_forward(
        self,
        *,
        verify_plan: VerifyPlan,
        write_plan: WritePlan,
        input_ids: Any,
        positions: Any,
        out_cache_loc: Any,
        violation_log: layout.ViolationLog,
        enable_write_input_assert: bool = False,
        enable_verify_token_assert: bool = False,
        expected_inputs: ExpectedInputs | None = None,
        real_kv_hash_mode: constants.RealKvHashMode = constants.RealKvHashMode.NONE,
        backend: str | None = None,
    ) -> tuple[CanaryEndpoint, layout.ViolationLog]:
        """HEAD / TAIL launch: verify ``verify_plan``, then write the step's tokens (SPEC 8.2).

        (1) verify with the token check iff ``enable_verify_token_assert``; (2) SWA endpoints translate
        ``out_cache_loc`` through the LUT (negative stays negative = write skip; a slot past the LUT clamps
        to its last entry, never reading outside it); (3) write, with the expected tensors only when
        ``enable_write_input_assert``.

        Args:
          input_ids, positions, out_cache_loc: int64-valued ``[T]`` ForwardBatch arrays (out_cache_loc in
            full-pool slots; padding tokens after the real rows).
          expected_inputs: required iff ``enable_write_input_assert``.

        Returns:
          ``(endpoint with the new canary_buf, new violation log)``.

        Raises:
          NotImplementedError: on a SWEEP endpoint ("kv-canary: launch_per_forward not supported on sweep
            endpoint SWEEP_K_FULL").
          ValueError: expected inputs missing while the write assert is on; any launch check.
        """
        tag = constants.CanaryLaunchTag(int(self.kernel_kind))
        if tag.is_sweep:
            raise NotImplementedError(f"kv-canary: launch_per_forward not supported on sweep endpoint {tag.name}")
        if enable_write_input_assert:
            has = expected_inputs is not None
            validation.check_expected_inputs(True, has_tokens=has, has_positions=has)
        ctx = launch.verify(
            self._context(violation_log, real_kv_hash_mode),
            verify_plan,
            check_verify_expected_token=bool(enable_verify_token_assert),
            backend=backend,
        )
        loc = out_cache_loc
        if self.full_to_swa_index_mapping is not None:
            loc = swa_translate(
                ints.as_int64_pairs(out_cache_loc, name="out_cache_loc", shape=(None,)), self.full_to_swa_index_mapping
            )
        if enable_write_input_assert:
            et, ep = expected_inputs.tokens, expected_inputs.positions
        else:
            et = ep = None
        ctx = launch.write(
            ctx,
            write_plan,
            input_ids,
            positions,
            loc,
            enable_write_input_assert=bool(enable_write_input_assert),
            expected_input_tokens=et,
            expected_input_positions=ep,
            backend=backend,
        )
        return dataclasses.replace(self, canary_buf=ctx.canary_buf), ctx.log

    def launch_sweep(
        self,
        *,
        verify_plan: VerifyPlan,
        violation_log: layout.ViolationLog,
        real_kv_hash_mode: constants.RealKvHashMode = constants.RealKvHashMode.NONE,
        backend: str | None = None,
    ) -> layout.ViolationLog:
        """SWEEP launch: verify only, token check off; the buffer is read-only.

        Raises:
          NotImplementedError: on a HEAD / TAIL endpoint ("kv-canary: launch_sweep not supported on
            non-sweep endpoint HEAD_K_FULL").
        """
        tag = constants.CanaryLaunchTag(int(self.kernel_kind))
        if not tag.is_sweep:
            raise NotImplementedError(f"kv-canary: launch_sweep not supported on non-sweep endpoint {tag.name}")
        ctx = launch.verify(
            self._context(violation_log, real_kv_hash_mode),
            verify_plan,
            check_verify_expected_token=False,
            backend=backend,
        )
        return ctx.log


jax.tree_util.register_pytree_node(
    CanaryEndpoint,
    lambda e: (
        (e.canary_buf, e.full_to_swa_index_mapping, tuple(e.real_kv_sources)),
        (constants.CanaryLaunchTag(int(e.kernel_kind)), e.buffer_name),
    ),
    lambda aux, ch: CanaryEndpoint(
        kernel_kind=aux[0],
        canary_buf=ch[0],
        full_to_swa_index_mapping=ch[1],
        real_kv_sources=tuple(ch[2]),
        buffer_name=aux[1],
    ),
)

# Per group, its tags in SGLang's endpoint order (HEAD-K, HEAD-V, TAIL-K, TAIL-V, SWEEP-K, SWEEP-V), which is
# the tags' value order, as (tag, phase, half): e.g. (TAIL_V_SWA, "TAIL", "v").
_LAYOUT = {
    kind: tuple(
        (t, t.name.split("_")[0], t.name.split("_")[1].lower())
        for t in constants.CanaryLaunchTag
        if t.group == kind.name
    )
    for kind in PoolKind
}


def build_endpoints_from_group(
    group: CanaryBufferGroup, *, real_kv_sources: tuple | None = None
) -> tuple[CanaryEndpoint, ...]:
    """The group's endpoints in SGLang's order HEAD-K, HEAD-V, TAIL-K, TAIL-V, SWEEP-K, SWEEP-V (V skipped
    without a V half): 3 or 6 endpoints, FULL tags 0..5 or SWA tags 6..11.

    Args:
      group: the :class:`~canary_jax.runtime.groups.CanaryBufferGroup`.
      real_kv_sources: ``(sources_k, sources_v)``: 0..4 :class:`~canary_jax.sources.RealKvSource` per half
        viewing the KV pool now (None or ``()`` for a half without sources), or None for none at all.

    HEAD endpoints get no real-KV sources; TAIL and SWEEP endpoints of a half get that half's sources and SWEEP
    shares the TAIL buffer. Cheap (no copies): rebuild it for every launch.

    Raises:
      TypeError: not a group, or ``real_kv_sources`` not a pair.
      ValueError: V-half sources for a group without a V half.
    """
    if not isinstance(group, CanaryBufferGroup):
        raise TypeError(f"kv-canary: group must be a CanaryBufferGroup, got {type(group).__name__}")
    by_half = dict(zip("kv", split_sources(real_kv_sources, group)))
    lut = group.swa_index_lut if group.kind is PoolKind.SWA else None
    out = []
    for tag, slot, half in _LAYOUT[group.kind]:
        if half == "v" and not group.has_v_half:
            continue
        buffer_name = f"{half}_{'head' if slot == 'HEAD' else 'tail'}"
        sources = () if slot == "HEAD" else by_half[half]
        out.append(
            CanaryEndpoint(
                kernel_kind=tag,
                canary_buf=getattr(group, buffer_name),
                full_to_swa_index_mapping=lut,
                real_kv_sources=tuple(sources),
                buffer_name=buffer_name,
            )
        )
    return tuple(out)


def split_sources(real_kv_sources: tuple | None, group: CanaryBufferGroup) -> tuple[tuple, tuple]:
    """``(sources_k, sources_v)`` as two tuples (None -> ``()``) for ``group``.

    Raises:
      TypeError: ``real_kv_sources`` is not None or a ``(sources_k, sources_v)`` pair.
      ValueError: V-half sources for a group without a V half.
    """
    if real_kv_sources is None:
        return (), ()
    if not isinstance(real_kv_sources, (tuple, list)) or len(real_kv_sources) != 2:
        raise TypeError(
            f"kv-canary: real-KV sources of group {group.kind.name} must be a (sources_k, sources_v) pair, "
            f"got {type(real_kv_sources).__name__}"
        )
    k, v = (() if x is None else tuple(x) for x in real_kv_sources)
    if v and not group.has_v_half:
        raise ValueError(f"kv-canary: V-half real-KV sources given for group {group.kind.name}, which has no V half")
    return k, v


def select_endpoints(
    endpoints: Iterable[CanaryEndpoint], phase: str, *, enable_v_half: bool = True
) -> tuple[CanaryEndpoint, ...]:
    """Endpoints of one phase (``"head"``, ``"tail"`` or ``"sweep"``), V halves only if ``enable_v_half``
    (SGLang's ``SGLANG_KV_CANARY_ENABLE_MHA_V`` gate; default off there).

    Raises:
      ValueError: an unknown phase.
    """
    phase = str(phase).lower()
    if phase not in ("head", "tail", "sweep"):
        raise ValueError(f"kv-canary: phase must be one of head/tail/sweep, got {phase!r}")
    out = []
    for e in endpoints:
        tag = constants.CanaryLaunchTag(int(e.kernel_kind))
        if not tag.name.lower().startswith(phase + "_"):
            continue
        if tag.is_v_half and not enable_v_half:
            continue
        out.append(e)
    return tuple(out)


def dispatch(
    endpoint: CanaryEndpoint,
    *,
    verify_plan: VerifyPlan,
    violation_log: layout.ViolationLog,
    write_plan: WritePlan | None = None,
    input_ids: Any = None,
    positions: Any = None,
    out_cache_loc: Any = None,
    enable_write_input_assert: bool = False,
    enable_verify_token_assert: bool = False,
    expected_inputs: ExpectedInputs | None = None,
    real_kv_hash_mode: constants.RealKvHashMode = constants.RealKvHashMode.NONE,
    backend: str | None = None,
) -> tuple[CanaryEndpoint, layout.ViolationLog]:
    """Routes ``endpoint`` to the launch its tag allows, so callers never hit the NotImplementedError.

    SWEEP tags -> :meth:`CanaryEndpoint.launch_sweep` (the write arguments are ignored; the endpoint comes
    back unchanged); HEAD / TAIL tags -> :meth:`CanaryEndpoint.launch_per_forward`.

    Returns:
      ``(endpoint, violation_log)`` after the launch.

    Raises:
      ValueError: a HEAD / TAIL endpoint without ``write_plan`` / token arrays.
    """
    if endpoint.is_sweep:
        log = endpoint.launch_sweep(
            verify_plan=verify_plan, violation_log=violation_log, real_kv_hash_mode=real_kv_hash_mode, backend=backend
        )
        return endpoint, log
    missing = [
        n
        for n, v in (
            ("write_plan", write_plan),
            ("input_ids", input_ids),
            ("positions", positions),
            ("out_cache_loc", out_cache_loc),
        )
        if v is None
    ]
    if missing:
        tag = constants.CanaryLaunchTag(int(endpoint.kernel_kind))
        raise ValueError(f"kv-canary: per-forward endpoint {tag.name} needs {', '.join(missing)}")
    return endpoint.launch_per_forward(
        verify_plan=verify_plan,
        write_plan=write_plan,
        input_ids=input_ids,
        positions=positions,
        out_cache_loc=out_cache_loc,
        violation_log=violation_log,
        enable_write_input_assert=enable_write_input_assert,
        enable_verify_token_assert=enable_verify_token_assert,
        expected_inputs=expected_inputs,
        real_kv_hash_mode=real_kv_hash_mode,
        backend=backend,
    )


def launch_group(
    group: CanaryBufferGroup,
    phase: str,
    *,
    verify_plan: VerifyPlan,
    violation_log: layout.ViolationLog,
    enable_v_half: bool = True,
    real_kv_sources: tuple | None = None,
    **launch_kw,
) -> tuple[CanaryBufferGroup, layout.ViolationLog]:
    """Runs every endpoint of ``group`` in ``phase`` (``head`` / ``tail`` / ``sweep``), K before V, through
    :func:`dispatch`, and returns the group with its updated buffers and the new log.

    ``real_kv_sources`` is the ``(sources_k, sources_v)`` pair viewing the KV pool now (see
    :func:`build_endpoints_from_group`); HEAD launches never read it.

    ``launch_kw`` are :func:`dispatch`'s per-forward arguments (write_plan, input_ids, positions,
    out_cache_loc, enable_write_input_assert, enable_verify_token_assert, expected_inputs,
    real_kv_hash_mode, backend); a sweep uses only real_kv_hash_mode and backend.
    """
    log = violation_log
    endpoints = build_endpoints_from_group(group, real_kv_sources=real_kv_sources)
    for ep in select_endpoints(endpoints, phase, enable_v_half=enable_v_half):
        if ep.is_sweep:
            kw = {k: v for k, v in launch_kw.items() if k in ("real_kv_hash_mode", "backend")}
        else:
            kw = launch_kw
        ep, log = dispatch(ep, verify_plan=verify_plan, violation_log=log, **kw)
        if not ep.is_sweep:
            group = group.with_endpoint(ep)
    return group, log
