"""torch.compile applied block by block, with the batch and sequence dimensions dynamic from the
first call, so new sequence lengths (padding-free batches, packing) never recompile.

Shapes: B batch, S sequence, D model dim, r rotary dim.

Only the blocks are compiled: the decoder's top level builds masks with data-dependent Python
branches, which would break a whole-model graph. All blocks of one kind share one compiled graph
(parameters are graph inputs), so compile time does not grow with depth. Expected graphs: one for
unpacked batches (mask None), one for packed or padded ones (a boolean mask), one more the first
time a batch of size 1 is seen (torch specializes size-1 dimensions).
"""

from __future__ import annotations

import types

import torch
from torch import nn


def _mark_batch_and_sequence_dynamic(x_BSD: torch.Tensor, cos_sin, mask) -> None:
    # maybe_mark_dynamic (not mark_dynamic): a size-1 batch may specialize instead of raising
    for tensor, dims in ((x_BSD, (0, 1)), (cos_sin[0], (0, 1)), (cos_sin[1], (0, 1))):
        for dim in dims:
            torch._dynamo.maybe_mark_dynamic(tensor, dim)
    if mask is not None:  # [B|1, 1, S, S]
        for dim in (0, 2, 3):
            torch._dynamo.maybe_mark_dynamic(mask, dim)


def _forward_with_dynamic_shapes(self, x_BSD, cos_sin, mask):
    _mark_batch_and_sequence_dynamic(x_BSD, cos_sin, mask)
    return self._compiled_forward(self, x_BSD, cos_sin, mask)


def _compile_forward(module: nn.Module, compiled_by_type: dict) -> None:
    if "_compiled_forward" in vars(module):  # already compiled: applying twice is a no-op
        return
    cls = type(module)
    if cls not in compiled_by_type:
        compiled_by_type[cls] = torch.compile(cls.forward, fullgraph=True)
    module._compiled_forward = compiled_by_type[cls]
    # a bound method (not a closure) so copy.deepcopy(model) rebinds it to the copy
    module.forward = types.MethodType(_forward_with_dynamic_shapes, module)


def apply_compile(model: nn.Module) -> nn.Module:
    """Compile each decoder block separately with fullgraph=True; in place, parameter names unchanged.

    A mixture-of-experts block routes tokens with a host sync (expert token counts), which cannot be
    one graph: there only the attention is compiled and the experts run eagerly.
    Activation checkpointing (``model.checkpointed_layers``) composes with it: the recomputation in
    backward runs the same compiled graph. Evaluation under torch.no_grad compiles its own graphs
    once. copy.deepcopy of a compiled model gives a compiled copy (its blocks are rebound to it).
    """
    compiled_by_type: dict = {}
    for block in model.layers:
        _compile_forward(block if getattr(block, "moe", None) is None else block.attention, compiled_by_type)
    return model
