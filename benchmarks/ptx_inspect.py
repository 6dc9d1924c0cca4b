"""PTX of the Pallas Triton kernels as lowered, and what ``ptxas -v`` / ``cuobjdump -sass`` say about it.

``PtxCapture`` wraps ``jax._src.lib.triton.compile`` to keep each lowered kernel's PTX; ``ptx_report`` writes
it to a folder and runs ``ptxas -v`` (registers, spills, stack, shared memory) and ``cuobjdump -sass`` on it,
with static PTX counts (``ptx_static``) and a theoretical sm_90 occupancy (``occupancy``); ``archive_ptx``
packs the text files. Used by ``benchmarks.sweep_verify --ptx``.
"""

from __future__ import annotations

import functools
import math
import os
import re
import shutil
import subprocess


class PtxCapture:
    """Wraps ``jax._src.lib.triton.compile`` (what the Pallas Triton lowering calls on jaxlib > 0.10.2) and
    keeps the PTX of every kernel lowered while ``sink`` is a list."""

    def __init__(self):
        self.sink: list | None = None
        self.error = None
        try:
            from jax._src.lib import triton as jt

            orig = jt.compile

            @functools.wraps(orig)
            def wrapped(*a, **k):
                res = orig(*a, **k)
                if self.sink is not None:
                    try:
                        asm = res.asm
                        asm = asm.decode() if isinstance(asm, bytes) else str(asm)
                        self.sink.append(
                            dict(
                                asm=asm,
                                smem_bytes=int(getattr(res, "smem_bytes", 0) or 0),
                                num_warps=k.get("num_warps"),
                                num_stages=k.get("num_stages"),
                                arch=a[2] if len(a) > 2 else k.get("arch_name"),
                            )
                        )
                    except Exception as e:  # noqa: BLE001
                        self.error = f"capture: {type(e).__name__}: {e}"
                return res

            jt.compile = wrapped
            try:  # a lowering module that imported the function itself
                from jax._src.pallas.triton import pallas_call_registration as reg

                for k, v in list(vars(reg).items()):
                    if v is orig:
                        setattr(reg, k, wrapped)
            except Exception:  # noqa: BLE001
                pass
        except Exception as e:  # noqa: BLE001
            self.error = f"cannot wrap jax._src.lib.triton.compile: {type(e).__name__}: {e}"


def _int(pattern, text, default=None):
    m = re.search(pattern, text)
    return int(m.group(1)) if m else default


def ptx_static(asm: str) -> dict:
    lines = asm.splitlines()
    ld = [ln for ln in lines if re.search(r"\bld\.global", ln)]
    return {
        "ptx_lines": len(lines),
        "ld_global": len(ld),
        "ld_global_v2": sum(".v2" in ln for ln in ld),
        "ld_global_v4": sum(".v4" in ln for ln in ld),
        "st_global": sum(bool(re.search(r"\bst\.global", ln)) for ln in lines),
        "ld_shared": sum(bool(re.search(r"\bld\.shared", ln)) for ln in lines),
        "st_shared": sum(bool(re.search(r"\bst\.shared", ln)) for ln in lines),
        "bar_sync": sum(bool(re.search(r"\bbar\.sync|\bbarrier\.sync", ln)) for ln in lines),
        "maxntid": (re.search(r"\.(?:maxntid|reqntid)\s+([\d, ]+)", asm) or [None, None])[1],
        "maxnreg": _int(r"\.maxnreg\s+(\d+)", asm),
    }


def parse_ptxas(text: str) -> dict:
    out = {}
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if m:
        out.update(stack_bytes=int(m.group(1)), spill_store_bytes=int(m.group(2)), spill_load_bytes=int(m.group(3)))
    out["registers"] = _int(r"Used (\d+) registers", text)
    out["ptxas_smem_bytes"] = _int(r"(\d+) bytes smem", text, 0)
    return out


