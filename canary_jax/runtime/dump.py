"""Saving and loading canary state: the violation log, the canary buffers and, for debugging, the KV and the
requests they describe, in one ``.npz`` that ``canary-jax verify-dump`` reads.

A dump is a plain numpy archive (no pickles). SGLang's own layouts are kept where it has one, so its tools read
the pieces as they are: the ring is ``int64[R, 8]`` (SGLang's ``violation_ring``), the canary buffers are
``uint8[num_slots, stride]``, the counters ``int64[12]``. Keys (``{i}`` = buffer group, ``{h}`` = ``k`` / ``v``):

=================================  ==========================================================================
key                                what
=================================  ==========================================================================
``canary_jax_dump_version``        ``int64``: :data:`DUMP_VERSION`
``ring``, ``write_index``          ``int64[R, 8]``, ``int32[1]``: the violation ring and its write index
``slot_run_counters``,             ``int64[12]`` per launch tag (SPEC 1.5)
``kernel_run_counters``
``enable_chain_position_assert``   ``int32[1]``
``num_groups``                     ``int64``: buffer groups
``g{i}_kind``                      ``int64``: PoolKind (0 FULL, 1 SWA)
``g{i}_{h}_head``, ``g{i}_{h}_tail``  ``uint8[num_slots, stride]``: the HEAD / TAIL canary buffers (V only if the
                                   group has a V half)
``g{i}_swa_index_lut``             ``int64[full_pool_size + 1]`` (SWA groups)
``g{i}_swa_window_size``,          ``int64``
``g{i}_kv_token_id_vs_position_offset``
``g{i}_{h}_src{j}``                ``uint8[rows, row_bytes]``: real-KV source ``j`` of the group's half, as bytes
``g{i}_{h}_src{j}_layout``         ``int64[8]``: page_size, num_bytes_per_token, read_bytes, has_chunks,
                                   chunk_bytes, num_chunks, chunk_stride_bytes, offset_bytes
``real_kv_hash_mode``              ``int64``: NONE 0 / PARTIAL 1 / ALL 2
``req_to_token``,                  ``int32[rows, L]``, ``int64[bs]``, ``int64[bs]``: the live requests (the
``req_pool_indices``, ``seq_lens``  dumped slots' positions; verify-dump re-verifies each buffer over them)
``step``                           ``int64``: the outer step of the dump
=================================  ==========================================================================

:func:`save_dump` writes one; :func:`load_dump` reads it back as device state (byte-identical: the canary
buffers, ring, write index, counters and flag) plus host metadata. Reading back is a host-side operation: a
dump is taken off the hot path (it copies the device state to the host).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from canary_jax.contract import constants, ints, layout, sources
from canary_jax.runtime.groups import CanaryBufferGroup, PoolKind
from canary_jax.runtime.state import CanaryState

__all__ = [
    "DUMP_VERSION",
    "CanaryDump",
    "DumpError",
    "dump_arrays",
    "load_dump",
    "read_arrays",
    "save_dump",
]

DUMP_VERSION = 1
VERSION_KEY = "canary_jax_dump_version"
_HALVES = ("k", "v")
_LAYOUT_FIELDS = 8


class DumpError(ValueError):
    """A dump file that cannot be read, or that holds nothing the reader recognises."""


# --- writing ---------------------------------------------------------------------------------------------
def _host(x: Any) -> np.ndarray:
    return np.asarray(x)


def _source_bytes(tensor: Any, name: str) -> np.ndarray:
    """A source tensor's bytes as ``uint8[rows, row_bytes]`` on the host."""
    if sources.element_bits(tensor.dtype) < 8:
        raise NotImplementedError(
            f"kv-canary: {name} has the packed sub-byte dtype {tensor.dtype}; a dump cannot save it as bytes yet"
        )
    arr = np.ascontiguousarray(np.asarray(tensor))
    return arr.view(np.uint8).reshape(arr.shape[0], -1)


def _layout(s: sources.RealKvSource) -> np.ndarray:
    ch = getattr(s, "chunks", None)
    extra = (
        (0, 0, 0, 0, 0) if ch is None else (1, ch.chunk_bytes, ch.num_chunks, ch.chunk_stride_bytes, ch.offset_bytes)
    )
    return np.array([s.page_size, s.num_bytes_per_token, s.read_bytes, *extra], np.int64)


