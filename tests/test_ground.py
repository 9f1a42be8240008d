"""Validated ground: every plan says, per parallel scheme, whether the cost model was checked
against measured runs there, in its text and its JSON."""

from __future__ import annotations

import json

import pytest

from autopar.cost_models.ground import (
    DEFAULT_MARGIN,
    Evidence,
    Ground,
    evidence_from_rows,
    ground_from_dict,
    load_ground,
    write_ground,
)

GROUND = Ground((
    Evidence("zero3", "nccl", 128, ("torchtitan",), 3, 0.05, 0.12),
    Evidence("tp", "nccl", 8, ("megatron",), 10, 0.06, 0.15),
))


def test_labels_validated_within_the_evidence_and_extrapolated_beyond() -> None:
    labels = GROUND.labels({"dp": 256, "tp": 8}, zero=3, schedule=None, backend="nccl",
                           devices_per_node=8)
    by = {label.scheme: label for label in labels}
    assert not by["zero3"].validated and "extrapolated" in by["zero3"].text
    assert "up to 128" in by["zero3"].text
    assert by["tp"].validated and "median error 6%" in by["tp"].text
    # beyond the evidence the margin is the model's worst error on that scheme
    assert GROUND.margin(labels) == pytest.approx(0.12)


def test_unknown_scheme_or_backend_is_extrapolated_with_the_default_margin() -> None:
    labels = GROUND.labels({"pp": 4, "dp": 2, "tp": 1}, zero=0, schedule="zb_v",
                           backend="gloo", devices_per_node=2)
    assert [label.validated for label in labels] == [False, False]
    # nothing was validated on gloo: no validated plan to prefer, no margin
    assert GROUND.margin(labels) == 0.0
    nccl = GROUND.labels({"pp": 4, "dp": 2, "tp": 1}, zero=0, schedule="zb_v",
                         backend="nccl", devices_per_node=8)
    assert GROUND.margin(nccl) == DEFAULT_MARGIN
    assert GROUND.margin(nccl, fixed=0.0) == 0.0
    assert GROUND.margin([]) == 0.0


def test_a_scheme_measured_and_found_off_is_not_validated() -> None:
    """Evidence says where the model was checked *and how well*: measured 30% off (median)
    is not validated ground, and an extrapolated plan's margin there is its worst error."""
    ground = Ground((Evidence("tp", "gloo", 2, ("cpu",), 4, 0.31, 0.39),
                     Evidence("dp", "gloo", 2, ("cpu",), 6, 0.16, 0.31)))
    labels = ground.labels({"dp": 1, "tp": 2}, zero=0, schedule=None, backend="gloo",
                           devices_per_node=2)
    assert [(label.scheme, label.validated) for label in labels] == [("tp", False)]
    assert "off by more than 25%" in labels[0].text and "median error 31%" in labels[0].text
    assert ground.margin(labels) == pytest.approx(0.39)
    dp = ground.labels({"dp": 2, "tp": 1}, zero=0, schedule=None, backend="gloo",
                       devices_per_node=2)
    assert dp[0].validated and ground.margin(dp) == 0.0


def test_tp_across_nodes_is_its_own_scheme() -> None:
    labels = GROUND.labels({"dp": 1, "tp": 16}, zero=0, schedule=None, backend="nccl",
                           devices_per_node=8)
    assert [(label.scheme, label.validated) for label in labels] == [("tp-cross-node", False)]


def test_evidence_round_trips_through_the_file(tmp_path) -> None:
    rows = [{"source": "s", "mesh": {"dp": 8, "tp": 1}, "zero": 3, "devices_per_node": 8,
             "error": 0.1},
            {"source": "s", "mesh": {"dp": 64, "tp": 1}, "zero": 3, "devices_per_node": 8,
             "error": -0.2}]
    evidence = evidence_from_rows(rows, "nccl")
    assert [(e.scheme, e.max_degree, e.rows) for e in evidence] == [("zero3", 64, 2)]
    assert evidence[0].median_error == pytest.approx(0.15)
    assert evidence[0].worst_error == pytest.approx(0.2)
    assert (evidence[0].median_signed, evidence[0].lowest_signed) == pytest.approx((-0.05, -0.2))
    # a throughput's error carries its step time's for the signs: +25% throughput is a
    # step predicted 20% short (optimistic)
    rate = evidence_from_rows([{**rows[0], "error": 0.25, "step_time_error": -0.2}], "nccl")
    assert (rate[0].median_error, rate[0].median_signed) == pytest.approx((0.25, -0.2))
    path = write_ground(evidence, tmp_path / "ground.json")
    assert load_ground(str(path)).evidence == tuple(evidence)
    with pytest.raises(ValueError, match="version"):
        ground_from_dict({**json.loads(path.read_text()), "version": 99})


