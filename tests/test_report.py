"""``autopar report``: the schedule simulation behind the timeline, the HTML page (charts,
labels, no web addresses), ``--run``, bad input, and one headless-Chromium check that the
charts draw with no network request."""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import pytest

import autopar
from autopar.calibrate import CalibrationError
from autopar.cli.load import trace_model
from autopar.cli.report_cmd import run_report
from autopar.core.errors import PlanError
from autopar.core.plan import Plan
from autopar.core.units import format_seconds
from autopar.report import ReportError, build_report, report_html, write_report
from autopar.report.facts import candidates, memory_bars, step_parts
from autopar.report.schedule import step_lanes
from autopar.report.timeline import (
    BACKWARD,
    FORWARD,
    WEIGHT,
    Action,
    Block,
    chunks_per_rank,
    idle,
    rank_orders,
    simulate,
    span,
)
from autopar.runtime.record import RUN_FORMAT, RUN_VERSION
from tests.test_errors import assert_well_formed, run_cli

SPEC = "gpt:layers=4,hidden=32,heads=4,vocab=64,seq=16,batch=8"
URL_ATTR = re.compile(r"""\b(src|href)\s*=\s*["']?\s*(https?:)?//""", re.IGNORECASE)


# --- the schedule simulation ------------------------------------------------------------
def _check_schedule(blocks: list[Block], schedule: str, pp: int, m: int, v: int = 1) -> None:
    """Every chunk runs F and B (and W under zb_v) of every microbatch exactly once, on the
    rank that holds it; dependencies hold; a rank runs one action at a time."""
    from autopar.core.knobs import rank_of_chunk

    n_chunks = pp * chunks_per_rank(schedule, v)
    kinds = (FORWARD, BACKWARD, WEIGHT) if schedule == "zb_v" else (FORWARD, BACKWARD)
    at = {b.action: b for b in blocks}
    assert len(at) == len(blocks), "an action ran twice"
    assert set(at) == {Action(k, c, i) for k in kinds for c in range(n_chunks)
                       for i in range(m)}
    for a, b in at.items():
        assert b.rank == rank_of_chunk(a.chunk, pp, schedule)
        if a.kind == FORWARD and a.chunk > 0:
            assert b.start >= at[Action(FORWARD, a.chunk - 1, a.microbatch)].end
        if a.kind == BACKWARD:
            assert b.start >= at[Action(FORWARD, a.chunk, a.microbatch)].end
            if a.chunk < n_chunks - 1:
                assert b.start >= at[Action(BACKWARD, a.chunk + 1, a.microbatch)].end
        if a.kind == WEIGHT:
            assert b.start >= at[Action(BACKWARD, a.chunk, a.microbatch)].end
    for r in range(pp):
        mine = sorted((b for b in blocks if b.rank == r), key=lambda b: b.start)
        assert all(x.end <= y.start + 1e-12 for x, y in zip(mine, mine[1:]))


def test_1f1b_two_stages_four_microbatches_by_hand():
    t_f, t_b = 1.0, 2.0
    blocks = simulate("1f1b", pp=2, microbatches=4, forward_s=[t_f, t_f], backward_s=[t_b, t_b])
    _check_schedule(blocks, "1f1b", 2, 4)
    for r in range(2):
        ran = [(b.action.kind, b.action.microbatch) for b in blocks if b.rank == r]
        assert sorted(ran) == sorted((k, i) for k in (FORWARD, BACKWARD) for i in range(4))
    # (m + p - 1)(t_f + t_b) in all; each rank idles (p - 1)(t_f + t_b): the 1F1B bubble
    assert span(blocks) == pytest.approx((4 + 2 - 1) * (t_f + t_b))
    assert idle(blocks, 0) == pytest.approx((2 - 1) * (t_f + t_b))
    assert idle(blocks, 1) == pytest.approx((2 - 1) * (t_f + t_b))
    # rank 0: F0 F1 B0 F2 B1 F3 B2 B3 (torch's Schedule1F1B); B0 waits for rank 1's B0
    order = [(b.action.kind, b.action.microbatch) for b in blocks if b.rank == 0]
    assert order == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2),
                     ("B", 3)]
    first_b0 = next(b for b in blocks if b.rank == 0 and b.action.kind == BACKWARD)
    assert first_b0.start == pytest.approx(t_f + t_f + t_b)  # F0 on both ranks, B0 on rank 1


