"""Distributed checkpoints: saved on one plan, resumed on another, with the losses of an
uninterrupted single-device run; exported as ordinary weights; bad checkpoints refused.

Training is AdamW (its two states per weight are what a resume must carry), on the fixed
batch of tests/workers/equivalence.py, compared at rtol 1e-5.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import autopar
from tests.distributed import FAST, ROOT, free_port

sys.path.insert(0, str(ROOT / "tests" / "workers"))
from equivalence import build  # noqa: E402
from grad_check import train_reference  # noqa: E402

RTOL = 1e-5


def launch(nproc: int, phases: list[dict], out: Path) -> list[list[dict]]:
    """One torchrun launch of ``nproc`` ranks running ``phases`` in order
    (tests/workers/checkpoint_worker.py): each phase's records, one per rank."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--master-port={free_port()}", str(ROOT / "tests" / "workers" / "checkpoint_worker.py"),
           *(arg for phase in phases for arg in ("--phase", json.dumps(phase, default=str)))]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), AUTOPAR_TEST_OUT=str(out))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-5000:]
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    return [list(records) for records in zip(*ranks)]


def reference_losses(name: str, steps: int = 4) -> list[float]:
    model, (a, k) = build(name)
    return train_reference(model, a, k, steps, optimizer="adamw")[1]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_a_checkpoint_resumes_under_other_layouts_and_four_ranks(name: str, tmp_path: Path) -> None:
    """Save after 2 steps, load under tp=2, pp=2, dp=2 and dp2 x tp2 (ZeRO-3) on 4 ranks,
    and continue 2 steps: the 4 losses are the single-device run's. The GPT saves under
    dp=2; the Llama under HSDP (ZeRO-3 within 2 ranks, 2 replica groups: FSDP2 on a 2-D
    mesh, whose replicas DCP writes once). The Llama's 4-rank run saves again (grouped tp
    shards, FSDP2 on top), and that checkpoint, exported as a safetensors file, loads
    strictly into an unwrapped HF Llama with step 5's loss."""
    ref = reference_losses(name, 5)
    ckpt, again = tmp_path / "ckpt", tmp_path / "ckpt-4-ranks"
    saved_on = ({"model": name, "dp": 4, "zero": 3, "dp_replicate": 2} if name == "llama"
                else {"model": name, "dp": 2})
    resumes = {
        "tp2": (2, {"model": name, "tp": 2, "cluster": FAST}),
        "pp2": (2, {"model": name, "pp": 2, "microbatches": 2}),
        **({"dp2": (2, {"model": name, "dp": 2})} if name == "llama" else {}),
        "4 ranks": (4, {"model": name, "dp": 2, "tp": 2, "zero": 3, "cluster": FAST}),
    }
    # Two launches, one of 2 ranks and one of 4; the save's launch (of its size) goes first.
    launches = {4 if name == "llama" else 2: [("save", {"case": saved_on, "dir": ckpt,
                                                        "save": True})]}
    for label, (nproc, case) in resumes.items():
        phase = {"case": case, "dir": ckpt, "load": True}
        if label == "4 ranks" and name == "llama":  # saves again, for the export below
            phase.update(save=True, save_dir=again)
        launches.setdefault(nproc, []).append((label, phase))
    ran: dict[str, list[dict]] = {}
    for nproc, named in launches.items():
        labels, phases = zip(*named)
        ran.update(zip(labels, launch(nproc, list(phases), tmp_path / f"{nproc}-ranks")))
    if name == "gpt":
        assert all(r["mesh"]["dp"] == 2 for r in ran["save"])
    assert ran["save"][0]["losses"] == pytest.approx(ref[:2], rel=RTOL)
    for label in resumes:
        for r in ran[label]:
            assert r["step"] == 2, (label, r)
            assert r["losses"] == pytest.approx(ref[2:4], rel=RTOL), (label, r, ref)
    if name == "llama":
        _exports_whole_weights(name, again, tmp_path / "model.safetensors", ref[4])


def _exports_whole_weights(name: str, ckpt: Path, out: Path, loss: float) -> None:
    cli = subprocess.run([sys.executable, "-m", "autopar.cli.main", "export", str(ckpt),
                          "--to", str(out)], capture_output=True, text=True, cwd=ROOT)
    assert cli.returncode == 0, cli.stderr
    from safetensors.torch import load_file

    model, (a, k) = build(name)
    model.load_state_dict(load_file(str(out)), strict=True)
    assert model(*a, **k).loss.item() == pytest.approx(loss, rel=RTOL)


# --- one process: bad checkpoints -------------------------------------------------------

def _one_process(name: str = "gpt", layers: int = 2):
    model, (a, k) = build(name, layers)
    pm = autopar.parallelize(model, "1xcpu", (a, k), recompute=("none",))
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    return pm, opt, pm.shard_batch(*a, **k)


def _train(pm, opt, batch, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        losses.append(pm.train_step(*batch[0], **batch[1]).item())
        opt.step()
    return losses


def _weights(pm) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in pm.named_parameters()}


