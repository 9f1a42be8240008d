"""Plan on rank 0 with pins no mesh matches; every rank must raise the same error, not hang.

    torchrun --nproc-per-node 2 tests/workers/plan_error.py

Each rank writes ``rank<r>.json`` (the error it raised: class, what, where, fix) into
``$AUTOPAR_TEST_OUT``. The process group times out after a minute, so a rank left waiting
in the broadcast fails instead of hanging the test.
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

import autopar
from autopar.core.errors import AutoparError
from autopar.models import GPT, GPTConfig
from autopar.runtime.teardown import leave


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32))
    idx = torch.randint(0, 64, (4, 16))
    record: dict[str, str] = {"class": "none"}
    try:
        autopar.parallelize(model, "2xcpu", (idx, idx), tp=3)  # tp=3 divides no mesh of 2
    except AutoparError as e:
        record = {"class": type(e).__name__, "what": e.what, "where": e.where or "",
                  "fix": e.fix or ""}
    except Exception as e:  # noqa: BLE001 - recorded for the test to show
        record = {"class": f"unexpected {type(e).__name__}", "what": str(e)}
    out = Path(os.environ["AUTOPAR_TEST_OUT"])
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
    leave(barrier=True)  # no rank tears its connections down while another still reads
