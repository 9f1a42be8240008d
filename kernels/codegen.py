"""Generate the Triton source of a forward/backward attention kernel trio for one spec.

Why generate text rather than pass flags: every choice of the spec (causal, window, GQA,
padded head dim, bias, ALiBi, soft-capping, dropout, dtype, scale) is resolved before Triton sees the
code, so the printed source is exactly what runs: no dead branches, no runtime flags, and
constants (scale, window, dropout threshold) appear as literals. `kernel_source(spec)` prints
it; `build_kernels(spec)` executes it once per (spec, mode) and caches the result.

The template is plain Python with line directives `#if COND` / `#elif COND` / `#else` /
`#endif` (COND a Python expression over the flags of `_flags`) and `{{NAME}}` substitutions;
it lives in :mod:`autopar.kernels.attention_template`, which describes the three kernels
(forward, dK/dV, dQ) that come out.
"""

from __future__ import annotations

import functools
import linecache
import os
import re
from dataclasses import dataclass
from typing import Any

from .attention_template import ATTENTION_TEMPLATE
from .spec import AttentionSpec

GENERATOR_VERSION = 2
"""Bumped whenever the template changes the generated code; printed in every header."""

_DIRECTIVE = re.compile(r"^\s*#(if|elif|else|endif)\b\s*(.*)$")
_SUBST = re.compile(r"\{\{([A-Z_]+)\}\}")


def keep_threshold(dropout_p: float) -> int:
    """Dropout drops an element when the low 31 bits of its Philox word are below this."""
    return round(dropout_p * 2**31)


def _flags(spec: AttentionSpec, interpret: bool) -> dict[str, Any]:
    """The values the template's directives and substitutions see."""
    lowp = spec.dtype != "float32"
    return {
        "VERSION": GENERATOR_VERSION,
        "MODE": "Triton interpreter" if interpret else "compiled Triton",
        "DESCRIPTION": spec.describe(),
        "INTERPRET": interpret,
        "LOWP": lowp,
        "DTYPE": f"tl.{spec.dtype}",
        "DTYPE_NAME": spec.dtype,
        "SCALE": repr(spec.scale),
        "SOFTCAP": spec.softcap is not None and repr(spec.softcap),
        "SCORES": "s, dcap" if spec.softcap is not None else "s",
        "HEAD_DIM": spec.head_dim,
        "BLOCK_D": spec.block_d,
        "GROUP": spec.group_size,
        "CAUSAL": spec.causal,
        "HAS_LEFT": spec.window_left >= 0,
        "HAS_RIGHT": spec.window_right >= 0 and not spec.causal,
        "WINDOW_LEFT": spec.window_left,
        "NEG_WINDOW_RIGHT": -spec.window_right,
        "PLUS_RIGHT": f" + {spec.window_right}" if spec.window_right > 0 else "",
        "MINUS_RIGHT": f" - {spec.window_right}" if spec.window_right > 0 else "",
        "HAS_BIAS": spec.bias,
        "BIAS_GRAD": spec.bias_grad,
        "ALIBI": spec.alibi,
        "DROPOUT": spec.dropout_p > 0,
        "KEEP_THRESHOLD": keep_threshold(spec.dropout_p),
        "KEEP_SCALE": repr(1.0 / (1.0 - spec.dropout_p)),
    }


def _condition(text: str, flags: dict[str, Any]) -> bool:
    """A directive's condition: flags joined by ``or``/``and``, ``not FLAG``, ``FLAG > N``
    (a closed little language, so the template needs no ``eval``)."""
    def term(t: str) -> bool:
        words = t.split()
        if len(words) == 1:
            return bool(flags[words[0]])
        if len(words) == 2 and words[0] == "not":
            return not flags[words[1]]
        if len(words) == 3 and words[1] == ">":
            return flags[words[0]] > int(words[2])
        raise ValueError(f"template condition not understood: {t!r}")

    return any(all(term(t) for t in alt.split(" and ")) for alt in text.split(" or "))


def render(template: str, flags: dict[str, Any]) -> str:
    """Resolve `#if`/`#elif`/`#else`/`#endif` lines and `{{NAME}}` substitutions."""
    out: list[str] = []
    # Each frame: (emitting now, some branch of this if already taken, parent emitting).
    stack: list[tuple[bool, bool, bool]] = []
    emitting = True
    for lineno, line in enumerate(template.splitlines(keepends=True), 1):
        m = _DIRECTIVE.match(line)
        if m is None:
            if emitting:
                out.append(_SUBST.sub(lambda s: str(flags[s.group(1)]), line))
            continue
        word, cond = m.group(1), m.group(2).strip()
        if word == "if":
            taken = emitting and _condition(cond, flags)
            stack.append((taken, taken, emitting))
        elif not stack:
            raise ValueError(f"template line {lineno}: #{word} without #if")
        elif word == "elif":
            _, done, parent = stack[-1]
            taken = parent and not done and _condition(cond, flags)
            stack[-1] = (taken, done or taken, parent)
        elif word == "else":
            _, done, parent = stack[-1]
            stack[-1] = (parent and not done, True, parent)
        else:
            stack.pop()
        emitting = stack[-1][0] if stack else True
    if stack:
        raise ValueError("template ends inside an #if")
    return "".join(out)


def interpreting() -> bool:
    """Whether Triton's interpreter is on, read from the environment at each call."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on", "y")


def kernel_source(spec: AttentionSpec, interpret: bool | None = None) -> str:
    """The generated Python/Triton source for `spec` (interpreter flavour if `interpret`).

    `interpret=None` follows TRITON_INTERPRET, so it prints what `attention` would run.
    """
    if interpret is None:
        interpret = interpreting()
    return render(ATTENTION_TEMPLATE, _flags(spec, interpret))


@dataclass(frozen=True)
class KernelSet:
    """The three generated kernels of one spec, with the source they came from."""

    spec: AttentionSpec
    interpret: bool
    source: str
    fwd: Any
    dkdv: Any
    dq: Any


@functools.lru_cache(maxsize=512)
def build_kernels(spec: AttentionSpec, interpret: bool) -> KernelSet:
    """Generate and load the kernels of `spec`, once per (spec, mode); Triton compiles lazily.

    The source is registered with `linecache` under a unique file name so that Triton (which
    reads a kernel's source through `inspect`) and tracebacks both see it.
    """
    source = kernel_source(spec, interpret)
    filename = f"<autopar-attention-{abs(hash((spec, interpret))):x}-{len(linecache.cache)}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    namespace: dict[str, Any] = {"__name__": f"autopar_generated_attention_{abs(hash(spec)):x}"}
    exec(compile(source, filename, "exec"), namespace)  # noqa: S102
    return KernelSet(spec, interpret, source, namespace["_attn_fwd"],
                     namespace["_attn_bwd_dkdv"], namespace["_attn_bwd_dq"])
