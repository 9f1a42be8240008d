"""Does the search ever discard a better plan? Settings it pruned or skipped, solved pinned.

For random (model, cluster) pairs (GPTs, MoE GPTs and HF Llamas of random depth, width, heads,
sequence, vocabulary and batch; clusters of 2-16 devices of several kinds, memory from
tight to ample, global batches up to 8x the traced one), the automatic search runs, then
settings it did not price — every one it pruned by a bound, skipped by a rule, or never
reached — are solved pinned (mesh, ZeRO stage, recomputation, microbatch; ``gpipe`` for a
pipeline with fewer microbatches than stages), each as a user would pin it. A violation is
a pinned setting that fits and beats the automatic plan on the search's own objective (the
modelled step, with the handicap beyond validated ground, ``cost_models.ground``); the
memory and time floors of the settings solved pinned are checked against what they solved
to as well. All figures are **modelled**.

    python benchmarks/search_audit.py                 # 200 pairs, 4 pinned settings each
    python benchmarks/search_audit.py --pairs 1000 --pinned 8 --seed 3
    python benchmarks/search_audit.py --meshes llama3-8b 8xH100-80GB   # vs every pinned mesh

``--meshes`` plans a named model as ``autopar plan`` does, then once per mesh of the cluster
(``pp``, ``dp``, ``tp`` pinned, the rest searched), and prints each against the automatic one.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autopar  # noqa: E402
from autopar.core.cluster import Cluster, load_cluster  # noqa: E402
from autopar.core.errors import AutoparError  # noqa: E402
from autopar.core.graph_facts import graph_facts  # noqa: E402
from autopar.core.knobs import SEARCHED_RECOMPUTE_MODES  # noqa: E402
from autopar.models import GPT, GPTConfig  # noqa: E402
from autopar.solver.options import PlanOptions  # noqa: E402
from autopar.solver.search.layout_solves import layout_scales, layout_tables  # noqa: E402
from autopar.solver.search.layout_trials import ground_margin, lower_bounds  # noqa: E402
from autopar.solver.search.mesh_search import SearchResult, search  # noqa: E402
from autopar.solver.search.meshes import mesh_shapes, n_layers_of  # noqa: E402
from autopar.solver.search.search_state import SearchState, SolveBudget  # noqa: E402
from autopar.solver.search.solve_ahead import SolveAhead  # noqa: E402
from autopar.solver.setting import Setting  # noqa: E402

DEVICES = ("H100-80GB", "A100-80GB", "A100-40GB", "V100-32GB")
TOLERANCE = 1e-6  # relative: a tie is not a violation


@dataclass
class Finding:
    """One pinned setting against the automatic plan (objectives in modelled seconds)."""

    pair: str
    status: str  # how the automatic search treated the setting
    setting: Setting
    auto: float
    pinned: float | None  # None: the pinned setting has no plan
    floors_ok: bool = True
    floor_note: str = ""

    @property
    def violation(self) -> bool:
        return self.pinned is not None and self.pinned < self.auto * (1 - TOLERANCE)


@dataclass
class Audit:
    pairs: int = 0
    planned: int = 0  # pairs with an automatic plan
    findings: list[Finding] = field(default_factory=list)

    @property
    def violations(self) -> list[Finding]:
        return [f for f in self.findings if f.violation or not f.floors_ok]


def random_model(rng: random.Random, small: bool = False):
    """A traced GPT or HF Llama of random shape (small: the audit plans thousands)."""
    layers, heads = rng.randint(1, 3 if small else 6), rng.choice([2, 4])
    width = heads * rng.choice([8, 16] if small else [8, 16, 32])
    seq, vocab, batch = rng.choice([16, 32, 64]), rng.choice([64, 128, 512]), rng.choice([2, 4, 8])
    what = f"{layers}x{width} h{heads} seq {seq} vocab {vocab} batch {batch}"
    kind = rng.random()
    if kind < 0.2:  # experts: the search prices expert parallelism (the pinned solve too)
        from autopar.models.moe import MoEConfig, MoEGPT
        experts = rng.choice([2, 4, 8])
        model = MoEGPT(MoEConfig(block_size=seq, vocab_size=vocab, n_layer=layers,
                                 n_head=heads, n_embd=width, experts=experts,
                                 top_k=rng.choice([1, 2]), expert_ffn=width * 2))
        what = f"moe{experts} " + what
    elif kind < 0.45 and _has_transformers():
        from autopar.models.hf import build_llama
        model = build_llama(layers=layers, hidden=width, heads=heads,
                            kv_heads=rng.choice([1, heads]), ffn=width * 2, vocab=vocab,
                            seq=seq)
        what = "llama " + what
    else:
        model = GPT(GPTConfig(block_size=seq, vocab_size=vocab, n_layer=layers, n_head=heads,
                              n_embd=width))
        what = "gpt " + what
    tokens = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    inputs = ({"input_ids": tokens, "labels": tokens} if what.startswith("llama")
              else (tokens, tokens))
    return autopar.trace(model, inputs), what


def _has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def random_cluster(rng: random.Random, state_bytes: float, small: bool = False) -> Cluster:
    """2-16 devices (``small``: 2-4); memory from below the model's unsharded states to well
    above them."""
    per_node = rng.choice([2, 4] if small else [2, 4, 8])
    nodes = rng.choice([1, 1, 2] if small and per_node == 2 else [1] if small else [1, 1, 2])
    gib = state_bytes * rng.choice([1.0, 2.0, 6.0] if small else [0.3, 0.6, 1.0, 2.0, 6.0]) / 2**30
    return load_cluster({"nodes": nodes, "devices_per_node": per_node,
                         "device": {"preset": rng.choice(DEVICES), "memory_gib": gib}})


def _objective(result: SearchResult, cluster: Cluster, options: PlanOptions) -> float:
    best = result.best
    return best.prediction.step_time_s * (1 + ground_margin(best.setting, cluster, options))


def every_setting(gm, cluster: Cluster, options: PlanOptions) -> list[Setting]:
    """Every (mesh, ZeRO, recomputation, microbatch) a user could pin (cp = 1)."""
    facts = graph_facts(gm)
    out = []
    for pp, dp, cp, tp in mesh_shapes(cluster, options, n_layers_of(gm), facts.seq_len):
        if cp > 1 or options.global_batch % dp:
            continue
        local = options.global_batch // dp
        for zero in options.zero if dp > 1 else (0,):
            for recompute in SEARCHED_RECOMPUTE_MODES:
                for mb in range(1, local + 1):
                    if local % mb == 0:
                        out.append(Setting(dp, tp, zero, mb, local // mb, recompute, pp=pp))
    return out


def _pinned_options(base: PlanOptions, s: Setting) -> PlanOptions:
    schedule = "gpipe" if s.pp > 1 and s.microbatches < s.pp else None
    return replace(base, dp=s.dp, tp=s.tp, pp=s.pp, zero=(s.zero,), recompute=(s.recompute,),
                   microbatch=s.microbatch, schedule=schedule)


def _unpriced(result: SearchResult, settings: list[Setting]) -> list[tuple[Setting, str]]:
    """The settings the search did not price, with how it treated each."""
    def key(s: Setting) -> tuple:
        return (s.pp, s.dp, s.tp, s.zero, s.recompute, s.microbatch)

    priced, status = set(), {}
    for c in result.candidates:
        k = key(c.setting)
        if c.prediction is not None:
            priced.add(k)
        status.setdefault(k, c.status)
    return [(s, status.get(key(s), "NOT REACHED")) for s in settings if key(s) not in priced]


def _floors(gm, cluster: Cluster, options: PlanOptions, pinned: SearchResult) -> str:
    """"" when the pinned setting's memory and time floors are below what it solved to."""
    best = pinned.best
    setting = replace(best.setting, recompute=best.setting.recompute
                      if best.setting.recompute != "mixed" else "none", layer_recompute=())
    facts = graph_facts(gm)
    state = SearchState(cluster, options, facts, facts.batch_size or 1, n_layers_of(gm), [],
                        [], {}, SolveBudget(None), SolveAhead(cores=1))
    problem = pinned.problem
    tables = layout_tables(state, problem, setting)[0]
    memory, step = lower_bounds(tables, *layout_scales(setting))
    notes = []
    if best.setting.recompute != "mixed" and memory > best.prediction.peak_memory_bytes * (1 + 1e-6):
        notes.append(f"memory floor {memory:.4g} B above the solved {best.prediction.peak_memory_bytes:.4g} B")
    if step / setting.pp > best.prediction.step_time_s * (1 + 1e-6):
        notes.append(f"time floor {step / setting.pp:.4g} s above the solved {best.prediction.step_time_s:.4g} s")
    return "; ".join(notes)


