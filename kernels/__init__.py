"""Generated Triton fused-attention kernels (forward, backward, log-sum-exp) and their reference.

`attention` is the entry point; `kernel_source(spec)` prints the code generated for a spec;
`merge_partials` combines partial results over disjoint keys, and `ring_attention_shard` /
`simulate_ring_attention` build ring attention (context parallelism) on it;
`reference_attention` is the plain-math definition the tests compare against.
"""


if __name__ != "autopar.kernels":
    # Reached as a top-level ``kernels`` because the repository root is on sys.path (``python
    # -m`` run there): this folder would shadow Hugging Face's ``kernels`` distribution, which
    # transformers imports. Load the installed one in its place; autopar's own kernels are only
    # ever ``autopar.kernels``.
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _root]
    _spec = importlib.machinery.PathFinder.find_spec(__name__, _path)
    if _spec is None:
        raise ModuleNotFoundError(f"No module named {__name__!r} (autopar's kernels are "
                                  "autopar.kernels)", name=__name__)
    _module = importlib.util.module_from_spec(_spec)
    sys.modules[__name__] = _module
    _spec.loader.exec_module(_module)
else:
    from .api import attention, backend_for, merge_partials, spec_for
    from .blocks import BLOCK_TABLE, Blocks, block_sizes
    from .codegen import build_kernels, kernel_source
    from .reference import dropout_keep_mask, reference_attention
    from .ring import ring_attention_shard, shard_pieces, simulate_ring_attention
    from .spec import AttentionSpec

    __all__ = [
        "BLOCK_TABLE",
        "AttentionSpec",
        "Blocks",
        "attention",
        "backend_for",
        "block_sizes",
        "build_kernels",
        "dropout_keep_mask",
        "kernel_source",
        "merge_partials",
        "reference_attention",
        "ring_attention_shard",
        "shard_pieces",
        "simulate_ring_attention",
        "spec_for",
    ]
