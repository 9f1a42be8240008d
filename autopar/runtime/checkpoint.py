"""Save and resume training on any plan: distributed checkpoints built on DCP.

    autopar.save_checkpoint("ckpt/step-000100", pm, optimizer, step=100)
    step = autopar.load_checkpoint("ckpt/step-000100", pm, optimizer)   # any plan, any size
    latest = autopar.latest_checkpoint("ckpt")                           # or None

``torch.distributed.checkpoint`` writes each rank's own shards (replicas once) and reads
them back resharded to whatever plan runs now: dp2 -> tp2, tp2 -> pp2, ZeRO-3 -> ZeRO-0,
2 ranks -> 4 (:mod:`autopar.runtime.checkpoint_layout` says how each weight's part is
described). Saved: the parameters, the optimizer's state and hyperparameters, the step,
each rank's RNG states, the fp16 loss scaler and the plan's fingerprint.

A checkpoint is a directory: DCP's files plus ``autopar.json``, written last. The save goes
to a hidden ``.<name>.partial`` directory, renamed into place only when complete; an older
checkpoint at the same path is moved aside first and removed only after the rename (a crash
in between leaves it as ``.<name>.previous``, which loading falls back to). So a crash
mid-save never leaves a checkpoint that loads half, and never destroys the one before.

Loading reads into fresh tensors and copies them into the model and the optimizer only
once everything was read: a checkpoint from another model (names or shapes differ) is
refused with the list of differences, and a truncated or corrupt one with the file that
failed, leaving the model untouched either way. ``load_checkpoint`` also accepts a
``.safetensors`` file or an ordinary ``torch.save``-d state dict (weights only): start
training from pretrained weights.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from autopar.core.errors import AutoparError
from autopar.runtime.checkpoint_layout import (
    Layout,
    copy_back,
    destination,
    layout_of,
    named_parameters,
    save_value,
    tied_aliases,
)

FORMAT = "autopar-checkpoint"
VERSION = 1
MARKER = "autopar.json"


class CheckpointError(AutoparError):
    """A checkpoint that cannot be saved or loaded as asked."""


def save_checkpoint(path: str | os.PathLike[str], module: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None, *, step: int) -> Path:
    """Write this training state to ``path`` (a directory) atomically; every rank calls it."""
    path = Path(path)
    pm = _parallel_module(module)
    partial = path.parent / f".{path.name}.partial"
    previous = path.parent / f".{path.name}.previous"
    rank = _rank()
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # a save that crashed earlier
    _barrier()
    params = named_parameters(pm)
    layouts = {fqn: layout_of(p, fqn, pm) for fqn, p in params.items()}
    state: dict[str, Any] = {}
    for fqn, p in params.items():
        state[f"model.{fqn}"] = save_value(p, layouts[fqn], pm.mesh_context)
    groups = []
    if optimizer is not None:
        names = {id(p): fqn for fqn, p in params.items()}
        for group in optimizer.param_groups:
            groups.append({"params": [names[id(p)] for p in group["params"]],
                           **_hyperparameters(group)})
            for p in group["params"]:
                fqn = names[id(p)]
                for key, value in optimizer.state.get(p, {}).items():
                    state[f"optim.{fqn}.{key}"] = _state_value(value, p, layouts[fqn], pm)
    state[f"rng.cpu.{rank}"] = torch.get_rng_state()
    if torch.cuda.is_available() and pm.mesh_context.device.type == "cuda":
        state[f"rng.cuda.{rank}"] = torch.cuda.get_rng_state().to("cpu")
    with single_process_dcp():
        dcp.save(state, checkpoint_id=str(partial), no_dist=not dist.is_initialized())
    shapes = _gather_dicts({fqn: list(lay.global_shape) for fqn, lay in layouts.items()})
    if rank == 0:
        meta = {
            "format": FORMAT, "version": VERSION, "step": int(step),
            "plan_fingerprint": hashlib.sha256(pm.plan.to_json().encode()).hexdigest()[:16],
            "model_fingerprint": pm.plan.model.get("fingerprint"),
            "model": pm.plan.model.get("name"), "mesh": pm.plan.mesh,
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "params": dict(sorted(shapes.items())), "tied": tied_aliases(pm),
            "optimizer": {"class": type(optimizer).__name__, "param_groups": groups}
            if optimizer is not None else None,
            "loss_scale": _scaler_state(pm),
        }
        (partial / MARKER).write_text(json.dumps(meta, indent=1))
        if path.exists():
            shutil.rmtree(previous, ignore_errors=True)
            path.rename(previous)
        partial.rename(path)
        shutil.rmtree(previous, ignore_errors=True)
    _barrier()
    return path


def load_checkpoint(path: str | os.PathLike[str], module: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> int:
    """Load ``path`` into ``module`` (and ``optimizer``), resharded to the running plan;
    returns the saved step (0 for a weights file). Every rank calls it."""
    path = Path(path)
    pm = _parallel_module(module)
    if path.is_file():
        from autopar.runtime.weights import load_weights_file

        load_weights_file(path, pm)
        return 0
    path, meta = complete_checkpoint(path)
    params = named_parameters(pm)
    layouts = {fqn: layout_of(p, fqn, pm) for fqn, p in params.items()}
    _check_same_model(meta, layouts)
    reader = dcp.FileSystemReader(str(path))
    stored = reader.read_metadata().state_dict_metadata
    targets: dict[str, tuple[torch.Tensor, Layout]] = {}
    state: dict[str, Any] = {}
    for fqn, p in params.items():
        state[f"model.{fqn}"] = destination(p, layouts[fqn], pm.mesh_context)
        targets[f"model.{fqn}"] = (p, layouts[fqn])
    states: dict[str, tuple[nn.Parameter, str, str]] = {}  # key -> (param, state, fqn)
    if optimizer is not None:
        names = {id(p): fqn for fqn, p in params.items()}
        for group in optimizer.param_groups:
            for p in group["params"]:
                fqn = names[id(p)]
                for key in _state_keys(stored, fqn):
                    existing = optimizer.state.get(p, {}).get(key)
                    template = existing if isinstance(existing, torch.Tensor) else (
                        p if _stored_shape(stored, f"optim.{fqn}.{key}") else torch.zeros(()))
                    state[f"optim.{fqn}.{key}"] = _state_destination(template, p, layouts[fqn],
                                                                     pm)
                    states[f"optim.{fqn}.{key}"] = (p, key, fqn)
    rank = _rank()
    rng_key = f"rng.cpu.{rank}" if f"rng.cpu.{rank}" in stored else "rng.cpu.0"
    state[rng_key] = torch.empty_like(torch.get_rng_state())
    try:
        with single_process_dcp():
            dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    except (Exception, CheckpointException) as err:  # (DCP's is a BaseException)
        raise CheckpointError(
            f"checkpoint {path} could not be read: {_cause(err)}",
            where=str(path),
            fix="it is truncated or corrupt: load an earlier checkpoint (the model was "
            "left unchanged)") from err
    for key, (p, layout) in targets.items():
        copy_back(p, state[key], layout, pm.mesh_context)
    for key, (p, name, fqn) in states.items():
        value = state[key]
        held = optimizer.state.setdefault(p, {})
        if value.ndim == 0 and not _stored_shape(stored, key):
            held[name] = value.clone()  # a scalar state (AdamW's step)
            continue
        if name not in held:
            held[name] = torch.zeros_like(p.detach())
        copy_back(held[name], value, layouts[fqn], pm.mesh_context)
    if optimizer is not None and meta.get("optimizer"):
        for group, saved in zip(optimizer.param_groups, meta["optimizer"]["param_groups"]):
            group.update({k: tuple(v) if isinstance(v, list) else v
                          for k, v in saved.items() if k != "params"})
    torch.set_rng_state(state[rng_key])
    _restore_scaler(pm, meta.get("loss_scale"))
    return int(meta["step"])


def latest_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """The complete checkpoint in ``directory`` with the highest step, or None."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    best: tuple[int, Path] | None = None
    for child in directory.iterdir():
        if child.name.startswith(".") or not (child / MARKER).is_file():
            continue
        try:
            step = int(json.loads((child / MARKER).read_text())["step"])
        except (ValueError, KeyError, json.JSONDecodeError):
            continue
        if best is None or step > best[0]:
            best = (step, child)
    return best[1] if best else None


