"""Shared harness of the kernel benchmarks: case and argument records, data, timing, the run's environment.

``benchmarks.bench`` and ``benchmarks.kernel_cases`` time the Pallas verify / write kernels with it;
``benchmarks.sweep_verify`` reuses its data, timing and environment record.

* Data: ``Data`` holds 4 random real-KV sources of ``ROW_BYTES``-byte rows over ``--pool`` slots and a random
  permutation of the slots; ``verify_chains`` cuts it into request-major chains of ``VERIFY_CHAIN_TOKENS``;
  ``populate`` stamps clean chains with the Pallas write.
* Timing: ``time_jax`` (a jitted, donating ``lax.fori_loop`` of ``n`` launches minus an empty program, median
  over repetitions) and ``time_peer`` (CUDA events around a CUDA graph of ``n`` launches).
* ``needed_bytes``: the bytes a case must move, for GB/s and the fraction of ``HBM_BYTES_PER_S``.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
import platform
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import canary_jax
from canary_jax.contract import constants, ints
from canary_jax.ops import reference
from pallas_kernels.write import write_pallas

HBM_BYTES_PER_S = 4.8e12  # the H200's HBM peak
TAG = constants.CanaryLaunchTag.TAIL_K_FULL
NONE, PARTIAL, ALL = constants.RealKvHashMode.NONE, constants.RealKvHashMode.PARTIAL, constants.RealKvHashMode.ALL
ROW_BYTES = 256  # bytes per real-KV source row
VERIFY_CHAIN_TOKENS = 1024  # tokens per request of the verify cases' chains


@dataclasses.dataclass(frozen=True)
class Case:
    """One timed case: ``op`` (verify | write), real-KV ``mode`` with ``num_sources`` sources; a write
    launches ``reqs`` requests of ``length`` tokens each."""

    id: str
    op: str  # verify | write
    mode: constants.RealKvHashMode
    num_sources: int
    reqs: int = 0
    length: int = 0


@dataclasses.dataclass(frozen=True)
class Args:
    """Sizes and repetition counts of one run (``n_*``: launches per timed program)."""

    pool: int
    entries: int
    long_tokens: int
    decode_reqs: int
    reps: int
    n_verify: int
    n_write: int
    n_ref: int
    n_peer: int
    seed: int
    only: str
    ref_x64_on: bool
    skip_reference: bool


def args_from_cli(a, *, n_peer: int, ref_x64_on: bool = False, skip_reference: bool = False) -> Args:
    """The run's ``Args`` from parsed command-line arguments (``pool``, ``entries``, ``long_tokens``,
    ``decode_reqs``, ``quick``, ``seed``, ``only``): 3 repetitions with ``--quick``, else 5."""
    return Args(
        pool=a.pool,
        entries=a.entries,
        long_tokens=a.long_tokens,
        decode_reqs=a.decode_reqs,
        reps=3 if a.quick else 5,
        n_verify=20,
        n_write=10,
        n_ref=3,
        n_peer=n_peer,
        seed=a.seed,
        only=a.only,
        ref_x64_on=ref_x64_on,
        skip_reference=skip_reference,
    )


# --- timing ------------------------------------------------------------------------------------------------
def median(xs) -> float:
    return float(np.median(np.asarray(xs)))


def time_jax(step, state, consts, *, n: int, reps: int):
    """Per-call seconds of ``state = step(state, consts)``.

    A jitted ``lax.fori_loop`` of ``n`` launches (static trip count: XLA runs it without host round trips,
    and the kernels are compiled once) that donates its state, minus an empty jitted program with the same
    arguments (the dispatch overhead), divided by ``n``; median over ``reps``. The loop's counter update is
    counted as ours (a bias of about a microsecond per call, against us).

    Returns:
      ``(seconds_per_call, final_state, info)``; ``info`` has ``compile_s`` (compile + first run),
      ``wall_s`` and ``empty_s`` (per repetition) and ``n``.
    """

    @functools.partial(jax.jit, donate_argnums=0)
    def many(s, c):
        return jax.lax.fori_loop(0, n, lambda i, s_: step(s_, c), s)

    @functools.partial(jax.jit, donate_argnums=0)
    def empty(s, c):  # same arguments, no device work: its wall time is the dispatch overhead
        return s

    t0 = time.perf_counter()
    state = jax.block_until_ready(many(state, consts))  # compile + warm up
    compile_s = time.perf_counter() - t0
    per_call, state, info = time_loop(many, state, consts, n=n, reps=reps, empty=empty)
    return per_call, state, {"compile_s": compile_s, **info}


def time_loop(many, state, consts, *, n: int, reps: int, empty=None):
    """Per-call seconds of ``state = many(state, consts)``, a (compiled) loop of ``n`` launches that donates its
    state: median wall time over ``reps`` minus that of ``empty`` (a program with the same arguments and no device
    work; None makes one), divided by ``n``. :func:`time_jax`'s timing, for a program compiled elsewhere.

    Returns:
      ``(seconds_per_call, final_state, {"wall_s", "empty_s", "n"})``.
    """
    if empty is None:
        empty = jax.jit(lambda s, c: s, donate_argnums=0)
    state = jax.block_until_ready(empty(state, consts))
    state = jax.block_until_ready(many(state, consts))
    walls, base = [], []
    for _ in range(reps):
        t = time.perf_counter()
        state = jax.block_until_ready(empty(state, consts))
        base.append(time.perf_counter() - t)
        t = time.perf_counter()
        state = jax.block_until_ready(many(state, consts))
        walls.append(time.perf_counter() - t)
    per_call = max(median(walls) - median(base), 0.0) / n
    return per_call, state, {"wall_s": walls, "empty_s": base, "n": n}


def time_peer(launch, *, n: int, reps: int):
    """Per-call seconds of ``launch(stream)`` (a cupy launch): CUDA events around ``n`` launches captured in a
    CUDA graph (plain launches if capture fails), median over ``reps``."""
    import cupy as cp

    stream = cp.cuda.Stream(non_blocking=True)
    graph = None
    try:
        with stream:
            stream.begin_capture()
            for _ in range(n):
                launch(stream)
            graph = stream.end_capture()
        graph.upload(stream)
    except Exception:  # noqa: BLE001 - fall back to plain launches
        graph = None
    run = (lambda: graph.launch(stream)) if graph is not None else (lambda: [launch(stream) for _ in range(n)])
    run()
    stream.synchronize()
    ts = []
    for _ in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record(stream)
        run()
        b.record(stream)
        b.synchronize()
        ts.append(cp.cuda.get_elapsed_time(a, b) * 1e-3)
    return median(ts) / n, {"graph": graph is not None, "n": n, "event_s": ts}


# --- data --------------------------------------------------------------------------------------------------
class Data:
    """Random inputs shared by every case of a run: 4 sources ``uint8[pool, ROW_BYTES]`` and ``perm``, a
    permutation of slots ``1 .. pool - 1``."""

    def __init__(self, args: Args):
        self.args = args
        self.rng = np.random.default_rng(args.seed)
        n = args.pool
        key = jax.random.PRNGKey(args.seed)
        self.sources_u8 = []
        for k in range(4):
            bits = jax.random.bits(jax.random.fold_in(key, k), (n, ROW_BYTES // 4), jnp.uint32)
            self.sources_u8.append(jax.lax.bitcast_convert_type(bits, jnp.uint8).reshape(n, ROW_BYTES))
        jax.block_until_ready(self.sources_u8)
        self.perm = self.rng.permutation(np.arange(1, n, dtype=np.int64))

    def sources(self, k: int):
        return tuple(
            canary_jax.RealKvSource(tensor=t, page_size=1, num_bytes_per_token=ROW_BYTES, read_bytes=ROW_BYTES)
            for t in self.sources_u8[:k]
        )


def int64_pairs(a) -> jax.Array:
    """Host int64 values as ``uint32[..., 2]`` pairs on the device."""
    return jnp.asarray(ints.int64_to_pairs_np(np.asarray(a, np.int64)))


def make_context(buf, log, srcs, mode):
    return canary_jax.VerifyOrWriteContext(
        canary_buf=buf, kernel_kind=TAG, log=log, real_kv_sources=srcs, real_kv_hash_mode=mode
    )


def with_tensors(srcs, tensors):
    """``srcs`` with their tensors replaced (the traced ones inside a timed program)."""
    return tuple(
        canary_jax.RealKvSource(
            tensor=t, page_size=s.page_size, num_bytes_per_token=s.num_bytes_per_token, read_bytes=s.read_bytes
        )
        for s, t in zip(srcs, tensors)
    )


def verify_chains(data: Data, entries: int):
    """The verify cases' entries: ``entries // VERIFY_CHAIN_TOKENS`` requests of ``VERIFY_CHAIN_TOKENS``
    random slots each, as ``(slots, positions, prev_slots)``, each ``int64[reqs, VERIFY_CHAIN_TOKENS]``
    (prev -1: the chain's head)."""
    length = VERIFY_CHAIN_TOKENS
    reqs = entries // length
    slots2d = data.perm[: reqs * length].reshape(reqs, length)
    pos2d = np.broadcast_to(np.arange(length, dtype=np.int64), (reqs, length))
    prev2d = np.concatenate([np.full((reqs, 1), -1, np.int64), slots2d[:, :-1]], axis=1)
    return slots2d, pos2d, prev2d


def needed_bytes(case: Case, args: Args) -> float:
    """Bytes a case must move at least (the GB/s figures divide these by the time)."""
    eff = 0 if case.mode == NONE else (16 if case.mode == PARTIAL else ROW_BYTES)
    if case.op == "verify":
        # plan slot/pos/prev 24 B + slot record 32 B + predecessor record 24 B + source bytes
        return args.entries * (24 + 32 + 24 + case.num_sources * eff)
    t = case.reqs * case.length
    # per token: slot/token/position 24 B + record store 32 B + source bytes; per request: offsets 16 B,
    # seed 8 B + seed record 24 B
    return t * (24 + 32 + case.num_sources * eff) + case.reqs * (16 + 8 + 24)


def populate(data: Data, buf, srcs, mode, slots2d, positions2d, cfg=None, *, write=None):
    """Writes clean chains (request-major) into ``buf`` with ``write`` (default the Pallas write); returns
    ``(buffer, token ids)``."""
    reqs, length = slots2d.shape
    plan = canary_jax.WritePlan.from_requests(counts=[length] * reqs, seed_slots=[-1] * reqs)
    ids = data.rng.integers(0, 1 << 31, reqs * length)
    ctx = make_context(buf, canary_jax.ViolationLog.allocate(ring_capacity=64), srcs, mode)
    del cfg  # always the default config: one compile serves every case and probe variant
    out = (write or write_pallas)(
        ctx, plan, int64_pairs(ids), int64_pairs(positions2d.reshape(-1)), int64_pairs(slots2d.reshape(-1))
    )
    assert int(out.log.write_index[0]) == 0
    return out.canary_buf, ids


def populate_reference(data: Data, buf, srcs, mode, slots2d, positions2d):
    """``populate`` with the jnp reference write (needs no write kernel); returns the buffer."""
    return populate(data, buf, srcs, mode, slots2d, positions2d, write=reference.write_reference)[0]


@dataclasses.dataclass(frozen=True)
class WriteInputs:
    """A write case's launch inputs: ``reqs`` requests of ``length`` tokens on distinct slots; a decode case
    (``length == 1``) seeds each request with a slot populated one step earlier, a longer one starts at the
    anchor."""

    srcs: list
    tensors: tuple
    slots: np.ndarray  # int64[T]
    buf0: jax.Array  # the populated canary buffer
    seeds: np.ndarray  # int64[reqs]
    positions: np.ndarray  # int64[T]
    plan: canary_jax.WritePlan
    ids_np: np.ndarray  # int64[T]


def write_inputs(case: Case, data: Data, args: Args, fill) -> WriteInputs:
    """The inputs of write ``case``; ``fill(buf, srcs, mode, slots2d, positions2d)`` populates the seeds."""
    reqs, length = case.reqs, case.length
    t = reqs * length
    srcs = data.sources(case.num_sources)
    tensors = tuple(s.tensor for s in srcs)
    slots = data.perm[-t:]  # distinct from each other
    buf0 = jnp.zeros((args.pool, 32), jnp.uint8)
    if length == 1:  # decode: seeds are slots written one step earlier (positions 0 .. reqs-1 + 10)
        seeds = data.perm[-t - reqs : -t]
        seed_pos = np.arange(reqs, dtype=np.int64) + 10
        buf0 = fill(buf0, srcs, case.mode, seeds.reshape(reqs, 1), seed_pos.reshape(reqs, 1))
        positions = seed_pos + 1
    else:
        seeds = np.full((reqs,), -1, np.int64)
        positions = np.arange(t, dtype=np.int64)
    plan = canary_jax.WritePlan.from_requests(counts=[length] * reqs, seed_slots=seeds)
    ids_np = data.rng.integers(0, 1 << 31, t)
    return WriteInputs(srcs, tensors, slots, buf0, seeds, positions, plan, ids_np)


# --- environment -------------------------------------------------------------------------------------------
def apply_pallas_config(fields_json: str | None) -> dict:
    """Replaces ``pallas_kernels.config.DEFAULT_CONFIG``'s fields with ``fields_json`` (a JSON object of
    ``PallasConfig`` fields) for every later launch of the process that is given no config; returns the fields
    (``{}`` for None). Raises ``ValueError`` / ``TypeError`` on an unknown field or a bad value
    (``PallasConfig``'s own checks)."""
    from pallas_kernels import config as pallas_config

    if not fields_json:
        return {}
    fields = json.loads(fields_json)
    # every launch reads the module's DEFAULT_CONFIG when it is given no config (config.launch_options)
    pallas_config.DEFAULT_CONFIG = dataclasses.replace(pallas_config.DEFAULT_CONFIG, **fields)
    return fields


def command_line() -> list[str]:
    """The command as run from the repository root: ``python -m benchmarks.X ARGS`` (no machine path)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:
        return ["python", "-m", spec.name, *sys.argv[1:]]
    return [os.path.basename(sys.argv[0]), *sys.argv[1:]]


def environment() -> dict:
    """Date, versions, devices, GPU (``nvidia-smi``), git commit and command line of this run."""
    env = {
        "date": datetime.date.today().isoformat(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "devices": [str(d) for d in jax.devices()],
        "argv": command_line(),
    }
    for mod in ("jaxlib", "cupy", "torch", "triton", "numpy"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            pass
    query = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm", "--format=csv,noheader"]
    here = os.path.dirname(os.path.abspath(__file__))
    for key, cmd, timeout, cwd in (("nvidia_smi", query, 20, None), ("git", ["git", "rev-parse", "HEAD"], 5, here)):
        try:
            env[key] = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd).stdout.strip()
        except Exception:  # noqa: BLE001
            pass
    return env
