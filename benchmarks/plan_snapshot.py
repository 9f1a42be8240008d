"""Plans and rank programs as files, to show a refactor changed no decision.

    python benchmarks/plan_snapshot.py write DIR        # every case's plan JSON and programs
    python benchmarks/plan_snapshot.py compare OLD NEW [--moved OLD.MOD=NEW.MOD ...]
                                                        # byte-identical, or the files that differ

Each case runs in its own process (a fresh import, plugins discovered as a user's would be).
Plan JSONs have their wall times removed (the only field that differs run to run: CP-SAT runs
one worker with a fixed seed); rank programs are ``autopar emit``'s Python, as printed.
A program names each function it calls by its module (``autopar_ops_comm_ops_redistribute``),
so ``--moved`` says which modules a refactor moved: OLD's programs are read with those names
changed, and nothing else.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMALL = "gpt:layers=4,hidden=256,heads=4,vocab=4096,seq=256"
TINY = "gpt:layers=2,hidden=64,heads=2,vocab=128,seq=32"

# name -> Python run in a fresh process; it prints one plan's JSON
_PLAN = """
import sys, torch, autopar
from autopar.models import resolve_model
{setup}
p = autopar.plan({model}, {cluster!r}, inputs, time_limit_s=20.0, **{kw!r})
sys.stdout.write(p.to_json())
"""
_LOAD = ("spec = resolve_model({spec!r})\n"
         "with torch.device('meta'):\n    model = spec.build()\n"
         "inputs = spec.example_inputs({batch}, spec.default_seq, device='meta')")
_LORA = ("from autopar.models.lora import LoraConfig, apply_lora\n"
         "model = apply_lora(model, LoraConfig(rank=8, alpha=16, targets=('c_attn',)))")


def _case(spec: str, cluster: str, batch: int = 8, lora: bool = False, **kw) -> str:
    setup = _LOAD.format(spec=spec, batch=batch) + ("\n" + _LORA if lora else "")
    return _PLAN.format(setup=setup, model="model", cluster=cluster, kw=kw)


PLANS: dict[str, tuple[str, bool]] = {  # name -> (code, needs the example plugin)
    "dense_gpt2_8xH100": (_case("gpt2", "8xH100-80GB", batch=32), False),
    "pipelined_llama_16xA100": (_case("llama3-8b", "2x8xA100-80GB", batch=64, pp=4), False),
    "cp_long_8xH100": (_case("gpt:layers=4,hidden=1024,heads=8,vocab=32000,seq=32768",
                             "8xH100-80GB", batch=8, cp=4), False),
    "ep_mixtral_64xH100": (_case("mixtral-8x7b", "8x8xH100-80GB", batch=64, ep=8), False),
    "fp8_gpt_8xH100": (_case("gpt-125m", "8xH100-80GB", batch=32, precision="fp8"), False),
    "lora_small_2xcpu": (_case(SMALL, "2xcpu", batch=8, lora=True), False),
    "hsdp_gpt2_16xH100": (_case("gpt2", "2x8xH100-80GB", batch=64, zero=3, dp_replicate=2),
                          False),
    "offload_small_2xA100": (_case(SMALL, "2xA100-80GB", batch=8, precision="fp32",
                                   offload="optimizer+params", zero=3), False),
    "constraints_gpt2_8xH100": (_case("gpt2", "8xH100-80GB", batch=32,
                                      constraints=["tp<=2", "pp==2", "replicate lm_head"]),
                                False),
    "plugin_tiny_2xcpu": (_case(TINY, "2xcpu", batch=4, tp=2), True),
    "dense_tiny_2xcpu": (_case(TINY, "2xcpu", batch=4), False),
}
PROGRAMS: dict[str, tuple[list[str], bool]] = {  # name -> (autopar emit's arguments, plugin)
    "tp_tiny_rank1": ([TINY, "--cluster", "2xcpu", "--tp", "2", "--rank", "1"], False),
    "pp_tiny_rank0": ([TINY, "--cluster", "2xcpu", "--pp", "2", "--rank", "0"], False),
    "dp_small_rank0": ([SMALL, "--cluster", "2xcpu", "--dp", "2", "--zero", "3",
                        "--rank", "0"], False),
    "plugin_tp_tiny_rank0": ([TINY, "--cluster", "2xcpu", "--tp", "2", "--rank", "0"], True),
}
_TIMES = ("wall_s",)


def _strip(value):
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if k not in _TIMES}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def _env(plugin_site: Path | None) -> dict[str, str]:
    import os

    env = dict(os.environ)
    paths = [str(ROOT)] + ([str(plugin_site)] if plugin_site else [])
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")])
    return env


def _run(cmd: list[str], env: dict[str, str]) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:3])}... failed:\n{done.stderr[-3000:]}")
    return done.stdout


def write(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT))
    from tests.plugin_dist import install_example

    site = Path(tempfile.mkdtemp(prefix="autopar-plugin-"))
    install_example(site)

    def plan(name: str) -> None:
        code, plugin = PLANS[name]
        text = _run([sys.executable, "-c", code], _env(site if plugin else None))
        (out / f"{name}.json").write_text(json.dumps(_strip(json.loads(text)), indent=1) + "\n")
        print(f"plan {name}", flush=True)

    def program(name: str) -> None:
        args, plugin = PROGRAMS[name]
        cmd = [sys.executable, "-m", "autopar.cli.main", "emit", *args, "--quiet"]
        (out / f"{name}.py.txt").write_text(_run(cmd, _env(site if plugin else None)))
        print(f"program {name}", flush=True)

    with ThreadPoolExecutor(2) as pool:
        jobs = [pool.submit(plan, n) for n in PLANS] + [pool.submit(program, n)
                                                          for n in PROGRAMS]
        for job in jobs:
            job.result()


def _read(path: Path, moved: list[tuple[str, str]]) -> bytes:
    text = path.read_text()
    if path.name.endswith(".py.txt"):
        for before, after in moved:
            text = text.replace(before.replace(".", "_") + "_", after.replace(".", "_") + "_")
    return text.encode()


def compare(old: Path, new: Path, moved: list[tuple[str, str]] = ()) -> int:
    names = sorted({p.name for p in old.iterdir()} | {p.name for p in new.iterdir()})
    differ = [n for n in names if not (old / n).exists() or not (new / n).exists()
              or _read(old / n, moved) != (new / n).read_bytes()]
    for n in names:
        print(f"{'DIFFERS' if n in differ else 'same   '}  {n}")
    print(f"{len(names) - len(differ)} of {len(names)} files byte-identical")
    return 1 if differ else 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "write":
        write(Path(sys.argv[2]))
    elif len(sys.argv) >= 4 and sys.argv[1] == "compare":
        pairs = [tuple(a.split("=", 1)) for a in sys.argv[5::2]] if "--moved" in sys.argv else []
        raise SystemExit(compare(Path(sys.argv[2]), Path(sys.argv[3]), pairs))
    else:
        raise SystemExit(__doc__)
