"""The readable plan summary ``autopar plan`` prints (every number labelled modelled)."""

from __future__ import annotations

from autopar.core.cluster.compute_share import slowest_chip_delay
from autopar.core.plan import Plan
from autopar.core.plan_schema import CARVED_AXES
from autopar.core.units import format_bytes, format_count, format_seconds

_KEY_OPS = ("linear", "addmm", "matmul", "bmm", "scaled_dot_product", "embedding", "layer_norm",
            "cross_entropy")


# op -> (activation slot, weight slot) in the strategy's inputs
_WEIGHTED = {"aten.linear": (0, 1), "aten.addmm": (1, 2)}


def _role(name: str, strategy: str) -> str:
    """Megatron's names for a weighted matmul's strategy: partial sums out = row-parallel;
    a whole activation times a split weight = column-parallel."""
    slots = next((v for k, v in _WEIGHTED.items() if f"({k}." in name), None)
    if slots is None:
        return ""
    ins, _, out = strategy.partition("->")
    inputs = ins.strip("()").split(",")
    if out.strip("()").startswith("P"):
        return "row-parallel (partial sums, reduced after)"
    if inputs[slots[0]] == "R" and inputs[slots[1]].startswith("S"):
        return "column-parallel (output features split)"
    return ""


def format_recompute(plan: Plan) -> list[str]:
    """Which layers recompute what (one line; per run of layers when the plan mixes)."""
    mode = plan.training.get("recompute", "none")
    if mode != "mixed":
        return [f"recompute {mode} (every layer)"] if mode != "none" else []
    runs = [f"{row['layers']} {row['recompute']}" for row in plan.layers
            if row["block"] != "<outside layers>"]
    counts: dict[str, int] = {}
    for m in plan.training.get("recompute_layers", []):
        counts[m] = counts.get(m, 0) + 1
    return [f"recompute per layer ({', '.join(f'{n} {m}' for m, n in counts.items())}): "
            f"layers {'; '.join(runs)}"]


def format_precision(plan: Plan) -> list[str]:
    """How many nodes compute in each dtype, and which are kept fp32 and why."""
    words, policy = plan.precision, plan.precision_policy
    if not words or set(words.values()) == {"fp32"} and not policy.get("overrides"):
        return []
    counts: dict[str, int] = {}
    for word in words.values():
        counts[word] = counts.get(word, 0) + 1
    shown = ", ".join(f"{counts[w]} {w}" for w in ("fp8", "bf16", "fp16", "fp32") if w in counts)
    lines = [f"precision {policy.get('compute', plan.training['precision'])} with fp32 master "
             f"weights (parameters read in {policy.get('params', 'fp32')}): {shown} nodes"]
    for why, names in policy.get("kept_fp32", {}).items():
        example = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        lines.append(f"          kept fp32 ({why}): {len(names)} node(s): {example}")
    if policy.get("overrides"):
        lines.append("          overrides: " + ", ".join(
            f"{k}={v}" for k, v in policy["overrides"].items()))
    return lines


def format_plan(plan: Plan, model_label: str, trace_s: float | None = None) -> str:
    """The summary ``autopar plan`` prints: the settings chosen, the strategies, and the
    modelled memory and step time."""
    lines = format_settings(plan, model_label, trace_s)
    lines += format_strategies(plan)
    lines += format_memory(plan.predicted)
    lines += format_step(plan)
    lines += format_alternatives(plan)
    p = plan.predicted
    if plan.pipeline:
        lines += ["", *format_pipeline(plan.pipeline)]
    if p.get("ground"):
        lines += ["", *format_ground(p["ground"], p.get("ground_margin", 0.0))]
    return "\n".join(lines)


