"""Gradient clipping under a plan clips as one device would: the norm of the whole model's
gradient (every tensor-parallel shard, pipeline stage, expert block and replica counted
once), the same
factor on every rank. Multi-process cases run through the equivalence worker: each step's
norm and every clipped gradient against ``torch.nn.utils.clip_grad_norm_`` on one device."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch

import autopar
from autopar.core.errors import AutoparError
from autopar.models import GPT, GPTConfig
from autopar.runtime.parallel_module import find_loss
from tests.distributed import FAST, run_pinned

CLIP = 0.05  # below every step's norm on these models: the clip really scales


def _gpt() -> tuple[torch.nn.Module, tuple]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=96, n_layer=2, n_head=4, n_embd=32))
    idx = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(1))
    return model, (idx, idx)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_one_device_clips_as_torch_does(norm_type: float) -> None:
    model, batch = _gpt()
    reference = copy.deepcopy(model)
    pm = autopar.parallelize(model, "1xcpu", batch, recompute=("none",))
    pm.train_step(*batch)
    find_loss(reference(*batch)).backward()
    want = torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP, norm_type)
    got = pm.clip_grad_norm_(CLIP, norm_type)
    assert got.item() > CLIP
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    mine = dict(pm.named_parameters())
    for name, p in reference.named_parameters():
        torch.testing.assert_close(mine[f"wrapped.{name}"].grad, p.grad, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("max_norm, norm_type, field", [
    (0.0, 2.0, "max_norm"), (float("nan"), 2.0, "max_norm"), (1.0, -1.0, "norm_type")])
def test_bad_arguments_name_the_field(max_norm: float, norm_type: float, field: str) -> None:
    model, batch = _gpt()
    pm = autopar.parallelize(model, "1xcpu", batch, recompute=("none",))
    pm.train_step(*batch)
    with pytest.raises(AutoparError, match=field):
        pm.clip_grad_norm_(max_norm, norm_type)


LAUNCHES = {
    "2ranks": (2, [
        # tensor parallelism: sharded matmul weights, replicated norms and biases
        {"model": "gpt", "tp": 2, "cluster": FAST, "clip": CLIP},
        # a pipeline: each stage holds other weights (GPT's tied embedding on both ends)
        {"model": "gpt", "pp": 2, "microbatches": 2, "clip": CLIP},
        # FSDP2 (ZeRO-3): DTensor shards over dp
        {"model": "llama", "dp": 2, "zero": 3, "clip": CLIP},
        # expert parallelism: each ep rank holds other experts under the same names
        {"model": "mixtral", "dp": 2, "ep": 2, "clip": CLIP},
    ]),
    "4ranks": (4, [
        {"model": "llama", "pp": 2, "tp": 2, "microbatches": 2, "cluster": FAST, "clip": CLIP},
        {"model": "gpt", "dp": 2, "tp": 2, "zero": 3, "cluster": FAST, "clip": CLIP},
        {"model": "mixtral", "dp": 4, "ep": 2, "zero": 3, "clip": CLIP},
    ]),
}


@pytest.mark.slow
@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_clipped_training_matches_single_device(launch: str, tmp_path: Path) -> None:
    nproc, cases = LAUNCHES[launch]
    run_pinned(nproc, tmp_path, cases)
