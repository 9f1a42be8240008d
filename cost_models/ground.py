"""Validated ground: where the cost model has been checked against measurements, and how well.

A plan's step time is only as good as the cost model at the plan's own layout. The model has
been compared with published runs (``benchmarks/fidelity_published.py``) and with runs on
the project's CPU machine (``benchmarks/fidelity_measured.py``); each comparison is evidence
for the *schemes* the run used -- data parallelism (DDP), ZeRO-3, tensor parallelism inside
a node or across nodes, a pipeline schedule -- up to the degree the run used them, on its
kind of interconnect (``nccl`` GPUs or ``gloo`` processes). The evidence lives in
``ground.json`` next to this file, written by those benchmarks (``--write-ground``), never
by hand: a plan says, for every scheme it uses, whether the model was validated there.

A scheme at degree ``d`` is *validated* when some measured run used the same scheme on the
same kind of interconnect at a degree of at least ``d`` and the model's median error there
is within :data:`DEFAULT_MARGIN` (a scheme measured and found further off, as tensor
parallelism on gloo processes is, is not validated ground); otherwise it is *extrapolated*, and
the planner demands that an extrapolated plan beat the best validated plan by more than the
model's error (see :func:`margin`).

>>> ground = Ground((Evidence("zero3", "nccl", 128, ("torchtitan-202412",), 2, 0.08, 0.12),))
>>> [label.validated for label in ground.labels({"dp": 64, "tp": 8}, zero=3, schedule=None,
...                                             backend="nccl", devices_per_node=8)]
[True, False]
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path

GROUND_FILE = Path(__file__).with_name("ground.json")

DEFAULT_MARGIN = 0.25
"""The margin an extrapolated plan must win by when no evidence says how wrong the model is
on a neighbouring scheme: the worst error this project accepts on validated ground (issue 11's
bar: worst <= 25% per source)."""


@dataclass(frozen=True)
class Evidence:
    """Measured runs that used ``scheme`` on ``backend``, at degrees up to ``max_degree``,
    and the model's absolute relative step-time error on them."""

    scheme: str
    backend: str
    max_degree: int
    sources: tuple[str, ...]
    rows: int
    median_error: float
    worst_error: float

    def describe(self) -> str:
        return (f"validated on {', '.join(self.sources)} up to {self.max_degree} "
                f"({self.rows} run{'s' if self.rows != 1 else ''}, median error "
                f"{self.median_error:.0%}, worst {self.worst_error:.0%})")


@dataclass(frozen=True)
class Label:
    """One scheme of one plan: validated or extrapolated, with the evidence, if any."""

    scheme: str
    degree: int
    validated: bool
    text: str
    evidence: Evidence | None = None
    backend: str = "nccl"

    def to_dict(self) -> dict:
        out = {"scheme": self.scheme, "degree": self.degree, "validated": self.validated,
               "text": self.text}
        if self.evidence is not None:
            out["sources"] = list(self.evidence.sources)
            out["validated_up_to"] = self.evidence.max_degree
            out["median_error"] = round(self.evidence.median_error, 4)
            out["worst_error"] = round(self.evidence.worst_error, 4)
        return out


def schemes(mesh: Mapping[str, int], *, zero: int, schedule: str | None,
            devices_per_node: int) -> list[tuple[str, int]]:
    """(scheme, degree) for every parallel scheme a layout uses (mesh ordered outer to inner).

    >>> schemes({"pp": 4, "dp": 2, "tp": 16}, zero=0, schedule="1f1b", devices_per_node=8)
    [('pp-1f1b', 4), ('dp', 2), ('tp-cross-node', 16)]
    """
    out = []
    pp, dp, tp = mesh.get("pp", 1), mesh.get("dp", 1), mesh.get("tp", 1)
    if pp > 1:
        out.append((f"pp-{schedule or '1f1b'}", pp))
    if dp > 1:
        out.append(("dp" if zero == 0 else f"zero{zero}", dp))
    if tp > 1:
        out.append(("tp" if tp <= devices_per_node else "tp-cross-node", tp))
    return out


