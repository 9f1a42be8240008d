"""Validated ground: where the cost model has been checked against measurements, and how well.

A plan's step time is only as good as the cost model at the plan's own layout. The model has
been compared with published runs (``benchmarks/fidelity_published.py``) and with runs on
the project's CPU machine (``benchmarks/fidelity_measured.py``); each comparison is evidence
for the *schemes* the run used -- data parallelism (DDP), ZeRO-3, tensor parallelism inside
a node or across nodes, a pipeline schedule, context parallelism by its attention algorithm --
up to the degree the run used them, on its kind of interconnect (``nccl`` GPUs or ``gloo``
processes). The evidence lives in ``ground.json`` next to this file, written by those
benchmarks (``--write-ground``), never by hand: a plan says, for every scheme it uses,
whether the model was validated there.

A scheme at degree ``d`` is *validated* when some measured run used the same scheme on the
same kind of interconnect at a degree of at least ``d`` and the model's median error there
is within :data:`DEFAULT_MARGIN` (a scheme measured and found further off, as tensor
parallelism on gloo processes is, is not validated ground); otherwise it is *extrapolated*, and
the planner demands that an extrapolated plan beat the best validated plan by more than the
model's error (see :func:`margin`).

That error is a *ranking* error. The planner compares an extrapolated plan with a validated
one on the same machine, so what can make it choose wrong is how much more optimistic the
model is on the extrapolated scheme than on validated ground. An error both share (a machine
slower while training than while calibrated, an overhead every layout pays) moves both
predictions alike and cannot flip the order. Evidence therefore keeps its signed errors
(predicted minus measured step time, over measured: negative is optimistic), and the margin
of a scheme measured at the plan's degree is how much faster the model's typical miss on it
makes a plan look than validated ground's typical miss: ``(1 + b) / (1 + e) - 1``, with
``e`` the scheme's median signed error and ``b`` the median of the validated schemes' on
that interconnect (never below 0: a scheme the model is more pessimistic about than
validated ground needs no margin). Medians, not the extremes: on a machine whose speed
drifts between runs, one slow run would otherwise set every margin. Evidence recorded
without signed errors falls back to the worst absolute error. Beyond the degrees measured
the margin stays the worst absolute error at the lower ones (see :meth:`Ground.margin`).

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
    and the model's absolute relative step-time error on them; with ``median_signed`` and
    ``lowest_signed`` also the signed errors' median and lowest (the most optimistic)."""

    scheme: str
    backend: str
    max_degree: int
    sources: tuple[str, ...]
    rows: int
    median_error: float
    worst_error: float
    median_signed: float | None = None
    lowest_signed: float | None = None

    @property
    def signed(self) -> bool:
        return self.median_signed is not None and self.lowest_signed is not None

    def describe(self) -> str:
        return (f"validated on {', '.join(self.sources)} up to {self.max_degree} "
                f"({self.rows} run{'s' if self.rows != 1 else ''}, median error "
                f"{self.median_error:.0%}, worst {self.worst_error:.0%}"
                + (f"; step time predicted {self.lowest_signed:+.0%} at the most optimistic"
                   if self.signed else "") + ")")


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
            if self.evidence.signed:
                out["median_signed_error"] = round(self.evidence.median_signed, 4)
                out["lowest_signed_error"] = round(self.evidence.lowest_signed, 4)
        return out


