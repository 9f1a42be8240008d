"""``autopar estimate``: the memory calculator's figures and verdicts."""

from __future__ import annotations

import json

import pytest
import torch

import autopar
from autopar.cli.estimate_cmd import EXIT_DOES_NOT_FIT
from autopar.cli.main import main
from autopar.core.values import tensor_inputs
from autopar.models import resolve_model

ARGS = ["llama3-8b", "--cluster", "8xH100-80GB", "--tp", "1", "--pp", "1", "--dp", "8",
        "--precision", "bf16", "--global-batch", "8", "--seq", "2048"]


def estimate(tmp_path, *extra: str, status: int | None = 0) -> dict:
    """The estimate's JSON; its exit status must be ``status`` (None: the one its own
    verdict implies, 0 if it fits, EXIT_DOES_NOT_FIT if not)."""
    out = tmp_path / "e.json"
    code = main(["estimate", *ARGS, *extra, "--json", str(out)])
    result = json.loads(out.read_text())
    if status is None:
        status = 0 if result["predicted"]["fits"] else EXIT_DOES_NOT_FIT
    assert code == status
    return result


@pytest.mark.slow
def test_llama3_8b_zero0_is_16_bytes_per_parameter_and_does_not_fit(tmp_path, capsys) -> None:
    """16Ψ as autopar runs mixed precision at ZeRO-0: 4 B fp32 parameters (the master copy)
    + 4 B fp32 gradients + 8 B (momentum, variance), whichever ``--master-weights``: at ZeRO-0
    the masters stay with the parameters. At ZeRO-1 over 8 ranks with the masters in the
    optimizer: 2 B 16-bit weights + 4 B fp32 gradients + 12 B / 8 (Megatron-LM's distributed
    optimizer, 6 + 12/d)."""
    params = 8.03e9
    e = estimate(tmp_path, "--zero", "1", status=None)
    m = e["predicted"]["memory"]
    assert m["params"] == pytest.approx(2 * params, rel=0.01)
    assert m["grads"] == pytest.approx(4 * params, rel=0.01)
    assert m["optimizer"] == pytest.approx(12 / 8 * params, rel=0.01)
    for how in ("optimizer", "params"):
        e = estimate(tmp_path, "--zero", "0", "--master-weights", how, status=EXIT_DOES_NOT_FIT)
        m = e["predicted"]["memory"]
        assert m["params"] == pytest.approx(4 * params, rel=0.01)
        assert m["grads"] == pytest.approx(4 * params, rel=0.01)
        assert m["optimizer"] == pytest.approx(8 * params, rel=0.01)
    # The peak is the optimizer step here (foreach AdamW's fp32 scratch), when activations
    # are gone: the breakdown is of the peak.
    assert m["activations"] + m["temporaries"] > 0
    assert e["predicted"]["fits"] is False
    text = capsys.readouterr().out
    assert "does NOT fit" in text and "assuming" in text and "bf16" in text
    for key in ("step_time_s", "peak_memory_bytes", "tflops_per_device", "tokens_per_s"):
        assert e["predicted"][key] > 0


@pytest.mark.slow
def test_llama3_8b_zero3_fits(tmp_path) -> None:
    e = estimate(tmp_path, "--zero", "3")
    assert e["predicted"]["fits"] is True
    memory = e["predicted"]["memory"]  # fp32 shards: parameters 4 B, moments 8 B
    assert memory["optimizer"] == pytest.approx(8 * 8.03e9 / 8, rel=0.01)
    assert memory["params"] == pytest.approx(4 * 8.03e9 / 8, rel=0.01)


def test_pinned_degrees_must_match_the_cluster(capsys) -> None:
    assert main(["estimate", "gpt:layers=2,hidden=64,heads=4,vocab=128,seq=32,batch=8",
                 "--cluster", "8xA100-80GB", "--tp", "2", "--dp", "2"]) == 2
    err = capsys.readouterr().err
    assert "tp x pp x dp x cp = 2 x 1 x 2 x 1 = 4" in err and "8" in err


