"""Checkpoints as ordinary single-device weights, and ordinary weights into a running plan.

    autopar export ckpt/step-000100 --to model.safetensors

writes every weight whole, under the model's own names (tied weights under each of their
names, as ``model.state_dict()`` has them; for a Hugging Face model these are the names
``save_pretrained`` writes), loadable with ``model.load_state_dict(..., strict=True)``
into the model that was parallelized. It reads the checkpoint without any process group
(DCP's ``no_dist``), one process, assembling each weight from every rank's shards.

``load_weights_file`` is the other way: a ``.safetensors`` file (or a ``torch.save``-d state
dict, read with ``weights_only=True``) loaded into what ``parallelize`` returned, each rank
taking its own part — to start training from pretrained weights.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from autopar.runtime.checkpoint_layout import copy_whole, layout_of, named_parameters

_DTYPES = {"torch.float32": torch.float32, "torch.float16": torch.float16,
           "torch.bfloat16": torch.bfloat16, "torch.float64": torch.float64}


def read_whole_weights(path: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor],
                                                               dict[str, Any]]:
    """Every weight of a checkpoint, whole, by the model's names; and its ``autopar.json``."""
    from autopar.runtime.checkpoint import complete_checkpoint, single_process_dcp

    path, meta = complete_checkpoint(Path(path))
    stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    state = {}
    for key, md in stored.items():
        if key.startswith("model."):
            dtype = getattr(md.properties, "dtype", torch.float32)
            state[key] = torch.empty(tuple(md.size), dtype=dtype)
    with single_process_dcp():
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    weights = {key[len("model."):]: value for key, value in state.items()}
    for alias, canonical in meta.get("tied", {}).items():
        weights[alias] = weights[canonical]
    return weights, meta


def export_checkpoint(path: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """Write ``path``'s weights to ``out``: ``.safetensors``, or ``torch.save`` otherwise."""
    weights, _ = read_whole_weights(path)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".safetensors":
        from safetensors.torch import save_file

        # safetensors keeps no two names on one storage: a tied weight is written per name
        save_file({k: v.contiguous().clone() for k, v in weights.items()}, str(out),
                  metadata={"format": "pt"})
    else:
        torch.save(weights, out)
    _as_umask_allows(out)
    return out


def _as_umask_allows(path: Path) -> None:
    """Permissions as an ordinary new file gets them (safetensors writes 0600)."""
    mask = os.umask(0)
    os.umask(mask)
    path.chmod(0o666 & ~mask)


def load_weights_file(path: Path, pm: nn.Module) -> None:
    """Load an ordinary state dict file into ``pm``; every rank takes its own part."""
    from autopar.runtime.checkpoint import CheckpointError

    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        weights = load_file(str(path))
    else:
        try:
            weights = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:
            raise CheckpointError(f"{path} is not a weights file torch can read safely: {err}",
                                  where=str(path), fix="pass a .safetensors file or a "
                                  "torch.save-d state dict of tensors") from None
    params = named_parameters(pm)
    layouts = {fqn: layout_of(p, fqn, pm) for fqn, p in params.items()}
    problems = [f"missing from the file: {n}" for n in sorted(params) if n not in weights]
    problems += [f"shape differs: {n} is {list(weights[n].shape)} in the file, "
                 f"{list(layouts[n].global_shape)} here"
                 for n in sorted(params) if n in weights
                 and tuple(weights[n].shape) != layouts[n].global_shape]
    if problems:
        raise CheckpointError(
            f"{path} does not hold this model's weights: " + "; ".join(problems[:12]),
            where=str(path), fix="load weights saved from the same model")
    for fqn, p in params.items():
        copy_whole(p, weights[fqn].to(dtype=p.dtype, device=_device(p)), layouts[fqn],
                   pm.mesh_context)


def _device(p: torch.Tensor) -> torch.device:
    return p.to_local().device if hasattr(p, "to_local") else p.device