def audit_pair(gm, what: str, cluster: Cluster, global_batch: int, rng: random.Random,
               pinned: int, audit: Audit) -> None:
    """Search ``gm`` on ``cluster``, then solve ``pinned`` settings it did not price."""
    base = PlanOptions(precision="bf16" if "bf16" in cluster.device.peak_flops else "fp16",
                       global_batch=global_batch, offload=("none",), time_limit_s=10.0,
                       max_solves=None)
    name = f"{what} on {cluster.name} ({cluster.device.memory_bytes / 2**20:.1f} MiB), " \
           f"global batch {global_batch}"
    audit.pairs += 1
    try:
        result = search(gm, cluster, base)
    except AutoparError:
        return
    audit.planned += 1
    auto = _objective(result, cluster, base)
    unpriced = _unpriced(result, every_setting(gm, cluster, base))
    for setting, status in rng.sample(unpriced, min(pinned, len(unpriced))):
        options = _pinned_options(base, setting)
        try:
            solved = search(gm, cluster, options)
        except AutoparError:
            audit.findings.append(Finding(name, status, setting, auto, None))
            continue
        note = _floors(gm, cluster, options, solved)
        audit.findings.append(Finding(name, status, solved.best.setting, auto,
                                      _objective(solved, cluster, options), not note, note))