def dump_arrays(
    state: CanaryState | layout.ViolationLog,
    *,
    real_kv_sources: Sequence | None = None,
    real_kv_hash_mode: Any = None,
    req_to_token: Any = None,
    req_pool_indices: Any = None,
    seq_lens: Any = None,
    step: int | None = None,
) -> dict[str, np.ndarray]:
    """The archive's arrays (see the module doc) without writing them: a host copy of the device state.

    Args:
      state: a :class:`~canary_jax.runtime.state.CanaryState` (log and buffer groups) or a bare
        :class:`~canary_jax.contract.layout.ViolationLog`.
      real_kv_sources: one ``(sources_k, sources_v)`` pair per group (None / ``()`` for a half without), the KV
        as it is now; saved as bytes so the real-KV fingerprints can be recomputed. None saves no KV.
      real_kv_hash_mode: the mode the state was built with (NONE / PARTIAL / ALL), or None if unknown.
      req_to_token: ``int32[rows, L]``; req_pool_indices, seq_lens: int64-valued ``[bs]`` (any lossless form),
        the live requests; all three or none.
      step: the outer step, or None.

    Raises:
      TypeError: ``state`` of another type, or a source that is not a RealKvSource.
      ValueError: sources not one pair per group; request metadata given in part, or of mismatched lengths.
      NotImplementedError: a source of a packed sub-byte dtype.
    """
    if isinstance(state, CanaryState):
        log, groups = state.log, state.groups
    elif isinstance(state, layout.ViolationLog):
        log, groups = state, ()
    else:
        raise TypeError(f"kv-canary: state must be a CanaryState or a ViolationLog, got {type(state).__name__}")
    out: dict[str, np.ndarray] = {
        VERSION_KEY: np.int64(DUMP_VERSION),
        "ring": ints.pairs_to_int64_np(_host(log.ring)),
        "write_index": _host(log.write_index).astype(np.int32).reshape(1),
        "slot_run_counters": ints.pairs_to_int64_np(_host(log.slot_run_counters)),
        "kernel_run_counters": ints.pairs_to_int64_np(_host(log.kernel_run_counters)),
        "enable_chain_position_assert": _host(log.enable_chain_position_assert).astype(np.int32).reshape(1),
        "num_groups": np.int64(len(groups)),
    }
    for i, g in enumerate(groups):
        p = f"g{i}_"
        out[p + "kind"] = np.int64(int(g.kind))
        out[p + "swa_window_size"] = np.int64(int(g.swa_window_size))
        out[p + "kv_token_id_vs_position_offset"] = np.int64(int(g.kv_token_id_vs_position_offset))
        for name in ("k_head", "k_tail", "v_head", "v_tail"):
            buf = getattr(g, name)
            if buf is not None:
                out[p + name] = _host(buf).astype(np.uint8, copy=False)
        if g.swa_index_lut is not None:
            out[p + "swa_index_lut"] = ints.pairs_to_int64_np(_host(g.swa_index_lut))
    if real_kv_sources is not None:
        real_kv_sources = tuple(real_kv_sources)
        if len(real_kv_sources) != len(groups):
            raise ValueError(f"kv-canary: real_kv_sources has {len(real_kv_sources)} entries for {len(groups)} groups")
        for i, pair in enumerate(real_kv_sources):
            halves = (None, None) if pair is None else tuple(pair)
            if len(halves) != 2:
                raise ValueError(f"kv-canary: real_kv_sources[{i}] must be a (sources_k, sources_v) pair")
            for h, srcs in zip(_HALVES, halves):
                for j, s in enumerate(() if srcs is None else tuple(srcs)):
                    if not isinstance(s, sources.RealKvSource):
                        raise TypeError(
                            f"kv-canary: real_kv_sources[{i}] {h.upper()} source {j} must be a RealKvSource, "
                            f"got {type(s).__name__}"
                        )
                    key = f"g{i}_{h}_src{j}"
                    out[key] = _source_bytes(s.tensor, key)
                    out[key + "_layout"] = _layout(s)
    if real_kv_hash_mode is not None:
        out["real_kv_hash_mode"] = np.int64(int(constants.RealKvHashMode(int(real_kv_hash_mode))))
    meta = (req_to_token, req_pool_indices, seq_lens)
    if any(m is not None for m in meta):
        if any(m is None for m in meta):
            raise ValueError("kv-canary: pass req_to_token, req_pool_indices and seq_lens together (or none)")
        rpi = _int64(req_pool_indices, "req_pool_indices")
        lens = _int64(seq_lens, "seq_lens")
        if rpi.shape != lens.shape:
            raise ValueError(f"kv-canary: req_pool_indices has {rpi.size} entries but seq_lens has {lens.size}")
        r2t = ints.as_int32(np.asarray(req_to_token), name="req_to_token", shape=(None, None))
        out["req_to_token"] = np.asarray(r2t)
        out["req_pool_indices"] = rpi
        out["seq_lens"] = lens
    if step is not None:
        out["step"] = np.int64(ints.check_int(step, name="step"))
    return out