def test_megatron_layout_under_ep_keeps_each_expert_whole(tmp_path) -> None:
    """Megatron's layout at tp2 x ep8 (Mixtral-style): the dense weight matrices split across
    tp, each ep rank's experts whole (Megatron-Core's expert tensor parallel size 1), so a
    device holds more than half of the tp1 weights and less than all of them. (Splitting the
    experts over tp too had no placement: "INFEASIBLE", it was.)"""
    model = ("mixtral:layers=2,hidden=256,heads=4,kv_heads=2,ffn=512,experts=8,vocab=256,"
             "seq=128")
    params = {}
    for name, extra in (("tp1", ["--tp", "1", "--dp", "64"]),
                        ("megatron", ["--tp", "2", "--dp", "32", "--layout", "megatron"])):
        out = tmp_path / f"{name}.json"
        assert main(["estimate", model, "--cluster", "8x8xH100-80GB", "--ep", "8",
                     "--precision", "bf16", *extra, "--json", str(out)]) == 0
        params[name] = json.loads(out.read_text())["predicted"]["memory"]["params"]
    assert params["tp1"] / 2 < params["megatron"] < params["tp1"], params


def test_pipeline_estimate_reports_stages(tmp_path, capsys) -> None:
    out = tmp_path / "p.json"
    assert main(["estimate", "gpt:layers=8,hidden=256,heads=8,vocab=1024,seq=128,batch=64",
                 "--cluster", "8xA100-80GB", "--tp", "2", "--pp", "2", "--dp", "2",
                 "--microbatch", "2", "--schedule", "interleaved", "--virtual-stages", "2",
                 "--recompute", "full", "--json", str(out)]) == 0
    e = json.loads(out.read_text())
    stages = e["predicted"]["stages"]
    # interleaved: each rank runs two chunks of two layers
    assert [s["layers"] for s in stages] == ["0-1,4-5", "2-3,6-7"]
    assert e["predicted"]["time"]["bubble_s"] > 0
    # 1F1B-family schedules: the first stage holds the most microbatches in flight.
    assert stages[0]["in_flight"] > stages[1]["in_flight"]
    assert "pipeline stages" in capsys.readouterr().out


def test_a_configuration_that_does_not_fit_exits_3_with_its_report(tmp_path, capsys) -> None:
    cluster = tmp_path / "small.yaml"
    cluster.write_text("nodes: 1\ndevices_per_node: 2\ndevice: {preset: cpu, memory_gib: 0.0001}\n")
    out = tmp_path / "e.json"
    code = main(["estimate", "gpt:layers=2,hidden=64,heads=4,vocab=128,seq=32,batch=8",
                 "--cluster", str(cluster), "--json", str(out)])
    assert code == EXIT_DOES_NOT_FIT == 3
    assert "does NOT fit" in capsys.readouterr().out
    assert json.loads(out.read_text())["predicted"]["fits"] is False


def test_megatron_layout_splits_all_weights_across_tp(tmp_path) -> None:
    """``--layout megatron`` prices Megatron-LM's tensor parallelism (every weight matrix split
    across tp), the layout published tp runs used: with GQA's small k/v weights the solver's
    own fastest layout keeps some whole, and so counts more weight memory per device."""
    model = "llama:layers=2,hidden=256,heads=8,kv_heads=2,ffn=512,vocab=512,seq=64"
    params = {}
    for name, extra in (("whole", ["--tp", "1", "--dp", "2"]),
                        ("auto", ["--tp", "2", "--dp", "1", "--sp", "--layout", "auto"]),
                        ("megatron", ["--tp", "2", "--dp", "1", "--sp", "--layout", "megatron"])):
        out = tmp_path / f"{name}.json"
        assert main(["estimate", model, "--cluster", "2xH100-80GB", "--global-batch", "2",
                     "--seq", "64", *extra, "--json", str(out)]) == 0
        params[name] = json.loads(out.read_text())["predicted"]["memory"]["params"]
    # split in half, but for the norm weights each device keeps whole
    assert params["whole"] / 2 <= params["megatron"] <= params["whole"] / 2 * 1.01
    assert params["megatron"] < params["auto"]


