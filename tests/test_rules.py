"""Tests of the built-in sharding rules, numerically and against DTensor.

For every case (an op on small concrete inputs) and every strategy its rule lists on mesh
axes of 2 and 4 devices:

- **numerics**: slice random global inputs per the strategy's input placements (``Partial``
  inputs are random terms that sum, or average, to the global), run the op on each device's
  local inputs (shape arguments localized as the tensor-parallel pass does), combine the
  local outputs per the claimed output placements and compare with the op on the globals;
- **DTensor**: ask DTensor's sharding propagator about the same input placements; when it
  accepts them without redistributing, its output placements must be one of the outputs we
  list for those inputs (we sometimes list several, e.g. ``expand`` of a replicated tensor
  may stay whole or come out sharded along a broadcast dim). Gaps and the one documented
  disagreement are listed next to that test.

Shapes mix dims divisible by 2 and 4 with odd ones, so a rule that shards a dim that does
not divide fails the validity check.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Partial as DPartial
from torch.distributed.tensor import Replicate as DReplicate
from torch.distributed.tensor import Shard as DShard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._dtensor_spec import TensorMeta as DTensorMeta
from torch.distributed.tensor._op_schema import OpSchema
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

import autopar.ops.moe_ops  # noqa: F401  (registers autopar::grouped_mm)
import autopar.strategies.builtin  # noqa: F401  (registers the rules)
from autopar.core.placements import Partial, Placement, Replicate, Shard, can_shard, local_shape
from autopar.passes.localize_shapes import SHAPE_ARG
from autopar.strategies import (
    OpCall,
    Strategy,
    TensorMeta,
    norm_dim,
    replicate_all,
    rule_for,
    strategies_for,
)
from autopar.strategies.embedding import VOCAB_PARALLEL, vocab_parallel_embedding

aten = torch.ops.aten
AXIS_SIZES = (2, 4)
BIG = 9223372036854775807  # INT64_MAX, as torch.export writes an open slice end


# ----------------------------------------------------------------------------- inputs


def f(*shape: int) -> torch.Tensor:
    return torch.randn(shape, dtype=torch.float64)


def pos(*shape: int) -> torch.Tensor:
    return torch.rand(shape, dtype=torch.float64) + 0.5


def i(high: int, *shape: int) -> torch.Tensor:
    return torch.randint(0, high, shape)


def b(*shape: int) -> torch.Tensor:
    return torch.rand(shape) > 0.5


def perm(high: int, k: int) -> torch.Tensor:
    """``k`` distinct indices below ``high`` (a write to a repeated index is unordered)."""
    return torch.randperm(high)[:k]


def rows_perm(rows: int, high: int, k: int) -> torch.Tensor:
    """Per row, ``k`` distinct indices below ``high`` (for ``scatter`` along dim 1)."""
    return torch.rand(rows, high).argsort(dim=1)[:, :k]


@dataclass(frozen=True)
class Case:
    name: str
    op: Any
    make: Callable[[], tuple]
    kwargs: Callable[[], dict] = dict
    hints: dict = field(default_factory=dict)
    values: bool = True  # False: uninitialized outputs, compare shapes only


CASES = [
    # --- pointwise
    Case("add", aten.add.Tensor, lambda: (f(4, 8, 4), f(8, 1))),
    Case("add_odd_bcast", aten.add.Tensor, lambda: (f(4, 6, 3), f(3))),
    Case("add_alpha", aten.add.Tensor, lambda: (f(4, 8), f(4, 8)), lambda: {"alpha": 2}),
    Case("add_scalar", aten.add.Tensor, lambda: (f(4, 6), 1e-6)),
    Case("add_Scalar", aten.add.Scalar, lambda: (f(4, 8), 2.0)),
    Case("add_groups", aten.add.Tensor, lambda: (f(4, 12), f(12)), hints={"split_groups": (3,)}),
    Case("sub", aten.sub.Tensor, lambda: (f(4, 8), f(8))),
    Case("sub_scalar", aten.sub.Tensor, lambda: (i(9, 4, 8), 1)),
    Case("sub_Scalar", aten.sub.Scalar, lambda: (f(4, 8), 0)),
    Case("mul", aten.mul.Tensor, lambda: (f(4, 8, 3), f(4, 1, 3))),
    Case("mul_scalar", aten.mul.Tensor, lambda: (f(4, 8), 0.5)),
    Case("mul_Scalar", aten.mul.Scalar, lambda: (f(4, 8), 3)),
    Case("div", aten.div.Tensor, lambda: (f(4, 8), pos(4, 1))),
    Case("div_scalar", aten.div.Tensor, lambda: (f(4, 8), 2.0)),
    Case("div_Scalar", aten.div.Scalar, lambda: (f(4, 8), 4.0)),
    Case(
        "div_mode",
        aten.div.Tensor_mode,
        lambda: (f(4, 8), pos(8)),
        lambda: {"rounding_mode": "floor"},
    ),
    Case("div_inplace", aten.div_.Tensor, lambda: (f(32, 2), pos(32, 1))),
    Case("div_inplace_scalar", aten.div_.Scalar, lambda: (f(4, 8), 2.0)),
    Case("neg", aten.neg.default, lambda: (f(4, 8, 3),)),
    Case("pow", aten.pow.Tensor_Scalar, lambda: (f(4, 8), 2)),
    Case("pow_tensor", aten.pow.Tensor_Tensor, lambda: (pos(4, 8), f(8))),
    Case("pow_scalar_base", aten.pow.Scalar, lambda: (2.0, f(4, 8))),
    Case("rsqrt", aten.rsqrt.default, lambda: (pos(4, 8, 1),)),
    Case("sqrt", aten.sqrt.default, lambda: (pos(4, 8),)),
    Case("exp", aten.exp.default, lambda: (f(4, 8),)),
    Case("log", aten.log.default, lambda: (pos(4, 8),)),
    Case("tanh", aten.tanh.default, lambda: (f(4, 8),)),
    Case("sigmoid", aten.sigmoid.default, lambda: (f(4, 8),)),
    Case("silu", aten.silu.default, lambda: (f(4, 8),)),
    Case("gelu", aten.gelu.default, lambda: (f(4, 8),)),
    Case("gelu_tanh", aten.gelu.default, lambda: (f(4, 8),), lambda: {"approximate": "tanh"}),
    Case("relu", aten.relu.default, lambda: (f(4, 8),)),
    Case("sin", aten.sin.default, lambda: (f(4, 8),)),
    Case("cos", aten.cos.default, lambda: (f(4, 8),)),
    Case("abs", aten.abs.default, lambda: (f(4, 8),)),
    Case("erf", aten.erf.default, lambda: (f(4, 8),)),
    Case("reciprocal", aten.reciprocal.default, lambda: (pos(4, 8),)),
    Case("clamp", aten.clamp.default, lambda: (f(4, 8), -0.5, 0.5)),
    Case("clamp_tensor", aten.clamp.Tensor, lambda: (f(4, 8), f(8), None)),
    Case("minimum", aten.minimum.default, lambda: (f(4, 8), f(4, 1))),
    Case("maximum", aten.maximum.default, lambda: (f(4, 8), f(8))),
    Case("where", aten.where.self, lambda: (b(4, 1, 8), f(4, 6, 8), f(8))),
    Case("where_scalar_other", aten.where.ScalarOther, lambda: (b(4, 8), f(4, 8), -1e9)),
    Case("where_scalar_other_zero", aten.where.ScalarOther, lambda: (b(8), f(4, 8), 0.0)),
    Case("where_scalar_self", aten.where.ScalarSelf, lambda: (b(4, 8), 0.0, f(4, 8))),
    Case("eq", aten.eq.Tensor, lambda: (i(3, 4, 8), i(3, 8))),
    Case("eq_scalar", aten.eq.Scalar, lambda: (i(3, 4, 8), 1)),
    Case("ne", aten.ne.Tensor, lambda: (i(3, 4, 8), i(3, 4, 8))),
    Case("ne_scalar", aten.ne.Scalar, lambda: (i(3, 4, 7), 1)),
    Case("le", aten.le.Tensor, lambda: (i(9, 1, 8, 1), i(9, 4, 1, 8))),
    Case("le_scalar", aten.le.Scalar, lambda: (f(4, 8), 0.0)),
    Case("lt", aten.lt.Tensor, lambda: (f(4, 8), f(8))),
    Case("lt_scalar", aten.lt.Scalar, lambda: (f(4, 8), 0.0)),
    Case("ge", aten.ge.Tensor, lambda: (f(4, 8), f(4, 8))),
    Case("ge_scalar", aten.ge.Scalar, lambda: (f(4, 8), 0.0)),
    Case("gt", aten.gt.Tensor, lambda: (f(4, 8), f(1))),
    Case("gt_scalar", aten.gt.Scalar, lambda: (f(4, 8), 0.0)),
    Case("and", aten.__and__.Tensor, lambda: (b(2, 1, 8, 8), b(2, 4, 8, 8))),
    Case("or", aten.__or__.Tensor, lambda: (b(4, 8), b(8))),
    Case("logical_and", aten.logical_and.default, lambda: (b(4, 8), b(4, 8))),
    Case("logical_or", aten.logical_or.default, lambda: (b(4, 8), b(4, 1))),
    Case("logical_not", aten.logical_not.default, lambda: (b(4, 8),)),
    Case("bitwise_not", aten.bitwise_not.default, lambda: (b(4, 8),)),
    Case("masked_fill", aten.masked_fill.Scalar, lambda: (f(4, 8), b(4, 1), -1e4)),
    Case("masked_fill_zero", aten.masked_fill.Scalar, lambda: (f(4, 8), b(8), 0.0)),
    Case("masked_fill_tensor", aten.masked_fill.Tensor, lambda: (f(4, 8), b(8), f())),
    Case("clone", aten.clone.default, lambda: (f(4, 8),)),
    Case("contiguous", aten.contiguous.default, lambda: (f(4, 8),)),
    Case("alias", aten.alias.default, lambda: (f(4, 8),)),
    Case("detach", aten.detach.default, lambda: (f(4, 8),)),
    Case("lift_fresh_copy", aten.lift_fresh_copy.default, lambda: (f(4, 8),)),
    Case("to_dtype", aten.to.dtype, lambda: (f(4, 8), torch.float32)),
    Case("to_dtype_int", aten.to.dtype, lambda: (f(4, 8) * 10, torch.int64)),
    Case(
        "to_dtype_layout",
        aten.to.dtype_layout,
        lambda: (f(4, 8),),
        lambda: {"dtype": torch.float32, "layout": torch.strided, "device": torch.device("cpu")},
    ),
    Case("to_copy", aten._to_copy.default, lambda: (f(4, 8),), lambda: {"dtype": torch.float32}),
    Case("type_as", aten.type_as.default, lambda: (f(4, 8), f(2, 3).float())),
    Case("dropout", aten.dropout.default, lambda: (f(4, 8), 0.0, True)),
    Case("native_dropout", aten.native_dropout.default, lambda: (f(4, 8), 0.0, True)),
    Case("floor_divide", aten.floor_divide.default, lambda: (i(50, 4, 8), i(5, 8) + 1)),
    Case("floor_divide_scalar", aten.floor_divide.Scalar, lambda: (i(50, 64), 2)),
    Case(
        "assert_tensor_metadata",
        aten._assert_tensor_metadata.default,
        lambda: (f(4, 8),),
        lambda: {"dtype": torch.float64, "device": torch.device("cpu"), "layout": torch.strided},
    ),
    Case(
        "assert_tensor_metadata_size",
        aten._assert_tensor_metadata.default,
        lambda: (f(4, 8), [4, 8]),
    ),
    # --- matrix products
    Case(
        "linear",
        aten.linear.default,
        lambda: (f(4, 6, 8), f(12, 8), f(12)),
        hints={"split_groups": (3,)},
    ),
    Case("linear_nobias", aten.linear.default, lambda: (f(8, 16), f(8, 16))),
    Case("linear_odd", aten.linear.default, lambda: (f(3, 5), f(6, 5), f(6))),
    Case("linear_1d", aten.linear.default, lambda: (f(8), f(4, 8))),
    Case(
        "addmm",
        aten.addmm.default,
        lambda: (f(12), f(8, 16), f(16, 12)),
        hints={"split_groups": (3,)},
    ),
    Case(
        "addmm_2d_bias",
        aten.addmm.default,
        lambda: (f(8, 12), f(8, 4), f(4, 12)),
        lambda: {"beta": 0.5, "alpha": 2.0},
    ),
    Case("addmm_row_bias", aten.addmm.default, lambda: (f(8, 1), f(8, 4), f(4, 12))),
    Case("mm", aten.mm.default, lambda: (f(8, 16), f(16, 12))),
    Case("mm_odd", aten.mm.default, lambda: (f(5, 8), f(8, 3))),
    Case("bmm", aten.bmm.default, lambda: (f(4, 8, 6), f(4, 6, 8))),
    Case("baddbmm", aten.baddbmm.default, lambda: (f(4, 1, 8), f(4, 8, 6), f(4, 6, 8))),
    Case("matmul", aten.matmul.default, lambda: (f(2, 4, 8, 6), f(2, 4, 6, 8))),
    Case("matmul_bcast", aten.matmul.default, lambda: (f(1, 4, 8, 6), f(2, 1, 6, 8))),
    Case("matmul_2d_rhs", aten.matmul.default, lambda: (f(4, 8, 6), f(6, 4))),
    Case("matmul_dot", aten.matmul.default, lambda: (f(8), f(8))),
    Case("matmul_mv", aten.matmul.default, lambda: (f(4, 8), f(8))),
    Case("matmul_vm", aten.matmul.default, lambda: (f(8), f(2, 8, 4))),
    # --- views
    Case("view_split", aten.view.default, lambda: (f(4, 8, 12), [4, 8, 3, 4])),
    Case("view_merge", aten.view.default, lambda: (f(4, 8, 12), [32, 12])),
    Case("view_infer", aten.view.default, lambda: (f(4, 8, 12), [4, -1])),
    Case(
        "view_groups",
        aten.view.default,
        lambda: (f(32, 12), [4, 8, 12]),
        hints={"split_groups": (3,)},
    ),
    Case("view_unfuse", aten.view.default, lambda: (f(4, 24), [4, 3, 8])),
    Case("view_fuse", aten.view.default, lambda: (f(4, 3, 8), [4, 24])),
    Case("view_odd", aten.view.default, lambda: (f(6, 4), [4, 6])),
    Case("reshape_gqa", aten.reshape.default, lambda: (f(2, 4, 2, 8, 8), [2, 8, 8, 8])),
    Case("reshape_seq", aten.reshape.default, lambda: (f(2, 8, 4), [16, 4])),
    Case("unsafe_view", aten._unsafe_view.default, lambda: (f(4, 8, 6), [32, 6])),
    Case("flatten", aten.flatten.using_ints, lambda: (f(4, 8, 6), 1, 2)),
    Case("unflatten", aten.unflatten.int, lambda: (f(4, 24), 1, [4, -1])),
    Case("unsqueeze", aten.unsqueeze.default, lambda: (f(4, 8), 1)),
    Case("unsqueeze_last", aten.unsqueeze.default, lambda: (f(4, 8), -1)),
    Case("squeeze_dim", aten.squeeze.dim, lambda: (f(4, 1, 8), 1)),
    Case("squeeze_noop", aten.squeeze.dim, lambda: (f(2, 8), 0)),
    Case("squeeze_all", aten.squeeze.default, lambda: (f(4, 1, 2),)),
    Case("squeeze_dims", aten.squeeze.dims, lambda: (f(4, 1, 8, 1), [1, 3])),
    Case("transpose", aten.transpose.int, lambda: (f(4, 8, 6), 1, 2)),
    Case("transpose_neg", aten.transpose.int, lambda: (f(4, 8, 6), -2, -1)),
    Case("permute", aten.permute.default, lambda: (f(4, 8, 6, 2), [0, 2, 1, 3])),
    Case("t", aten.t.default, lambda: (f(4, 8),)),
    Case("expand", aten.expand.default, lambda: (f(4, 1, 8), [4, 6, 8])),
    Case("expand_new_dims", aten.expand.default, lambda: (f(8), [4, 2, 8])),
    Case("expand_infer", aten.expand.default, lambda: (f(4, 1), [-1, 8])),
    Case("slice_full", aten.slice.Tensor, lambda: (f(4, 8, 6), 1, 0, BIG)),
    Case("slice_full_exact", aten.slice.Tensor, lambda: (f(4, 8, 6), 1, 0, 8)),
    Case("slice_part", aten.slice.Tensor, lambda: (f(4, 8, 8), 2, 0, 4)),
    Case("slice_tail", aten.slice.Tensor, lambda: (f(4, 8, 8), 2, 4, BIG)),
    Case("slice_step", aten.slice.Tensor, lambda: (f(4, 8), 1, 0, 8, 2)),
    Case("select", aten.select.int, lambda: (f(4, 8, 6), 1, 3)),
    Case("split_qkv", aten.split.Tensor, lambda: (f(4, 8, 12), 4, 2)),
    Case("split_uneven", aten.split.Tensor, lambda: (f(4, 10), 4, 1)),
    Case("split_with_sizes", aten.split_with_sizes.default, lambda: (f(4, 12), [4, 4, 4], 1)),
    Case("split_with_sizes_uneven", aten.split_with_sizes.default, lambda: (f(4, 12), [4, 8], 1)),
    Case("chunk", aten.chunk.default, lambda: (f(4, 8, 16), 2, -1)),
    Case("unbind", aten.unbind.int, lambda: (f(3, 4, 8), 0)),
    Case("cat", aten.cat.default, lambda: ([f(4, 8), f(4, 8)], 1)),
    Case("cat_uneven", aten.cat.default, lambda: ([f(4, 2, 8), f(4, 6, 8)], 1)),
    Case("cat_three", aten.cat.default, lambda: ([f(4, 8), f(4, 8), f(4, 8)], -1)),
    Case("stack", aten.stack.default, lambda: ([f(4, 8), f(4, 8)], 1)),
    Case("pad_labels", aten.pad.default, lambda: (i(9, 2, 16), [0, 1], "constant", -100.0)),
    Case("pad_zero", aten.pad.default, lambda: (f(4, 8, 6), [1, 1], "constant", 0.0)),
    Case("pad_value", aten.pad.default, lambda: (f(4, 8, 6), [0, 0, 1, 2], "constant", 2.0)),
    Case("pad_reflect", aten.pad.default, lambda: (f(4, 8, 6), [1, 1], "reflect")),
    Case("constant_pad_nd", aten.constant_pad_nd.default, lambda: (f(4, 8, 6), [1, 1])),
    Case("index_rows", aten.index.Tensor, lambda: (f(8, 6), [i(8, 16)])),
    Case("index_adjacent", aten.index.Tensor, lambda: (f(4, 8, 6), [None, i(8, 4, 1), i(6, 1, 4)])),
    Case("index_apart", aten.index.Tensor, lambda: (f(4, 8, 6), [i(4, 8), None, i(6, 8)])),
    Case(
        "index_llama_mask",
        aten.index.Tensor,
        lambda: (f(2, 16), [i(2, 2, 1, 1, 1), i(16, 1, 1, 16, 1)]),
    ),
    Case("index_bool", aten.index.Tensor, lambda: (f(4, 8), [b(4, 8)])),
    Case("diff", aten.diff.default, lambda: (f(4, 8), 1, -1)),
    Case("diff_prepend", aten.diff.default, lambda: (f(4, 8), 1, 1, f(4, 1))),
    Case("diff_dim0", aten.diff.default, lambda: (f(4, 8), 1, 0, None, f(1, 8))),
    Case("cumsum", aten.cumsum.default, lambda: (f(4, 8), -1)),
    Case("cumsum_dtype", aten.cumsum.default, lambda: (b(4, 8), 0), lambda: {"dtype": torch.int32}),
    Case("tril", aten.tril.default, lambda: (f(2, 8, 8),)),
    Case("triu", aten.triu.default, lambda: (f(4, 8, 8), 1)),
    Case("repeat", aten.repeat.default, lambda: (f(4, 8), [2, 1, 1])),
    # --- convolutions
    Case("conv2d", aten.conv2d.default, lambda: (f(4, 3, 8, 8), f(4, 3, 2, 2), f(4), [2, 2])),
    Case("conv1d_nobias", aten.conv1d.default, lambda: (f(4, 2, 8), f(6, 2, 3))),
    Case("conv2d_groups", aten.conv2d.default,
         lambda: (f(4, 4, 8, 8), f(4, 2, 3, 3), None, [1, 1], [1, 1], [1, 1], 2)),
    # --- MoE routing (autopar/strategies/routing.py)
    Case("one_hot", aten.one_hot.default, lambda: (i(4, 4, 8), 4)),
    Case("view_as", aten.view_as.default, lambda: (f(4, 8), f(2, 2, 8))),
    Case("repeat_interleave", aten.repeat_interleave.self_int, lambda: (f(4, 8), 2, 1)),
    Case("repeat_interleave_sized", aten.repeat_interleave.self_int, lambda: (f(4, 8), 2, 1),
         lambda: {"output_size": 16}),
    Case("repeat_interleave_flat", aten.repeat_interleave.self_int, lambda: (f(4, 8), 2)),
    Case("gather", aten.gather.default, lambda: (f(4, 8), 1, i(8, 4, 3))),
    Case("einsum_dispatch", aten.einsum.default,
         lambda: ("bsec,bsm->becm", [f(2, 4, 4, 2), f(2, 4, 6)])),
    Case("einsum_experts", aten.einsum.default,
         lambda: ("becm,emf->becf", [f(2, 4, 2, 6), f(4, 6, 4)])),
    Case("grouped_mm", torch.ops.autopar.grouped_mm.default,
         lambda: (f(6, 4), f(2, 4, 8), torch.tensor([2, 6], dtype=torch.int32))),
    Case("square", aten.square.default, lambda: (f(4, 8),)),
    Case("broadcast_tensors", aten.broadcast_tensors.default, lambda: ([f(4, 8), f(4, 8)],)),
    Case("mse_loss", aten.mse_loss.default, lambda: (f(4, 8), f(4, 8))),
    Case("l1_loss_sum", aten.l1_loss.default, lambda: (f(4, 8), f(4, 8), 2)),
    Case("smooth_l1_loss_none", aten.smooth_l1_loss.default, lambda: (f(4, 8), f(4, 8), 0)),
    Case("huber_loss", aten.huber_loss.default, lambda: (f(4, 8), f(4, 8))),
    Case("roll", aten.roll.default, lambda: (f(4, 8), [1], [1])),
    Case("roll_flat", aten.roll.default, lambda: (f(4, 8), [2])),
    Case("view_as_complex", aten.view_as_complex.default, lambda: (f(4, 8, 2),)),
    Case("view_as_real", aten.view_as_real.default,
         lambda: (torch.view_as_complex(f(4, 8, 2)),)),
    # --- reductions
    Case("sum_keepdim", aten.sum.dim_IntList, lambda: (f(4, 8, 6), [-1], True)),
    Case("sum_dims", aten.sum.dim_IntList, lambda: (f(4, 8, 6), [0, 2])),
    Case("sum_bool", aten.sum.dim_IntList, lambda: (b(4, 8), [1])),
    Case("sum_all", aten.sum.default, lambda: (f(4, 8),)),
    Case("mean_keepdim", aten.mean.dim, lambda: (f(4, 8, 6), [-1], True)),
    Case("mean_dim0", aten.mean.dim, lambda: (f(4, 8), [0])),
    Case("mean_all", aten.mean.default, lambda: (f(4, 8),)),
    Case("amax", aten.amax.default, lambda: (f(4, 8, 6), [-1])),
    Case("amax_all", aten.amax.default, lambda: (f(4, 8),)),
    Case("amin", aten.amin.default, lambda: (f(4, 8, 6), [1], True)),
    Case("max_dim", aten.max.dim, lambda: (f(4, 8, 6), 1)),
    Case("min_dim", aten.min.dim, lambda: (f(4, 8), -1, True)),
    Case("var", aten.var.dim, lambda: (f(4, 8), [-1])),
    Case(
        "var_correction",
        aten.var.correction,
        lambda: (f(4, 8, 6), [1]),
        lambda: {"correction": 0, "keepdim": True},
    ),
    Case("std", aten.std.dim, lambda: (f(4, 8), [0])),
    Case("std_correction", aten.std.correction, lambda: (f(4, 8), [1])),
    Case("var_mean", aten.var_mean.correction, lambda: (f(4, 8), [1])),
    Case(
        "std_mean", aten.std_mean.correction, lambda: (f(4, 8, 2), [2]), lambda: {"keepdim": True}
    ),
    Case("argmax", aten.argmax.default, lambda: (f(4, 8), 1)),
    Case("argmax_all", aten.argmax.default, lambda: (f(4, 8),)),
    Case("argmin", aten.argmin.default, lambda: (f(4, 8), 0, True)),
    Case("logsumexp", aten.logsumexp.default, lambda: (f(4, 8), [1])),
    Case("vector_norm", aten.linalg_vector_norm.default, lambda: (f(4, 8, 6), 2.0, [-1], True)),
    Case("vector_norm_dims", aten.linalg_vector_norm.default, lambda: (f(4, 8, 6), 2.0, [1, 2])),
    Case("norm", aten.norm.ScalarOpt_dim, lambda: (f(4, 8), 2.0, [0])),
    Case("topk", aten.topk.default, lambda: (f(32, 4), 2)),
    Case("topk_dim", aten.topk.default, lambda: (f(4, 8, 6), 3, 1)),
    Case("sort_1d", aten.sort.default, lambda: (f(64),)),
    Case("sort", aten.sort.default, lambda: (f(4, 8), 0, True)),
    Case("sort_stable", aten.sort.stable, lambda: (f(4, 8),), lambda: {"stable": True, "dim": 1}),
    # --- normalizations
    Case(
        "layer_norm",
        aten.layer_norm.default,
        lambda: (f(4, 8, 16), [16], f(16), f(16), 1e-5, False),
    ),
    Case("layer_norm_2d", aten.layer_norm.default, lambda: (f(4, 8, 6), [8, 6])),
    Case("layer_norm_bias_only", aten.layer_norm.default, lambda: (f(4, 8, 6), [6], None, f(6))),
    Case(
        "native_layer_norm",
        aten.native_layer_norm.default,
        lambda: (f(4, 8, 16), [16], f(16), f(16), 1e-5),
    ),
    Case("rms_norm", aten.rms_norm.default, lambda: (f(4, 8, 16), [16], f(16), 1e-6)),
    Case("fused_rms_norm", aten._fused_rms_norm.default, lambda: (f(4, 8, 16), [16], f(16), 1e-6)),
    Case("softmax", aten.softmax.int, lambda: (f(4, 8, 6), -1)),
    Case("softmax_dim1", aten.softmax.int, lambda: (f(4, 8, 6), 1)),
    Case("_softmax", aten._softmax.default, lambda: (f(4, 8), -1, False)),
    Case("log_softmax", aten.log_softmax.int, lambda: (f(4, 8), 1)),
    Case("_log_softmax", aten._log_softmax.default, lambda: (f(4, 8), 0, False)),
    # --- attention
    Case(
        "sdpa",
        aten.scaled_dot_product_attention.default,
        lambda: (f(2, 4, 8, 6), f(2, 4, 8, 6), f(2, 4, 8, 6)),
    ),
    Case(
        "sdpa_causal",
        aten.scaled_dot_product_attention.default,
        lambda: (f(2, 4, 8, 6), f(2, 4, 8, 6), f(2, 4, 8, 6), None, 0.0, True),
    ),
    Case(
        "sdpa_mask",
        aten.scaled_dot_product_attention.default,
        lambda: (
            f(2, 4, 8, 6),
            f(2, 4, 8, 6),
            f(2, 4, 8, 6),
            torch.tril(torch.ones(8, 8, dtype=torch.bool)).expand(2, 1, 8, 8),
        ),
        lambda: {"scale": 0.25},
    ),
    Case(
        "sdpa_float_mask",
        aten.scaled_dot_product_attention.default,
        lambda: (f(4, 8, 6), f(4, 8, 6), f(4, 8, 6), f(8, 8)),
    ),
    Case(
        "sdpa_gqa",
        aten.scaled_dot_product_attention.default,
        lambda: (f(2, 8, 8, 6), f(2, 4, 8, 6), f(2, 4, 8, 6)),
        lambda: {"enable_gqa": True},
    ),
    Case(
        "sdpa_dropout",
        aten.scaled_dot_product_attention.default,
        lambda: (f(2, 4, 8, 6), f(2, 4, 8, 6), f(2, 4, 8, 6), None, 1e-9),
    ),
    Case(
        "sdpa_gqa_2kv",
        aten.scaled_dot_product_attention.default,
        lambda: (f(2, 8, 8, 6), f(2, 2, 8, 6), f(2, 2, 8, 6)),
        lambda: {"enable_gqa": True},
    ),
    # --- embedding
    Case("embedding", aten.embedding.default, lambda: (f(16, 8), i(16, 4, 6))),
    Case("embedding_pad", aten.embedding.default, lambda: (f(16, 8), i(16, 4, 6), 0)),
    Case("embedding_odd_vocab", aten.embedding.default, lambda: (f(15, 8), i(15, 8))),
    # --- losses (no ignored targets: see the mean caveat in losses.py)
    Case("cross_entropy", aten.cross_entropy_loss.default, lambda: (f(8, 5), i(5, 8))),
    Case(
        "cross_entropy_sum", aten.cross_entropy_loss.default, lambda: (f(8, 5), i(5, 8), pos(5), 2)
    ),
    Case(
        "cross_entropy_none", aten.cross_entropy_loss.default, lambda: (f(8, 5), i(5, 8), pos(5), 0)
    ),
    Case(
        "cross_entropy_nanogpt",
        aten.cross_entropy_loss.default,
        lambda: (f(8, 5), i(5, 8), None, 1, -1),
    ),
    Case(
        "cross_entropy_smooth",
        aten.cross_entropy_loss.default,
        lambda: (f(8, 5), i(5, 8), None, 1, -100, 0.1),
    ),
    Case(
        "cross_entropy_spatial",
        aten.cross_entropy_loss.default,
        lambda: (f(4, 5, 6), i(5, 4, 6), None, 0),
    ),
    Case(
        "cross_entropy_probs",
        aten.cross_entropy_loss.default,
        lambda: (f(8, 5), f(8, 5).softmax(-1)),
    ),
    Case(
        "cross_entropy_probs_smooth",
        aten.cross_entropy_loss.default,
        lambda: (f(4, 5, 8), f(4, 5, 8).softmax(1), None, 0, -100, 0.2),
    ),
    Case("nll_loss", aten.nll_loss.default, lambda: (f(8, 5), i(5, 8))),
    Case("nll_loss_nd", aten.nll_loss_nd.default, lambda: (f(4, 5, 8), i(5, 4, 8), None, 2)),
    Case(
        "nll_loss_forward", aten.nll_loss_forward.default, lambda: (f(8, 5), i(5, 8), None, 1, -100)
    ),
    Case(
        "nll_loss_forward_sum",
        aten.nll_loss_forward.default,
        lambda: (f(8, 5), i(5, 8), pos(5), 2, -100),
    ),
    Case(
        "nll_loss_forward_none",
        aten.nll_loss_forward.default,
        lambda: (f(8, 5), i(5, 8), None, 0, -100),
    ),
    Case(
        "nll_loss2d_forward",
        aten.nll_loss2d_forward.default,
        lambda: (f(2, 5, 4, 4), i(5, 2, 4, 4), None, 2, -100),
    ),
    # --- factories
    Case("arange", aten.arange.default, lambda: (16,), lambda: {"dtype": torch.int64}),
    Case("arange_start", aten.arange.start, lambda: (0, 16)),
    Case("arange_step", aten.arange.start_step, lambda: (0, 16, 2)),
    Case("zeros", aten.zeros.default, lambda: ([4, 8],), lambda: {"dtype": torch.float64}),
    Case("ones", aten.ones.default, lambda: ([4, 8],)),
    Case("full", aten.full.default, lambda: ([4, 8], 2.0)),
    Case("empty", aten.empty.memory_format, lambda: ([4, 8],), values=False),
    Case("empty_strided", aten.empty_strided.default, lambda: ([4, 8], [8, 1]), values=False),
    Case("scalar_tensor", aten.scalar_tensor.default, lambda: (2.0,)),
    Case(
        "new_ones", aten.new_ones.default, lambda: (f(4, 8), [2, 16]), lambda: {"dtype": torch.bool}
    ),
    Case("new_zeros", aten.new_zeros.default, lambda: (f(4, 8), [3])),
    Case("new_empty", aten.new_empty.default, lambda: (f(4, 8), [4]), values=False),
    Case("new_full", aten.new_full.default, lambda: (f(4, 8), [4], 1.5)),
    Case(
        "new_empty_strided",
        aten.new_empty_strided.default,
        lambda: (f(4, 8), [4], [1]),
        values=False,
    ),
    Case("zeros_like", aten.zeros_like.default, lambda: (f(4, 8),)),
    Case("ones_like", aten.ones_like.default, lambda: (f(4, 8, 3),)),
    Case("empty_like", aten.empty_like.default, lambda: (i(64, 64),), values=False),
    Case(
        "full_like", aten.full_like.default, lambda: (f(4, 12), 3.0), hints={"split_groups": (3,)}
    ),
    Case("new_zeros_2d", aten.new_zeros.default, lambda: (i(9, 4, 8), [4, 8])),
    Case("new_full_zero", aten.new_full.default, lambda: (f(4, 8), [8, 4], 0.0)),
    Case("full_zero", aten.full.default, lambda: ([4, 6], 0.0)),
    # --- in-place ops: the written tensor (the first input) keeps its placement
    Case("copy_", aten.copy_.default, lambda: (f(4, 8, 6), f(8, 1))),
    Case("copy_int_into_float", aten.copy_.default, lambda: (f(4, 8), i(9, 4, 8))),
    Case("fill_", aten.fill_.Scalar, lambda: (f(4, 8), 2.0)),
    Case("fill_zero", aten.fill_.Scalar, lambda: (f(4, 8), 0)),
    Case("fill_tensor", aten.fill_.Tensor, lambda: (f(4, 8), f())),
    Case("zero_", aten.zero_.default, lambda: (f(4, 8),)),
    Case("add_", aten.add_.Tensor, lambda: (f(4, 8), f(8))),
    Case("add_scalar_", aten.add_.Tensor, lambda: (f(4, 8), 1.0)),
    Case("sub_", aten.sub_.Tensor, lambda: (f(4, 8), f(4, 8))),
    Case("mul_", aten.mul_.Tensor, lambda: (f(4, 8), f(4, 1))),
    Case("masked_fill_", aten.masked_fill_.Scalar, lambda: (f(4, 8), b(4, 1), -1e4)),
    Case("masked_fill_tensor_", aten.masked_fill_.Tensor, lambda: (f(4, 8), b(8), f())),
    Case("clamp_", aten.clamp_.default, lambda: (f(4, 8), -0.5, 0.5)),
    Case("tril_", aten.tril_.default, lambda: (f(4, 8, 8),)),
    Case("bernoulli_", aten.bernoulli_.float, lambda: (f(4, 8), 0.5), values=False),
    Case("uniform_", aten.uniform_.default, lambda: (f(4, 8),), values=False),
    # --- writes into positions (functional forms, and their in-place forms)
    Case("index_put", aten.index_put.default, lambda: (f(8, 4, 6), [perm(8, 5)], f(5, 1, 6))),
    Case(
        "index_put_accumulate",
        aten.index_put.default,
        lambda: (f(8, 4, 6), [i(8, 5)], f(5, 4, 1), True),
    ),
    Case(
        "index_put_apart",
        aten.index_put.default,
        lambda: (f(4, 6, 8), [perm(4, 3), None, perm(8, 3)], f(3, 6)),
    ),
    Case("index_put_middle", aten.index_put.default, lambda: (f(4, 6, 8), [None, perm(6, 3)], f(8))),
    Case("index_put_mask", aten.index_put.default, lambda: (f(4, 8), [b(4, 8)], f())),
    Case("index_put_row_mask", aten.index_put.default, lambda: (f(4, 8), [b(4)], f(1))),
    Case("index_put_", aten.index_put_.default, lambda: (f(8, 6), [perm(8, 4)], f(4, 6))),
    Case("index_put_int_", aten.index_put_.default, lambda: (i(9, 16), [perm(16, 16)], i(9, 16))),
    Case("index_copy", aten.index_copy.default, lambda: (f(8, 6), 0, perm(8, 4), f(4, 6))),
    Case("index_copy_", aten.index_copy_.default, lambda: (f(6, 8), 1, perm(8, 4), f(6, 4))),
    Case("index_add", aten.index_add.default, lambda: (f(8, 6), 0, i(8, 5), f(5, 6))),
    Case("index_add_", aten.index_add_.default, lambda: (f(8, 6), 0, i(8, 5), f(5, 6))),
    Case("scatter", aten.scatter.src, lambda: (f(4, 8), 1, rows_perm(4, 8, 8), f(4, 8))),
    Case("scatter_short", aten.scatter.src, lambda: (f(4, 8), 1, rows_perm(2, 8, 3), f(4, 8))),
    Case("scatter_value", aten.scatter.value, lambda: (f(4, 8), 1, rows_perm(4, 8, 3), 0.0)),
    Case("scatter_value_", aten.scatter_.value, lambda: (f(8, 4), 1, i(4, 8, 1), 1.0)),
    Case("scatter_add", aten.scatter_add.default, lambda: (f(4, 8), 1, i(8, 4, 8), f(4, 8))),
    Case("scatter_add_", aten.scatter_add_.default, lambda: (f(4, 8), 0, i(4, 4, 8), f(4, 8))),
    Case(
        "scatter_reduce",
        aten.scatter.reduce,
        lambda: (f(4, 8), 1, i(8, 4, 8), f(4, 8)),
        lambda: {"reduce": "multiply"},
    ),
    Case("slice_scatter", aten.slice_scatter.default, lambda: (f(4, 8, 6), f(4, 8, 2), 2, 1, 3)),
    Case("select_scatter", aten.select_scatter.default, lambda: (f(4, 8, 6), f(4, 6), 1, 3)),
]


# ----------------------------------------------------------------------------- machinery


def _tensors(tree: object) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(tree)
    return [x for x in leaves if isinstance(x, torch.Tensor)]


def _clone(tree: Any) -> Any:
    return tree_map_only(torch.Tensor, lambda t: t.clone(), tree)


def _meta(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(tuple(t.shape), t.dtype)


def _build(case: Case) -> tuple[tuple, dict, OpCall, list[torch.Tensor]]:
    torch.manual_seed(zlib.crc32(case.name.encode()))
    args, kwargs = case.make(), case.kwargs()
    ref = case.op(*_clone(args), **_clone(kwargs))
    cargs, ckwargs = tree_map_only(torch.Tensor, _meta, (args, kwargs))
    call = OpCall(case.op, cargs, ckwargs, tuple(_meta(t) for t in _tensors(ref)), case.hints)
    return args, kwargs, call, _tensors(ref)


def shard_local(t: torch.Tensor, p: Shard, rank: int, n: int) -> torch.Tensor:
    """Device ``rank``'s part of ``t``: each of ``groups`` blocks sliced, then joined."""
    blocks = t.chunk(p.groups, p.dim)
    return torch.cat([blk.chunk(n, p.dim)[rank] for blk in blocks], p.dim)


