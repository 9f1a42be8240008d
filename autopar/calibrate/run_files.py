"""Run directories written by ``ParallelModule.record_run``: read and validated, each problem
a clear error (what, where, how to record one), and the per-step views the refit reads
(:mod:`autopar.calibrate.from_run`)."""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autopar.calibrate.collectives import KINDS, CalibrationError
from autopar.core.errors import ClusterError
from autopar.runtime.record import RUN_FORMAT, RUN_VERSION

_RECORD_FIX = ("record one with `pm.record_run(DIR)` around the training loop "
               "(or `autopar demo --record-run DIR`)")


def _overlapped(c: Mapping[str, Any]) -> bool:
    """A collective that ran partly beside compute (a DDP bucket launched before backward
    ended): its time is not the link's, so it is no link point; its exposed part is a wait."""
    return "exposed_s" in c and float(c["exposed_s"]) < 0.999 * float(c["seconds"])



@dataclass(frozen=True)
class RankRecord:
    """One rank's validated file."""

    path: Path
    rank: int
    world_size: int
    plan: Mapping[str, Any]
    host: Mapping[str, Any]
    warmup_steps: int
    steps: tuple[Mapping[str, Any], ...]
    timed: tuple[str, ...] = ()


@dataclass(frozen=True)
class Run:
    """A validated run directory: every rank's record, the same plan on each."""

    directory: Path
    ranks: tuple[RankRecord, ...]

    @property
    def plan(self) -> Mapping[str, Any]:
        return self.ranks[0].plan

    @property
    def world_size(self) -> int:
        return self.ranks[0].world_size

    @property
    def fitted_steps(self) -> range:
        """Indices of the steps the fit uses (past the warm-up; every rank recorded them)."""
        n = min(len(r.steps) for r in self.ranks)
        return range(min(self.ranks[0].warmup_steps, n), n)

    @property
    def kept_steps(self) -> list[int]:
        """The fitted steps the fit keeps: with four or more, those whose step time is within
        Tukey's fences (1.5 interquartile ranges past the quartiles), so a step stretched by
        another process on a busy machine does not pull the fit."""
        steps = list(self.fitted_steps)
        if len(steps) < 4:
            return steps
        q1, _, q3 = statistics.quantiles([self.step_s(i) for i in steps], n=4)
        low, high = q1 - 1.5 * (q3 - q1), q3 + 1.5 * (q3 - q1)
        return [i for i in steps if low <= self.step_s(i) <= high]

    def step_s(self, i: int) -> float:
        """Step ``i``'s wall time (measured): the median over ranks."""
        return statistics.median(float(r.steps[i]["step_s"]) for r in self.ranks)

    def measured_step_s(self) -> float:
        """The run's step time (measured): the median over the fitted steps."""
        return statistics.median(self.step_s(i) for i in self.fitted_steps)

    def predicted(self, key: str = "step_time_s") -> float:
        return float(self.plan.get("predicted", {}).get(key, 0.0) or 0.0)

    def modelled_device_s(self) -> float:
        """The plan's device time per step (modelled): compute and optimizer."""
        return self.predicted("compute_s") + self.predicted("optimizer_s")

    def untimed_comm_s(self) -> float:
        """The plan's modelled data-parallel collectives that the recording could not time
        (FSDP2 runs them: ZeRO-3, and data parallelism of pipeline stages): the fit takes
        the model's figure for them."""
        mesh, zero = self.plan.get("mesh", {}), self.plan.get("training", {}).get("zero", 0)
        fsdp = mesh.get("dp", 1) > 1 and (zero == 3 or mesh.get("pp", 1) > 1)
        if fsdp and "fsdp" not in self.ranks[0].timed:
            return self.predicted("dp_exposed_s")
        return 0.0

    def collective_seconds(self, i: int) -> tuple[list[dict[str, Any]], list[float]]:
        """Step ``i``'s collectives, each at its cost (the least time over ranks when every
        rank ran the same sequence), and each rank's own time waiting on them."""
        per_rank = [list(r.steps[i]["collectives"]) for r in self.ranks]
        waits = [sum(float(c.get("exposed_s", c["seconds"])) for c in cs) for cs in per_rank]
        shapes = {tuple((c["kind"], c["bytes"], c["group_size"]) for c in cs) for cs in per_rank}
        if len(shapes) == 1 and len(per_rank) > 1:
            merged = [dict(cs[0], seconds=min(float(c["seconds"]) for c in cs))
                      for cs in zip(*per_rank)]
            for m, cs in zip(merged, zip(*per_rank)):
                if all("exposed_s" in c for c in cs):
                    m["exposed_s"] = min(float(c["exposed_s"]) for c in cs)
        else:
            merged = [c for cs in per_rank for c in cs]
        return merged, waits

    def busy_latency_s(self) -> float:
        """What the plan's cluster makes each asynchronous message (a DDP bucket, an FSDP
        collective) wait for a core (``cost_models.comm.busy_latency``'s rule: CPU processes
        with no spare core)."""
        cluster = self.plan.get("cluster", {})
        cores = cluster.get("cores_per_node")
        if cores is None or int(cores) > int(cluster.get("devices_per_node", 1)):
            return 0.0
        return float(cluster.get("intra_node_link", {}).get("busy_latency_s", 0.0))

    def measured_device_s(self, i: int, link: Any | None = None, busy_s: float = 0.0) -> float:
        """Step ``i``'s device time: its wall time net of the collectives and pipeline waits
        (measured), for the slowest rank. With ``link`` (``predict(kind, bytes, n)``), each
        collective is taken at the link's time for it, not at its measured time, so what
        the fitted link does not explain (ranks waiting for one another) stays in the step
        as device time, where the model can put it. Collectives the recording could not
        time are taken out at their modelled time (:meth:`untimed_comm_s`). On gloo the
        model overlaps no collective with compute (its threads take the compute's cores), so
        a DDP bucket that ran beside the backward comes out at the link's whole time too: the
        backward it slowed is not device time. ``busy_s`` more comes out for each
        asynchronous message (DDP, FSDP), as the model adds its busy latency to each."""
        serial = self.plan.get("cluster", {}).get("backend") == "gloo"

        def comm(c: Mapping[str, Any]) -> float:
            if link is None or (_overlapped(c) and not serial):
                return float(c.get("exposed_s", c["seconds"]))
            wait = busy_s if c.get("source") in ("ddp", "fsdp") else 0.0
            return link.predict(c["kind"], c["bytes"], c["group_size"]) + wait

        return max(float(r.steps[i]["step_s"]) - float(r.steps[i].get("p2p_wait_s", 0.0))
                   - sum(comm(c) for c in r.steps[i]["collectives"])
                   for r in self.ranks) - self.untimed_comm_s()

    def measured_comm_s(self, i: int) -> float:
        """Step ``i``'s collectives at their cost (measured; what held the step up)."""
        return sum(float(c.get("exposed_s", c["seconds"])) for c in self.collective_seconds(i)[0])


