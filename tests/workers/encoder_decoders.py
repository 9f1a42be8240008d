"""Models that write buffers in place, trained under autopar against one device:
encoder-decoders (T5, BART; tiny, eager attention, dropout 0), and a buffer split by heads.

Both build their decoder inputs by writing the shifted labels into a new buffer in place
(``_shift_right``, ``shift_tokens_right``), which once trained silently wrong with tp=2.
Run under torchrun by tests/test_inplace_equivalence.py; each rank writes
``rank<r>.json`` into ``$AUTOPAR_TEST_OUT``: per case, the comparison of every loss and
every gradient of every step::

    torchrun --nproc-per-node 2 tests/workers/encoder_decoders.py '{"model": "t5", "tp": 2}'
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from equivalence import cluster_for  # noqa: E402
from grad_check import compare, train_parallel, train_reference  # noqa: E402

import autopar  # noqa: E402
from autopar.runtime.teardown import leave

FAST = str(Path(__file__).resolve().parents[1] / "clusters" / "cpu-fast-links.yaml")


def build(name: str):
    """The model and one global batch (keyword arguments) that gives a loss."""
    import transformers

    torch.manual_seed(0)
    if name == "t5":
        config = transformers.T5Config(
            vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
            num_heads=4, relative_attention_num_buckets=8, dropout_rate=0.0, use_cache=False,
            decoder_start_token_id=0, pad_token_id=0, eos_token_id=2)
        cls = transformers.T5ForConditionalGeneration
    else:
        config = transformers.BartConfig(
            vocab_size=96, d_model=32, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
            decoder_ffn_dim=64, max_position_embeddings=16, dropout=0.0, attention_dropout=0.0,
            activation_dropout=0.0, use_cache=False, pad_token_id=1, bos_token_id=0,
            eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None)
        cls = transformers.BartForConditionalGeneration
    model = cls._from_config(config, attn_implementation="eager").train()
    ids = torch.randint(3, 96, (4, 16), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(3, 96, (4, 16), generator=torch.Generator().manual_seed(2))
    return model, {"input_ids": ids, "labels": labels, "use_cache": False}


def head_buffer():
    """tests/test_inplace.py's HeadBuffer (queries assembled in a new buffer), with the
    solver made to split the buffer by heads: the written buffer really is sharded."""
    from autopar.core.placements import Shard
    from autopar.solver.model.problem import restrict_to
    from autopar.solver.search import mesh_search as search
    from tests.test_inplace import HeadBuffer

    real = search.build_problem

    def build_problem(gm, tp, batch, *skeleton):
        problem = real(gm, tp, batch, *skeleton)
        first = next(n.name for n in gm.graph.nodes if str(n.target) == "aten.slice.Tensor"
                     and "new_empty" in n.args[0].name)
        restrict_to(problem, frozenset({first}), lambda s: s.inputs[0] == Shard(2))
        return problem

    search.build_problem = build_problem
    torch.manual_seed(0)
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(1))  # batch != heads
    return HeadBuffer(), {"x": x}


def run_case(case: dict) -> dict:
    options = {k: v for k, v in case.items() if k != "model"}
    model, kwargs = head_buffer() if case["model"] == "head_buffer" else build(case["model"])
    reference, ref_losses, ref_grads = train_reference(model, (), kwargs, 3)
    world = int(os.environ.get("WORLD_SIZE", 1))
    pm = autopar.parallelize(model, cluster_for(FAST, world), ((), kwargs), **options)
    la, lk = pm.shard_batch(**kwargs)
    losses, grads = train_parallel(pm, la, lk, 3)
    result = compare(pm, reference, losses, ref_losses, grads, ref_grads, rtol=1e-5)
    buffers = [n for n, st in pm.plan.strategies.items() if n.startswith("new_")]
    return {"case": case, "mesh": pm.plan.mesh, "losses": losses, "reference": ref_losses,
            "sharded": sorted(f for f, ax in pm.plan.params.items() if ax.get("tp", "R") != "R"),
            "buffers": {n: pm.plan.strategies[n]["tp"]["out"][0] for n in buffers},
            **result.to_dict()}


def main() -> int:
    records = [run_case(json.loads(arg)) for arg in sys.argv[1:]]
    rank = dist.get_rank() if dist.is_initialized() else 0
    Path(os.environ["AUTOPAR_TEST_OUT"], f"rank{rank}.json").write_text(json.dumps(records))
    return 0


if __name__ == "__main__":
    leave(main())