def format_settings(plan: Plan, model_label: str, trace_s: float | None = None) -> list[str]:
    """The head of the summary: model, batch, mesh, how the solver did, and one line per
    decision beyond the mesh (devices, HSDP, offload, precision, tp, experts, attention,
    context parallelism, recomputation)."""
    mesh = " x ".join(f"{a}={n}" for a, n in plan.mesh.items() if a not in CARVED_AXES)
    carved = [f"{a}={n} within dp" for a, n in plan.mesh.items() if a in CARVED_AXES and n > 1]
    mesh += f" ({', '.join(carved)})" if carved else ""
    cluster = plan.cluster
    b = plan.batch
    t = plan.training
    lines = [
        f"autopar plan: {model_label} on {cluster.get('name')} ({cluster['devices']} devices)",
        "",
        f"model     {format_count(plan.model['params'])} parameters"
        + (f", traced in {trace_s:.1f} s (measured)" if trace_s is not None else "")
        + f", {plan.solver.get('nodes', 0)} graph nodes, {plan.solver.get('decisions', 0)} "
        "decisions",
        f"batch     {b['global']} sequences x {b['seq']} tokens ({b['global'] * b['seq']:,} "
        f"tokens a step); microbatch {b['microbatch']} x "
        f"{b['microbatches']} per data-parallel rank",
        f"mesh      {mesh}   (tp innermost, inside a node)   ZeRO-{t['zero']}, "
        f"{t['precision']}, {t['optimizer']}",
        f"solver    chose from {_priced(plan.solver.get('candidates', []))} settings priced of "
        f"{len(plan.solver.get('candidates', []))} considered, in {plan.solver['wall_s']:.2f} s "
        "(measured)",
    ]
    lines += format_solves(plan)
    if plan.explanation.get("devices"):
        lines.append(f"devices   {plan.explanation['devices']['why']}")
    if t.get("dp_replicate", 1) > 1:
        r = t["dp_replicate"]
        lines.append(f"hsdp      ZeRO-{t['zero']} shards within {plan.mesh['dp'] // r} "
                     f"data-parallel ranks and the {r} groups replicate, all-reducing their "
                     "gradient shards once per step")
    if t.get("offload", "none") != "none":
        lines.append(f"offload   {t['offload']}: ZeRO-3's parameter, gradient and optimizer "
                     "shards stay in host memory and the optimizer steps there "
                     f"({plan.predicted['optimizer_s']:.3g} s per step, modelled); no plan fits "
                     "in device memory without it")
    lines += format_precision(plan)
    lines += format_tp(plan.explanation.get("tp", {}))
    lines += format_experts(plan.explanation.get("experts", {}))
    lines += format_attention(plan.attention)
    if plan.context:
        c = plan.context
        lines.append(f"context   cp={c['cp']}, {c['layout']} chunks, {c['algorithm']} attention: "
                     f"{c['why']}")
    if plan.unruled_ops:
        ops = ", ".join(f"{k} x{v}" for k, v in plan.unruled_ops.items())
        lines.append(f"replicated (no sharding rule): {ops}")
    lines += format_recompute(plan)
    return lines


def format_solves(plan: Plan) -> list[str]:
    """How each CP-SAT solve behind the plan ended, and whether the search was cut short
    (interrupted, or out of its solve budget); the constraints it obeyed."""
    lines = []
    for solve in plan.solver.get("plan_solves", []):
        gap = "" if solve.get("gap") is None else f", gap {100 * solve['gap']:.2f}%"
        outcome = solve["outcome"]
        if solve.get("stand_in"):
            outcome += (" for the setting it was solved for (the same microbatch and "
                        "recomputation), reused here without a solve of its own (budget)")
        elif solve.get("reused"):
            outcome += (" for the setting it was solved for (the same microbatch and "
                        "recomputation); priced here below this setting's own solve")
        lines.append(f"          {solve['what']} solve: {outcome}{gap}")
    lines.append(search_text(plan.solver.get("candidates", [])))
    if plan.solver.get("interrupted"):
        lines.append("          search interrupted (Ctrl-C): the best plan found so far, not "
                     "proven the fastest")
    if plan.constraints:
        lines.append(f"obeys     {', '.join(plan.constraints)} (constraints)")
    if plan.solver.get("budget_reached"):
        lines.append(f"          search stopped solving at its budget of "
                     f"{plan.solver['max_solves']} CP-SAT solves: later settings were priced "
                     "only with layouts already solved, so this is the best plan found, not "
                     "proven the fastest (--max-solves raises the budget)")
    return lines