@pytest.mark.slow
def test_the_chunked_loss_drops_the_logits_temporaries(tmp_path) -> None:
    """Llama 3 8B at 8,192 tokens on a rank: torch's cross-entropy keeps the fp32
    [tokens, vocab] log-softmax and makes its gradient beside it; the chunked loss keeps one
    log-sum-exp a token. The modelled peak falls by those two buffers."""
    chunked = estimate(tmp_path, "--zero", "3", "--seq", "8192")["predicted"]
    whole = estimate(tmp_path, "--zero", "3", "--seq", "8192", "--no-chunked-loss",
                     status=None)["predicted"]
    log_softmax = 8192 * 128256 * 4
    drop = whole["peak_memory_bytes"] - chunked["peak_memory_bytes"]
    assert drop == pytest.approx(2 * log_softmax, rel=0.02)
    assert chunked["fits"] is True


def test_fuse_elementwise_prices_a_fusing_program(tmp_path) -> None:
    """``--fuse-elementwise`` prices the program Transformer Engine or torch.compile would
    run: the same matmuls, fewer bytes and launches between them, and none of the values
    inside its RMSNorms kept for backward; it says so in its assumptions."""
    args = ["llama:layers=2,hidden=256,heads=4,kv_heads=2,ffn=512,vocab=512,seq=256",
            "--global-batch", "8", "--cluster",
            "1xH100-80GB", "--precision", "bf16"]
    eager_out, fused_out = tmp_path / "eager.json", tmp_path / "fused.json"
    assert main(["estimate", *args, "--json", str(eager_out)]) == 0
    assert main(["estimate", *args, "--fuse-elementwise", "--json", str(fused_out)]) == 0
    eager, fused = json.loads(eager_out.read_text()), json.loads(fused_out.read_text())
    assert fused["assumptions"]["fuse_elementwise"] and not eager["assumptions"][
        "fuse_elementwise"]
    assert fused["predicted"]["step_time_s"] < eager["predicted"]["step_time_s"]
    assert (fused["predicted"]["memory"]["activations"]
            < eager["predicted"]["memory"]["activations"])


def test_a_training_step_serves_only_the_loss_to_its_caller() -> None:
    """``train_step`` reads only the loss: the planner gives the caller no other output (an
    LM's logits are not made whole, nor kept, for a step that drops them), while a forward
    call still gets them whole (tests/test_equivalence.py, ``forward``)."""
    from autopar.core.values import training_output
    from autopar.solver.model.problem import problem_skeleton

    spec = resolve_model("llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=128,seq=32")
    with torch.device("meta"):
        gm = autopar.trace(spec.build(), spec.example_inputs(2, 32))
    outputs = tensor_inputs(gm.graph.output_node())
    assert any(training_output(a) for a in outputs)  # the loss
    assert any(not training_output(a) for a in outputs)  # the logits
    skeleton = problem_skeleton(gm)
    served = [key for key, info in skeleton.values.items()
              if any(use.consumer < 0 for use in info.uses)]
    groups = skeleton.groups
    assert served and all(groups[d][0].meta["val"].ndim == 0 for d, _ in served)


def test_seq_without_a_global_batch_keeps_the_tokens_a_step(tmp_path, capsys) -> None:
    """``--seq 256`` on gpt2 (512 x 1,024 a step) is 2,048 sequences of 256, not 512: the
    tokens a step stay, and the output says so."""
    from autopar.models import resolve_model

    spec = resolve_model("gpt2")
    out = tmp_path / "e.json"
    main(["estimate", "gpt2", "--cluster", "8xH100-80GB", "--zero", "3", "--seq", "256",
          "--json", str(out)])
    a = json.loads(out.read_text())["assumptions"]
    assert a["seq"] == 256
    assert a["global_batch"] * 256 == spec.default_batch * spec.default_seq
    assert "keeping gpt2's" in capsys.readouterr().out
