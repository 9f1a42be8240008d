"""Dynamic loss scaling: GradScaler's rule, bit for bit, agreed over ranks."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from autopar.core.errors import AutoparError
from autopar.runtime.loss_scale import DynamicLossScaler, LossScaleConfig
from tests.distributed import free_port

INF, NAN = 3, 6  # steps whose first gradient is set to inf, nan
CONFIGS = {
    "powers_of_two": LossScaleConfig(init_scale=2.0 ** 10, growth_interval=2),
    # Factors that float32 cannot hold exactly: the scale must round as GradScaler's does.
    "odd_factors": LossScaleConfig(init_scale=3.1, growth_factor=1.7, backoff_factor=0.3,
                                   growth_interval=2),
}
OPTIMIZERS = {"sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
              "adam": lambda p: torch.optim.Adam(p, lr=0.01)}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(5, 4, generator=g), torch.randn(5, 2, generator=g)
    return nn.functional.mse_loss(model(x), y)


def _spoil(model: nn.Module, step: int) -> None:
    if step in (INF, NAN):
        model[0].weight.grad[0, 0] = math.inf if step == INF else math.nan


def _train_grad_scaler(config: LossScaleConfig, optimizer: str
                       ) -> tuple[list[float], nn.Module, dict]:
    model = _model()
    opt = OPTIMIZERS[optimizer](model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=config.init_scale,
                                  growth_factor=config.growth_factor,
                                  backoff_factor=config.backoff_factor,
                                  growth_interval=config.growth_interval)
    scales = []
    for step in range(8):
        opt.zero_grad()
        scaler.scale(_loss(model, step)).backward()
        _spoil(model, step)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, model, opt.state_dict()


def _train_ours(config: LossScaleConfig, optimizer: str) -> tuple[list[float], nn.Module, dict]:
    model = _model()
    opt = OPTIMIZERS[optimizer](model.parameters())
    scaler = DynamicLossScaler(config)
    scales = []
    for step in range(8):
        opt.zero_grad()
        scaler.scale_loss(_loss(model, step)).backward()
        _spoil(model, step)
        found = scaler.unscale_and_check(model.parameters())
        if not found:
            opt.step()
        scaler.update(found)
        scales.append(scaler.scale)
    assert scaler.skipped_steps == 2
    return scales, model, opt.state_dict()


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("config", list(CONFIGS))
def test_matches_grad_scaler_bit_for_bit(config: str, optimizer: str) -> None:
    want_scales, want_model, want_state = _train_grad_scaler(CONFIGS[config], optimizer)
    got_scales, got_model, got_state = _train_ours(CONFIGS[config], optimizer)
    assert got_scales == want_scales
    # The run exercised both rules: the scale grew and backed off.
    assert any(b > a for a, b in zip(want_scales, want_scales[1:]))
    assert any(b < a for a, b in zip(want_scales, want_scales[1:]))
    for (name, want), got in zip(want_model.named_parameters(), got_model.parameters()):
        assert torch.equal(got, want), name
    for key, want in want_state["state"].items():
        for name, value in want.items():
            assert torch.equal(got_state["state"][key][name], value), (key, name)


@pytest.mark.parametrize("growth_factor", [2.0, 1.7])
def test_update_matches_torch_kernel_at_float32_edges(growth_factor: float) -> None:
    """Near float32's largest value the scale stops growing (it would be inf), as GradScaler's
    ``_amp_update_scale_`` has it; backing off rounds to float32."""
    config = LossScaleConfig(init_scale=2.0 ** 125, growth_factor=growth_factor,
                             backoff_factor=0.3, growth_interval=1)
    ours = DynamicLossScaler(config)
    scale = torch.full((1,), config.init_scale, dtype=torch.float32)
    tracker = torch.zeros(1, dtype=torch.int32)
    for found in [False] * 5 + [True, False, True, True] + [False] * 4:
        torch._amp_update_scale_(scale, tracker, torch.full((1,), float(found)),
                                 growth_factor, config.backoff_factor, config.growth_interval)
        ours.update(found)
        assert ours.scale == scale.item()
    assert ours.scale < math.inf and ours.skipped_steps == 3


def test_overflow_skips_the_step_and_backs_off() -> None:
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    scaler = DynamicLossScaler(LossScaleConfig(init_scale=2.0 ** 10, growth_interval=100))
    for step in range(2):  # one clean step (Adam has state), then an overflow
        opt.zero_grad()
        scaler.scale_loss(_loss(model, step)).backward()
        if step == 1:
            params = copy.deepcopy(list(model.parameters()))
            state = copy.deepcopy(opt.state_dict())
            model[2].bias.grad[1] = math.inf
        found = scaler.unscale_and_check(model.parameters())
        if not found:
            opt.step()
        scaler.update(found)
        assert found == (step == 1) and scaler.last_step_skipped == (step == 1)
    assert scaler.scale == 2.0 ** 9 and scaler.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), params))
    after = opt.state_dict()["state"]
    assert all(torch.equal(after[k][n], v) for k, s in state["state"].items()
               for n, v in s.items())
    # The finite gradients were unscaled all the same, as GradScaler unscales them.
    assert model[2].weight.grad.abs().max() < 10


def test_fp16_loss_is_scaled_in_float32_and_unscaled_once() -> None:
    scaler = DynamicLossScaler()
    scaled = scaler.scale_loss(torch.tensor(3.0, dtype=torch.float16))
    assert scaled.dtype == torch.float32 and scaled.item() == 3.0 * 2 ** 16
    param = nn.Parameter(torch.zeros(2, dtype=torch.float16))
    param.grad = torch.tensor([2.0 ** 15, 2.0], dtype=torch.float16)
    assert scaler.unscale_and_check([param]) is False
    assert param.grad.tolist() == [0.5, 2.0 ** -15]
    with pytest.raises(AutoparError, match="twice"):
        scaler.unscale_and_check([param])


@pytest.mark.parametrize(("field", "value"), [
    ("init_scale", 0.0), ("init_scale", -1.0), ("init_scale", math.inf), ("init_scale", 1e39),
    ("growth_factor", 1.0), ("growth_factor", 0.5),
    ("backoff_factor", 1.0), ("backoff_factor", 0.0),
    ("growth_interval", 0), ("growth_interval", 2.5), ("growth_interval", True)])
def test_config_errors_name_the_field(field: str, value: object) -> None:
    with pytest.raises(AutoparError) as caught:
        LossScaleConfig(**{field: value})
    assert caught.value.where == f"LossScaleConfig.{field}"
    assert field in caught.value.what and caught.value.fix


def test_state_dict_round_trip() -> None:
    config = LossScaleConfig(init_scale=3.1, growth_factor=1.7, backoff_factor=0.3,
                             growth_interval=3)
    first = DynamicLossScaler(config)
    for found in (False, False, False, True, False, True, False, False):
        first.update(found)
    saved = json.loads(json.dumps(first.state_dict()))  # plain data
    second = DynamicLossScaler()  # other knobs: the checkpoint's are restored
    second.load_state_dict(saved)
    assert second.state_dict() == first.state_dict()
    assert (second.scale, second.skipped_steps, second.last_step_skipped) == (
        first.scale, 2, False)
    for found in (False, True, False, False, False):  # both go on alike
        first.update(found)
        second.update(found)
        assert second.scale == first.scale
    with pytest.raises(AutoparError, match="growth_tracker"):
        second.load_state_dict({k: v for k, v in saved.items() if k != "growth_tracker"})


def _overflow_on_rank_1(rank: int, port: int, out: str) -> None:
    """Rank 1 alone has an inf in its shard of a DTensor gradient; both ranks must skip."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    # The store lives in the test process, as torchrun's agent hosts it: a worker that hosts
    # it can abort at exit while its server thread still runs.
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        sharded = nn.Parameter(distribute_tensor(torch.ones(4, 3), mesh, [Shard(0)]))
        plain = nn.Parameter(torch.ones(3))  # each rank's own (a tensor-parallel shard)
        params = [sharded, plain]
        opt = torch.optim.SGD(params, lr=0.5)
        scaler = DynamicLossScaler(LossScaleConfig(init_scale=4.0, growth_interval=1))
        found = []
        for step in range(3):
            sharded.grad = distribute_tensor(torch.full((4, 3), 8.0), mesh, [Shard(0)])
            plain.grad = torch.full((3,), 8.0 * (rank + 1))
            if step == 0 and rank == 1:
                sharded.grad.to_local()[0, 0] = math.inf
            # Step 2: rank 0 has no gradients at all and still takes part.
            if step == 2 and rank == 1:
                plain.grad[1] = math.nan
            found.append(scaler.unscale_and_check(params if rank == 1 or step < 2 else []))
            if not found[-1]:
                opt.step()
            scaler.update(found[-1])
            if step == 0:
                unscaled = sharded.grad.to_local()[-1].tolist()
        record = {"found": found, "skipped": scaler.skipped_steps, "scale": scaler.scale,
                  "unscaled": unscaled, "sharded": sharded.to_local().tolist(),
                  "plain": plain.tolist()}
        Path(out, f"rank{rank}.json").write_text(json.dumps(record))
        dist.barrier()  # neither rank tears gloo down while the other still talks to it
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_overflow_on_one_rank_skips_every_rank(tmp_path: Path) -> None:
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False)
    mp.spawn(_overflow_on_rank_1, args=(port, str(tmp_path)), nprocs=2)
    del store
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, r in enumerate(records):
        assert r["found"] == [True, False, True], (rank, r)
        assert r["skipped"] == 2 and r["scale"] == 4.0 * 0.5 * 2 * 0.5
        assert r["unscaled"] == [2.0] * 3  # the DTensor's local shard was divided by 4
        # Only step 1 moved the weights: grad 8 / scale 2 = 4 (rank 0), 8 (rank 1 plain).
        assert r["sharded"] == [[1.0 - 0.5 * 4.0] * 3] * 2
        assert r["plain"] == [1.0 - 0.5 * 4.0 * (rank + 1)] * 3