# --- reading -----------------------------------------------------------------------------------
def read_run(directory: str | os.PathLike[str]) -> Run:
    """Read and validate a run directory; every problem is a :class:`CalibrationError`
    saying which file and field, and what to do."""
    path = Path(directory)
    shown = str(path)
    if not path.exists():
        raise CalibrationError(f"run directory '{shown}' not found", where=shown,
                               fix=f"check the path; {_RECORD_FIX}")
    if not path.is_dir():
        raise CalibrationError(f"'{shown}' is a file, not a run directory", where=shown,
                               fix="pass the directory holding rank0.json, rank1.json, ...")
    files = sorted(path.glob("rank*.json"))
    if not files:
        raise CalibrationError(f"run directory '{shown}' holds no rank*.json files",
                               where=shown, fix=_RECORD_FIX)
    records = [_read_rank(f) for f in files]
    records.sort(key=lambda r: r.rank)
    world = records[0].world_size
    ranks = [r.rank for r in records]
    if ranks != list(range(world)) or any(r.world_size != world for r in records):
        missing = sorted(set(range(world)) - set(ranks))
        raise CalibrationError(
            f"run '{shown}' has files for ranks {ranks} of a {world}-rank run"
            + (f" (missing rank {', '.join(map(str, missing))})" if missing else ""),
            where=shown,
            fix="copy every rank's rank{r}.json into one directory (each rank writes its own)")
    first = records[0]
    for r in records[1:]:
        if r.plan != first.plan:
            raise CalibrationError(
                f"{r.path.name} ran another plan than {first.path.name}", where=str(r.path),
                fix="one directory per run: record each run into an empty directory")
    if not any(len(r.steps) > r.warmup_steps for r in records) or min(
            len(r.steps) for r in records) <= first.warmup_steps:
        raise CalibrationError(
            f"run '{shown}' recorded {min(len(r.steps) for r in records)} step(s); the first "
            f"{first.warmup_steps} {'is' if first.warmup_steps == 1 else 'are'} warm-up, so "
            "nothing is left to fit",
            where=shown, fix="record more training steps (10 or more)")
    return Run(path, tuple(records))