def run_audit(pairs: int, pinned: int, seed: int, models: int | None = None,
              small: bool = False, say=None) -> Audit:
    """``pairs`` random pairs over ``models`` traced models (default: one per 5 pairs);
    ``small``: models of 1-3 layers on 2-4 devices (the test's budget)."""
    rng = random.Random(seed)
    traced = [random_model(rng, small) for _ in range(models or max(1, pairs // 5))]
    audit = Audit()
    for i in range(pairs):
        gm, what = traced[i % len(traced)]
        facts = graph_facts(gm)
        states = sum(p.numel() for p in gm.parameters()) * 16  # fp32 + Adam + grads
        cluster = random_cluster(rng, states, small)
        batch = (facts.batch_size or 1) * rng.choice([1, 2, 4, 8])
        audit_pair(gm, what, cluster, batch, rng, pinned, audit)
        if say:
            say(i, audit)
    return audit


def audit_meshes(model: str, cluster_name: str) -> int:
    """The automatic plan of ``model`` against every pinned mesh; 1 if one is faster."""
    from autopar.api.planning import plan
    from autopar.cli.load import trace_model

    traced = trace_model(model, None, None)
    cluster = load_cluster(cluster_name)
    auto = plan(traced.gm, cluster, global_batch=traced.batch)
    step = auto.predicted["step_time_s"]
    print(f"{model} on {cluster.name} (modelled): automatic plan {_mesh_text(auto.mesh)} "
          f"{step:.3f} s a step")
    print(f"  {'pinned mesh':24} {'step (s)':>10} {'vs automatic':>13}")
    worse = 0
    for pp, dp, _, tp in mesh_shapes(cluster, PlanOptions(), n_layers_of(traced.gm)):
        try:
            pinned = plan(traced.gm, cluster, global_batch=traced.batch, pp=pp, dp=dp, tp=tp)
        except AutoparError as e:
            print(f"  {f'pp={pp} dp={dp} tp={tp}':24} {'no plan':>10}   {e.what[:60]}")
            continue
        other = pinned.predicted["step_time_s"]
        worse += other < step * (1 - TOLERANCE)
        print(f"  {f'pp={pp} dp={dp} tp={tp}':24} {other:>10.3f} {other / step:>12.3f}x")
    print(f"pinned meshes faster than the automatic plan: {worse}")
    return 1 if worse else 0


def _mesh_text(mesh: dict) -> str:
    return " x ".join(f"{k}={v}" for k, v in mesh.items())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--meshes", nargs=2, metavar=("MODEL", "CLUSTER"),
                        help="a named model on a cluster against every pinned mesh")
    parser.add_argument("--pairs", type=int, default=200)
    parser.add_argument("--pinned", type=int, default=4, help="settings solved pinned a pair")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--small", action="store_true",
                        help="models of 1-3 layers on 2-4 devices (what the test runs)")
    args = parser.parse_args()
    if args.meshes:
        return audit_meshes(*args.meshes)
    started = time.perf_counter()
    audit = run_audit(args.pairs, args.pinned, args.seed, small=args.small)
    by_status: dict[str, list[int]] = {}
    for f in audit.findings:
        kind = f.status.split("(")[0] if "(" in f.status else f.status
        kind = f.status if kind == "PRUNED" else kind
        row = by_status.setdefault(kind, [0, 0, 0])
        row[0] += 1
        row[1] += f.pinned is not None
        row[2] += f.violation
    print(f"search audit (modelled): {audit.pairs} random (model, cluster) pairs, "
          f"{audit.planned} with a plan, {len(audit.findings)} settings solved pinned, "
          f"{time.perf_counter() - started:.0f} s (measured)")
    print(f"  {'how the search treated it':44} {'pinned':>7} {'has plan':>9} {'beats auto':>11}")
    for kind, (n, fits, beats) in sorted(by_status.items()):
        print(f"  {kind[:44]:44} {n:>7} {fits:>9} {beats:>11}")
    bad = audit.violations
    print(f"violations: {len(bad)}")
    for f in bad[:20]:
        gain = f"{(1 - f.pinned / f.auto) * 100:.2f}% faster" if f.violation else f.floor_note
        print(f"  {f.pair}: {f.status} {f.setting}: {gain}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