def _priced(candidates: list[dict]) -> int:
    return sum(1 for c in candidates if "step_time_s" in c)


def search_text(candidates: list[dict]) -> str:
    """What the search over settings proved: which settings it priced, which it ruled out
    by a lower bound (never above what the setting solves to: benchmarks/search_audit.py),
    which cannot run; each priced setting has its own layout solve unless the solve budget
    ran out (then the plan says so)."""
    def count(*heads: str) -> int:
        return sum(1 for c in candidates if c["status"].startswith(heads))

    reused = sum(1 for c in candidates if "layout reused" in c["status"])
    return (f"          search: {_priced(candidates)} settings priced, each with its own "
            f"layout solve ({reused} also with a layout solved for another setting), "
            f"{count('PRUNED(memory')} ruled out by their memory floor and "
            f"{count('PRUNED(time')} by their time floor (proven lower bounds), "
            f"{count('SKIPPED', 'INFEASIBLE')} that cannot run or fit")


def format_strategies(plan: Plan) -> list[str]:
    """The tensor-parallel strategy of each kind of layer's key ops, once per kind."""
    lines = ["", "tensor-parallel strategies (per layer kind; inputs -> output, per tp rank: "
             "R whole, S(d) split along dim d, P partial sums to add)"]
    shown: set[str] = set()
    if not any(row["strategies"] for row in plan.layers):
        lines.append("  everything replicated on tp" + (
            " (every tp rank computes the whole model)" if plan.mesh.get("tp", 1) > 1
            else " (pure data parallelism)"))
    for row in plan.layers:
        if not row["strategies"] or row["block"] in shown:
            continue  # rows that differ only in recomputation show their strategies once
        shown.add(row["block"])
        lines.append(f"  {row['block']}  layers {row['layers']}"
                     + (" (and the block's other layers)"
                        if sum(r["block"] == row["block"] for r in plan.layers) > 1 else ""))
        for name, strategy in row["strategies"].items():
            if "(" in name and not any(k in name for k in _KEY_OPS):
                continue
            role = _role(name, strategy)
            lines.append(f"    {name:<52} {strategy:<28} {role}")
    return lines


def format_memory(predicted: dict) -> list[str]:
    """Each device's modelled memory by kind, against its capacity."""
    mem = predicted["memory"]
    capacity = predicted["memory_capacity_bytes"]
    lines = ["", "memory per device (modelled)"]
    lines += memory_kinds(mem, predicted.get("memory_training"))
    used = mem["total"] / capacity
    lines.append(
        f"  {'total':<12} {format_bytes(mem['total']):>12} of {format_bytes(capacity)} "
        f"({used:.0%}; headroom {format_bytes(capacity - mem['total'])})"
    )
    if mem.get("host"):
        lines.append(f"  {'host':<12} {format_bytes(mem['host']):>12} (offloaded, in host "
                     "memory; not in the total)")
    return lines


MEMORY_KINDS = ("params", "grads", "optimizer", "activations", "buffers", "temporaries")


def memory_kinds(peak: dict, training: dict | None, gb: bool = False) -> list[str]:
    """The bytes of each kind at the step's peak; when that peak is the optimizer step's
    (activations freed by then), beside those at the forward/backward peak, so that what
    the activations take is never hidden behind a 0. ``gb`` adds decimal GB (one column)."""
    two = training is not None and training["total"] < peak["total"]
    lines = []
    if two:
        lines.append(f"  {'':<12} {'optimizer step':>14}   {'forward/backward':>16}")
        lines.append(f"  {'':<12} {'(the peak)':>14}   {format_bytes(training['total']):>16}")
    for key in MEMORY_KINDS:
        row = f"  {key:<12} {format_bytes(peak.get(key, 0)):>{14 if two else 12}}"
        if two:
            row += f"   {format_bytes(training.get(key, 0)):>16}"
        if gb and not two:
            row += f"  ({peak.get(key, 0) / 1e9:,.1f} GB)"
        lines.append(row)
    return lines