def _int64(x: Any, name: str) -> np.ndarray:
    a = np.asarray(x)
    if a.ndim == 2 and a.shape[-1] == 2 and a.dtype == np.uint32:
        return ints.pairs_to_int64_np(a)
    return ints.exact_int64_np(a, name=name).reshape(-1)


def save_dump(path: str | os.PathLike, state: CanaryState | layout.ViolationLog, **kw: Any) -> str:
    """Writes :func:`dump_arrays` of ``state`` to ``path`` (``.npz``; numpy adds the suffix if missing).

    Returns:
      The path written.

    Raises:
      As :func:`dump_arrays`; OSError when the file cannot be written.
    """
    arrays = dump_arrays(state, **kw)
    path = os.fspath(path)
    if not path.endswith(".npz"):
        path += ".npz"
    with open(path, "wb") as f:
        np.savez(f, **arrays)
    return path


# --- reading ---------------------------------------------------------------------------------------------
def read_arrays(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every array of a ``.npy`` (under the key ``""``) or ``.npz`` file, pickles refused.

    Raises:
      DumpError: a directory, a missing or unreadable file, a file that is not ``.npy`` / ``.npz``, or an empty
        archive.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        raise DumpError(f"{path} is a directory, not a .npy/.npz file")
    if not os.path.isfile(path):
        raise DumpError(f"dump file not found: {path}")
    try:
        with open(path, "rb") as f:
            magic = f.read(6)
    except OSError as e:
        raise DumpError(f"cannot read {path}: {e.strerror}") from None
    if magic != b"\x93NUMPY" and magic[:4] not in (b"PK\x03\x04", b"PK\x05\x06"):
        raise DumpError(f"{path} is not a .npy or .npz file")
    try:
        obj = np.load(path, allow_pickle=False)
        if isinstance(obj, np.ndarray):
            return {"": obj}
        with obj:
            data = {k: obj[k] for k in obj.files}
    except Exception as e:  # numpy raises several types for bad files
        raise DumpError(f"cannot read {path} as .npy/.npz: {e}") from None
    if not data:
        raise DumpError(f"{path} is an empty .npz archive (no arrays); nothing to decode")
    return data


@dataclasses.dataclass(frozen=True, kw_only=True)
class CanaryDump:
    """A dump read back.

    Fields:
      log: the :class:`~canary_jax.contract.layout.ViolationLog` (device arrays, byte-identical to the saved one).
      state: the :class:`~canary_jax.runtime.state.CanaryState` (None for a log-only dump).
      real_kv_sources: one ``(sources_k, sources_v)`` pair of numpy-backed
        :class:`~canary_jax.contract.sources.RealKvSource` per group (``uint8[rows, row_bytes]`` tensors), or None.
      real_kv_hash_mode: the saved mode, or None.
      req_to_token, req_pool_indices, seq_lens: the saved request metadata (numpy), or None.
      step: the saved outer step, or None.
      arrays: every array of the file.
    """

    log: layout.ViolationLog
    state: CanaryState | None
    real_kv_sources: tuple | None
    real_kv_hash_mode: constants.RealKvHashMode | None
    req_to_token: np.ndarray | None
    req_pool_indices: np.ndarray | None
    seq_lens: np.ndarray | None
    step: int | None
    arrays: Mapping[str, np.ndarray]


def _scalar(data: Mapping[str, np.ndarray], key: str) -> int | None:
    if key not in data:
        return None
    a = np.asarray(data[key]).reshape(-1)
    if a.size != 1 or a.dtype.kind not in "iu":
        raise DumpError(f"{key} has shape {data[key].shape} dtype {data[key].dtype}; expected one integer")
    return int(a[0])


def _need(data: Mapping[str, np.ndarray], key: str) -> np.ndarray:
    if key not in data:
        raise DumpError(f"the dump has no {key!r} (a canary-jax dump of version {DUMP_VERSION} has one)")
    return data[key]


def _device_pairs(a: np.ndarray) -> jax.Array:
    return ints.to_device(ints.int64_to_pairs_np(np.asarray(a, np.int64)))


def source_from_arrays(tensor: np.ndarray, layout_row: np.ndarray) -> sources.RealKvSource:
    """A RealKvSource over saved bytes (``uint8[rows, row_bytes]``) and its ``int64[8]`` layout row."""
    v = [int(x) for x in np.asarray(layout_row).reshape(-1)]
    if len(v) != _LAYOUT_FIELDS:
        raise DumpError(f"a source layout holds {_LAYOUT_FIELDS} integers, got {len(v)}")
    kw = {}
    if v[3]:
        kw["chunks"] = sources.SlotChunks(chunk_bytes=v[4], num_chunks=v[5], chunk_stride_bytes=v[6], offset_bytes=v[7])
    try:
        return sources.RealKvSource(tensor=tensor, page_size=v[0], num_bytes_per_token=v[1], read_bytes=v[2], **kw)
    except (TypeError, ValueError) as e:
        raise DumpError(f"a saved real-KV source is malformed: {e}") from None


def group_sources(data: Mapping[str, np.ndarray], i: int, half: str) -> tuple[sources.RealKvSource, ...]:
    """The saved sources of group ``i``'s ``half`` (``"k"`` / ``"v"``), in order."""
    out = []
    j = 0
    while f"g{i}_{half}_src{j}" in data:
        key = f"g{i}_{half}_src{j}"
        out.append(source_from_arrays(data[key], _need(data, key + "_layout")))
        j += 1
    return tuple(out)


def load_dump(path: str | os.PathLike) -> CanaryDump:
    """Reads a dump written by :func:`save_dump` back (host to device for the state).

    Returns:
      A :class:`CanaryDump`; its ``state`` / ``log`` equal the saved ones byte for byte.

    Raises:
      DumpError: an unreadable file, a file without ``canary_jax_dump_version`` (e.g. a bare SGLang ring:
        ``canary-jax verify-dump`` reads those), a newer version, or missing / malformed arrays.
    """
    data = read_arrays(path)
    version = _scalar(data, VERSION_KEY)
    if version is None:
        raise DumpError(
            f"{os.fspath(path)} is not a canary-jax dump (no {VERSION_KEY}); `canary-jax verify-dump` decodes "
            "bare rings and canary buffers"
        )
    if version > DUMP_VERSION:
        raise DumpError(f"{os.fspath(path)} is a dump of version {version}; this canary-jax reads up to {DUMP_VERSION}")
    ring = np.asarray(_need(data, "ring"))
    if ring.ndim != 2 or ring.shape[1] != constants.VIOLATION_FIELDS or ring.dtype != np.int64:
        raise DumpError(f"ring has shape {ring.shape} dtype {ring.dtype}; expected int64[R, 8]")
    try:
        log = layout.ViolationLog(
            ring=_device_pairs(ring),
            write_index=ints.to_device(np.asarray(_need(data, "write_index"), np.int32).reshape(1)),
            slot_run_counters=_device_pairs(_need(data, "slot_run_counters")),
            kernel_run_counters=_device_pairs(_need(data, "kernel_run_counters")),
            enable_chain_position_assert=ints.to_device(
                np.asarray(_need(data, "enable_chain_position_assert"), np.int32).reshape(1)
            ),
            launch_ticket=ints.to_device(np.zeros((1,), np.int32)),  # zero between launches, as allocate() makes it
        )
        log.check()
    except (TypeError, ValueError) as e:
        raise DumpError(f"the dump's violation log is malformed: {e}") from None
    n = _scalar(data, "num_groups") or 0
    groups, srcs = [], []
    has_sources = any(k.startswith("g") and "_src" in k for k in data)
    for i in range(n):
        p = f"g{i}_"
        bufs = {name: data.get(p + name) for name in ("k_head", "k_tail", "v_head", "v_tail")}
        if bufs["k_head"] is None or bufs["k_tail"] is None:
            raise DumpError(f"group {i} has no {p}k_head / {p}k_tail canary buffers")
        lut = data.get(p + "swa_index_lut")
        try:
            g = CanaryBufferGroup(
                kind=PoolKind(_scalar(data, p + "kind") or 0),
                **{k: None if v is None else ints.to_device(np.asarray(v, np.uint8)) for k, v in bufs.items()},
                swa_index_lut=None if lut is None else _device_pairs(lut),
                kv_token_id_vs_position_offset=_scalar(data, p + "kv_token_id_vs_position_offset") or 0,
                swa_window_size=_scalar(data, p + "swa_window_size") or 0,
            )
        except (TypeError, ValueError) as e:
            raise DumpError(f"group {i} of the dump is malformed: {e}") from None
        groups.append(g)
        srcs.append((group_sources(data, i, "k"), group_sources(data, i, "v")))
    state = CanaryState(groups=tuple(groups), log=log) if groups else None
    mode = _scalar(data, "real_kv_hash_mode")
    meta = [data.get(k) for k in ("req_to_token", "req_pool_indices", "seq_lens")]
    return CanaryDump(
        log=log,
        state=state,
        real_kv_sources=tuple(srcs) if has_sources else None,
        real_kv_hash_mode=None if mode is None else constants.RealKvHashMode(mode),
        req_to_token=None if meta[0] is None else np.asarray(meta[0], np.int32),
        req_pool_indices=None if meta[1] is None else np.asarray(meta[1], np.int64),
        seq_lens=None if meta[2] is None else np.asarray(meta[2], np.int64),
        step=_scalar(data, "step"),
        arrays=data,
    )