def complete_checkpoint(path: Path) -> tuple[Path, dict[str, Any]]:
    """``path``, or the checkpoint a save over it moved aside and did not finish replacing;
    with its ``autopar.json``. A directory with neither is refused."""
    previous = path.parent / f".{path.name}.previous"
    for candidate in (path, previous):
        marker = candidate / MARKER
        if marker.is_file():
            try:
                meta = json.loads(marker.read_text())
            except json.JSONDecodeError as err:
                raise CheckpointError(f"{marker} is not valid JSON ({err})", where=str(marker),
                                      fix="the checkpoint is damaged: load an earlier one") from None
            if meta.get("format") != FORMAT:
                raise CheckpointError(f"{candidate} is not an autopar checkpoint",
                                      where=str(marker), fix="pass a directory save_checkpoint wrote")
            return candidate, meta
    partial = path.parent / f".{path.name}.partial"
    hint = f" (an unfinished save is in {partial.name})" if partial.exists() else ""
    raise CheckpointError(
        f"no complete checkpoint at {path}{hint}", where=str(path),
        fix="pass a directory save_checkpoint finished, or use autopar.latest_checkpoint(DIR) "
        "to find the newest one")


def _check_same_model(meta: dict[str, Any], layouts: dict[str, Layout]) -> None:
    """Refuse a checkpoint of another model, listing every difference (on every rank)."""
    mine = _gather_dicts({fqn: list(lay.global_shape) for fqn, lay in layouts.items()})
    saved = meta["params"]
    problems = [f"missing from the checkpoint: {n} {mine[n]}" for n in sorted(mine)
                if n not in saved]
    problems += [f"not in this model: {n} {saved[n]}" for n in sorted(saved) if n not in mine]
    problems += [f"shape differs: {n} is {saved[n]} in the checkpoint, {mine[n]} here"
                 for n in sorted(mine) if n in saved and list(saved[n]) != list(mine[n])]
    if problems:
        shown = "; ".join(problems[:12]) + (f"; ... {len(problems) - 12} more"
                                            if len(problems) > 12 else "")
        raise CheckpointError(
            f"the checkpoint was saved from another model ({meta.get('model')!r}): {shown}",
            where="load_checkpoint", fix="load it into the model it was saved from (or export "
            "it and load the matching weights yourself)")


