"""One point of the planner's outer search: the knobs a layout is solved under (mesh degrees,
ZeRO stage, microbatching, recomputation, pipeline, context and expert parallelism), with the
meshes they imply. The cost tables (:mod:`autopar.solver.pricing.costs`) price a problem at one."""

from __future__ import annotations

from dataclasses import dataclass

from autopar.core.constraints import SettingView
from autopar.core.knobs import RECOMPUTE_MODES


@dataclass(frozen=True)
class Setting:
    """One point of the outer search: mesh degrees, ZeRO stage, microbatching, recompute,
    and the pipeline (``pp`` stages run with ``schedule``, ``virtual`` chunks per stage)."""

    dp: int
    tp: int
    zero: int
    microbatch: int  # sequences per microbatch on one data-parallel rank
    microbatches: int  # microbatches per optimizer step
    recompute: str = "none"
    pp: int = 1
    schedule: str = "1f1b"
    virtual: int = 1
    partition: tuple[int, ...] | None = None  # layers per chunk; None: equal counts
    cp: int = 1  # context parallelism: the sequence split over cp ranks
    cp_algorithm: str = "none"  # attention under cp (cost_models.context_parallel)
    cp_layout: str = "zigzag"
    # per repeated layer, in the order they run (recompute "mixed"); empty: ``recompute``
    layer_recompute: tuple[str, ...] = ()
    ep: int = 1  # expert parallelism, carved out of dp: experts spread over ep ranks
    offload: str = "none"  # "optimizer+params": ZeRO-3's shards in host memory (FSDP2)
    # HSDP: the data-parallel ranks form ``dp_replicate`` groups (outer) of dp/dp_replicate
    # consecutive ranks (inner); ZeRO shards within a group and the groups replicate (their
    # gradient shards all-reduced across groups). 1: ZeRO shards over the whole dp (x cp).
    dp_replicate: int = 1

    def __post_init__(self) -> None:
        if self.recompute == "mixed":
            if not self.layer_recompute or any(m not in RECOMPUTE_MODES
                                               for m in self.layer_recompute):
                raise ValueError("recompute 'mixed' needs a mode per layer, got "
                                 f"{self.layer_recompute!r}")
        elif self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {self.recompute!r}")
        if self.offload != "none" and self.zero != 3:
            raise ValueError(f"offload {self.offload!r} needs ZeRO-3, got ZeRO-{self.zero}")
        if self.dp_replicate < 1 or self.dp % self.dp_replicate:
            raise ValueError(f"dp_replicate {self.dp_replicate} must divide dp={self.dp}")
        if self.dp_replicate > 1 and (self.zero == 0 or self.ep > 1):
            raise ValueError("HSDP (dp_replicate > 1) shards with ZeRO 1-3 and no experts, got "
                             f"ZeRO-{self.zero}, ep={self.ep}")

    def layer_mode(self, position: int) -> str:
        """The recomputation of the ``position``-th repeated layer (in running order)."""
        return self.layer_recompute[position] if self.layer_recompute else self.recompute

    @property
    def view(self) -> SettingView:
        """This setting as constraints see it (``autopar.core.constraints.SettingView``)."""
        return SettingView(dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep,
                           zero=self.zero, microbatch=self.microbatch,
                           microbatches=self.microbatches,
                           schedule=self.schedule if self.pp > 1 else None,
                           virtual=self.virtual, recompute=self.recompute)

    @property
    def mesh(self) -> dict[str, int]:
        """Axis -> degree, outer to inner (``pp`` and ``cp`` only when used)."""
        mesh = {"pp": self.pp} if self.pp > 1 else {}
        mesh["dp"] = self.dp
        if self.cp > 1:
            mesh["cp"] = self.cp
        return {**mesh, "tp": self.tp}

    @property
    def plan_mesh(self) -> dict[str, int]:
        """The plan's mesh: :attr:`mesh` with ``ep`` after ``dp`` when experts are spread."""
        mesh: dict[str, int] = {}
        for axis, size in self.mesh.items():
            mesh[axis] = size
            if axis == "dp" and self.ep > 1:
                mesh["ep"] = self.ep
        return mesh

    @property
    def ep_mesh(self) -> dict[str, int]:
        """The devices as expert parallelism groups them: dp split into the ranks holding
        the same experts (``edp``, outer) and ``ep`` (inner, consecutive dp ranks)."""
        mesh = {"pp": self.pp} if self.pp > 1 else {}
        return {**mesh, "edp": self.dp // self.ep, "ep": self.ep, "cp": self.cp, "tp": self.tp}

    @property
    def grad_group(self) -> int:
        """Ranks that hold the same parameters and sum their gradients: dp x cp (context
        parallelism replicates the weights, as data parallelism does; ZeRO shards over both,
        as torchtitan folds cp into the FSDP mesh)."""
        return self.dp * self.cp

    @property
    def shard_group(self) -> int:
        """Ranks one ZeRO shard spans: the whole gradient group, or under HSDP one replica
        group of it (dp/dp_replicate ranks, x cp)."""
        return self.grad_group // self.dp_replicate

    @property
    def shard_mesh(self) -> dict[str, int]:
        """The mesh the data-parallel collectives run on: dp and cp merged (cp sits just
        inside dp, so the merged group has dp's place in the rank order), then split into
        ``dp_replicate`` (outer: the replica groups, whose gradient shards are all-reduced;
        1 without HSDP) and ``dp`` (inner: the ``shard_group`` ranks ZeRO shards over,
        gathering and reduce-scattering there)."""
        mesh = {"pp": self.pp} if self.pp > 1 else {}
        return {**mesh, "dp_replicate": self.dp_replicate, "dp": self.shard_group,
                "tp": self.tp}