def format_step(plan: Plan) -> list[str]:
    """The modelled step: its time, what it is made of, the throughput, and the wait for
    the slowest chip."""
    p, cluster = plan.predicted, plan.cluster
    lines = [
        "",
        "step (modelled)",
        f"  step time    {format_seconds(p['step_time_s'])}",
        f"  compute      {format_seconds(p['compute_s'])}{_comm_parts(plan)}",
        f"  throughput   {p['tokens_per_s']:,.0f} tokens/s, {p['tflops_per_device']:.1f} TFLOP/s "
        f"per device (model FLOPs), MFU {p['mfu']:.1%}",
    ]
    spread = cluster.get("device", {}).get("speed_spread", 0.0)
    used = plan.explanation.get("devices", {}).get("used", cluster["devices"])
    if spread and used > 1:
        lines.append(f"  device times include the wait for the slowest of {used} chips: "
                     f"+{slowest_chip_delay(spread, used):.1%} (chip speed spread {spread:.1%})")
    return lines


def _comm_parts(plan: Plan) -> str:
    """The step's communication, each part named by the axis that pays it (none when the
    mesh has no such axis and it costs nothing)."""
    p, mesh = plan.predicted, plan.mesh
    parts = ""
    if p["tp_comm_s"] or mesh.get("tp", 1) > 1:
        axes = [a for a in ("tp", "cp", "ep") if mesh.get(a, 1) > 1] or ["tp"]
        parts += f"   {'/'.join(axes)} comm {format_seconds(p['tp_comm_s'])}"
    if p["dp_comm_s"] or mesh.get("dp", 1) > 1:
        parts += (f"   dp comm {format_seconds(p['dp_comm_s'])} (adds "
                  f"{format_seconds(p['dp_exposed_s'])} to the step)")
    if mesh.get("pp", 1) > 1:
        parts += (f"   pipeline bubble {format_seconds(p['bubble_s'])}, sends "
                  f"{format_seconds(p['p2p_s'])}")
    return parts


def setting_text(c: dict) -> str:
    """A candidate's setting (``Candidate.summary()``, or a plan JSON's candidate) in a few
    words: ``pp=2 dp=8 tp=1 ZeRO-3 microbatch 8 x 8 1f1b``."""
    words = [f"{k}={c[k]}" for k in ("pp", "dp", "tp", "ep", "dp_replicate") if k in c]
    words.append(f"ZeRO-{c.get('zero', 0)}")
    words.append(f"microbatch {c.get('microbatch')} x {c.get('microbatches')}")
    if c.get("recompute", "none") != "none":
        words.append(f"recompute {c['recompute']}")
    if c.get("pp", 1) > 1 and c.get("schedule"):
        v = c.get("virtual", 1)
        words.append(c["schedule"] + (f" v={v}" if v and v > 1 else ""))
    return " ".join(words)


def _mesh_of(c: dict) -> tuple[int, ...]:
    return tuple(c.get(k, 1) for k in ("pp", "dp", "cp", "tp", "ep"))


def _mesh_words(mesh: tuple[int, ...]) -> str:
    return " ".join(f"{k}={v}" for k, v in zip(("pp", "dp", "cp", "tp", "ep"), mesh)
                    if v > 1 or k in ("dp", "tp"))


