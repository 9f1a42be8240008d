"""Communication another framework's program overlaps, priced as it runs: tensor-parallel
collectives pipelined with their matmuls (``PinnedConfig.tp_overlap``: Transformer Engine's
userbuffers, PyTorch's async TP) and pipeline sends posted beside the compute
(``PinnedConfig.p2p_overlap``: Megatron-Core's interleaved schedule). What hides, what
cannot, and that nothing else of the estimate moves."""

from __future__ import annotations

import pytest
import torch

from autopar.core.cluster import load_cluster
from autopar.core.errors import AutoparError
from autopar.cost_models.data_parallel import OVERLAP_SLOWDOWN
from autopar.models import resolve_model
from autopar.solver.pricing.tp_overlap import exposed_s
from autopar.solver.search.pinned import PinnedConfig, estimate_graph
from autopar.trace import trace


def test_one_chunk_always_shows_and_a_short_matmul_hides_only_its_share() -> None:
    # a long matmul hides all but the one chunk that cannot overlap (1/n)
    assert exposed_s(1.0, 100.0, 4, contention=0.0) == pytest.approx(0.25)
    # a short one hides (n - 1)/n of its own time, no more
    assert exposed_s(1.0, 0.4, 4, contention=0.0) == pytest.approx(1.0 - 0.3)
    # the matmul beside the hidden part runs slower
    assert exposed_s(1.0, 100.0, 4) == pytest.approx(0.25 + OVERLAP_SLOWDOWN * 0.75)
    # nothing to overlap with, or one rank: the collective whole; none: nothing
    assert exposed_s(1.0, 0.0, 4) == 1.0
    assert exposed_s(1.0, 5.0, 1) == 1.0
    assert exposed_s(0.0, 5.0, 4) == 0.0


@pytest.fixture(scope="module")
def llama():
    spec = resolve_model("llama:layers=2,hidden=1024,heads=8,kv_heads=8,ffn=2816,vocab=4096,"
                         "seq=2048")
    with torch.device("meta"):
        model = spec.build()
    return trace(model, spec.example_inputs(1, 2048))


def _estimate(gm, tp: int, overlap: bool):
    config = PinnedConfig(tp=tp, dp=1, sp=tp > 1, microbatch=1, global_batch=4,
                          layout="megatron" if tp > 1 else "auto", tp_overlap=overlap)
    return estimate_graph(gm, load_cluster(f"{tp}xH100-80GB"), config).prediction


def test_overlap_hides_tp_collectives_behind_matmuls_and_changes_nothing_else(llama) -> None:
    whole, piped = _estimate(llama, 4, False), _estimate(llama, 4, True)
    assert whole.tp_comm_s > 0
    # at least the chunk per collective that cannot hide stays; most of the rest hides
    assert whole.tp_comm_s / 4 <= piped.tp_comm_s < 0.75 * whole.tp_comm_s
    assert piped.compute_s == pytest.approx(whole.compute_s)
    assert piped.peak_memory_bytes == pytest.approx(whole.peak_memory_bytes)
    assert piped.step_time_s == pytest.approx(
        whole.step_time_s - (whole.tp_comm_s - piped.tp_comm_s), rel=1e-6)


def test_without_tensor_parallelism_there_is_nothing_to_overlap(llama) -> None:
    assert _estimate(llama, 1, True).step_time_s == _estimate(llama, 1, False).step_time_s


def test_tp_overlap_must_be_a_bool() -> None:
    with pytest.raises(AutoparError, match="tp_overlap"):
        PinnedConfig(tp=2, tp_overlap="yes")


def test_estimate_cli_prices_and_says_it(tmp_path, capsys) -> None:
    import json

    from autopar.cli.main import main

    args = ["estimate", "llama:layers=2,hidden=512,heads=8,kv_heads=8,ffn=1408,vocab=1024,"
            "seq=1024", "--global-batch", "2", "--cluster", "2xH100-80GB", "--tp", "2", "--sp",
            "--layout", "megatron"]
    out = {}
    for flag in ((), ("--tp-overlap",)):
        path = tmp_path / f"{len(flag)}.json"
        assert main([*args, *flag, "--json", str(path)]) == 0
        out[bool(flag)] = json.loads(path.read_text())
    assert out[True]["assumptions"]["tp_overlap"] and not out[False]["assumptions"]["tp_overlap"]
    assert out[True]["predicted"]["step_time_s"] < out[False]["predicted"]["step_time_s"]
    assert main(args + ["--tp-overlap"]) == 0
    assert "pipelined with the matmuls (--tp-overlap)" in capsys.readouterr().out
    piped = ["estimate", "llama:layers=4,hidden=256,heads=4,kv_heads=4,ffn=704,vocab=512,"
             "seq=256", "--global-batch", "4", "--cluster", "2xH100-80GB", "--pp", "2",
             "--schedule", "interleaved", "--virtual-stages", "2"]
    assert main([*piped, "--p2p-overlap"]) == 0
    assert "pipeline sends beside the compute (--p2p-overlap)" in capsys.readouterr().out


def test_pipeline_sends_beside_compute_cost_only_their_contention() -> None:
    spec = resolve_model("llama:layers=4,hidden=512,heads=8,kv_heads=8,ffn=1408,vocab=1024,"
                         "seq=1024")
    with torch.device("meta"):
        model = spec.build()
    gm = trace(model, spec.example_inputs(1, 1024))

    def estimate(overlap: bool):
        config = PinnedConfig(pp=2, dp=1, microbatch=1, global_batch=4, schedule="interleaved",
                              virtual=2, p2p_overlap=overlap)
        return estimate_graph(gm, load_cluster("2xH100-80GB"), config).prediction

    blocking, overlapped = estimate(False), estimate(True)
    assert blocking.p2p_s > 0
    assert overlapped.p2p_s == pytest.approx(OVERLAP_SLOWDOWN * blocking.p2p_s)
    assert overlapped.compute_s == pytest.approx(blocking.compute_s)
    assert overlapped.step_time_s < blocking.step_time_s