def shard_global(parts: list[torch.Tensor], p: Shard) -> torch.Tensor:
    """Inverse of :func:`shard_local` over all ranks."""
    per_rank = [part.chunk(p.groups, p.dim) for part in parts]
    return torch.cat([torch.cat([r[g] for r in per_rank], p.dim) for g in range(p.groups)], p.dim)


def partial_terms(t: torch.Tensor, p: Partial, n: int) -> list[torch.Tensor]:
    """Random local terms whose sum (or mean) is ``t``."""
    terms = [torch.randn_like(t) for _ in range(n - 1)]
    total = t if p.reduce == "sum" else t * n
    return [*terms, total - sum(terms)]


def local_inputs(
    tensors: list[torch.Tensor], placements: tuple[Placement, ...], n: int
) -> list[list[torch.Tensor]]:
    """Per rank, the local value of each tensor input."""
    per_tensor = []
    for t, p in zip(tensors, placements):
        if isinstance(p, Shard):
            per_tensor.append([shard_local(t, p, r, n).clone() for r in range(n)])
        elif isinstance(p, Partial):
            per_tensor.append(partial_terms(t, p, n))
        else:
            per_tensor.append([t.clone() for _ in range(n)])
    return [[locs[r] for locs in per_tensor] for r in range(n)]