def test_plans_label_every_scheme_in_json_and_text() -> None:
    from autopar import plan
    from autopar.core.plan import Plan
    from autopar.core.plan_summary import format_plan
    from autopar.models import resolve_model
    from autopar.trace import trace

    spec = resolve_model("gpt:layers=2,hidden=64,heads=4,vocab=128,seq=32,batch=4")
    import torch

    with torch.device("meta"):
        model = spec.build()
    gm = trace(model, spec.example_inputs(4, 32))
    p = plan(gm, "2xcpu", dp=2, tp=1, pp=1, zero=0)
    labels = p.predicted["ground"]
    assert [label["scheme"] for label in labels] == ["dp"]
    assert isinstance(labels[0]["validated"], bool)
    again = Plan.from_dict(json.loads(json.dumps(p.to_dict())))
    assert again.predicted["ground"] == labels
    text = format_plan(p, "gpt")
    assert "validated ground" in text and labels[0]["text"] in text


def test_an_error_validated_ground_shares_is_no_margin() -> None:
    """The margin guards the ranking: when the model misses tp and dp alike (both measured
    about 30% slower than predicted), a tp plan predicted faster than a dp plan is faster,
    and only the difference is asked; a scheme the model is more pessimistic about than
    validated ground needs no margin."""
    shared = Ground((Evidence("dp", "gloo", 2, ("cpu",), 4, 0.24, 0.3, -0.24, -0.3),
                     Evidence("tp", "gloo", 2, ("cpu",), 4, 0.3, 0.44, -0.3, -0.44)))
    tp = shared.labels({"dp": 1, "tp": 2}, zero=0, schedule=None, backend="gloo",
                       devices_per_node=2)
    assert not tp[0].validated
    # (1 - 0.24) / (1 - 0.3) - 1: only the 6 points tp's typical miss exceeds dp's (its
    # worst, 44%, is not the margin: medians, so one slow run does not set it)
    assert shared.margin(tp) == pytest.approx(0.76 / 0.7 - 1)
    assert shared.margin(tp) < tp[0].evidence.worst_error
    pessimistic = Ground((shared.evidence[0],
                          Evidence("tp", "gloo", 2, ("cpu",), 4, 0.3, 0.35, 0.3, 0.25)))
    assert pessimistic.margin(pessimistic.labels(
        {"dp": 1, "tp": 2}, zero=0, schedule=None, backend="gloo", devices_per_node=2)) == 0.0
    # beyond the degrees measured the worst error at the lower ones stays the margin
    tp4 = shared.labels({"dp": 1, "tp": 4}, zero=0, schedule=None, backend="gloo",
                        devices_per_node=4)
    assert "extrapolated" in tp4[0].text and shared.margin(tp4) == pytest.approx(0.44)
    # an unmeasured scheme carries the largest ranking error measured there, at least 25%
    pp = shared.labels({"pp": 2, "dp": 1, "tp": 1}, zero=0, schedule="1f1b", backend="gloo",
                       devices_per_node=2)
    assert shared.margin(pp) == DEFAULT_MARGIN
    # evidence written without signed errors keeps the worst absolute error
    unsigned = Ground((Evidence("dp", "gloo", 2, ("cpu",), 4, 0.24, 0.3),
                       Evidence("tp", "gloo", 2, ("cpu",), 4, 0.3, 0.44, -0.3, -0.44)))
    assert unsigned.margin(unsigned.labels(
        {"dp": 1, "tp": 2}, zero=0, schedule=None, backend="gloo", devices_per_node=2)
    ) == pytest.approx(0.44)
    label = tp[0].to_dict()
    assert label["lowest_signed_error"] == pytest.approx(-0.44)
    assert "-44% at the most optimistic" in label["text"]


def test_context_parallelism_is_labelled_per_attention_algorithm() -> None:
    """A plan with cp says whether its attention algorithm was validated there: runs that
    passed keys and values around a ring are evidence for the ring, not for Ulysses'
    all-to-alls or an all-gather."""
    rows = [{"source": "long-seq", "mesh": {"dp": 8, "cp": cp, "tp": 4}, "zero": 1,
             "schedule": None, "cp_algorithm": "ring", "devices_per_node": 8, "error": 0.05}
            for cp in (2, 8)]
    ground = Ground(tuple(evidence_from_rows(rows, "nccl")))
    assert ground.best("cp-ring", "nccl").max_degree == 8

    def label(cp: int, algorithm: str | None):
        labels = ground.labels({"dp": 8, "cp": cp, "tp": 4}, zero=1, schedule=None,
                               backend="nccl", devices_per_node=8, cp_algorithm=algorithm)
        return {lab.scheme: lab for lab in labels}

    assert label(8, "ring")["cp-ring"].validated
    assert not label(16, "ring")["cp-ring"].validated  # beyond the degrees measured
    assert "extrapolated" in label(8, "ulysses")["cp-ulysses"].text
    assert not label(4, "auto")["cp"].validated  # not chosen yet: no algorithm's evidence
