"""The benchmark's shapes and targets: the decoder shape (Qwen3-0.6B, or tiny for the CPU smoke test), the
scenarios (decode b1 / b128, chunked prefill), the modes and their hash modes, the percent / ms / us targets,
and each scenario's roofline (bytes over HBM bandwidth for decode, FLOPs over the bf16 peak for prefill)."""

from __future__ import annotations

import dataclasses

from benchmarks import harness
from canary_jax.contract.constants import RealKvHashMode

PEAK_BF16_FLOPS = 790e12  # measured on this workplace's H200 (KINDS.md), dense bf16 on random data
HBM = harness.HBM_BYTES_PER_S  # 4.8 TB/s
MODES = ("off", "none", "partial", "all")
HASH = {"none": RealKvHashMode.NONE, "partial": RealKvHashMode.PARTIAL, "all": RealKvHashMode.ALL}
SCENARIOS = ("decode128", "prefill", "decode1")  # run order of --scenario all (the main targets first)
PARTS = ("plan", "head_verify", "head_write", "tail_verify", "tail_write", "sweep")
TARGETS = {"prefill": 9.0, "decode128": 2.5, "decode1": 5.0}  # PARTIAL over off, percent
HEAD_TAIL_TARGET_MS = {"partial": 0.3, "all": 0.6}  # decode b128
WRITE_TARGET_US = 8.0  # decode write 4096 x 1, NONE


# --- shapes --------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ModelShape:
    """Decoder shape (Qwen3-0.6B by default; tied embeddings)."""

    layers: int = 28
    hidden: int = 1024
    q_heads: int = 16
    kv_heads: int = 8
    head_dim: int = 128
    mlp: int = 3072
    vocab: int = 151936
    rope_theta: float = 1_000_000.0
    eps: float = 1e-6

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def q_dim(self) -> int:
        return self.q_heads * self.head_dim

    @property
    def layer_matmul_params(self) -> int:
        h = self.hidden
        return h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h + 3 * h * self.mlp

    @property
    def params(self) -> int:
        norms = 2 * self.hidden + 2 * self.head_dim
        return self.layers * (self.layer_matmul_params + norms) + self.vocab * self.hidden + self.hidden

    @property
    def weight_bytes(self) -> int:
        return 2 * self.params


QWEN3_0_6B = ModelShape()
SMALL_MODEL = ModelShape(layers=2, hidden=64, q_heads=4, kv_heads=2, head_dim=32, mlp=128, vocab=512)


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One forward shape: ``batch`` requests, each with ``prefix`` tokens in the pool, writing ``new`` tokens;
    the pool also holds ``cached_reqs - batch`` other requests of ``cached_len`` tokens (swept, never run)."""

    name: str
    kind: str  # decode | prefill
    batch: int
    prefix: int
    new: int
    cached_reqs: int
    cached_len: int
    steps: int  # steps per timed call (a multiple of the sweep interval)
    part_launches: int  # launches per timed call of a part's own program

    @property
    def context(self) -> int:
        return self.prefix + self.new

    @property
    def tokens(self) -> int:
        return self.batch * self.new

    @property
    def verify_entries(self) -> int:
        return self.batch * self.prefix

    @property
    def sweep_entries(self) -> int:
        return self.batch * self.context + (self.cached_reqs - self.batch) * self.cached_len

    @property
    def row_len(self) -> int:
        return max(self.context, self.cached_len)


def scenarios(small: bool) -> dict[str, Scenario]:
    if small:
        return {
            "decode1": Scenario("decode1", "decode", 1, 63, 1, 1, 64, 4, 4),
            "decode128": Scenario("decode128", "decode", 8, 63, 1, 8, 64, 4, 4),
            "prefill": Scenario("prefill", "prefill", 1, 32, 32, 4, 64, 4, 4),
        }
    return {
        "decode1": Scenario("decode1", "decode", 1, 4095, 1, 1, 4096, 64, 50),
        "decode128": Scenario("decode128", "decode", 128, 4095, 1, 128, 4096, 8, 20),
        "prefill": Scenario("prefill", "prefill", 1, 8192, 8192, 32, 16384, 4, 8),
    }


def bucket(n: int) -> int:
    return max(16, 1 << max(0, int(n) - 1).bit_length())


def roofline(scn: Scenario, m: ModelShape) -> dict:
    """Decode: (weights + KV read) / HBM. Prefill: FLOPs / the bf16 peak (bytes given beside)."""
    kv_tok = 2 * m.kv_dim * 2 * m.layers  # K and V, all layers, bf16
    if scn.kind == "decode":
        kv_read = scn.batch * scn.context * kv_tok
        b = m.weight_bytes + kv_read
        return {"basis": "bytes / 4.8 TB/s", "bytes": b, "kv_read_bytes": kv_read, "ms": 1e3 * b / HBM}
    t = scn.tokens
    mm = 2 * t * m.layers * m.layer_matmul_params + 2 * m.hidden * m.vocab
    avg_keys = scn.prefix + (scn.new + 1) / 2  # causal chunk after its prefix
    att = 4 * t * avg_keys * m.q_heads * m.head_dim * m.layers
    flops = mm + att
    b = m.weight_bytes + scn.batch * scn.context * kv_tok
    return {
        "basis": "FLOPs / 790 TFLOP/s",
        "flops": flops,
        "matmul_flops": mm,
        "attention_flops": att,
        "bytes": b,
        "ms": 1e3 * flops / PEAK_BF16_FLOPS,
        "bytes_ms": 1e3 * b / HBM,
    }
