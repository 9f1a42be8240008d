"""Hand edits of solver plans, and plans made under a scrambled cost model: layouts the
solver may pick but rarely does (its tie-breaking changes with CP-SAT's settings; its
preferences with the cost model), so the equivalence tests run them.

``nest_cp_tp``: a value whole over ``cp`` (a rotary table, a mask: it does not follow the
sequence split) that a consumer slices to its sequence over ``cp`` is also split on ``tp``
along that same dim. The slice over ``cp`` then meets a ``tp`` split of the same dim, which
the runtime must undo first (``passes/insert_collectives.redistribution_steps``).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator
from contextlib import contextmanager

import torch.fx as fx

from autopar.core.placements import Shard, parse_placement
from autopar.core.plan import Plan, strategy_to_json
from autopar.core.values import tensor_inputs
from autopar.strategies import strategies_for
from autopar.strategies.calls import op_call


def nest_cp_tp(plan: Plan, gm: fx.GraphModule) -> tuple[Plan, list[str]]:
    """``plan`` with every such value split on ``tp`` too, and the names of the nodes edited
    (the test asserts there is at least one)."""
    data = json.loads(plan.to_json())
    strategies = data["strategies"]
    tp = plan.mesh["tp"]
    edited = []
    for node in gm.graph.nodes:
        mine = strategies.get(node.name)
        if node.op != "call_function" or not mine or mine["cp"]["out"] != ["R"]:
            continue
        dims = set()
        for user in node.users:
            theirs = strategies.get(user.name)
            if not theirs or user.op != "call_function":
                continue
            for slot, value in enumerate(tensor_inputs(user)):
                need = parse_placement(theirs["cp"]["in"][slot])
                if value is node and isinstance(need, Shard):
                    dims.add(need.dim)
        if len(dims) != 1:
            continue
        dim = dims.pop()
        fitting = [s for s in strategies_for(op_call(node), tp) if s.outputs == (Shard(dim),)]
        if fitting and mine["tp"]["out"] != [str(Shard(dim))]:
            strategies[node.name]["tp"] = strategy_to_json(fitting[0])
            edited.append(node.name)
    return Plan.from_json(json.dumps(data), source="nest_cp_tp"), edited


@contextmanager
def scrambled_costs(seed: int) -> Iterator[None]:
    """Within, the planner prices every op and every redistribution at a pseudo-random
    multiple (0.05-4x, fixed by ``seed``, the same on every rank) of its modelled time, so
    the solver lands on another valid layout: every constraint it keeps (ties, memory,
    parameter placements) still holds, only the preferences move. What the runtime must run
    right is any layout the planner may pick, whatever the cost model says."""
    from autopar.solver.pricing.costs import CostTables

    times, moves = CostTables._compute_times, CostTables._redistribution

    def factor(*parts: object) -> float:
        return 0.05 + 3.95 * (zlib.crc32("|".join(map(str, (seed, *parts))).encode()) / 2**32)

    def scrambled_times(self, d, s):
        f = factor("op", d.nodes[0].name, s)
        return tuple(t * f for t in times(self, d, s))

    def scrambled_moves(self, key, src, dst):
        return moves(self, key, src, dst) * factor("move", key, src, dst)

    CostTables._compute_times, CostTables._redistribution = scrambled_times, scrambled_moves
    try:
        yield
    finally:
        CostTables._compute_times, CostTables._redistribution = times, moves
