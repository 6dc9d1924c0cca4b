"""Triton IR text as JAX's Pallas lowering prints it: locations stripped, the kernel's pointer parameters and
the alignment each declares (``tt.divisibility``). Pure text work, used by :mod:`interop.native.triton_ttir`."""

from __future__ import annotations

import re

# jax prints the module with ``get_asm(enable_debug_info=True, pretty_debug_info=True)``: every op, block
# argument and function argument ends in a location, ``[unknown]`` or a name location ``"name"(#locN)``, and
# ``#locN = ...`` alias lines surround the module.
_LOCATION = re.compile(r' (?:\[unknown\]|"(?:[^"\\\n]|\\.)*"\(#loc\d*\))')
_LEFTOVER = re.compile(r"#loc|\[unknown\]|\bloc\(")
MODULE_START = re.compile(r"^module @", re.M)


def strip_locations(module_text: str) -> str:
    """The ``module @... {`` ... ``}`` block of jax's debug print, without locations (what ``triton.compile``
    parses).

    Args:
      module_text: text starting at the ``module @`` line (what follows the closing ``}`` is ignored).

    Raises:
      ValueError: no closing ``}`` line, or a location form this function does not know (the line is quoted).
    """
    lines = []
    for line in module_text.splitlines():
        line = _LOCATION.sub("", line).rstrip()
        lines.append(line)
        if line == "}":
            break
    else:
        raise ValueError("kv-canary: the printed Triton module has no closing '}' line")
    text = "\n".join(lines) + "\n"
    bad = _LEFTOVER.search(text)
    if bad:
        start = text.rfind("\n", 0, bad.start()) + 1
        raise ValueError(f"kv-canary: unknown location form in the Triton module: {text[start : start + 200]!r}")
    return text


def _split_top(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "({<[":
            depth += 1
        elif ch in ")}>]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if text[start:].strip():
        parts.append(text[start:])
    return [p.strip() for p in parts]


_FUNC = re.compile(r"^\s*tt\.func\s+(?:public\s+|private\s+)?@([\w$.-]+)\s*\(", re.M)
_DIVISIBILITY = re.compile(r"tt\.divisibility\s*=\s*(\d+)")


def _signature(ttir: str) -> tuple[str, int, int]:
    """``(name, start, end)`` of the TTIR's one function: its parameter list is ``ttir[start:end]``.

    Raises:
      ValueError: not exactly one ``tt.func``.
    """
    funcs = list(_FUNC.finditer(ttir))
    if len(funcs) != 1:
        raise ValueError(f"kv-canary: the TTIR must hold exactly one tt.func, found {len(funcs)}")
    m = funcs[0]
    depth, i = 1, m.end()
    while depth:
        depth += {"(": 1, ")": -1}.get(ttir[i], 0)
        i += 1
    return m.group(1), m.end(), i - 1


def ttir_params(ttir: str) -> tuple[str, list[tuple[str, int | None]]]:
    """The TTIR's one function: ``(name, [(type, divisibility or None) per parameter])``.

    ``type`` is the parameter's MLIR type text (``!tt.ptr<i32>``); ``divisibility`` its ``tt.divisibility``
    attribute (bytes a pointer is aligned to; jax's lowering sets 32 on every pointer).

    Raises:
      ValueError: not exactly one ``tt.func``.
    """
    name, start, end = _signature(ttir)
    params = []
    for p in _split_top(ttir[start:end]):
        _, _, rest = p.partition(":")
        rest = rest.strip()
        ty = rest.split("{", 1)[0].strip()
        d = _DIVISIBILITY.search(rest)
        params.append((ty, int(d.group(1)) if d else None))
    return name, params


def pointer_alignments(ttir: str, label: str) -> list[int]:
    """Per parameter of the TTIR's function, the byte alignment its pointer must have (``tt.divisibility``, else
    1); ``label`` names the kernel in errors.

    Raises:
      NotImplementedError: a parameter that is not a pointer.
    """
    _, params = ttir_params(ttir)
    out = []
    for k, (ty, div) in enumerate(params):
        if not ty.startswith("!tt.ptr<"):
            raise NotImplementedError(f"kv-canary: Triton kernel {label}: parameter {k} is {ty}, not a pointer")
        out.append(div or 1)
    return out


def relax_alignment(ttir: str, params: set[int]) -> str:
    """The TTIR with the ``tt.divisibility`` attribute dropped from the parameters ``params`` (indices), so Triton
    assumes nothing of their pointers' alignment there (element-wise loads and stores). The native path drops it
    for tiny operands, such as SGLang's one-row counter views at 8-byte offsets, which would otherwise be staged
    through an aligned copy every launch.

    Raises:
      ValueError: not exactly one ``tt.func``.
    """
    _, start, end = _signature(ttir)
    parts = _split_top(ttir[start:end])
    for k in params:
        parts[k] = re.sub(r"\s*\{\s*tt\.divisibility\s*=\s*\d+\s*:\s*i32\s*\}", "", parts[k])
    return ttir[:start] + ", ".join(parts) + ttir[end:]
