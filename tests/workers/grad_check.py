"""Training under autopar against single-device training: the loss of every step, and every
gradient this rank holds at every step, each against the same slice of the reference's.

The trajectory uses SGD with momentum and weight decay, not AdamW. Two mathematically equal
single-device runs of HF Llama (4 layers) — the whole batch at once, or 4 microbatches with
their gradients accumulated — already differ beyond rtol 1e-5 after 3 AdamW steps
(``layers.2.mlp.*``): Adam's first update is about ``lr * sign(g)`` for every element, however
small ``|g|``, so an element whose gradient is a sum that cancels to rounding level moves by
``±lr`` in a direction set by the rounding, that is by the order of the summation — which
depends on the machine (SIMD width, GEMM blocking) and on the split into microbatches. That is
why the interleaved-pipeline case failed on one machine and passed on another. SGD's update
is linear in the gradient, so rounding stays at rounding size over the steps, while a real
error (a microbatch counted twice or not at all, a tied gradient not summed, a wrong shard,
a weight the optimizer misses) changes a loss or a gradient at full size.

Each gradient is compared element by element at ``rtol`` of the element and of the
tensor's largest element: an element whose terms cancel (the gradient of a bias a norm
follows, 1e-7 beside its neighbours' 1e-2) carries their rounding, which a different but
equal summation order changes; a real error (a term counted twice or lost, a shard
misplaced) is of the tensor's size. Nothing is skipped silently: a gradient on this rank with no reference to compare with, or a
parameter of this rank left without a gradient that the reference has, is a failure.
"""

from __future__ import annotations

import copy
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from autopar.core.placements import Shard, parse_placement
from autopar.ops.comm_ops import local_slice
from autopar.runtime.parallel_module import find_loss


def make_optimizer(params, kind: str = "sgd") -> torch.optim.Optimizer:
    """The optimizer both sides use (see the module docstring for why SGD by default).
    ``"adamw"`` where the optimizer's state is what is tested (ZeRO-1/2 shard it, offload
    moves it): on models and splits whose gradients do not cancel to rounding level."""
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)


def whole(grad: torch.Tensor) -> torch.Tensor:
    """FSDP2 keeps gradients as DTensor shards over dp; compare whole (tp-local) tensors."""
    from torch.distributed.tensor import DTensor

    return grad.full_tensor() if isinstance(grad, DTensor) else grad.detach().clone()


def train_reference(model: nn.Module, args: tuple, kwargs: dict, steps: int,
                    loss_of: Callable[[Any], torch.Tensor] = find_loss, optimizer: str = "sgd",
                    clip: float | None = None, norms: list[float] | None = None
                    ) -> tuple[nn.Module, list[float], list[dict[str, torch.Tensor]]]:
    """A copy of ``model`` trained on one device: (the copy, losses, gradients per step).
    ``clip``: gradients clipped to that norm (torch's ``clip_grad_norm_``), each step's norm
    appended to ``norms``."""
    reference = copy.deepcopy(model)
    opt = make_optimizer(reference.parameters(), optimizer)
    losses, grads = [], []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_of(reference(*args, **kwargs))
        loss.backward()
        losses.append(loss.item())
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
            if norms is not None:
                norms.append(norm.item())
        grads.append({n: p.grad.clone() for n, p in reference.named_parameters()
                      if p.grad is not None})
        opt.step()
    return reference, losses, grads


def train_parallel(pm: nn.Module, args: tuple, kwargs: dict, steps: int, optimizer: str = "sgd",
                   clip: float | None = None, norms: list[float] | None = None
                   ) -> tuple[list[float], list[dict[str, torch.Tensor | None]]]:
    """``pm`` (what ``autopar.parallelize`` returned) trained on this rank's share of the batch
    (``args``/``kwargs``: ``pm.shard_batch``'s output): losses and this rank's gradients
    (clipped by ``pm.clip_grad_norm_(clip)``, its norms appended to ``norms``)."""
    opt = make_optimizer(pm.parameters(), optimizer)
    losses, grads = [], []
    for _ in range(steps):
        opt.zero_grad()
        losses.append(pm.train_step(*args, **kwargs).item())
        if clip is not None:
            norm = pm.clip_grad_norm_(clip)
            if norms is not None:
                norms.append(norm.item())
        grads.append({n: None if p.grad is None else whole(p.grad)
                      for n, p in pm.named_parameters()})
        opt.step()
    return losses, grads


