"""PallasConfig variants of the verify sweep (``benchmarks.sweep_verify``): named presets and the parser of
``--variants`` / ``--single``."""

from __future__ import annotations

import json

# Presets; the first DEFAULT_VARIANTS run by default, most informative first.
PRESETS: dict[str, dict] = {
    "default": {},
    "b128w4": dict(verify_source_block=128, verify_num_warps=4),  # one entry per thread
    "b64w2": dict(verify_source_block=64, verify_num_warps=2),  # one entry per thread, smaller programs
    "b256w8": dict(verify_source_block=256, verify_num_warps=8),  # one entry per thread, bigger programs
    "unroll1": dict(source_unroll=1),
    "unroll4": dict(source_unroll=4),
    "sg_word": dict(source_gather="word"),
    "sg_quad": dict(source_gather="quad"),
    "gather_quad": dict(gather="quad"),
    # extras (name them in --variants)
    "unroll0": dict(source_unroll=0),  # straight-line real-KV code: compiles ~10x slower on the H200 (results/)
    "b128w4_unroll4": dict(verify_source_block=128, verify_num_warps=4, source_unroll=4),
    "b128w4_sg_quad": dict(verify_source_block=128, verify_num_warps=4, source_gather="quad"),
    "b128w4_p8192": dict(verify_source_block=128, verify_num_warps=4, verify_max_programs=8192),
    "b64w2_p16384": dict(verify_source_block=64, verify_num_warps=2, verify_max_programs=16384),
    "b512w8": dict(verify_source_block=512, verify_num_warps=8),
    "w8": dict(verify_num_warps=8),
    "w2": dict(verify_num_warps=2),
    "p1056": dict(verify_max_programs=1056),
    "portable": dict(multiplier="portable"),
    "tile_contiguous": dict(source_gather="tile_contiguous"),  # 16-byte loads + shared-memory hand-over
    "tile_contiguous32": dict(source_gather="tile_contiguous", source_tile_words=32),
    "tile32": dict(source_tile_words=32),
}
DEFAULT_VARIANTS = ["default", "b128w4", "b64w2", "b256w8", "unroll1", "unroll4", "sg_word", "sg_quad", "gather_quad"]


def parse_variants(spec: str) -> list[tuple[str, dict]]:
    """``(name, overrides)`` per variant of ``spec``: empty (``DEFAULT_VARIANTS``), comma-separated preset
    names, or JSON (a list of preset names and / or override dicts, or a dict ``{name: overrides}``)."""
    spec = spec.strip()
    if not spec:
        return [(n, PRESETS[n]) for n in DEFAULT_VARIANTS]
    if spec[0] in "[{":
        obj = json.loads(spec)
        items = list(obj.items()) if isinstance(obj, dict) else obj
    else:
        items = [s for s in spec.split(",") if s]
    out = []
    for it in items:
        if isinstance(it, str):
            if it not in PRESETS:
                raise SystemExit(f"unknown preset {it!r}; presets: {', '.join(PRESETS)}")
            out.append((it, PRESETS[it]))
        elif isinstance(it, dict):
            out.append((",".join(f"{k}={v}" for k, v in it.items()) or "default", dict(it)))
        else:  # (name, overrides) from a JSON dict
            name, kw = it
            out.append((str(name), dict(kw)))
    return out