def _read_rank(path: Path) -> RankRecord:
    from autopar.core.cluster.text import parse_json, read_text

    shown = str(path)
    try:
        data = parse_json(read_text(path, "run record", _RECORD_FIX), "run record", shown,
                          "one rank's record written by `pm.record_run(DIR)`")
    except ClusterError as err:
        raise CalibrationError(err.what, where=err.where, fix=err.fix) from None

    def bad(field: str, what: str) -> CalibrationError:
        return CalibrationError(f"run record '{shown}': {field} {what}",
                                where=f"{shown}: {field}",
                                fix=f"the file is damaged or was edited; {_RECORD_FIX}")

    if not isinstance(data, dict):
        raise bad("(top level)", f"must be a JSON object, got {type(data).__name__}")
    if data.get("format") != RUN_FORMAT:
        raise CalibrationError(
            f"'{shown}' is not an autopar run record (format {data.get('format')!r}, "
            f"expected {RUN_FORMAT!r})", where=f"{shown}: format", fix=_RECORD_FIX)
    if data.get("version") != RUN_VERSION:
        raise CalibrationError(
            f"run record '{shown}' has version {data.get('version')!r}; this autopar reads "
            f"version {RUN_VERSION}", where=f"{shown}: version",
            fix="record the run again with this autopar")
    for key in ("rank", "world_size", "warmup_steps"):
        if not _is_int(data.get(key)) or data[key] < 0:
            raise bad(key, f"must be a non-negative integer, got {data.get(key)!r}")
    if data["world_size"] < 1 or data["rank"] >= data["world_size"]:
        raise bad("rank", f"{data['rank']} is not a rank of a {data['world_size']}-rank run")
    if not path.name == f"rank{data['rank']}.json":
        raise bad("rank", f"is {data['rank']}, but the file is named {path.name}")
    plan = data.get("plan")
    if not isinstance(plan, dict) or not isinstance(plan.get("predicted"), dict):
        raise bad("plan", "must be the plan that ran (with its predicted step time)")
    for key in ("step_time_s", "compute_s"):
        if not _is_number(plan["predicted"].get(key)):
            raise bad(f"plan.predicted.{key}", "must be a number")
    if not isinstance(plan.get("cluster"), dict) or not isinstance(
            plan["cluster"].get("device"), dict):
        raise bad("plan.cluster.device", "must describe the device the plan was made for")
    host = data.get("host", {})
    if not isinstance(host, dict):
        raise bad("host", "must be an object")
    steps = data.get("steps")
    if not isinstance(steps, list):
        raise bad("steps", "must be a list")
    for i, step in enumerate(steps):
        where = f"steps[{i}]"
        if not isinstance(step, dict):
            raise bad(where, "must be an object")
        for key in ("step_s", "train_step_s"):
            if not _is_number(step.get(key)) or step[key] < 0:
                raise bad(f"{where}.{key}", f"must be seconds >= 0, got {step.get(key)!r}")
        if not _is_number(step.get("p2p_wait_s", 0.0)) or step.get("p2p_wait_s", 0.0) < 0:
            raise bad(f"{where}.p2p_wait_s", "must be seconds >= 0")
        collectives = step.get("collectives")
        if not isinstance(collectives, list):
            raise bad(f"{where}.collectives", "must be a list")
        for j, c in enumerate(collectives):
            cw = f"{where}.collectives[{j}]"
            if not isinstance(c, dict) or c.get("kind") not in KINDS:
                raise bad(f"{cw}.kind", f"must be one of {', '.join(KINDS)}")
            if not _is_int(c.get("bytes")) or c["bytes"] <= 0:
                raise bad(f"{cw}.bytes", "must be a positive integer")
            if not _is_int(c.get("group_size")) or c["group_size"] < 2:
                raise bad(f"{cw}.group_size", "must be an integer >= 2")
            if not _is_number(c.get("seconds")) or c["seconds"] < 0:
                raise bad(f"{cw}.seconds", "must be seconds >= 0")
            if "exposed_s" in c and (not _is_number(c["exposed_s"]) or c["exposed_s"] < 0):
                raise bad(f"{cw}.exposed_s", "must be seconds >= 0")
    timed = data.get("timed", [])
    if not isinstance(timed, list) or not all(isinstance(t, str) for t in timed):
        raise bad("timed", "must be a list of names")
    return RankRecord(path, data["rank"], data["world_size"], plan, host,
                      data["warmup_steps"], tuple(steps), tuple(timed))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))