def schemes(mesh: Mapping[str, int], *, zero: int, schedule: str | None,
            devices_per_node: int, cp_algorithm: str | None = None) -> list[tuple[str, int]]:
    """(scheme, degree) for every parallel scheme a layout uses (mesh ordered outer to inner).
    Context parallelism is one scheme per attention algorithm (``cp-ring``, ...): they move
    different tensors at different times; ``cp`` alone when the algorithm is not chosen yet.

    >>> schemes({"pp": 4, "dp": 2, "tp": 16}, zero=0, schedule="1f1b", devices_per_node=8)
    [('pp-1f1b', 4), ('dp', 2), ('tp-cross-node', 16)]
    >>> schemes({"dp": 2, "cp": 4, "tp": 2}, zero=1, schedule=None, devices_per_node=8,
    ...         cp_algorithm="ring")
    [('zero1', 2), ('cp-ring', 4), ('tp', 2)]

    Expert parallelism (``ep``, carved out of ``dp``: a plan's mesh) is a scheme of its own:
    its all-to-alls are priced by no evidence of dp's.

    >>> schemes({"dp": 64, "ep": 8, "tp": 1}, zero=1, schedule=None, devices_per_node=8)
    [('zero1', 64), ('ep', 8)]
    """
    out = []
    pp, dp, tp = mesh.get("pp", 1), mesh.get("dp", 1), mesh.get("tp", 1)
    cp = mesh.get("cp", 1)
    if pp > 1:
        out.append((f"pp-{schedule or '1f1b'}", pp))
    if dp > 1:
        out.append(("dp" if zero == 0 else f"zero{zero}", dp))
    if mesh.get("ep", 1) > 1:
        out.append(("ep", mesh["ep"]))
    if cp > 1:
        known = cp_algorithm not in (None, "", "auto", "none")
        out.append((f"cp-{cp_algorithm}" if known else "cp", cp))
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
               backend: str, devices_per_node: int,
               cp_algorithm: str | None = None) -> list[Label]:
        out = []
        for scheme, degree in schemes(mesh, zero=zero, schedule=schedule,
                                      devices_per_node=devices_per_node,
                                      cp_algorithm=cp_algorithm):
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
        given (0: no preference), else the largest of the extrapolated schemes' margins. A
        scheme measured at its degree, but found off, carries its ranking error
        (:meth:`scheme_margin`). A scheme beyond the degrees measured carries the worst error
        the model has at the lower ones: how it errs further out is not known, and published
        runs show its errors growing with the degree. A scheme never measured on the
        interconnect gets the largest margin any measured scheme there has, and at least
        :data:`DEFAULT_MARGIN`: nothing says the model is better where it was not checked
        than where it was, so an unmeasured scheme never wins over a measured one only by
        being unmeasured. Where nothing at all was validated on the plan's interconnect
        there is no validated plan to prefer, and the margin is 0."""
        extrapolated = [label for label in labels if not label.validated]
        if not extrapolated:
            return 0.0
        if fixed is not None:
            return fixed
        backend = self._backend_of(labels)
        measured = [self.scheme_margin(e) for e in self.evidence if e.backend == backend]
        if not measured:
            return 0.0
        unmeasured = max(DEFAULT_MARGIN, *measured)

        def one(label: Label) -> float:
            if label.evidence is None:
                return unmeasured
            if label.degree > label.evidence.max_degree:
                return label.evidence.worst_error
            return self.scheme_margin(label.evidence)

        return max(one(label) for label in extrapolated)

    def scheme_margin(self, evidence: Evidence) -> float:
        """The ranking error of ``evidence``'s scheme against validated ground on its
        interconnect (see the module docstring): ``(1 + b) / (1 + e) - 1``, at least 0;
        the worst absolute error when either side's signed errors were not recorded.

        >>> g = Ground((Evidence("dp", "gloo", 2, ("m",), 4, 0.2, 0.3, -0.2, -0.3),
        ...             Evidence("tp", "gloo", 2, ("m",), 4, 0.36, 0.4, -0.36, -0.4)))
        >>> round(g.scheme_margin(g.best("tp", "gloo")), 3)   # 0.8 / 0.64 - 1: a quarter rosier
        0.25
        """
        validated = [e for e in self.evidence if e.backend == evidence.backend
                     and e.median_error <= DEFAULT_MARGIN]
        if not evidence.signed or not validated or not all(e.signed for e in validated):
            return evidence.worst_error
        typical = statistics.median(e.median_signed for e in validated)
        return max(0.0, (1 + typical) / (1 + evidence.median_signed) - 1)

    @staticmethod
    def _backend_of(labels: list[Label]) -> str | None:
        return labels[0].backend if labels else None


def ground_from_dict(data: Mapping) -> Ground:
    """Evidence from the JSON written by the fidelity benchmarks (schema version 1)."""
    if data.get("version") != 1:
        raise ValueError(f"{GROUND_FILE.name}: unknown version {data.get('version')!r}")

    def signed(e: Mapping, key: str) -> float | None:
        return float(e[key]) if e.get(key) is not None else None

    return Ground(tuple(
        Evidence(e["scheme"], e["backend"], int(e["max_degree"]), tuple(e["sources"]),
                 int(e["rows"]), float(e["median_error"]), float(e["worst_error"]),
                 signed(e, "median_signed"), signed(e, "lowest_signed"))
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
    "schedule", "devices_per_node", "error"}``, with ``cp_algorithm`` when the mesh has
    ``cp`` (``error`` the relative error the source's
    figure is compared by, signed), with ``step_time_error`` (predicted minus measured step
    time, over measured) when ``error`` is not one already, as a throughput's is not;
    every scheme a row uses gets the row's errors."""
    by_scheme: dict[str, list[tuple[int, str, float, float]]] = {}  # degree, source, errors
    for row in rows:
        for scheme, degree in schemes(row["mesh"], zero=row["zero"], schedule=row.get("schedule"),
                                      devices_per_node=row["devices_per_node"],
                                      cp_algorithm=row.get("cp_algorithm")):
            by_scheme.setdefault(scheme, []).append(
                (degree, row["source"], row["error"], row.get("step_time_error", row["error"])))
    out = []
    for scheme, hits in sorted(by_scheme.items()):
        errors = sorted(abs(e) for _, _, e, _ in hits)
        signed = sorted(e for _, _, _, e in hits)
        out.append(Evidence(scheme, backend, max(d for d, *_ in hits),
                            tuple(sorted({s for _, s, *_ in hits})), len(hits),
                            round(statistics.median(errors), 4), round(errors[-1], 4),
                            round(statistics.median(signed), 4), round(signed[0], 4)))
    return out


def write_ground(evidence: list[Evidence], path: Path = GROUND_FILE) -> Path:
    """Replace the evidence of the backends in ``evidence``, keeping the others'."""
    kept = [e for e in load_ground(str(path)).evidence
            if e.backend not in {x.backend for x in evidence}] if path.exists() else []
    data = {"version": 1, "evidence": [
        {"scheme": e.scheme, "backend": e.backend, "max_degree": e.max_degree,
         "sources": list(e.sources), "rows": e.rows, "median_error": round(e.median_error, 4),
         "worst_error": round(e.worst_error, 4),
         **({"median_signed": round(e.median_signed, 4),
             "lowest_signed": round(e.lowest_signed, 4)} if e.signed else {})}
        for e in sorted([*kept, *evidence], key=lambda e: (e.backend, e.scheme))]}
    path.write_text(json.dumps(data, indent=1) + "\n")
    load_ground.cache_clear()
    return path