def localize(op: Any, args: tuple, call: OpCall, strategy: Strategy, n: int) -> tuple:
    """Shape arguments made local, as the tensor-parallel pass does: from the outputs'
    global shapes and placements."""
    outs = [local_shape(m.shape, (p,), (n,)) for m, p in zip(call.out, strategy.outputs)]
    args = list(args)
    if op in SHAPE_ARG:
        args[SHAPE_ARG[op]] = list(outs[0])
    elif op is aten.unflatten.int:
        dim = norm_dim(args[1], call.tensor_args[0].ndim)
        args[2] = list(outs[0][dim : dim + len(args[2])])
    elif op in (aten.split.Tensor, aten.split_with_sizes.default):
        dim = norm_dim(args[2] if len(args) > 2 else 0, call.tensor_args[0].ndim)
        sizes = [o[dim] for o in outs]
        args[1] = sizes[0] if op is aten.split.Tensor else sizes
    return tuple(args)


def run_local(
    case: Case, args: tuple, kwargs: dict, call: OpCall, strategy: Strategy, n: int
) -> list[list[torch.Tensor]]:
    """Run the strategy on every rank; returns each rank's tensor outputs."""
    leaves, spec = tree_flatten((args, kwargs))
    slots = [k for k, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    per_rank = local_inputs([leaves[k] for k in slots], strategy.inputs, n)
    results = []
    for r in range(n):
        local = list(leaves)
        for k, t in zip(slots, per_rank[r]):
            local[k] = t
        largs, lkwargs = tree_unflatten(local, spec)
        largs = localize(case.op, largs, call, strategy, n)
        if strategy.local_impl == VOCAB_PARALLEL:
            weight, ids = largs[:2]
            out = vocab_parallel_embedding(
                weight, ids, rank=r, axis_size=n, vocab_size=call.tensor_args[0].shape[0]
            )
        else:
            assert strategy.local_impl is None, strategy
            out = case.op(*largs, **lkwargs)
        results.append(_tensors(out))
    return results


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    tol = 1e-5 if expected.dtype in (torch.float32, torch.float16, torch.bfloat16) else 1e-9
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


def check_valid(call: OpCall, strategy: Strategy, n: int) -> None:
    assert len(strategy.inputs) == len(call.tensor_args), strategy
    assert len(strategy.outputs) == len(call.out), strategy
    for meta, p in zip((*call.tensor_args, *call.out), (*strategy.inputs, *strategy.outputs)):
        if isinstance(p, Shard):
            assert p.dim < meta.ndim, f"{strategy}: {p} on a {meta.ndim}-d tensor"
            assert can_shard(meta.shape[p.dim], n, p.groups), (
                f"{strategy}: {p} of {meta.shape} on {n}"
            )
    for meta, p in zip(call.tensor_args, strategy.inputs):
        if isinstance(p, Partial):
            assert meta.dtype.is_floating_point, f"{strategy}: partial {meta.dtype} input"


def check_numerics(
    case: Case,
    args: tuple,
    kwargs: dict,
    call: OpCall,
    refs: list[torch.Tensor],
    strategy: Strategy,
    n: int,
) -> None:
    results = run_local(case, args, kwargs, call, strategy, n)
    for k, (ref, p) in enumerate(zip(refs, strategy.outputs)):
        locals_ = [res[k] for res in results]
        what = f"{case.name} n={n} {strategy} output {k}"
        for r, loc in enumerate(locals_):
            expected = local_shape(tuple(ref.shape), (p,), (n,))
            assert tuple(loc.shape) == expected, (
                f"{what}: rank {r} shape {tuple(loc.shape)} != {expected}"
            )
        if not case.values:
            continue
        if isinstance(p, Shard):
            _assert_close(shard_global(locals_, p), ref, what)
        elif isinstance(p, Partial):
            total = sum(locals_[1:], locals_[0].clone())
            _assert_close(total if p.reduce == "sum" else total / n, ref, what)
        else:
            for r, loc in enumerate(locals_):
                _assert_close(loc, ref, f"{what} rank {r}")


@pytest.mark.parametrize("n", AXIS_SIZES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_rule_numerics(case: Case, n: int) -> None:
    args, kwargs, call, refs = _build(case)
    rule = rule_for(case.op)
    assert rule is not None, f"no rule for {case.op}"
    strategies = rule(call, n)
    assert strategies, f"{case.op}: empty strategy list"
    assert len(set(strategies)) == len(strategies), f"duplicate strategies: {strategies}"
    assert any(s.is_replicated for s in strategies), "the all-Replicate strategy is missing"
    for strategy in strategies:
        check_valid(call, strategy, n)
        check_numerics(case, args, kwargs, call, refs, strategy, n)


# ----------------------------------------------------------------------------- DTensor

# Cases DTensor cannot answer even for replicated inputs (its propagator raises), with why.
# The test checks that each still fails, so the list stays true.
DTENSOR_GAPS = {
    "one_hot": "composite: DTensor propagates what it decomposes into",
    "einsum_dispatch": "composite: DTensor propagates what it decomposes into",
    "einsum_experts": "composite: DTensor propagates what it decomposes into",
    "grouped_mm": "autopar's own op",
    "broadcast_tensors": "composite: DTensor propagates what it decomposes into",
    "where_scalar_other": "no rule for where.ScalarOther",
    "where_scalar_other_zero": "no rule for where.ScalarOther",
    "where_scalar_self": "no rule for where.ScalarSelf",
    "lift_fresh_copy": "no rule for lift_fresh_copy",
    "to_dtype_layout": "no rule for to.dtype_layout",
    "assert_tensor_metadata": "no rule for _assert_tensor_metadata",
    "assert_tensor_metadata_size": "no rule for _assert_tensor_metadata",
    "pad_reflect": "pad decomposes to reflection_pad1d, which has no rule",
    "index_bool": "boolean indexing has a data-dependent shape",
    "sdpa_causal": "sdpa with is_causal decomposes to ops without a rule",
    "sdpa_mask": "sdpa with a boolean attn_mask decomposes to ops without a rule",
    "nll_loss": "no rule for nll_loss (nll_loss_nd and nll_loss_forward have one)",
    "fill_tensor": "no rule for fill_.Tensor",
    "tril_": "no rule for tril_",
    "scatter_reduce": "no rule for scatter.reduce",
}

# (case, our input placements) -> (DTensor's output, why it differs from ours). DTensor runs a
# composite op's decomposition with the *global* shapes baked in; we run the op on local
# tensors, so a mean over a sharded batch divides by the local size.
KNOWN_DISAGREEMENTS = {
    ("cross_entropy_probs", "(S(0),S(0))"): (
        "(P)",
        "DTensor divides the local sum by the global batch; the local op divides by the local one",
    ),
}


def _to_dtensor(p: Placement) -> Any:
    if isinstance(p, Shard):
        return DShard(p.dim) if p.groups == 1 else _StridedShard(p.dim, split_factor=p.groups)
    if isinstance(p, Partial):
        return DPartial(p.reduce)
    return DReplicate()


def _from_dtensor(p: Any) -> Placement:
    """DTensor's ``_StridedShard`` is our ``groups``; its ``_MaskPartial`` (the vocabulary-
    parallel embedding) and ``_NormPartial`` are subclasses of ``Partial``."""
    if isinstance(p, _StridedShard):
        return Shard(p.dim, p.split_factor)
    if isinstance(p, DShard):
        return Shard(p.dim)
    if isinstance(p, DPartial):
        return Partial(p.reduce_op)
    return Replicate()


_PROPAGATOR = DTensor._op_dispatcher.sharding_propagator
_MESHES: dict[int, DeviceMesh] = {}


def _mesh(n: int) -> DeviceMesh:
    # No process group: the propagator only reads the mesh's shape.
    if n not in _MESHES:
        _MESHES[n] = DeviceMesh("cpu", list(range(n)), _init_backend=False, _rank=0)
    return _MESHES[n]


def _specs(schema: OpSchema) -> list[DTensorSpec]:
    leaves, _ = tree_flatten((schema.args_schema, dict(schema.kwargs_schema)))
    return [x for x in leaves if isinstance(x, DTensorSpec)]


def dtensor_propagate(
    case: Case, args: tuple, kwargs: dict, inputs: tuple[Placement, ...], n: int
) -> tuple[Placement, ...] | None:
    """DTensor's output placements for these input placements, or None if it would
    redistribute the inputs first."""
    mesh = _mesh(n)
    leaves, spec = tree_flatten((args, kwargs))
    it = iter(inputs)
    specs = [
        DTensorSpec(mesh, (_to_dtensor(next(it)),), DTensorMeta(x.shape, x.stride(), x.dtype))
        if isinstance(x, torch.Tensor)
        else x
        for x in leaves
    ]
    sargs, skwargs = tree_unflatten(specs, spec)
    prop = _PROPAGATOR
    info = prop.op_to_schema_info.get(case.op)
    info = info or prop.op_to_schema_info_for_single_dim_strategy.get(case.op)
    schema = OpSchema(case.op, tuple(sargs), skwargs, schema_info=info)
    try:
        result = prop.propagate_op_sharding_non_cached(schema)
    except RuntimeError as e:
        if "in-place operations that require placement changes" in str(e):
            return None  # DTensor would redistribute the written tensor: it refuses
        raise
    if result.redistribute_schema is not None:
        # A suggestion that only rewrites shape arguments (view sizes) is not a redistribution.
        wanted = [s.placements for s in _specs(schema)]
        if wanted != [s.placements for s in _specs(result.redistribute_schema)]:
            return None
    outs = result.output_spec
    outs = [outs] if isinstance(outs, DTensorSpec) else [o for o in outs or () if o is not None]
    return tuple(_from_dtensor(o.placements[0]) for o in outs)


def _fmt(placements: tuple[Placement, ...]) -> str:
    return "(" + ",".join(str(p) for p in placements) + ")"


@pytest.mark.parametrize("n", AXIS_SIZES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_rule_agrees_with_dtensor(case: Case, n: int) -> None:
    """Where DTensor runs our input placements as they are, its output is one of ours."""
    args, kwargs, call, _ = _build(case)
    if not call.tensor_args:
        pytest.skip("no tensor input: DTensor has no mesh to propagate on")
    strategies = rule_for(case.op)(call, n)
    if case.name in DTENSOR_GAPS:
        with pytest.raises(Exception):  # noqa: B017  (any propagation failure)
            dtensor_propagate(case, args, kwargs, replicate_all(call).inputs, n)
        pytest.skip(f"DTensor gap: {DTENSOR_GAPS[case.name]}")
    ours: dict[tuple[Placement, ...], set[tuple[Placement, ...]]] = {}
    for s in strategies:
        ours.setdefault(s.inputs, set()).add(s.outputs)
    compared = 0
    for inputs, outputs in ours.items():
        try:
            theirs = dtensor_propagate(case, args, kwargs, inputs, n)
        except NotImplementedError:
            continue  # DTensor cannot run these placements (its decomposition fails)
        if theirs is None:
            continue
        compared += 1
        known = KNOWN_DISAGREEMENTS.get((case.name, _fmt(inputs)))
        if known is not None:
            assert _fmt(theirs) == known[0], f"DTensor changed: {_fmt(theirs)}"
            continue
        assert theirs in outputs, (
            f"{case.name} n={n} inputs {_fmt(inputs)}: DTensor gives {_fmt(theirs)}, "
            f"we give {sorted(_fmt(o) for o in outputs)}"
        )
    assert compared, "DTensor accepted none of the input placements, not even replicated"


# ----------------------------------------------------------------------------- other checks


def test_dropout_never_partial() -> None:
    """Dropout draws its mask per device: a partial input (or, in attention, a value split
    over devices that see the same attention weights) would get several masks.

    The numeric cases run dropout with p=0 (deterministic), so this is checked by listing.
    """
    for op, args in (
        (aten.dropout.default, (f(4, 8), 0.1, True)),
        (aten.native_dropout.default, (f(4, 8), 0.1, True)),
        (
            aten.scaled_dot_product_attention.default,
            (f(2, 4, 8, 8), f(2, 4, 8, 8), f(2, 4, 8, 8), None, 0.1),
        ),
    ):
        case = Case("dropout_check", op, lambda args=args: args)
        _, _, call, _ = _build(case)
        for n in AXIS_SIZES:
            for s in rule_for(op)(call, n):
                assert not any(isinstance(p, Partial) for p in s.inputs), s
                if op is aten.scaled_dot_product_attention.default:
                    assert s.inputs[2] != Shard(3), s


def _writes_first_input(op: Any) -> bool:
    args = op._schema.arguments
    return bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write


IN_PLACE_CASES = [c for c in CASES if _writes_first_input(c.op)]


@pytest.mark.parametrize("case", IN_PLACE_CASES, ids=lambda c: c.name)
def test_in_place_rules_keep_the_written_placement(case: Case) -> None:
    """An in-place op's result lives in the written tensor's storage, which other nodes
    read as placed: every strategy gives the output the written input's placement. (The
    numeric test cannot see this: ``R.add_(P(avg))`` computes a correct ``P(avg)`` value,
    but leaves partial terms in a tensor its other readers take as whole.)"""
    _, _, call, _ = _build(case)
    for n in AXIS_SIZES:
        for s in rule_for(case.op)(call, n):
            assert s.outputs[0] == s.inputs[0], f"{case.name} n={n}: {s}"


def test_every_in_place_form_of_a_ruled_op_has_a_rule() -> None:
    """``op_`` gets ``op``'s rule filtered, unless it re-shapes its input or takes other
    arguments than ``op`` (``pow_.Scalar`` is ``pow.Tensor_Scalar``'s in-place form)."""
    from autopar.strategies.builtin import IN_PLACE_FORMS

    assert {"aten.add_.Tensor", "aten.masked_fill_.Scalar", "aten.index_put_.default",
            "aten.scatter_.value", "aten.div_.Tensor"} <= set(IN_PLACE_FORMS)
    assert rule_for(aten.pow_.Scalar) is None


def test_vocab_parallel_embedding_forward_and_backward() -> None:
    """Summing the local lookups gives the full lookup, and each device's weight gradient is
    its rows of the full gradient (out-of-range ids contribute nothing)."""
    torch.manual_seed(0)
    vocab, dim = 16, 6
    weight = f(vocab, dim)
    ids = torch.tensor([[0, 3, 4, 7], [8, 11, 12, 15]])
    upstream = f(2, 4, dim)
    ref_w = weight.clone().requires_grad_()
    (torch.nn.functional.embedding(ids, ref_w) * upstream).sum().backward()
    for n in AXIS_SIZES:
        shards = [w.clone().requires_grad_() for w in weight.chunk(n, 0)]
        outs = [
            vocab_parallel_embedding(w, ids, rank=r, axis_size=n, vocab_size=vocab)
            for r, w in enumerate(shards)
        ]
        _assert_close(sum(outs), torch.nn.functional.embedding(ids, weight), "forward")
        (sum(outs) * upstream).sum().backward()
        _assert_close(torch.cat([w.grad for w in shards]), ref_w.grad, "weight gradient")


BRIEF_OPS = [
    aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, aten.mul.Tensor,
    aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar, aten.div_.Tensor, aten.neg.default,
    aten.pow.Tensor_Scalar, aten.rsqrt.default, aten.sqrt.default, aten.exp.default,
    aten.log.default, aten.tanh.default, aten.sigmoid.default, aten.silu.default,
    aten.gelu.default, aten.relu.default, aten.where.self, aten.where.ScalarOther,
    aten.where.ScalarSelf, aten.eq.Tensor, aten.eq.Scalar, aten.ne.Tensor, aten.ne.Scalar,
    aten.le.Tensor, aten.le.Scalar, aten.lt.Tensor, aten.lt.Scalar, aten.ge.Tensor,
    aten.ge.Scalar, aten.gt.Tensor, aten.gt.Scalar, aten.__and__.Tensor, aten.__or__.Tensor,
    aten.logical_not.default, aten.bitwise_not.default, aten.masked_fill.Scalar,
    aten.clone.default, aten.contiguous.default, aten.alias.default, aten.detach.default,
    aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.type_as.default,
    aten.dropout.default, aten.native_dropout.default, aten.floor_divide.default,
    aten._assert_tensor_metadata.default,
    aten.linear.default, aten.addmm.default, aten.mm.default, aten.bmm.default,
    aten.matmul.default, aten.baddbmm.default,
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default,
    aten.squeeze.dim, aten.squeeze.dims, aten.transpose.int, aten.permute.default, aten.t.default,
    aten.expand.default, aten.flatten.using_ints, aten.unflatten.int, aten.slice.Tensor,
    aten.select.int, aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default,
    aten.unbind.int, aten.cat.default, aten.stack.default, aten.pad.default, aten.index.Tensor,
    aten.diff.default, aten.cumsum.default, aten.tril.default, aten.triu.default,
    aten.repeat.default, aten.roll.default,
    aten.conv1d.default, aten.conv2d.default,
    aten.one_hot.default, aten.view_as.default, aten.repeat_interleave.self_int,
    aten.gather.default, aten.einsum.default, aten.square.default,
    torch.ops.autopar.grouped_mm.default,
    aten.broadcast_tensors.default, aten.mse_loss.default, aten.l1_loss.default,
    aten.smooth_l1_loss.default, aten.huber_loss.default,
    aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default, aten.amax.default,
    aten.max.dim, aten.var.correction, aten.var_mean.correction, aten.std.correction,
    aten.argmax.default, aten.topk.default, aten.sort.default,
    aten.layer_norm.default, aten.native_layer_norm.default, aten.rms_norm.default,
    aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default,
    aten.scaled_dot_product_attention.default, aten.embedding.default,
    aten.cross_entropy_loss.default, aten.nll_loss.default, aten.nll_loss_forward.default,
    aten.nll_loss_nd.default,
    aten.arange.default, aten.arange.start, aten.zeros.default, aten.ones.default,
    aten.full.default, aten.empty.memory_format, aten.new_ones.default, aten.new_zeros.default,
    aten.new_empty.default, aten.new_full.default, aten.zeros_like.default,
    aten.ones_like.default, aten.empty_like.default, aten.full_like.default,
    aten.scalar_tensor.default,
    # in-place ops and their functional forms
    aten.copy_.default, aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default,
    aten.add_.Tensor, aten.sub_.Tensor, aten.mul_.Tensor, aten.masked_fill_.Scalar,
    aten.masked_fill_.Tensor, aten.index_put.default, aten.index_put_.default,
    aten.index_copy.default, aten.index_copy_.default, aten.index_add.default,
    aten.index_add_.default, aten.scatter.src, aten.scatter.value, aten.scatter_.value,
    aten.scatter_add.default, aten.scatter_add_.default, aten.slice_scatter.default,
    aten.select_scatter.default,
]  # fmt: skip

# Deliberately no rule (they run replicated): data-dependent output shapes, and in-place
# ops that re-shape the tensor they write (other readers would see the new shape).
NO_RULE = [aten.nonzero.default, aten.histc.default, aten.unsqueeze_.default,
           aten.transpose_.default, aten.t_.default, aten.squeeze_.dim, aten.resize_.default]


def test_every_listed_op_has_a_rule_and_a_case() -> None:
    tested = {c.op for c in CASES}
    assert [op for op in BRIEF_OPS if rule_for(op) is None] == []
    assert [op for op in BRIEF_OPS if op not in tested] == []
    assert [op for op in NO_RULE if rule_for(op) is not None] == []


def test_strategies_for_puts_replicated_first() -> None:
    _, _, call, _ = _build(CASES[0])
    strategies = strategies_for(call, 2)
    assert strategies[0].is_replicated
    assert len(set(strategies)) == len(strategies)
    assert strategies_for(call, 1) == [replicate_all(call)]
    unruled = OpCall(aten.nonzero.default, (call.tensor_args[0],), {}, call.out[:1])
    assert strategies_for(unruled, 2) == [replicate_all(unruled)]


# ----------------------------------------------------------------------------- real graphs


class _NanoGPT(torch.nn.Module):
    """nanoGPT's model, two layers, tiny: the ops ``torch.export`` gives for it."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.wte = torch.nn.Embedding(vocab, dim)
        self.wpe = torch.nn.Embedding(16, dim)
        self.blocks = torch.nn.ModuleList(
            torch.nn.ModuleDict(
                {
                    "ln_1": torch.nn.LayerNorm(dim),
                    "c_attn": torch.nn.Linear(dim, 3 * dim),
                    "c_proj": torch.nn.Linear(dim, dim),
                    "ln_2": torch.nn.LayerNorm(dim),
                    "fc": torch.nn.Linear(dim, 4 * dim),
                    "proj": torch.nn.Linear(4 * dim, dim),
                }
            )
            for _ in range(layers)
        )
        self.ln_f = torch.nn.LayerNorm(dim)
        self.lm_head = torch.nn.Linear(dim, vocab, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        fn = torch.nn.functional
        bsz, seq = idx.shape
        pos = torch.arange(0, seq, dtype=torch.long, device=idx.device)
        x = fn.dropout(self.wte(idx) + self.wpe(pos), 0.1, self.training)
        for blk in self.blocks:
            q, k, v = blk["c_attn"](blk["ln_1"](x)).split(x.shape[-1], dim=2)
            q, k, v = (t.view(bsz, seq, self.heads, -1).transpose(1, 2) for t in (q, k, v))
            y = fn.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)
            x = x + blk["c_proj"](y.transpose(1, 2).contiguous().view(bsz, seq, -1))
            x = x + blk["proj"](fn.gelu(blk["fc"](blk["ln_2"](x))))
        logits = self.lm_head(self.ln_f(x))
        return fn.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


def _graph_calls(graph: torch.fx.Graph) -> list[tuple[torch.fx.Node, OpCall]]:
    """An OpCall per aten call in an exported graph, built from the nodes' fake values."""

    def meta_of(node: torch.fx.Node) -> Any:
        val = node.meta.get("val")
        return _meta(val) if isinstance(val, torch.Tensor) else val

    calls = []
    for node in graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        args, kwargs = tree_map_only(torch.fx.Node, meta_of, (node.args, dict(node.kwargs)))
        outs = tuple(_meta(t) for t in _tensors(node.meta.get("val")))
        calls.append((node, OpCall(node.target, tuple(args), kwargs, outs)))
    return calls


def _check_graph(graph: torch.fx.Graph) -> set[Any]:
    """Every rule runs on every call of the graph and lists valid strategies; returns the
    aten ops without a rule."""
    unruled = set()
    for _, call in _graph_calls(graph):
        if rule_for(call.target) is None:
            unruled.add(call.target)
        for n in AXIS_SIZES:
            for strategy in strategies_for(call, n):
                check_valid(call, strategy, n)
    return {op for op in unruled if op.namespace == "aten"}


def test_nanogpt_graph() -> None:
    """All ops of an exported nanoGPT have a rule, and with the fused-QKV hint the
    projection and the split agree on ``S(2)g3``."""
    model = _NanoGPT()
    ids = torch.randint(0, 64, (2, 16))
    graph = torch.export.export(model, (ids, ids), strict=False).graph
    assert _check_graph(graph) == set()
    for node, call in _graph_calls(graph):
        if node.target is aten.split.Tensor:
            producer = node.args[0]
            ((_, pcall),) = [(nd, c) for nd, c in _graph_calls(graph) if nd is producer]
            hinted = OpCall(
                pcall.target, pcall.args, pcall.kwargs, pcall.out, {"split_groups": (3,)}
            )
            column = Strategy((Replicate(), Shard(0, 3), Shard(0, 3)), (Shard(2, 3),))
            assert column in strategies_for(hinted, 4)
            assert Strategy((Shard(2, 3),), (Shard(2),) * 3) in strategies_for(call, 4)


def _hf_graph(name: str) -> torch.fx.Graph:
    transformers = pytest.importorskip("transformers")
    ids = torch.randint(0, 128, (2, 16))
    if name == "llama":
        config = transformers.LlamaConfig(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(config)
    elif name == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=128, n_embd=64, n_layer=1, n_head=4, n_positions=32,
            attn_implementation="eager",
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.MixtralConfig(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
            num_experts_per_tok=2,
        )  # fmt: skip
        model = transformers.MixtralForCausalLM(config)
    kwargs = {"input_ids": ids, "labels": ids, "use_cache": False}
    return torch.export.export(model, (), kwargs, strict=False).graph


@pytest.mark.parametrize(
    ("model", "unruled"),
    [
        ("llama", set()),
        ("gpt2", set()),
        ("mixtral", {aten.histc.default}),
    ],
)
def test_hf_graph(model: str, unruled: set[Any]) -> None:
    """Every aten op of a tiny HF model has a rule (except data-dependent ones), and every
    rule lists valid strategies on the real argument formats torch.export produces."""
    assert _check_graph(_hf_graph(model)) == unruled