def occupancy(regs, warps: int, smem_bytes: int) -> dict:
    """Theoretical sm_90 occupancy: 64K registers (256-register warp granules), 64 warps, 32 blocks,
    228 KiB shared memory per SM (1 KiB reserved per block)."""
    if not regs or not warps:
        return {}
    per_warp = math.ceil(regs * 32 / 256) * 256
    by_regs = (65536 // per_warp) // warps
    by_smem = (233472 // (smem_bytes + 1024)) if smem_bytes else 32
    blocks = max(0, min(by_regs, 64 // warps, by_smem, 32))
    return {
        "blocks_per_sm": blocks,
        "occupancy": blocks * warps / 64,
        "limit": min((by_regs, "regs"), (64 // warps, "warps"), (by_smem, "smem"), (32, "blocks"))[1],
    }


def ptx_report(captured: list[dict], out_dir: str, variant: str) -> dict:
    """Writes each captured kernel's PTX and runs ptxas -v (and cuobjdump -sass) on it."""
    rep: dict = {}
    if not captured:
        return {
            "error": "no PTX captured (CPU/interpret mode, a compile-cache path that skips lowering, or a "
            "jaxlib that lowers through XLA's triton custom call: use XLA_FLAGS=--xla_dump_to)"
        }
    vdir = os.path.join(out_dir, re.sub(r"[^A-Za-z0-9_.-]+", "_", variant))
    os.makedirs(vdir, exist_ok=True)
    ptxas = shutil.which("ptxas")
    cuobjdump = shutil.which("cuobjdump")
    for item in captured:
        asm = item["asm"]
        name = (re.search(r"\.entry\s+([A-Za-z_$][\w$]*)", asm) or [None, f"kernel{len(rep)}"])[1]
        if name in rep:
            continue
        path = os.path.join(vdir, name + ".ptx")
        with open(path, "w") as f:
            f.write(asm)
        r = {
            "smem_bytes": item["smem_bytes"],
            "num_warps": item["num_warps"],
            "num_stages": item["num_stages"],
            **ptx_static(asm),
        }
        target = (re.search(r"\.target\s+(sm_\w+)", asm) or [None, "sm_90"])[1]
        if ptxas is None:
            r["ptxas_error"] = "ptxas not on PATH"
        else:
            cubin = os.path.join(vdir, name + ".cubin")
            for arch in dict.fromkeys((target, "sm_90a", "sm_90")):
                try:
                    p = subprocess.run(
                        [ptxas, f"-arch={arch}", "-v", path, "-o", cubin], capture_output=True, text=True, timeout=180
                    )
                except Exception as e:  # noqa: BLE001
                    r["ptxas_error"] = f"{type(e).__name__}: {e}"
                    break
                text = p.stdout + p.stderr
                if p.returncode == 0:
                    r.update(parse_ptxas(text), ptxas_arch=arch)
                    r.pop("ptxas_error", None)
                    with open(os.path.join(vdir, name + ".ptxas.txt"), "w") as f:
                        f.write(text)
                    break
                r["ptxas_error"] = f"-arch={arch} rc={p.returncode}: {text.strip()[-600:]}"
            if "registers" in r and cuobjdump is not None:
                try:
                    p = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True, timeout=120)
                    if p.returncode == 0:
                        with open(os.path.join(vdir, name + ".sass"), "w") as f:
                            f.write(p.stdout)
                        r["sass_ldg"] = len(re.findall(r"\bLDG\.", p.stdout))
                        r["sass_instructions"] = len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/", p.stdout, re.M))
                except Exception as e:  # noqa: BLE001
                    r["sass_error"] = f"{type(e).__name__}: {e}"
            r.update(
                occupancy(
                    r.get("registers"), item["num_warps"] or 4, max(item["smem_bytes"], r.get("ptxas_smem_bytes") or 0)
                )
            )
        rep[name] = r
    return rep


def archive_ptx(src: str, dest: str) -> str:
    """Packs the PTX / ptxas / SASS files (no cubins) of ``src`` into one ``.tar.gz``."""
    import tarfile

    try:
        with tarfile.open(dest, "w:gz") as tar:
            for root, _, files in os.walk(src):
                for fn in sorted(files):
                    if not fn.endswith(".cubin"):
                        path = os.path.join(root, fn)
                        tar.add(path, arcname=os.path.relpath(path, src))
        return f"{dest} ({os.path.getsize(dest)} bytes)"
    except Exception as e:  # noqa: BLE001
        return f"archive failed: {type(e).__name__}: {e}"
