"""Record what a real training run spends its time on, for ``autopar calibrate --from-run``.

    pm = autopar.parallelize(model, cluster, batch)
    with pm.record_run("runs/today"):          # one JSON file per rank, written on exit
        for batch in batches:
            loss = pm.train_step(*pm.shard_batch(*batch)[0]); opt.step(); opt.zero_grad()

Every ``train_step`` inside is one recorded step (all numbers measured, seconds):

- ``step_s``: from this step's ``train_step`` call to the next one's (or to the end of the
  recording): the whole step a user sees, the optimizer and the loop included;
- ``train_step_s``: forward and backward over the microbatches, with their communication;
- ``collectives``: each collective the step ran, with ``kind`` (the ring-model kinds of
  ``autopar.calibrate.collectives.KINDS``), ``bytes`` (the whole tensor, nccl-tests'
  convention), ``group_size``, ``seconds`` and ``source``:

  - ``autopar``: the tensor-parallel collectives the rewritten graph calls
    (``autopar.ops.comm_ops``), timed around the blocking call;
  - ``loss``: a pipeline's loss, sent from the last stage and averaged over data-parallel
    ranks for the caller, which the plan prices as one blocking scalar collective each
    (``solver.evaluate.loss_for_caller_s``); without a pipeline that average runs beside
    the backward and is not recorded;
  - ``ddp``: DDP's gradient buckets, from the bucket's launch to its completion (a comm hook
    that runs DDP's own all-reduce: same result), and ``exposed_s``, the part after the
    backward pass ended (the last bucket's launch): the rest ran beside backward;
  - ``fsdp``: FSDP2's all-gathers and reduce-scatters (ZeRO-3, and data parallelism of
    pipeline stages), run to completion where FSDP2 asked for an asynchronous one (always
    correct; it gives up only the overlap, which gloo's collectives on the cores that
    compute hardly have);

- ``p2p_wait_s``: time the pipeline schedule waited on its sends and receives (transfers and
  the bubble; no sizes, so they are not link points).

``timed`` lists the sources a recording timed, so a reader knows what is missing.

A run is JSON (``rank{r}.json``, format ``autopar-run``, a schema version), never a pickle;
:mod:`autopar.calibrate.from_run` reads and validates it.
"""

from __future__ import annotations

import atexit
import json
import os
import platform
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

RUN_FORMAT = "autopar-run"
RUN_VERSION = 1
WARMUP_STEPS = 2
"""Steps at the start of a recording that the fit leaves out: the first (first-call
allocation, the optimizer's state, pipeline shape inference) and the second, where DDP
rebuilds its gradient buckets in the order the first backward made them ready. On the demo
GPT (dp=2, gloo) both ran 15-40% over the steady step (measured)."""


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _group_size(group: Any) -> int:
    return dist.get_world_size(group) if group is not None else dist.get_world_size()


