"""The memory calculator's kinds, in every path: what a plan's peak holds adds up to the peak,
and activations are never shown as 0 for a model that trains.

The step's peak may be the optimizer step's (gradients, states and AdamW's scratch, the
activations freed by then): ``autopar estimate`` then printed "activations 0 B" for
Korthikanti et al.'s GPT configurations under ``--master-weights optimizer``. The forward/
backward peak's kinds (``memory_training``) are reported beside it.
"""

from __future__ import annotations

import json

import pytest

from autopar.cli.main import main

MODEL = "gpt:layers=4,hidden=1024,heads=8,vocab=1024,seq=64,batch=8"  # states outweigh activations
KINDS = ("params", "grads", "optimizer", "activations", "buffers", "temporaries",
         "fragmentation")
CONFIGS = {
    "tp8 sp selective, fp32 masters beside the optimizer": [
        "--tp", "8", "--sp", "--recompute", "selective", "--master-weights", "optimizer"],
    "tp2 pp4 sp full": ["--tp", "2", "--pp", "4", "--sp", "--recompute", "full",
                        "--master-weights", "optimizer"],
    "tp8 full, one microbatch": ["--tp", "8", "--recompute", "full", "--microbatch", "8",
                                 "--master-weights", "optimizer"],
    "pp2 dp4 ZeRO-1, 16-bit parameters as masters": [
        "--pp", "2", "--zero", "1", "--master-weights", "params", "--microbatch", "1"],
    "dp8 ZeRO-3 op recompute": ["--zero", "3", "--recompute", "op"],
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_the_kinds_add_up_and_activations_show(config: str, tmp_path, capsys) -> None:
    out = tmp_path / "e.json"
    code = main(["estimate", MODEL, "--cluster", "8xA100-80GB", "--precision", "bf16",
                 *CONFIGS[config], "--json", str(out)])
    assert code == 0, capsys.readouterr().out
    predicted = json.loads(out.read_text())["predicted"]
    peak, training = predicted["memory"], predicted["memory_training"]
    for kinds in (peak, training):
        assert sum(kinds[k] for k in KINDS) == pytest.approx(kinds["total"], abs=8), config
    assert peak["total"] == predicted["peak_memory_bytes"]
    assert training["total"] <= peak["total"]
    assert training["activations"] > 0, config
    text = capsys.readouterr().out
    row = next(line for line in text.splitlines() if line.strip().startswith("activations"))
    if config.startswith("tp8"):  # states outweigh activations: the optimizer step peaks
        assert training["total"] < peak["total"] and peak["activations"] == 0
    if training["total"] < peak["total"]:  # the peak is the optimizer step's: both shown
        assert "forward/backward" in text and not row.rstrip().endswith(" 0 B"), text
    else:
        assert " 0 B" not in row.split("(")[0], text