def test_transfers_delay_the_receiver():
    blocks = simulate("1f1b", pp=2, microbatches=4, forward_s=[1.0, 1.0],
                      backward_s=[2.0, 2.0], transfer_s=[0.5, 0.25])
    _check_schedule(blocks, "1f1b", 2, 4)
    f0 = {b.rank: b for b in blocks if b.action == Action(FORWARD, b.rank, 0)}
    assert f0[1].start == pytest.approx(f0[0].end + 0.5)  # chunk 0's output sent on
    b0 = {b.rank: b for b in blocks if b.action == Action(BACKWARD, b.rank, 0)}
    assert b0[0].start == pytest.approx(b0[1].end + 0.25)  # chunk 1's input gradient back


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2),
                                        ("interleaved", 3), ("zb_v", 2)])
@pytest.mark.parametrize("pp,m", [(2, 2), (2, 8), (3, 6), (4, 8)])
def test_every_schedule_runs_everything_once_in_dependency_order(schedule, v, pp, m):
    n = pp * chunks_per_rank(schedule, v)
    blocks = simulate(schedule, pp, m, [1.0 + 0.1 * c for c in range(n)], [2.0] * n, virtual=v,
                      transfer_s=[0.05] * n)
    _check_schedule(blocks, schedule, pp, m, v)


def test_interleaved_bubble_shrinks_by_the_chunks():
    """Megatron's interleaved bubble is (p-1)/v of a stage's work per microbatch."""
    pp, m, v = 4, 8, 2
    per_chunk_f, per_chunk_b = 1.0 / v, 2.0 / v
    blocks = simulate("interleaved", pp, m, [per_chunk_f] * pp * v, [per_chunk_b] * pp * v,
                      virtual=v)
    assert idle(blocks, 0) == pytest.approx((pp - 1) * 3.0 / v)


