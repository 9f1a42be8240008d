"""The step of a plan as lanes of blocks (all modelled): the pipeline schedule played out
from the plan's per-rank times (:mod:`autopar.report.timeline`), then the step's exposed
data-parallel communication and optimizer step; without a pipeline, one lane per phase.

The plan records each rank's forward and backward time per microbatch, not each chunk's: a
rank holding several chunks (interleaved, zb_v) has its time split among them by their
layer counts. Tensor-parallel time is spread half over the forward, half over the
backward (as :func:`autopar.solver.pricing.evaluate.data_parallel_costs` does), and a rank's p2p
time per microbatch evenly over the sends it makes, each a delay on the receiving side.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from autopar.core.plan import Plan
from autopar.report.timeline import FORWARD, Action, Block, chunks_per_rank, idle, simulate, span

COMPUTE, TP, DP, OPTIMIZER = "compute", "tp", "dp", "optimizer"
"""Kinds of the blocks that are no pipeline action (the step's other phases)."""


@dataclass(frozen=True)
class Segment:
    """A drawn block: a lane, a kind (F, B, W, or a phase above), a time span in seconds."""

    lane: str
    kind: str
    start: float
    end: float
    microbatch: int | None = None
    chunk: int | None = None
    text: str = ""  # what the block is, for its hover


@dataclass
class StepLanes:
    """What the timeline chart draws (every time modelled)."""

    title: str
    lanes: list[str]
    segments: list[Segment]
    notes: list[str] = field(default_factory=list)
    simulated_span_s: float = 0.0  # the pipeline's span as simulated
    modelled_span_s: float = 0.0  # the same by the plan's formula (compute+tp+bubble+p2p)
    idle_s: dict[str, float] = field(default_factory=dict)  # lane -> simulated idle


def step_lanes(plan: Plan) -> StepLanes:
    """The lanes of ``plan``'s step: per pipeline rank when pp > 1, per phase otherwise."""
    if plan.mesh.get("pp", 1) > 1 and plan.pipeline.get("stages"):
        return _pipeline_lanes(plan)
    return _phase_lanes(plan)


def _phase_lanes(plan: Plan) -> StepLanes:
    p = plan.predicted
    m = int(plan.batch.get("microbatches", 1))
    per_mb = float(p.get("compute_s", 0.0)) / m
    tp_per_mb = float(p.get("tp_comm_s", 0.0)) / m
    lanes = ["forward + backward", "tensor-parallel comm", "data-parallel comm (exposed)",
             "optimizer"]
    segments: list[Segment] = []
    t = 0.0
    for i in range(m):
        segments.append(Segment(lanes[0], COMPUTE, t, t + per_mb, i, None,
                                f"forward + backward of microbatch {i}"))
        t += per_mb
        if tp_per_mb > 0:
            segments.append(Segment(lanes[1], TP, t, t + tp_per_mb, i, None,
                                    f"tensor-parallel collectives of microbatch {i}"))
            t += tp_per_mb
    t = _tail(segments, [lanes[2]], [lanes[3]], t, p)
    lanes = [lane for lane in lanes if any(s.lane == lane for s in segments)]
    return StepLanes(
        title=(f"Step timeline, one device ({m} microbatch{'es' if m != 1 else ''}, "
               "no pipeline) — modelled"),
        lanes=lanes, segments=segments, simulated_span_s=t, modelled_span_s=t,
        notes=["Without a pipeline the plan records forward and backward together "
               "(compute_s); they are drawn as one block per microbatch."])


def _tail(segments: list[Segment], dp_lanes: list[str], opt_lanes: list[str], t: float,
          p: dict[str, Any]) -> float:
    """The step's end after the microbatches: exposed dp communication, then the optimizer
    (the plan's figures for the rank that finishes last), drawn on each lane given."""
    dp, opt = float(p.get("dp_exposed_s", 0.0)), float(p.get("optimizer_s", 0.0))
    for lane in dp_lanes:
        if dp > 0:
            segments.append(Segment(lane, DP, t, t + dp, text="data-parallel communication "
                                    "the backward did not hide (exposed; the plan's figure "
                                    "for the rank that finishes last)"))
    for lane in opt_lanes:
        if opt > 0:
            segments.append(Segment(lane, OPTIMIZER, t + dp, t + dp + opt,
                                    text="optimizer step (the plan's figure for the rank "
                                    "that finishes last)"))
    return t + dp + opt


def chunk_layers(plan: Plan) -> list[tuple[int, int, int]]:
    """(chunk, rank, layer count) of every model chunk, from the plan's ``pipeline.chunks``
    (which the schema checks: one per rank and virtual stage, in order, each on the rank
    its schedule runs it)."""
    return [(int(c["chunk"]), int(c["rank"]), int(c["layers"][1]) - int(c["layers"][0]) + 1)
            for c in sorted(plan.pipeline["chunks"], key=lambda c: c["chunk"])]


def _pipeline_lanes(plan: Plan) -> StepLanes:
    pipe, p = plan.pipeline, plan.predicted
    pp = plan.mesh["pp"]
    m = int(pipe.get("microbatches") or plan.batch.get("microbatches", 1))
    schedule = pipe.get("schedule", "1f1b")
    virtual = int(pipe.get("virtual_stages", 1))
    stages = {int(s["rank"]): s for s in pipe["stages"]}
    chunks = chunk_layers(plan)
    on_rank = {r: sum(n for _, rr, n in chunks if rr == r) for r in range(pp)}
    fwd, bwd, send = [], [], []
    last = len(chunks) - 1
    for _, r, n in chunks:
        s = stages[r]
        share = n / on_rank[r] if on_rank[r] else 1 / sum(1 for _, rr, _ in chunks if rr == r)
        tp = float(s.get("tp_comm_s", 0.0))
        fwd.append(share * (float(s["forward_s"]) + tp / 2))
        bwd.append(share * (float(s["backward_s"]) + tp / 2))
        sends = sum((cc < last) + (cc > 0) for cc, rr, _ in chunks if rr == r)
        send.append(float(s.get("p2p_s", 0.0)) / sends if sends else 0.0)
    blocks = simulate(schedule, pp, m, fwd, bwd, virtual=virtual, transfer_s=send)
    lanes = [_rank_lane(r, stages[r]) for r in range(pp)]
    layer_text = {c: _chunk_text(plan, c) for c, _, _ in chunks}
    split = schedule == "zb_v"
    segments = [_segment(b, lanes[b.rank], layer_text, split) for b in blocks]
    pipeline_end = span(blocks)
    _tail(segments, lanes, lanes, pipeline_end, p)
    modelled = sum(float(p.get(k, 0.0)) for k in ("compute_s", "tp_comm_s", "bubble_s", "p2p_s"))
    v_text = (f", {virtual} chunks per rank" if chunks_per_rank(schedule, virtual) > 1 else "")
    return StepLanes(
        title=(f"Pipeline schedule per rank — {schedule}, pp={pp}, {m} microbatches{v_text} "
               "— modelled"),
        lanes=lanes, segments=segments, simulated_span_s=pipeline_end,
        modelled_span_s=modelled,
        idle_s={lanes[r]: idle(blocks, r) for r in range(pp)},
        notes=_notes(schedule, chunks, pp))


def _notes(schedule: str, chunks: list[tuple[int, int, int]], pp: int) -> list[str]:
    notes = ["Blocks are the plan's modelled per-microbatch times, played out in the order "
             "torch.distributed.pipelining's schedule runs them on each rank; gaps are "
             "bubbles (a rank waiting for a neighbour)."]
    if len(chunks) > pp:
        notes.append("The plan records each rank's time, not each chunk's: a rank's time is "
                     "split among its chunks by their layer counts.")
    if schedule == "zb_v":
        notes.append("zb_v splits each backward into B (input gradient) and W (weight "
                     "gradient), each modelled as half the backward, as the cost model does.")
    return notes


def _rank_lane(rank: int, stage: dict[str, Any]) -> str:
    layers = stage.get("layers", "")
    return f"rank {rank}" + (f" (layers {layers})" if layers else "")


def _chunk_text(plan: Plan, chunk: int) -> str:
    for c in plan.pipeline.get("chunks") or []:
        if int(c["chunk"]) == chunk:
            first, last = c["layers"]
            return f"layer {first}" if first == last else f"layers {first}-{last}"
    return ""


def _segment(b: Block, lane: str, layer_text: dict[int, str], split: bool) -> Segment:
    a: Action = b.action
    backward = "backward (input gradient)" if split else "backward"
    what = {FORWARD: "forward", "B": backward, "W": "weight gradient"}[a.kind]
    where = layer_text.get(a.chunk, "")
    return Segment(lane, a.kind, b.start, b.end, a.microbatch, a.chunk,
                   f"{what} of microbatch {a.microbatch}, chunk {a.chunk}"
                   + (f" ({where})" if where else ""))
