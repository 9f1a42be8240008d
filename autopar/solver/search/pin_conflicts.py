"""Why the pins rule out every mesh: the arithmetic, so "no plan" names the pin to change.

The search skips a mesh without solving when the global batch does not split over its
``dp``, when pinned microbatches do not divide a rank's share, when a pipeline has fewer
microbatches than stages, or when the pinned schedule cannot run; this module says which,
for every mesh, in words that name the pin.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from autopar.solver.options import PlanOptions

Variants = Callable[[PlanOptions, int, int, int], list]
"""``pipeline_variants(options, pp, microbatches, n_layers)`` of the search."""


@dataclass(frozen=True)
class Conflict:
    reason: str  # what rules the mesh out, with the arithmetic
    fix: str  # what to change


def pinned(options: PlanOptions, global_batch: int) -> str:
    """The pins as ``name=value``, in the knobs' own spelling."""
    names = ("dp", "tp", "pp", "cp", "microbatch", "microbatches", "schedule", "virtual_stages")
    pins = [f"{n}={getattr(options, n)}" for n in names if getattr(options, n) is not None]
    return ", ".join([f"global_batch={global_batch}", *pins])


def conflict(options: PlanOptions, mesh: tuple[int, int, int, int], global_batch: int,
             n_layers: int, variants: Variants) -> Conflict | None:
    """Why ``mesh`` (pp, dp, cp, tp) is ruled out before solving; None if it is not."""
    pp, dp = mesh[0], mesh[1]
    if global_batch % dp:
        return Conflict(f"global batch {global_batch} does not split over dp={dp}",
                        "make the global batch a multiple of dp, or pin another dp")
    local = global_batch // dp
    share = f"the {local} sequences per data-parallel rank (global batch {global_batch} / dp={dp})"
    for name in ("microbatches", "microbatch"):
        value = getattr(options, name)
        if value is not None and local % value:
            return Conflict(f"{name}={value} does not divide {share}",
                            f"pin {name} to a divisor of the sequences per data-parallel rank, "
                            "or leave it out")
    if options.microbatch:
        counts = [local // options.microbatch]
    elif options.microbatches:
        counts = [options.microbatches]
    else:
        counts = [d for d in range(1, local + 1) if local % d == 0]
    if pp > 1 and max(counts) < pp and options.schedule != "gpipe":
        return Conflict(f"{max(counts)} microbatch(es) from {share} cannot fill pp={pp} "
                        "pipeline stages (a pipeline needs at least pp microbatches)",
                        "use fewer pipeline stages, smaller or more microbatches, a larger "
                        "global batch, or schedule='gpipe' (which runs them one after another)")
    runnable = [m for m in counts if m >= pp or options.schedule == "gpipe"]
    if pp > 1 and not any(variants(options, pp, m, n_layers) for m in runnable):
        schedule = options.schedule or "any schedule"
        return Conflict(f"{schedule} (virtual_stages={options.virtual_stages}) cannot run pp={pp} "
                        f"stages with {', '.join(str(m) for m in runnable)} "
                        f"microbatches on {n_layers} layers (interleaved needs microbatches a "
                        "multiple of pp and layers >= pp x virtual stages; zb_v needs layers >= "
                        "2 x pp)", "pin another schedule or fewer virtual stages or pipeline stages")
    return None
