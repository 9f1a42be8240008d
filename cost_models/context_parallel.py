"""What context parallelism costs an attention call: the three algorithms, priced.

Under context parallelism (``cp``) every rank holds ``seq / cp`` tokens of each sequence.
Everything but attention works token by token; attention's queries need every key, so the
keys and values move. Three ways, each with its price (per attention call, per microbatch,
one rank; modelled):

- ``ring`` (Liu et al., "Ring Attention with Blockwise Transformers", 2023): ``cp - 1``
  steps; at each, a rank sends its visiting K/V block to the next rank while its kernel
  runs on the block it holds, and partial results merge by log-sum-exp. Backward sends the
  K/V blocks around again with their dK/dV, which end on the block's owner. The transfer
  hides behind the step's compute when the backend overlaps (NCCL); on gloo, whose
  transfers run on the cores that compute, it does not. The merges are memory-bound
  kernels of their own, which nothing hides (:func:`ring_merge_bytes`; priced when the
  device is given).
- ``all_gather`` (Llama 3, Dubey et al. 2024 §3.3.2): gather every K/V before the kernel
  and reduce-scatter dK/dV after backward's; nothing overlaps, but with grouped-query
  attention K/V are a fraction of the queries, and the kernel runs once, unsplit. Backward
  gathers again rather than keep the gathered copy.
- ``ulysses`` (Jacobs et al., "DeepSpeed Ulysses", 2023): all-to-all from sequence-sharded
  to head-sharded q, k, v, attention over whole sequences, all-to-all back; the same again
  for the gradients. Needs the heads (and K/V heads) on a rank divisible by ``cp``.

Causal masks leave the last contiguous shard ``2 - 1/cp`` times the average work; the
zigzag layout (chunks ``i`` and ``2cp - 1 - i`` on rank ``i``) evens it out (Brandon et al.,
"Striped Attention", 2023, and Megatron-Core's load-balanced CP): :func:`causal_imbalance`.

>>> from autopar.core.cluster import LinkSpec
>>> s = AttentionShape(batch=1, heads=32, kv_heads=8, seq=131072, head_dim=128, element_bytes=2)
>>> link = LinkSpec(4.5e11, 1e-5)
>>> ring = attention_comm("ring", s, 8, link, compute_fwd_s=0.05, compute_bwd_s=0.1,
...                       overlap=True, contention=0.0)
>>> ring.forward_s == 0.0   # each K/V step hides behind a block of compute
True
>>> gather = attention_comm("all_gather", s, 8, link, overlap=True)
>>> gather.forward_s > 0 and gather.temporary_bytes > ring.temporary_bytes
True
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.core.cluster import DeviceSpec, LinkSpec
from autopar.core.knobs import CP_ALGORITHMS
from autopar.cost_models.comm import collective_time, send_recv_time
from autopar.cost_models.compute import op_time
from autopar.cost_models.data_parallel import OVERLAP_SLOWDOWN, with_contention


@dataclass(frozen=True)
class AttentionShape:
    """One attention call on one rank before the sequence is split: ``heads`` query heads
    and ``kv_heads`` key/value heads (already divided by tensor parallelism), ``seq`` the
    whole sequence."""

    batch: int
    heads: int
    kv_heads: int
    seq: int
    head_dim: int
    element_bytes: int

    def local_elements(self, cp: int, heads: int) -> float:
        """Elements of one ``(batch, heads, seq / cp, head_dim)`` tensor."""
        return self.batch * heads * self.seq / cp * self.head_dim

    def local_bytes(self, cp: int, heads: int) -> float:
        """Bytes of one ``(batch, heads, seq / cp, head_dim)`` tensor."""
        return self.local_elements(cp, heads) * self.element_bytes


@dataclass(frozen=True)
class AttentionComm:
    """Exposed seconds an algorithm adds to one call's forward and backward (its
    communication, and a ring's merges), the bytes it sends per rank, and the largest
    buffer it holds beside the local tensors."""

    forward_s: float
    backward_s: float
    bytes_sent: float
    temporary_bytes: float

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s


def unsupported(algorithm: str, shape: AttentionShape, cp: int, masked: bool = False) -> str:
    """Why ``algorithm`` cannot run this call at ``cp`` ("" when it can). ``masked``: the call
    has a mask or bias over (queries, keys) (a padded batch), which only ``all_gather``
    applies: each rank attends its rows of it to every key."""
    if algorithm not in CP_ALGORITHMS:
        return f"unknown algorithm {algorithm!r} (use one of {', '.join(CP_ALGORITHMS)})"
    if masked and algorithm != "all_gather":
        return (f"{algorithm} passes keys in blocks that take a causal flag only; this "
                "attention has a mask (padding), which all_gather applies")
    if algorithm == "ulysses" and (shape.heads % cp or shape.kv_heads % cp):
        return (f"ulysses needs the query heads ({shape.heads}) and key/value heads "
                f"({shape.kv_heads}) on a rank divisible by cp={cp}")
    return ""


def ring_merge_bytes(shape: AttentionShape, cp: int) -> tuple[float, float]:
    """(forward, backward) bytes one rank's ring moves outside its attention kernels.

    Forward: each of the ``cp - 1`` visiting blocks' partial output and log-sum-exp merges
    into the running fp32 output (read it, read the partial in the kernel's dtype, write it
    back), and the last merged output is cast to the kernel's dtype. Backward: each block's
    fp32 dQ is added into the running dQ (read both, write one), and its dK and dV into the
    ones travelling with the block. Every block counted whole: the slowest rank's share
    (with a causal mask some blocks touch half the rows). The log-sum-exps are one value
    per row: left out.

    >>> s = AttentionShape(batch=1, heads=8, kv_heads=8, seq=4096, head_dim=128, element_bytes=2)
    >>> [round(b / 2**20) for b in ring_merge_bytes(s, 2)]   # 2,048 rows x 1,024 per rank
    [32, 72]
    """
    q, kv = shape.local_elements(cp, shape.heads), shape.local_elements(cp, shape.kv_heads)
    forward = (cp - 1) * (4 + shape.element_bytes + 4) * q + (4 + shape.element_bytes) * q
    backward = (cp - 1) * (3 * 4 * q + 2 * 3 * 4 * kv)
    return forward, backward


def attention_comm(
    algorithm: str,
    shape: AttentionShape,
    cp: int,
    link: LinkSpec,
    *,
    compute_fwd_s: float = 0.0,
    compute_bwd_s: float = 0.0,
    overlap: bool = True,
    busy_s: float = 0.0,
    backend: str = "nccl",
    contention: float = OVERLAP_SLOWDOWN,
    device: DeviceSpec | None = None,
) -> AttentionComm:
    """Modelled cost of ``algorithm`` for one attention call (see the module's docstring).

    ``compute_fwd_s``/``compute_bwd_s``: the rank's kernel time for the call, which ring
    steps hide behind when ``overlap``; ``busy_s``: the extra wait of an asynchronous
    message on a busy host (a ring step is one); ``backend``: see
    :func:`~autopar.cost_models.comm.collective_time`; ``contention``: how much slower the
    kernel runs beside a ring step (:func:`~autopar.cost_models.data_parallel.with_contention`);
    ``device``: where the ring's merges run (:func:`ring_merge_bytes`; None leaves them out)."""
    if cp <= 1:
        return AttentionComm(0.0, 0.0, 0.0, 0.0)
    why = unsupported(algorithm, shape, cp)
    if why:
        raise ValueError(why)
    kv = 2 * shape.local_bytes(cp, shape.kv_heads)  # this rank's K and V
    if algorithm == "ring":
        step = send_recv_time(kv, link) + busy_s
        back = send_recv_time(2 * kv, link) + busy_s  # K/V with their dK/dV
        if overlap:  # each step hides behind one block of the kernel's work, which the
            # transfer beside it slows (cost_models.data_parallel.OVERLAP_SLOWDOWN)
            fwd = with_contention((cp - 1) * step,
                                  (cp - 1) * max(0.0, step - compute_fwd_s / cp), contention)
            bwd = with_contention((cp - 1) * back + step,
                                  (cp - 1) * max(0.0, back - compute_bwd_s / cp) + step,
                                  contention)
        else:
            fwd, bwd = (cp - 1) * step, (cp - 1) * back + step
        if device is not None:
            merge_fwd, merge_bwd = ring_merge_bytes(shape, cp)
            fwd += op_time(0.0, merge_fwd, device, "fp32")
            bwd += op_time(0.0, merge_bwd, device, "fp32")
        return AttentionComm(fwd, bwd, (cp - 1) * kv + (cp - 1) * 2 * kv + kv, 3 * kv)
    if algorithm == "all_gather":
        gathered = cp * kv
        gather = collective_time("all_gather", gathered, cp, link, backend=backend)
        scatter = collective_time("reduce_scatter", gathered, cp, link, backend=backend)
        sent = 3 * (cp - 1) * kv
        return AttentionComm(gather, gather + scatter, sent, 2 * gathered)
    q = shape.local_bytes(cp, shape.heads)
    moved = 2 * q + kv  # q, k, v in; the output back
    one_way = collective_time("all_to_all", q, cp, link, backend=backend) * 2 + collective_time(
        "all_to_all", kv, cp, link, backend=backend)
    return AttentionComm(one_way, one_way, 2 * moved * (cp - 1) / cp, moved)


def causal_imbalance(cp: int, layout: str, causal: bool) -> float:
    """The slowest rank's attention work over the average rank's. With a causal mask and
    contiguous shards rank i sees keys of i + 1/2 shards: the last does ``(2cp - 1) / cp``
    times the average. Zigzag gives every rank one early and one late chunk: 1.

    >>> causal_imbalance(4, "contiguous", True)
    1.75
    >>> causal_imbalance(4, "zigzag", True)
    1.0
    """
    if cp <= 1 or not causal or layout == "zigzag":
        return 1.0
    return (2 * cp - 1) / cp
