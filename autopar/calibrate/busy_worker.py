"""One rank of the busy-latency benchmark; ``autopar calibrate`` launches it with torchrun.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        autopar/calibrate/busy_worker.py --out busy.json

What a training step's *asynchronous* messages cost while every process computes: each rank
runs a loop of small matmuls (the compute), alone and then with a 16 KiB message per
iteration in the two patterns training uses — an all-reduce posted before the compute and
waited after it (a DDP gradient bucket), and a send from one rank to the next after its
compute (a pipeline stage handing on activations). The extra seconds per iteration, less the
same message's time on idle processes, is the wait for a core: gloo's I/O threads must take
one that a compute thread holds. Like ``collective_worker.py`` it is run as a script and
imports only torch and the standard library. Rank 0 writes ``{"points": [...]}`` to
``--out``, one point per (pattern, compute per iteration) with the slowest rank's times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from autopar.runtime.teardown import leave

MESSAGE_BYTES = 16 * 2**10
WORK_MS = (2.0, 5.0)
"""Compute per iteration: about a layer's forward or backward on the CPUs autopar plans for."""


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _per_iteration(body: Callable[[], None], iterations: int, repeats: int) -> float:
    """Median over ``repeats`` of the slowest rank's seconds per iteration of ``body``."""
    samples = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iterations):
            body()
        samples.append(_slowest((time.perf_counter() - start) / iterations))
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="JSON file rank 0 writes")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    a, b = torch.randn(128, 128), torch.randn(128, 128)
    message = torch.ones(MESSAGE_BYTES // 4)
    for _ in range(200):  # warm up: the first calls run slower
        a @ b
    start = time.perf_counter()
    for _ in range(200):
        a @ b
    per_matmul = _slowest((time.perf_counter() - start) / 200)

    def work(calls: int) -> None:
        for _ in range(calls):
            a @ b

    def all_reduce() -> None:
        dist.all_reduce(message)

    def send_recv() -> None:  # rank i hands on to rank i + 1, as pipeline stages do
        if rank + 1 < world:
            dist.send(message, rank + 1)
        if rank > 0:
            dist.recv(message, rank - 1)

    n, r = args.iterations, args.repeats
    idle = {"all_reduce": _per_iteration(all_reduce, n, r),
            "send_recv": _per_iteration(send_recv, n, r) / max(world - 1, 1)}
    points = []
    try:
        for work_ms in WORK_MS:
            calls = max(1, round(work_ms / 1e3 / per_matmul))
            alone = _per_iteration(lambda c=calls: work(c), n, r)

            def overlapped(c: int = calls) -> None:
                handle = dist.all_reduce(message, async_op=True)
                work(c)
                handle.wait()

            def handed_on(c: int = calls) -> None:
                if rank > 0:
                    dist.recv(message, rank - 1)
                work(c)
                if rank + 1 < world:
                    dist.send(message, rank + 1)

            for pattern, body in (("all_reduce", overlapped), ("send_recv", handed_on)):
                loaded = _per_iteration(body, n, r)
                points.append({"pattern": pattern, "compute_s": alone, "loaded_s": loaded,
                               "idle_message_s": idle[pattern]})
        if rank == 0:
            with open(args.out, "w", encoding="utf-8") as f:
                json.dump({"world_size": world, "points": points}, f)
    except BaseException:
        dist.destroy_process_group()
        raise
    leave()  # not through the interpreter's teardown (autopar.runtime.teardown)


if __name__ == "__main__":
    main()