class _TimedDist:
    """Stands in for ``torch.distributed`` inside ``autopar.ops.comm_ops`` while recording: the
    blocking collectives it calls are timed; everything else passes through."""

    def __init__(self, real: Any, recorder: RunRecorder, source: str = "autopar"):
        self._real = real
        self._recorder = recorder
        self._source = source

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def _timed(self, kind: str, nbytes: int, group: Any, call: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        out = call()
        self._recorder.collective(kind, nbytes, _group_size(group),
                                  time.perf_counter() - start, self._source)
        return out

    def all_reduce(self, tensor, op=None, group=None, async_op=False):
        kwargs = {} if op is None else {"op": op}
        if async_op:
            return self._real.all_reduce(tensor, group=group, async_op=True, **kwargs)
        return self._timed("all_reduce", _nbytes(tensor), group,
                           lambda: self._real.all_reduce(tensor, group=group, **kwargs))

    def all_gather(self, tensor_list, tensor, group=None, async_op=False):
        if async_op:
            return self._real.all_gather(tensor_list, tensor, group=group, async_op=True)
        return self._timed("all_gather", sum(_nbytes(t) for t in tensor_list), group,
                           lambda: self._real.all_gather(tensor_list, tensor, group=group))

    def all_to_all_single(self, output, input, *args, group=None, async_op=False, **kwargs):
        if async_op:
            return self._real.all_to_all_single(output, input, *args, group=group,
                                                async_op=True, **kwargs)
        return self._timed("all_to_all", _nbytes(input), group, lambda: (
            self._real.all_to_all_single(output, input, *args, group=group, **kwargs)))

    def all_gather_single(self, output_tensor, input_tensor, group=None, async_op=False,
                          **kwargs):
        # FSDP2's all-gather: run to completion and timed; None tells FSDP2 it is done
        # (waiting at once is always correct; it only gives up overlap, which gloo's
        # collectives on the computing cores hardly have).
        real = getattr(self._real, "all_gather_single", None) or self._real.all_gather_into_tensor
        self._timed("all_gather", _nbytes(output_tensor), group, lambda: real(
            output_tensor, input_tensor, group=group, **kwargs))
        return None

    def reduce_scatter_single(self, output, input, op=None, group=None, async_op=False,
                              **kwargs):
        real = getattr(self._real, "reduce_scatter_single", None) or self._real.reduce_scatter_tensor
        if op is not None:
            kwargs["op"] = op
        self._timed("reduce_scatter", _nbytes(input), group, lambda: real(
            output, input, group=group, **kwargs))
        return None

    def broadcast(self, tensor, src=None, group=None, async_op=False, **kwargs):
        if async_op:
            return self._real.broadcast(tensor, src, group=group, async_op=True, **kwargs)
        return self._timed("broadcast", _nbytes(tensor), group,
                           lambda: self._real.broadcast(tensor, src, group=group, **kwargs))


class RunRecorder:
    """Times this rank's training steps and collectives; ``close()`` writes ``rank{r}.json``.

    Made by :meth:`ParallelModule.record_run`; a context manager (closing on exit)."""

    def __init__(self, module: Any, directory: str | os.PathLike[str], max_steps: int = 1000):
        self.module = module
        self.directory = Path(directory)
        if self.directory.exists() and not self.directory.is_dir():
            from autopar.core.errors import RuntimeSetupError

            raise RuntimeSetupError(
                f"cannot record a run into {self.directory}: it is a file",
                where="record_run(directory)",
                fix="name a directory (it is created; one rank{r}.json per rank goes in it)")
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        # the plan's ranks: where it uses fewer than were launched, the others idle unrecorded
        self.world_size = module.plan.world_size
        self.steps: list[dict[str, Any]] = []
        self.max_steps = max_steps  # later steps run unrecorded (a long job's file stays small)
        self.active = False
        self._current: dict[str, Any] | None = None
        self._in_step = False
        self._started = time.perf_counter()
        self._restore: list[Callable[[], None]] = []
        self.timed: list[str] = ["autopar", "loss"]  # which sources of collectives it times

    # --- lifecycle --------------------------------------------------------------------------
    def __enter__(self) -> RunRecorder:
        return self

    def __exit__(self, *exc: Any) -> bool:
        self.close()
        return False

    def start(self) -> RunRecorder:
        if self.active:
            return self
        self.active = True
        self._patch()
        atexit.register(self.close)  # a process that ends without closing still writes
        return self

    def close(self) -> Path | None:
        """Stop recording and write this rank's file; returns its path."""
        if not self.active:
            return None
        self.active = False
        atexit.unregister(self.close)
        now = time.perf_counter()
        if self.steps and self.steps[-1]["step_s"] is None:
            self.steps[-1]["step_s"] = now - self.steps[-1]["_start"]
        for restore in reversed(self._restore):
            restore()
        self._restore.clear()
        if getattr(self.module, "_recorder", None) is self:
            self.module._recorder = None
        return self.write()

    def write(self) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        steps = [{k: v for k, v in s.items() if not k.startswith("_")} for s in self.steps]
        doc = {
            "format": RUN_FORMAT,
            "version": RUN_VERSION,
            "rank": self.rank,
            "world_size": self.world_size,
            "backend": dist.get_backend() if dist.is_initialized() else "none",
            "host": {
                "hostname": socket.gethostname(),
                "platform": platform.platform(),
                "cpu_count": os.cpu_count() or 1,
                "torch_version": torch.__version__,
                "threads_per_process": torch.get_num_threads(),
            },
            "warmup_steps": WARMUP_STEPS,
            "timed": list(self.timed),
            "plan": self.module.plan.to_dict(),
            "steps": steps,
        }
        path = self.directory / f"rank{self.rank}.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
        tmp.replace(path)
        return path

    # --- what train_step calls --------------------------------------------------------------
    def step_begin(self) -> None:
        now = time.perf_counter()
        if self.steps and self.steps[-1]["step_s"] is None:
            self.steps[-1]["step_s"] = now - self.steps[-1]["_start"]
        if len(self.steps) >= self.max_steps:
            self._current, self._in_step = None, False
            return
        self._current = {"step": len(self.steps), "step_s": None, "train_step_s": None,
                         "p2p_wait_s": 0.0, "collectives": [], "_start": now}
        self.steps.append(self._current)
        self._in_step = True

    def step_end(self) -> None:
        if self._current is not None:
            self._current["train_step_s"] = time.perf_counter() - self._current["_start"]
            _exposed(self._current["collectives"])
        self._in_step = False

    def collective(self, kind: str, nbytes: int, group_size: int, seconds: float,
                   source: str, span: tuple[float, float] | None = None) -> None:
        if self.active and self._in_step and self._current is not None and group_size > 1:
            entry: dict[str, Any] = {
                "kind": kind, "bytes": int(nbytes), "group_size": int(group_size),
                "seconds": float(seconds), "source": source}
            if span is not None:
                entry["_span"] = span
            self._current["collectives"].append(entry)

    def p2p_wait(self, seconds: float) -> None:
        if self.active and self._in_step and self._current is not None:
            self._current["p2p_wait_s"] += seconds

    # --- hooks ------------------------------------------------------------------------------
    def _patch(self) -> None:
        from autopar.ops import comm_ops

        real_dist, real_gather = comm_ops.dist, comm_ops._all_gather_single
        comm_ops.dist = _TimedDist(real_dist, self)

        def gather_single(out, x, group=None, async_op=False):
            if async_op:
                return real_gather(out, x, group=group, async_op=True)
            start = time.perf_counter()
            result = real_gather(out, x, group=group)
            self.collective("all_gather", _nbytes(out), _group_size(group),
                            time.perf_counter() - start, "autopar")
            return result

        comm_ops._all_gather_single = gather_single

        def restore_comm_ops() -> None:
            comm_ops.dist, comm_ops._all_gather_single = real_dist, real_gather

        self._restore.append(restore_comm_ops)
        self._patch_fsdp()
        self._patch_pipeline_waits()

    def _patch_fsdp(self) -> None:
        """Time FSDP2's all-gathers and reduce-scatters (ZeRO-3, and data parallelism of
        pipeline stages): its collectives module calls them through its ``dist``."""
        try:
            from torch.distributed.fsdp._fully_shard import _fsdp_collectives as fsdp
        except ImportError:
            return
        real = getattr(fsdp, "dist", None)
        if real is None:
            return
        fsdp.dist = _TimedDist(real, self, source="fsdp")

        def restore() -> None:
            fsdp.dist = real

        self._restore.append(restore)
        self.timed.append("fsdp")

    def _patch_pipeline_waits(self) -> None:
        """Time the schedule's waits on its sends and receives (torch's pipelining calls
        one module-level function for them)."""
        if getattr(self.module, "_pipeline", None) is None:
            return
        from torch.distributed.pipelining import schedules

        real = getattr(schedules, "_wait_batch_p2p", None)
        if real is None:
            return

        def timed_wait(work: Any) -> Any:
            start = time.perf_counter()
            out = real(work)
            self.p2p_wait(time.perf_counter() - start)
            return out

        schedules._wait_batch_p2p = timed_wait
        self.timed.append("p2p")

        def restore() -> None:
            schedules._wait_batch_p2p = real

        self._restore.append(restore)


def _exposed(collectives: list[dict[str, Any]]) -> None:
    """``exposed_s`` of asynchronous collectives (DDP's buckets): the part of each after the
    backward pass ended, which is when the last bucket was launched (it holds the first
    layers' gradients). A bucket launched earlier ran beside the backward pass; only what
    it took past the end of backward held the step up."""
    spans = [c for c in collectives if "_span" in c]
    if not spans:
        return
    backward_end = max(c["_span"][0] for c in spans)
    for c in spans:
        start, end = c.pop("_span")
        c["exposed_s"] = max(0.0, end - max(start, backward_end))


def ddp_timing_hook(recorder_of: Callable[[], RunRecorder | None]) -> Callable:
    """A DDP comm hook that runs DDP's own all-reduce (divide by the group size, sum) and
    times each bucket from launch to completion for the active recorder, if any."""

    def hook(process_group: Any, bucket: Any) -> torch.futures.Future:
        group = process_group if process_group is not None else dist.group.WORLD
        tensor = bucket.buffer()
        tensor.div_(group.size())
        start = time.perf_counter()
        recorder = recorder_of()
        fut = dist.all_reduce(tensor, group=group, async_op=True).get_future()

        def done(f: torch.futures.Future) -> torch.Tensor:
            if recorder is not None:
                end = time.perf_counter()
                recorder.collective("all_reduce", _nbytes(tensor), group.size(),
                                    end - start, "ddp", span=(start, end))
            return f.value()[0]

        return fut.then(done)

    # DDP checks the annotations themselves (strings under postponed evaluation)
    hook.__annotations__ = {"process_group": object, "bucket": dist.GradBucket,
                            "return": torch.futures.Future[torch.Tensor]}
    return hook
