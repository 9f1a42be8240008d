"""How a process torchrun launched for autopar (a calibration, the demo, a test) ends.

Under load, a gloo process now and then aborts in the interpreter's own teardown, after its
work is done and written: "terminate called without an active exception", SIGABRT (seen in
the calibration, checkpoint and plan-error launches, about 1 in 50; never before the last
line of a worker ran). ``destroy_process_group`` drops torch.distributed's references to the
groups, but the meshes, FSDP2 states and modules that hold them die only as the interpreter
finalises, and a gloo thread that then needs the GIL is ended by the interpreter mid C++
frame (the unwinding through a noexcept frame is the ``terminate``; pytorch/pytorch#179291
describes the same teardown race). The launcher then reports a failed run of finished work.
These processes therefore leave without the interpreter's teardown once their work is done:
nothing is left to wait for, and the OS closes the sockets and files.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

import torch.distributed as dist


def leave(code: int = 0, *, barrier: bool = False) -> NoReturn:
    """End a launched process with ``code``: after a barrier when ``barrier`` (no rank then
    tears its connections down while another still talks to it), with the process group
    destroyed and the standard streams flushed, without the interpreter's teardown."""
    if dist.is_initialized():
        if barrier:
            dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