def test_resume_in_one_process_continues_the_run(tmp_path: Path) -> None:
    pm, opt, batch = _one_process()
    first = _train(pm, opt, batch, 2)
    autopar.save_checkpoint(tmp_path / "c", pm, opt, step=2)
    rest = _train(pm, opt, batch, 2)
    pm2, opt2, batch2 = _one_process()
    assert autopar.load_checkpoint(tmp_path / "c", pm2, opt2) == 2
    assert _train(pm2, opt2, batch2, 2) == pytest.approx(rest, rel=RTOL)
    assert first != rest


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_an_export_is_an_ordinary_file_as_the_umask_allows(tmp_path: Path, suffix: str) -> None:
    """Readable by the group and others where the umask allows (safetensors writes 0600)."""
    from autopar.runtime.weights import export_checkpoint

    pm, opt, _ = _one_process()
    autopar.save_checkpoint(tmp_path / "c", pm, opt, step=1)
    mask = os.umask(0o022)
    try:
        out = export_checkpoint(tmp_path / "c", tmp_path / f"model{suffix}")
    finally:
        os.umask(mask)
    assert out.stat().st_mode & 0o777 == 0o644


def test_checkpoint_of_another_model_is_refused_listing_differences(tmp_path: Path) -> None:
    pm, opt, _ = _one_process(layers=2)
    autopar.save_checkpoint(tmp_path / "c", pm, opt, step=1)
    other, opt2, _ = _one_process(layers=3)
    before = _weights(other)
    with pytest.raises(autopar.AutoparError, match=r"another model.*transformer\.h\.2\."):
        autopar.load_checkpoint(tmp_path / "c", other, opt2)
    assert all(torch.equal(before[n], p) for n, p in other.named_parameters())


def test_corrupt_checkpoint_is_refused_and_nothing_is_loaded(tmp_path: Path) -> None:
    pm, opt, batch = _one_process()
    _train(pm, opt, batch, 1)
    autopar.save_checkpoint(tmp_path / "c", pm, opt, step=1)
    data = next((tmp_path / "c").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])  # truncated
    fresh, opt2, _ = _one_process()
    before = _weights(fresh)
    with pytest.raises(autopar.AutoparError, match="could not be read") as info:
        autopar.load_checkpoint(tmp_path / "c", fresh, opt2)
    assert "left unchanged" in str(info.value)
    assert all(torch.equal(before[n], p) for n, p in fresh.named_parameters())
    assert not opt2.state


def test_directory_without_a_complete_checkpoint_says_so(tmp_path: Path) -> None:
    pm, opt, _ = _one_process()
    (tmp_path / "empty").mkdir()
    with pytest.raises(autopar.AutoparError, match="no complete checkpoint"):
        autopar.load_checkpoint(tmp_path / "empty", pm, opt)
    assert autopar.latest_checkpoint(tmp_path) is None


_KILL_MID_SAVE = """
import os, signal, sys
sys.path.insert(0, {workers!r})
import torch, autopar
import autopar.runtime.checkpoint as ckpt
from equivalence import build
model, (a, k) = build("gpt")
pm = autopar.parallelize(model, "1xcpu", (a, k), recompute=("none",))
opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
la, lk = pm.shard_batch(*a, **k)
for step in (1, 2):
    opt.zero_grad(); pm.train_step(*la, **lk); opt.step()
    if step == 2:  # killed once the new data is written, before it is complete
        real = ckpt.dcp.save
        def save_then_die(*args, **kwargs):
            real(*args, **kwargs)
            os.kill(os.getpid(), signal.SIGKILL)
        ckpt.dcp.save = save_then_die
    autopar.save_checkpoint({path!r}, pm, opt, step=step)
"""


def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "ckpt" / "latest"
    script = _KILL_MID_SAVE.format(workers=str(ROOT / "tests" / "workers"), path=str(path))
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == -9, proc.stderr[-3000:]
    assert (tmp_path / "ckpt" / ".latest.partial").is_dir()  # the unfinished save
    pm, opt, _ = _one_process()
    assert autopar.load_checkpoint(path, pm, opt) == 1  # the one before is whole
    assert autopar.latest_checkpoint(tmp_path / "ckpt") == path


def test_expert_parallel_plans_are_refused_not_saved_wrong(tmp_path: Path) -> None:
    """Ranks of one ep group hold different experts under the same names: a checkpoint that
    described them as replicas would keep one rank's experts for all."""
    from types import SimpleNamespace

    pm = SimpleNamespace(plan=SimpleNamespace(mesh={"dp": 2, "ep": 2, "tp": 1}),
                         mesh_context=None)
    with pytest.raises(autopar.AutoparError, match="expert-parallel") as info:
        autopar.save_checkpoint(tmp_path / "c", pm, step=1)
    assert info.value.where == "plan.mesh.ep"
    assert not (tmp_path / "c").exists()
