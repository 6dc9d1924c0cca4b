"""A CUDA peer written for canary-jax following SGLang's published kv-canary kernel design (SPEC 5, 6).

Not SGLang's code: our own CUDA C, compiled with cupy's ``RawKernel``, following the design the SPEC
describes, so the Pallas kernels have a same-machine, same-run baseline:

* verify: a persistent grid (64 blocks x 512 threads) striding over the entries, one thread per entry,
  native 64-bit arithmetic, real-KV bytes read 16 at a time; per-thread counts folded with a warp reduce and
  one ``atomicAdd`` per warp; violations appended with ``atomicAdd`` on the write index (nondeterministic
  order across entries, as in SGLang).
* write: one thread per request (grid = write_req_capacity blocks x 1 thread) walking its entries serially,
  hashing the real-KV bytes of each written slot inline.

Data layout is SGLang's: int64 plan / token arrays, a ``uint8[N, stride]`` canary buffer, an ``int64[R, 8]``
ring, ``int32[1]`` write index, ``int64[1]`` counters and up to 4 real-KV sources addressed by
``row * row_stride + (slot % page_size) * num_bytes_per_token``.
"""

from __future__ import annotations

import numpy as np

_SOURCE = r"""
typedef unsigned long long u64;
typedef long long i64;

#define ANCHOR_HASH 0xDE7FAE23A9A1B716ULL

__device__ __forceinline__ u64 sm64(u64 x) {
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

__device__ __forceinline__ u64 mix3(u64 a, u64 b, u64 c) {
  u64 h = sm64(a);
  h = sm64(h ^ b);
  return sm64(h ^ c);
}

struct Sources {
  const unsigned char* ptr[4];
  i64 page_size[4];
  i64 nbpt[4];
  i64 read_bytes[4];
  i64 row_stride[4];
  int num;
  int mode;  // 0 NONE, 1 PARTIAL, 2 ALL
};

// params: int64[4][4] = (page_size, num_bytes_per_token, read_bytes, row_stride_bytes) per source.
__device__ __forceinline__ Sources make_sources(const unsigned char* p0, const unsigned char* p1,
                                                const unsigned char* p2, const unsigned char* p3,
                                                const i64* params, int num, int mode) {
  Sources s;
  s.ptr[0] = p0; s.ptr[1] = p1; s.ptr[2] = p2; s.ptr[3] = p3;
  #pragma unroll
  for (int k = 0; k < 4; ++k) {
    s.page_size[k] = params[4 * k + 0];
    s.nbpt[k] = params[4 * k + 1];
    s.read_bytes[k] = params[4 * k + 2];
    s.row_stride[k] = params[4 * k + 3];
  }
  s.num = num;
  s.mode = mode;
  return s;
}

__device__ __forceinline__ u64 real_kv_hash(const Sources& s, i64 slot) {
  if (s.mode == 0 || s.num == 0) return 0ULL;
  u64 acc = 0ULL;
  #pragma unroll
  for (int k = 0; k < 4; ++k) {
    if (k >= s.num) break;
    const i64 eff = (s.mode == 1) ? 16 : s.read_bytes[k];
    const i64 row = slot / s.page_size[k];
    const i64 col = (slot % s.page_size[k]) * s.nbpt[k];
    const ulonglong2* p = reinterpret_cast<const ulonglong2*>(s.ptr[k] + row * s.row_stride[k] + col);
    u64 h = 0ULL;
    for (i64 c = 0; c < eff / 16; ++c) {
      const ulonglong2 v = p[c];
      h = sm64(h ^ v.x);
      h = sm64(h ^ v.y);
    }
    acc = sm64(acc ^ h);
  }
  return acc;
}

__device__ __forceinline__ void put_row(i64* ring, int ring_cap, int* write_index, i64 c0, i64 c1, i64 c2,
                                        i64 c3, i64 c4, i64 c5, i64 c6, i64 c7) {
  const int seq = atomicAdd(write_index, 1);
  if (seq < ring_cap) {
    i64* r = ring + (i64)seq * 8;
    r[0] = c0; r[1] = c1; r[2] = c2; r[3] = c3; r[4] = c4; r[5] = c5; r[6] = c6; r[7] = c7;
  }
}

extern "C" __global__ void peer_verify(
    const unsigned char* canary, i64 stride, const i64* slots, const i64* exp_tok, const i64* exp_pos,
    const i64* prev, const int* num_valid, const int* enable, i64 cap, i64* ring, int ring_cap,
    int* write_index, unsigned long long* slot_counter, unsigned long long* kernel_counter, int tag, int check,
    const unsigned char* p0, const unsigned char* p1, const unsigned char* p2, const unsigned char* p3,
    const i64* src_params, int num_sources, int mode) {
  const Sources src = make_sources(p0, p1, p2, p3, src_params, num_sources, mode);
  const i64 tid = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  const i64 nthreads = (i64)gridDim.x * blockDim.x;
  if (tid == 0) atomicAdd(kernel_counter, 1ULL);
  if (enable[0] == 0) return;
  i64 active = num_valid[0];
  active = active < 0 ? 0 : (active > cap ? cap : active);
  unsigned long long local = 0ULL;
  for (i64 i = tid; i < active; i += nthreads) {
    local += 1ULL;
    const i64 slot = slots[i];
    if (slot == 0) continue;
    const i64* rec = reinterpret_cast<const i64*>(canary + slot * stride);
    const i64 tok = rec[0], pos = rec[1], ph = rec[2], rk = rec[3];
    const i64 et = check ? exp_tok[i] : -1;
    const i64 ps = prev[i];
    const bool reachable = ps != 0;
    u64 expc;
    if (ps < 0) {
      expc = ANCHOR_HASH;
    } else if (ps == 0) {
      expc = (u64)ph;
    } else {
      const i64* pr = reinterpret_cast<const i64*>(canary + ps * stride);
      expc = mix3((u64)pr[2], (u64)pr[0], (u64)pr[1]);
    }
    const u64 erk = real_kv_hash(src, slot);
    i64 bits = 0;
    if (reachable && (u64)ph != expc) bits |= 1;
    if (check && et != -1 && tok != et) bits |= 32;
    if (pos != exp_pos[i]) bits |= 2;
    if ((u64)rk != erk) bits |= 4;
    if (bits) put_row(ring, ring_cap, write_index, tag, slot, pos, tok, et, ph, (i64)expc, bits);
  }
  for (int o = 16; o > 0; o >>= 1) local += __shfl_down_sync(0xffffffffu, local, o);
  if ((threadIdx.x & 31) == 0 && local) atomicAdd(slot_counter, local);
}

extern "C" __global__ void peer_write(
    unsigned char* canary, i64 stride, i64 num_slots, const i64* offsets, const i64* seeds, const int* num_reqs,
    i64 cw, const i64* ids, const i64* positions, const i64* loc, i64* ring, int ring_cap, int* write_index,
    unsigned long long* slot_counter, unsigned long long* kernel_counter, const int* chain_assert, int tag,
    const unsigned char* p0, const unsigned char* p1, const unsigned char* p2, const unsigned char* p3,
    const i64* src_params, int num_sources, int mode) {
  const Sources src = make_sources(p0, p1, p2, p3, src_params, num_sources, mode);
  const i64 r = blockIdx.x;
  if (r == 0 && threadIdx.x == 0) atomicAdd(kernel_counter, 1ULL);
  i64 nv = num_reqs[0];
  nv = nv < 0 ? 0 : (nv > cw ? cw : nv);
  if (r >= nv || threadIdx.x != 0) return;
  const i64 start = offsets[r];
  const i64 count = offsets[r + 1] - start;
  if (count <= 0) return;
  const i64 seed = seeds[r];
  u64 running;
  i64 run_pos = 0;
  const bool gate = seed >= 0 && chain_assert[0] != 0;
  if (seed < 0) {
    running = ANCHOR_HASH;
  } else {
    const i64* sr = reinterpret_cast<const i64*>(canary + seed * stride);
    running = mix3((u64)sr[2], (u64)sr[0], (u64)sr[1]);
    if (gate) run_pos = sr[1];
  }
  unsigned long long written = 0ULL;
  for (i64 j = 0; j < count; ++j) {
    const i64 i = start + j;
    const i64 slot = loc[i];
    if (slot < 0) continue;
    const i64 tok = ids[i];
    const i64 pos = positions[i];
    const u64 rk = real_kv_hash(src, slot);
    if (gate) {
      if (pos != run_pos + 1)
        put_row(ring, ring_cap, write_index, tag, slot, pos, tok, tok, (i64)running, run_pos + 1, 16);
      run_pos = pos;
    }
    i64* rec = reinterpret_cast<i64*>(canary + slot * stride);
    rec[0] = tok; rec[1] = pos; rec[2] = (i64)running; rec[3] = (i64)rk;
    running = mix3(running, (u64)tok, (u64)pos);
    written += 1ULL;
  }
  atomicAdd(slot_counter, written);
}
"""


