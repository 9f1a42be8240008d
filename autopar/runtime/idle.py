"""The ranks a plan does not use, when it uses fewer devices than were launched.

A plan may use fewer devices than its cluster has (``plan.explanation["devices"]``: the
modelled step is faster on fewer). Launched on the whole cluster, ranks 0 ..
``plan.world_size - 1`` run the plan; each other rank gets an :class:`IdleRank`. It trains
nothing: ``train_step`` computes no forward or backward and leaves no gradient (so an
optimizer built on its parameters changes nothing), and returns the step's loss, which rank
0 sends to every rank, so a training loop reads the same loss on every rank as with any plan.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autopar.core.errors import RuntimeSetupError
from autopar.core.plan import Plan
from autopar.runtime.grad_clip import clip_grad_norm_
from autopar.runtime.mesh import MeshContext
from autopar.runtime.parallel_module import ParallelModule, scaler_for


def share_loss(loss: torch.Tensor) -> torch.Tensor:
    """Rank 0's loss on every launched rank (idle ones included)."""
    dist.broadcast(loss, src=0)
    return loss


class NoRecording:
    """What ``record_run`` gives an idle rank: the recorder's interface, writing nothing."""

    def __enter__(self) -> NoRecording:
        return self

    def __exit__(self, *exc: Any) -> bool:
        return False

    def close(self) -> None:
        return None


class PartOfWorld(ParallelModule):
    """A ParallelModule on a rank that runs the plan while other launched ranks idle: its
    ``train_step`` also sends the loss to them (one broadcast per step)."""

    def train_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return share_loss(super().train_step(*args, **kwargs))


class IdleRank(nn.Module):
    """A launched rank the plan does not use. It holds the model unchanged (so
    ``torch.optim.AdamW(pm.parameters())`` works) but never gives it a gradient; its
    ``train_step`` returns the loss of the ranks that train."""

    active = False

    def __init__(self, model: nn.Module, plan: Plan, ctx: MeshContext):
        super().__init__()
        self.model = model
        self.plan = plan
        self.mesh_context = ctx
        self._scaler = scaler_for(plan, None)

    @property
    def code(self) -> str:
        rank = dist.get_rank() if dist.is_initialized() else 0
        return (f"# rank {rank} is idle: the plan uses ranks 0-{self.plan.world_size - 1} "
                f"({self.plan.explanation.get('devices', {}).get('why', '')})\n")

    def shard_batch(self, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        """Nothing of the batch is this rank's; returned as given (train_step ignores it)."""
        return args, kwargs

    def train_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """No work here; the loss the training ranks computed for this step (under fp16,
        after taking part in their overflow check, with nothing to report)."""
        if self._scaler is not None:
            self._scaler.update(self._scaler.unscale_and_check([]))
        return share_loss(torch.zeros((), device=self.mesh_context.device))

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """No gradient here; takes part in the training ranks' norm (one all-reduce) and
        returns it."""
        return clip_grad_norm_(self, max_norm, norm_type)

    def record_run(self, directory: str | os.PathLike[str]) -> NoRecording:
        """Nothing to record: this rank runs no part of the plan. The ranks that run it write
        the run's files (a run of ``plan.world_size`` ranks)."""
        return NoRecording()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeSetupError(
            f"this rank is idle: the plan uses {self.plan.world_size} of the "
            f"{self.plan.cluster['devices']} launched ranks",
            where="IdleRank.forward",
            fix="call train_step (it returns the step's loss on every rank), or launch "
            f"{self.plan.world_size} process(es) with this plan")