def _state_value(value: Any, p: nn.Parameter, layout: Layout, pm: nn.Module) -> Any:
    if isinstance(value, torch.Tensor) and value.shape == p.shape:
        return save_value(value, layout, pm.mesh_context)
    if isinstance(value, torch.Tensor):
        return value.detach().to_local() if hasattr(value, "to_local") else value.detach()
    return torch.tensor(value)


def _state_destination(template: torch.Tensor, p: nn.Parameter, layout: Layout,
                       pm: nn.Module) -> torch.Tensor:
    if template.shape == p.shape and template.ndim > 0:
        return destination(template, layout, pm.mesh_context)
    return torch.empty_like(template.detach())


def _state_keys(stored: dict[str, Any], fqn: str) -> list[str]:
    prefix = f"optim.{fqn}."
    return [k[len(prefix):] for k in stored if k.startswith(prefix) and "." not in k[len(prefix):]]


def _stored_shape(stored: dict[str, Any], key: str) -> tuple[int, ...]:
    md = stored.get(key)
    return tuple(getattr(md, "size", ()) or ())


def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    """A parameter group's JSON-able settings (lr, betas, weight decay, ...)."""
    out = {}
    for key, value in group.items():
        if key == "params":
            continue
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, (bool, int, float, str, type(None))) or (
                isinstance(value, tuple) and all(isinstance(v, (int, float)) for v in value)):
            out[key] = list(value) if isinstance(value, tuple) else value
    return out


def _scaler_state(pm: nn.Module) -> dict[str, Any] | None:
    scaler = getattr(pm, "_scaler", None)
    if scaler is None:
        return None
    return {"scale": float(scaler.scale), "growth_tracker": scaler._growth_tracker,
            "skipped_steps": scaler.skipped_steps}


def _restore_scaler(pm: nn.Module, saved: dict[str, Any] | None) -> None:
    scaler = getattr(pm, "_scaler", None)
    if scaler is None or not saved:
        return
    scaler._scale = float(saved["scale"])
    scaler._growth_tracker = int(saved["growth_tracker"])
    scaler.skipped_steps = int(saved["skipped_steps"])


def _gather_dicts(mine: dict[str, Any]) -> dict[str, Any]:
    """The union of every rank's dict (pipeline ranks hold different weights)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return dict(mine)
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    out: dict[str, Any] = {}
    for part in parts:
        out.update(part or {})
    return out


def _parallel_module(module: nn.Module) -> nn.Module:
    if not hasattr(module, "plan") or not hasattr(module, "mesh_context"):
        raise CheckpointError(
            f"expected what autopar.parallelize returned, got {type(module).__name__}",
            where="module", fix="pass the ParallelModule (pm = autopar.parallelize(...))")
    if module.plan.mesh.get("ep", 1) > 1:
        # each ep rank holds other experts under the same names: described as replicas,
        # one rank's experts would be written for all
        raise CheckpointError(
            f"checkpoints of expert-parallel plans (ep={module.plan.mesh['ep']}) are not "
            "supported yet", where="plan.mesh.ep",
            fix="checkpoint a plan with ep=1 (the same weights load into any ep later once "
            "supported), or export the weights per rank yourself")
    return module


@contextlib.contextmanager
def single_process_dcp() -> Iterator[None]:
    """DCP warns that it assumes one process whenever there is no process group; without
    torchrun there is one process, by design."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _cause(err: BaseException) -> str:
    """The error in one line: DCP's exception wraps each rank's traceback, whose last line
    is what went wrong ("EOFError", "Ran out of input", ...)."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    if isinstance(err, CheckpointException) and lines:
        return lines[-1][:300]
    return f"{type(err).__name__}: {lines[0][:300] if lines else ''}"