@dataclass(frozen=True)
class Ground:
    """All evidence; :func:`load_ground` reads the shipped file."""

    evidence: tuple[Evidence, ...] = ()

    def best(self, scheme: str, backend: str) -> Evidence | None:
        """The evidence reaching the highest degree of ``scheme`` on ``backend``."""
        matches = [e for e in self.evidence if e.scheme == scheme and e.backend == backend]
        return max(matches, key=lambda e: e.max_degree, default=None)

    def labels(self, mesh: Mapping[str, int], *, zero: int, schedule: str | None,
               backend: str, devices_per_node: int) -> list[Label]:
        out = []
        for scheme, degree in schemes(mesh, zero=zero, schedule=schedule,
                                      devices_per_node=devices_per_node):
            e = self.best(scheme, backend)
            if e is not None and degree <= e.max_degree and e.median_error <= DEFAULT_MARGIN:
                out.append(Label(scheme, degree, True, f"{scheme}={degree}: {e.describe()}", e,
                                 backend))
            elif e is not None and degree <= e.max_degree:  # checked, and found wrong
                out.append(Label(scheme, degree, False,
                                 f"{scheme}={degree}: measured, but the model is off by more "
                                 f"than {DEFAULT_MARGIN:.0%} there ({e.describe()}): not "
                                 "validated", e, backend))
            elif e is not None:
                out.append(Label(scheme, degree, False,
                                 f"{scheme}={degree}: not validated, extrapolated ({e.describe()})",
                                 e, backend))
            else:
                out.append(Label(scheme, degree, False,
                                 f"{scheme}={degree}: not validated on {backend}, extrapolated",
                                 None, backend))
        return out

    def margin(self, labels: list[Label], fixed: float | None = None) -> float:
        """How much faster (a fraction) a plan with these labels must be predicted than the
        best validated plan to be preferred: 0 on validated ground; otherwise ``fixed`` when
        given (0: no preference), else the worst error the model has on the extrapolated
        schemes' evidence at lower degrees. A scheme never measured on the interconnect gets
        the worst error any scheme measured there has, and at least :data:`DEFAULT_MARGIN`:
        nothing says the model is better where it was not checked than where it was, so an
        unmeasured scheme never wins over a measured one only by being unmeasured. Where
        nothing at all was validated on the plan's interconnect there is no validated plan
        to prefer, and the margin is 0."""
        extrapolated = [label for label in labels if not label.validated]
        if not extrapolated:
            return 0.0
        if fixed is not None:
            return fixed
        backend = self._backend_of(labels)
        measured = [e.worst_error for e in self.evidence if e.backend == backend]
        if not measured:
            return 0.0
        unmeasured = max(DEFAULT_MARGIN, *measured)
        return max(label.evidence.worst_error if label.evidence is not None else unmeasured
                   for label in extrapolated)

    @staticmethod
    def _backend_of(labels: list[Label]) -> str | None:
        return labels[0].backend if labels else None


def ground_from_dict(data: Mapping) -> Ground:
    """Evidence from the JSON written by the fidelity benchmarks (schema version 1)."""
    if data.get("version") != 1:
        raise ValueError(f"{GROUND_FILE.name}: unknown version {data.get('version')!r}")
    return Ground(tuple(
        Evidence(e["scheme"], e["backend"], int(e["max_degree"]), tuple(e["sources"]),
                 int(e["rows"]), float(e["median_error"]), float(e["worst_error"]))
        for e in data["evidence"]))


@cache
def load_ground(path: str | None = None) -> Ground:
    """The shipped evidence (``ground.json``); an empty ground when there is none yet."""
    file = Path(path) if path else GROUND_FILE
    if not file.exists():
        return Ground()
    return ground_from_dict(json.loads(file.read_text()))


def evidence_from_rows(rows: list[dict], backend: str) -> list[Evidence]:
    """Summarize compared runs into evidence: each row is ``{"source", "mesh", "zero",
    "schedule", "devices_per_node", "error"}`` (``error`` the signed relative step-time
    error); every scheme a row uses gets the row's error."""
    by_scheme: dict[str, list[tuple[int, str, float]]] = {}
    for row in rows:
        for scheme, degree in schemes(row["mesh"], zero=row["zero"], schedule=row.get("schedule"),
                                      devices_per_node=row["devices_per_node"]):
            by_scheme.setdefault(scheme, []).append((degree, row["source"], abs(row["error"])))
    out = []
    for scheme, hits in sorted(by_scheme.items()):
        errors = sorted(e for _, _, e in hits)
        out.append(Evidence(scheme, backend, max(d for d, _, _ in hits),
                            tuple(sorted({s for _, s, _ in hits})), len(hits),
                            round(statistics.median(errors), 4), round(errors[-1], 4)))
    return out


def write_ground(evidence: list[Evidence], path: Path = GROUND_FILE) -> Path:
    """Replace the evidence of the backends in ``evidence``, keeping the others'."""
    kept = [e for e in load_ground(str(path)).evidence
            if e.backend not in {x.backend for x in evidence}] if path.exists() else []
    data = {"version": 1, "evidence": [
        {"scheme": e.scheme, "backend": e.backend, "max_degree": e.max_degree,
         "sources": list(e.sources), "rows": e.rows, "median_error": round(e.median_error, 4),
         "worst_error": round(e.worst_error, 4)}
        for e in sorted([*kept, *evidence], key=lambda e: (e.backend, e.scheme))]}
    path.write_text(json.dumps(data, indent=1) + "\n")
    load_ground.cache_clear()
    return path