class CudaPeer:
    """cupy-compiled peer kernels; every array argument is a cupy array in SGLang's layout."""

    VERIFY_GRID = 64
    VERIFY_BLOCK = 512

    def __init__(self):
        import cupy as cp

        self.cp = cp
        module = cp.RawModule(code=_SOURCE, options=("-std=c++17",))
        self._verify = module.get_function("peer_verify")
        self._write = module.get_function("peer_write")

    def sources(self, srcs, mode: int):
        """srcs: list of (cupy uint8 2-D array, page_size, num_bytes_per_token, read_bytes) -> kernel args."""
        cp = self.cp
        params = np.zeros((4, 4), np.int64)
        ptrs = []
        for k, (arr, page, nbpt, read) in enumerate(srcs):
            params[k] = (page, nbpt, read, arr.strides[0])
            ptrs.append(arr)
        dummy = cp.zeros((16,), cp.uint8)
        self._keep = (dummy,)
        while len(ptrs) < 4:
            ptrs.append(dummy)
        return tuple(ptrs) + (cp.asarray(params.reshape(-1)), np.int32(len(srcs)), np.int32(int(mode)))

    def verify(
        self,
        canary,
        slots,
        exp_tok,
        exp_pos,
        prev,
        num_valid,
        enable,
        ring,
        write_index,
        slot_counter,
        kernel_counter,
        *,
        tag: int,
        check: bool,
        sources,
        stream=None,
    ):
        args = (
            canary,
            np.int64(canary.shape[1]),
            slots,
            exp_tok,
            exp_pos,
            prev,
            num_valid,
            enable,
            np.int64(slots.shape[0]),
            ring,
            np.int32(ring.shape[0]),
            write_index,
            slot_counter,
            kernel_counter,
            np.int32(tag),
            np.int32(int(check)),
        ) + tuple(sources)
        self._launch(self._verify, (self.VERIFY_GRID,), (self.VERIFY_BLOCK,), args, stream)

    def write(
        self,
        canary,
        offsets,
        seeds,
        num_reqs,
        ids,
        positions,
        loc,
        ring,
        write_index,
        slot_counter,
        kernel_counter,
        chain_assert,
        *,
        tag: int,
        sources,
        stream=None,
    ):
        cw = seeds.shape[0]
        args = (
            canary,
            np.int64(canary.shape[1]),
            np.int64(canary.shape[0]),
            offsets,
            seeds,
            num_reqs,
            np.int64(cw),
            ids,
            positions,
            loc,
            ring,
            np.int32(ring.shape[0]),
            write_index,
            slot_counter,
            kernel_counter,
            chain_assert,
            np.int32(tag),
        ) + tuple(sources)
        self._launch(self._write, (max(1, cw),), (1,), args, stream)

    @staticmethod
    def _launch(kernel, grid, block, args, stream):
        if stream is None:
            kernel(grid, block, args)
        else:
            with stream:
                kernel(grid, block, args)