def format_alternatives(plan: Plan) -> list[str]:
    """What the plan beat: the runner-up setting, and the best of every other mesh the
    search tried with its step, or why it has none (modelled)."""
    candidates = plan.solver.get("candidates", [])
    if not candidates:
        return []
    step = plan.predicted["step_time_s"]
    fits = [c for c in candidates if "step_time_s" in c and not c["status"].startswith("REJECTED")]
    chosen = _mesh_of(plan.mesh)
    others = sorted((c for c in fits if abs(c["step_time_s"] - step) > 1e-12 * step
                     or _mesh_of(c) != chosen), key=lambda c: c["step_time_s"])
    lines = ["", "what the plan beat (modelled; the best setting of each mesh tried)"]
    shown = {chosen}
    if others:
        first = others[0]
        shown.add(_mesh_of(first))  # its mesh is on its line
        lines.append(f"  runner-up    {_mesh_words(_mesh_of(first)):<16} {_rest(first)}: "
                     f"{_lost(first, step)}")
    by_mesh: dict[tuple, list[dict]] = {}
    for c in candidates:
        by_mesh.setdefault(_mesh_of(c), []).append(c)
    fitting = {id(c) for c in fits}
    for mesh, tried in sorted(by_mesh.items()):
        if mesh in shown:
            continue
        priced = [c for c in tried if id(c) in fitting]
        if priced:
            best = min(priced, key=lambda c: c["step_time_s"])
            why = f"{_rest(best)}: {_lost(best, step)}"
        else:
            why = _none_fits(tried, plan.predicted["memory_capacity_bytes"])
        lines.append(f"  {'':<12} {_mesh_words(mesh):<16} {why}")
    return lines


def _rest(c: dict) -> str:
    """A candidate's setting without its mesh (shown beside it)."""
    return "ZeRO-" + setting_text(c).split(" ZeRO-", 1)[1]


def _lost(c: dict, step: float) -> str:
    """Why a priced setting lost to the plan's ``step``: slower, or beyond validated ground."""
    other = c["step_time_s"]
    memory = f", {format_bytes(c['peak_memory_bytes'])}" if "peak_memory_bytes" in c else ""
    if other >= step:
        return f"{format_seconds(other)} a step{memory}, {other / step - 1:+.1%} (slower)"
    return (f"{format_seconds(other)} a step{memory}, {other / step - 1:+.1%}, but beyond "
            "validated ground: it must win by the model's error there")


def _none_fits(tried: list[dict], capacity: float) -> str:
    """Why no setting of one mesh was priced, from how the search ended each: a lower bound
    first (they are proven), then what cannot run."""
    statuses = [c["status"] for c in tried]
    if any(st.startswith("PRUNED(time") for st in statuses):
        return "cannot beat the plan: its compute alone (a lower bound) is slower"
    if any(st.startswith("PRUNED(memory") for st in statuses):
        return f"does not fit: its memory floor is above the {format_bytes(capacity)} usable"
    if any(st.startswith(("REJECTED", "INFEASIBLE")) for st in statuses):
        return "does not fit (no layout within the memory)"
    return statuses[0].removeprefix("SKIPPED(").removesuffix(")") if statuses else "not tried"


def format_ground(labels: list[dict], margin: float) -> list[str]:
    """Where the cost model behind this plan was checked against measured runs."""
    lines = ["validated ground (cost model vs measured runs; benchmarks/fidelity_*.py)"]
    for label in labels:
        lines.append(f"  {'validated   ' if label['validated'] else 'extrapolated'}  "
                     f"{label['text']}")
    if margin > 0:
        lines.append(f"  an extrapolated plan is preferred only when predicted more than "
                     f"{margin:.0%} faster than the best validated one")
    return lines