@dataclass
class Comparison:
    losses_ok: bool = True
    checked: int = 0
    max_err: float = 0.0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.losses_ok and not self.problems and self.checked > 0

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "losses_ok": self.losses_ok, "grads_checked": self.checked,
                "max_grad_err": self.max_err, "problems": self.problems[:20]}


def compare(pm: nn.Module, reference: nn.Module, losses: list[float], ref_losses: list[float],
            grads: list[dict], ref_grads: list[dict], rtol: float = 1e-5,
            atol: float = 1e-6) -> Comparison:
    """Every loss, and every gradient of every step, against the reference."""
    out = Comparison()
    out.losses_ok = len(losses) == len(ref_losses) and all(
        abs(x - y) <= rtol * abs(y) + 1e-7 for x, y in zip(losses, ref_losses))
    if not out.losses_ok:
        out.problems.append(f"losses {losses} != reference {ref_losses}")
    coords, mesh = pm.mesh_context.coords, pm.plan.mesh
    for step, (mine, theirs) in enumerate(zip(grads, ref_grads)):
        for name, g in mine.items():
            fqn = model_name(name)
            ref_name = fqn if fqn in theirs else tied_name(fqn, reference)
            ref = theirs.get(ref_name) if ref_name else None
            if g is None:
                if ref is not None:
                    out.problems.append(f"step {step + 1}: {fqn} has no gradient on this rank")
                continue
            if ref is None:
                out.problems.append(f"step {step + 1}: {fqn} has a gradient but no reference")
                continue
            for axis, text in placements(pm, fqn).items():
                p = parse_placement(text)
                if isinstance(p, Shard) and mesh.get(axis, 1) > 1:
                    ref = local_slice(ref, p, mesh[axis], coords[axis])
            out.checked += 1
            if g.shape != ref.shape:
                out.problems.append(f"step {step + 1}: {fqn} shape {tuple(g.shape)} != "
                                    f"{tuple(ref.shape)}")
                continue
            # an element is judged at rtol of its own size, and of its tensor's: a gradient
            # summed to near zero carries the rounding of its large terms
            scale = atol + rtol * ref.abs().max().item() if ref.numel() else atol
            if not torch.allclose(g, ref, rtol=rtol, atol=scale):
                err = ((g - ref).abs() / (ref.abs() + scale)).max().item()
                out.max_err = max(out.max_err, err)
                out.problems.append(f"step {step + 1}: {fqn} differs (max rel err {err:.3g})")
    return out


def placements(pm: nn.Module, fqn: str) -> dict[str, str]:
    """The plan's placements of a parameter, looking through tied names."""
    if fqn in pm.plan.params:
        return pm.plan.params[fqn]
    named = {model_name(n): p for n, p in pm.named_parameters(remove_duplicate=False)}
    target = named.get(fqn)
    for name, p in named.items():
        if p is target and name in pm.plan.params:
            return pm.plan.params[name]
    return {}


def model_name(name: str) -> str:
    """A parameter's model name from its name under the ParallelModule (DDP's ``module.``,
    pipeline stages' list index, FSDP's wrapper)."""
    return re.sub(r"^(wrapped|_program)\.(\d+\.)?(module\.)?", "", name)


def tied_name(fqn: str, model: nn.Module) -> str | None:
    """The name ``model.named_parameters()`` gives the parameter also called ``fqn``."""
    try:
        target = operator.attrgetter(fqn)(model) if fqn else None
    except AttributeError:
        return None
    for n, p in model.named_parameters():
        if p is target:
            return n
    return None
