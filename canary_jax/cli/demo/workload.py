"""The demo's requests: real text prompts shipped with the package, tokenized bytewise."""

from __future__ import annotations

import dataclasses
import importlib.resources
import os

import numpy as np

from canary_jax.cli.demo import model
from canary_jax.cli.demo.scheduler import Request


class PromptFileError(ValueError):
    """The prompt file is missing, unreadable or holds no prompts."""


@dataclasses.dataclass(frozen=True)
class PromptSet:
    preambles: tuple[str, ...]
    prompts: tuple[str, ...]


def default_prompt_path() -> str:
    return str(importlib.resources.files("canary_jax") / "data" / "prompts.txt")


def load_prompts(path: str | None = None) -> PromptSet:
    """Parses a prompt file (see ``canary_jax/data/prompts.txt`` for the format).

    Raises:
      PromptFileError: missing or unreadable file, or no prompt lines.
    """
    path = path or default_prompt_path()
    if not os.path.isfile(path):
        raise PromptFileError(f"prompt file not found: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise PromptFileError(f"cannot read prompt file {path}: {e}") from None
    pre, prompts = [], []
    for line in lines:
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        if s.startswith("system:"):
            pre.append(s[len("system:") :].strip().replace("\\n", "\n") + " ")
        else:
            prompts.append(s)
    if not prompts:
        raise PromptFileError(f"prompt file {path} holds no prompts")
    return PromptSet(tuple(pre) or ("",), tuple(prompts))


def build_requests(prompts: PromptSet, *, num_requests: int, max_new_tokens: int, seed: int = 0) -> list[Request]:
    """``num_requests`` requests: ``preamble[i % P] + prompt[perm[i % N]]``, bytewise tokens with a BOS.

    Shared preambles and near-duplicate prompts give the radix cache real prefixes to share; request order
    is a seeded shuffle so shared prefixes are sometimes still running and sometimes already cached.
    """
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(prompts.prompts))
    out = []
    for i in range(num_requests):
        text = prompts.preambles[i % len(prompts.preambles)] + prompts.prompts[order[i % len(order)]]
        out.append(Request(rid=i, prompt=model.tokenize(text), max_new_tokens=max_new_tokens))
    return out