def format_pipeline(pipe: dict) -> list[str]:
    """The stage table: which layers each pipeline rank holds, and its modelled time and memory
    per microbatch. The first chunk's rank also holds the embedding, the last chunk's the output
    head and the loss; their cost is in that rank's figures."""
    virtual = pipe.get("virtual_stages", 1)
    lines = [
        f"pipeline (modelled)  {pipe['schedule']}"
        + (f", {virtual} virtual stages per rank" if virtual > 1 else "")
        + f", {pipe['microbatches']} microbatches, bubble {format_seconds(pipe['bubble_s'])} "
        f"({pipe['bubble_fraction']:.1%} of the microbatches' work), p2p {format_seconds(pipe['p2p_s'])}",
        f"  {'rank':>4}  {'layers':<22} {'fwd/mb':>9} {'bwd/mb':>9} {'total/mb':>9} "
        f"{'in flight':>9} {'memory':>10}",
    ]
    chunks = pipe["chunks"]
    for stage in pipe["stages"]:
        layers = stage["layers"]
        if chunks and chunks[0]["rank"] == stage["rank"]:
            layers = f"embedding,{layers}"
        if chunks and chunks[-1]["rank"] == stage["rank"]:
            layers = f"{layers},head"
        lines.append(
            f"  {stage['rank']:>4}  {layers:<22} {format_seconds(stage['forward_s']):>9} "
            f"{format_seconds(stage['backward_s']):>9} "
            f"{format_seconds(stage['time_per_microbatch_s']):>9} {stage['in_flight']:>9.1f} "
            f"{format_bytes(stage['memory_bytes']):>10}"
        )
    return lines


def format_tp(tp: dict) -> list[str]:
    """How tensor parallelism is used, and (for a pinned tp used unexpectedly) why."""
    if not tp:
        return []
    pinned = "pinned" if tp["pinned"] else "chosen"
    batch = (f"splits the batch on {tp['batch_split_work']:.0%} of the work"
             if tp["batch_split_work"] else "does not split the batch")
    lines = [f"tp        {tp['tp']} ({pinned}): shards {tp['weights_sharded']} of {tp['weights']} "
             f"weights ({tp['weight_bytes_sharded']:.0%} of their bytes), splits "
             f"{tp['work_split']:.0%} of the work, {batch}"]
    if tp.get("why"):
        lines.append(f"  why     {tp['why']}")
    return lines


def format_experts(entry: dict) -> list[str]:
    """Where the experts live and what moving tokens to them costs (modelled)."""
    if not entry:
        return []
    ep, layers = entry["ep"], entry["layers"]
    head = (f"experts   {layers} MoE layer(s) of {entry['experts']} experts; ep={ep}: "
            f"{entry['per_rank']} experts per rank")
    if ep > 1:
        head += (f", tokens all-to-all {format_bytes(entry['all_to_all_bytes_per_step'])} "
                 f"per rank per step, {entry['all_to_all_s'] * 1e3:.1f} ms (modelled)")
    lines = [head, f"          {entry['why']}"]
    load = entry.get("load") or {}
    if ep > 1 or "dropped_fraction" in load:
        words = []
        if ep > 1:
            words.append(f"the busiest ep rank gets {load['busiest_rank_excess']:.1%} more "
                         "tokens than its share")
        if "dropped_fraction" in load:
            words.append(f"a capacity of {load['capacity_slots']} slots per expert drops "
                         f"{load['dropped_fraction']:.2%} of the (token, choice) pairs")
        lines.append(f"          load: {'; '.join(words)} (modelled: {load['basis']})")
    return lines


def format_attention(sites: list[dict]) -> list[str]:
    """One line for the attention sites (fused by the generated kernels or not, and why)."""
    if not sites:
        return []
    fused = [s for s in sites if s["fused"]]
    kinds = sorted({s["what"] for s in fused})
    line = f"attention {len(fused)} of {len(sites)} sites fused"
    if kinds:
        line += f" into generated kernels ({'; '.join(kinds)})"
    lines = [line]
    priced = sorted({s["kernel"] for s in fused if s.get("kernel")})
    if priced:
        lines.append(f"  priced as {'; '.join(priced)} (modelled)")
    for s in sites:
        if not s["fused"]:
            lines.append(f"  kept {s['node']} (layer {s['layer']}): {s['reason']}")
    return lines