def _torch_orders(schedule: str, pp: int, m: int, v: int) -> list[list[tuple]]:
    """The per-rank orders torch's schedule classes compute (their private helper, called
    without building stages)."""
    from types import SimpleNamespace

    from torch.distributed.pipelining import schedules as S

    if schedule == "interleaved":
        rounds = max(1, m // pp)
        self = SimpleNamespace(n_local_stages=v, microbatches_per_round=m // rounds,
                               pp_group_size=pp, _n_microbatches=m)
        cls = S.ScheduleInterleaved1F1B
    else:
        self = SimpleNamespace(pp_group_size=pp, _n_microbatches=m, num_stages=2 * pp)
        cls = S.ScheduleZBVZeroBubble
    kind = {"F": FORWARD, "B": BACKWARD, "I": BACKWARD, "W": WEIGHT}
    return [[(kind[a.computation_type.value], a.stage_index, a.microbatch_index)
             for a in cls._calculate_single_rank_operations(self, r) if a is not None]
            for r in range(pp)]


@pytest.mark.parametrize("schedule,v", [("interleaved", 2), ("interleaved", 3), ("zb_v", 2)])
@pytest.mark.parametrize("pp,m", [(2, 2), (2, 8), (3, 6), (4, 4), (4, 12)])
def test_orders_are_torchs(schedule, v, pp, m):
    try:
        theirs = _torch_orders(schedule, pp, m, v)
    except (AttributeError, TypeError) as e:  # a torch without these private helpers
        pytest.skip(f"torch's schedule helpers changed: {e}")
    ours = [[(a.kind, a.chunk, a.microbatch) for a in rank] for rank in
            rank_orders(schedule, pp, m, v)]
    assert ours == theirs


# --- plans and pages --------------------------------------------------------------------
@pytest.fixture(scope="module")
def plans() -> dict[str, Plan]:
    gm = trace_model(SPEC, None, None).gm
    return {
        "1f1b": autopar.plan(gm, "2xcpu", global_batch=8, pp=2, dp=1, microbatches=4,
                             schedule="1f1b", time_limit_s=5),
        "zb_v": autopar.plan(gm, "2xcpu", global_batch=8, pp=2, dp=1, microbatches=4,
                             schedule="zb_v", time_limit_s=5),
        "dp": autopar.plan(gm, "2xcpu", global_batch=8, dp=2, time_limit_s=5),
    }


@pytest.fixture(scope="module")
def page(plans) -> str:
    return report_html(plans["1f1b"])


def _no_web_address(html: str) -> None:
    assert 'src="http' not in html and 'href="http' not in html
    assert not URL_ATTR.search(html), URL_ATTR.search(html)
    assert "<link" not in html.lower()
    assert not re.search(r"<script[^>]*\bsrc\s*=", html, re.IGNORECASE)
    assert "@import" not in html and "url(http" not in html


def test_page_charts_labels_and_no_web_addresses(plans, page):
    plan = plans["1f1b"]
    assert page.count('class="chart"') >= 4
    for name in ("timeline", "memory", "breakdown", "candidates"):
        assert f'id="chart-{name}"' in page
    _no_web_address(page)
    assert page.count("<script") >= 5  # the library once, then one per chart
    assert page.count("Plotly.newPlot") == page.count('class="chart"')
    # it opens with the chosen plan's figures, before any chart
    head = page[page.index("<body>"):page.index('class="chart"')]
    assert format_seconds(plan.predicted["step_time_s"]) in head
    assert "pp=2" in head and "modelled" in head and "measured" in head
    assert "Content-Security-Policy" in page and "default-src 'none'" in page
    assert "validated" in page or "extrapolated" in page


def test_facts_of_a_pipelined_plan(plans):
    plan = plans["1f1b"]
    lanes = step_lanes(plan)
    assert [lane.split(" (")[0] for lane in lanes.lanes] == ["rank 0", "rank 1"]
    per_rank = [[s for s in lanes.segments if s.lane == lane and s.kind in (FORWARD, BACKWARD)]
                for lane in lanes.lanes]
    assert all(len(segs) == 2 * plan.batch["microbatches"] for segs in per_rank)
    assert lanes.simulated_span_s == pytest.approx(lanes.modelled_span_s, rel=0.5)
    bars, _ = memory_bars(plan)
    assert [b.label for b in bars] == ["rank 0", "rank 1"]
    assert max(b.total for b in bars) == pytest.approx(plan.predicted["peak_memory_bytes"])
    assert sum(s for _, s in step_parts(plan)) == pytest.approx(plan.predicted["step_time_s"])
    cands = candidates(plan)
    assert cands.chosen is not None
    chosen = cands.solved[cands.chosen]
    assert chosen["step_time_s"] == plan.predicted["step_time_s"]
    assert sum(len(g) for g in cands.reasons.values()) == cands.total - 1


def test_zero_bubble_and_unpipelined_plans(plans):
    zb = step_lanes(plans["zb_v"])
    assert {s.kind for s in zb.segments} >= {FORWARD, BACKWARD, WEIGHT}
    dp = step_lanes(plans["dp"])
    assert dp.lanes[0] == "forward + backward" and "optimizer" in dp.lanes
    html = report_html(plans["dp"])
    assert html.count('class="chart"') >= 4
    _no_web_address(html)


def _record_run(directory: Path, plan: Plan, steps: int = 6, world: int = 2) -> Path:
    """A run directory as ``ParallelModule.record_run`` writes it, with made-up times."""
    directory.mkdir()
    for rank in range(world):
        doc = {"format": RUN_FORMAT, "version": RUN_VERSION, "rank": rank, "world_size": world,
               "backend": "gloo", "host": {"hostname": "test", "cpu_count": 2},
               "warmup_steps": 1, "plan": plan.to_dict(),
               "steps": [{"step": i, "step_s": 0.05 + 0.2 * (i == 0) + 0.001 * rank,
                          "train_step_s": 0.049, "p2p_wait_s": 0.0, "collectives": []}
                         for i in range(steps)]}
        (directory / f"rank{rank}.json").write_text(json.dumps(doc))
    return directory


def test_run_adds_predicted_vs_measured(plans, tmp_path, capsys):
    plan = plans["1f1b"]
    plan_file = tmp_path / "plan.json"
    plan.save(plan_file)
    run = _record_run(tmp_path / "run", plan)
    out = tmp_path / "plan.html"
    assert run_report(argparse.Namespace(plan=str(plan_file), out=str(out), run=str(run))) == 0
    line = capsys.readouterr().out.strip()
    assert re.fullmatch(rf"wrote {re.escape(str(out))} \([\d,]+ KiB, 5 charts\)", line), line
    html = out.read_text()
    assert 'id="chart-run"' in html and "predicted (modelled) vs measured" in html
    assert "50.5 ms" in html  # the median step past the warm-up (measured)
    _no_web_address(html)


def test_bad_input_is_a_clear_error(plans, tmp_path, capsys):
    not_plan = tmp_path / "cluster.json"
    not_plan.write_text('{"nodes": 2}')
    with pytest.raises(PlanError) as e:
        run_report(argparse.Namespace(plan=str(not_plan), out=str(tmp_path / "x.html"),
                                      run=None))
    assert_well_formed(e.value)
    err = run_cli(["report", str(tmp_path / "missing.json"), "-o", str(tmp_path / "x.html")],
                  capsys)
    assert "not found" in err
    with pytest.raises(CalibrationError) as e:
        build_report(plans["1f1b"], tmp_path / "no-run")
    assert_well_formed(e.value)
    with pytest.raises(ReportError) as e:
        write_report(plans["1f1b"], tmp_path / "no-dir" / "x.html")
    assert_well_formed(e.value)
    with pytest.raises(ReportError) as e:
        report_html(plans["1f1b"].to_dict())  # data, not a Plan
    assert_well_formed(e.value)


# --- in a browser ------------------------------------------------------------------------
def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        found = shutil.which(name)
        if found:
            return found
    pytest.skip("no Chromium installed (Debian: apt-get install chromium)")


def test_charts_render_in_chromium_offline(plans, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api",
                                   reason="the playwright package is not installed")
    browser_path = _chromium()
    out = write_report(plans["1f1b"], tmp_path / "plan.html",
                       run_dir=_record_run(tmp_path / "run", plans["1f1b"]))
    url = out.resolve().as_uri()
    requests, problems = [], []
    with sync_api.sync_playwright() as pw:
        try:
            browser = pw.chromium.launch(executable_path=browser_path,
                                         args=["--no-sandbox", "--disable-gpu"])
        except Exception as e:  # a Chromium this playwright cannot drive
            pytest.skip(f"cannot start {browser_path} with playwright: {e}")
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            page.on("request", lambda r: requests.append(r.url))  # every request, any scheme
            page.route("**/*", lambda route: route.continue_() if route.request.url == url
                       else route.abort())  # and none reaches a network
            page.on("console", lambda m: m.type in ("error", "warning")
                    and problems.append(f"{m.type}: {m.text}"))
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url}"))
            page.goto(url, wait_until="load")
            page.wait_for_function("document.querySelectorAll('.chart .main-svg').length >= 5",
                                   timeout=15000)
            charts = page.evaluate("""() => [...document.querySelectorAll('.chart')].map(c => {
                const svg = c.querySelector('svg.main-svg');
                const box = svg ? svg.getBoundingClientRect() : {width: 0, height: 0};
                return {id: c.id, width: box.width, height: box.height,
                        marks: c.querySelectorAll('.point, .bars path, .scatterlayer path')
                                .length}; })""")
            page.screenshot(path=str(tmp_path / "report.png"), full_page=True)
        finally:
            browser.close()
    assert [c["id"] for c in charts] == ["chart-timeline", "chart-memory", "chart-breakdown",
                                         "chart-candidates", "chart-run"]
    for c in charts:
        assert c["width"] > 100 and c["height"] > 100, c
        assert c["marks"] > 0, c
    assert requests == [url], requests
    assert not problems, problems
    assert (tmp_path / "report.png").stat().st_size > 10_000
