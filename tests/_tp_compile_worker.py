"""torch 2.13 compiling tensor-parallel blocks, for tests/test_compile_and_checkpointing.py: one rank of a 2-process
torchrun launch (gloo), run with a fresh TORCHINDUCTOR_CACHE_DIR.

usage: torchrun --standalone --nproc_per_node 2 _tp_compile_worker.py OUT_JSON

A 2-block native model (without and with q/k norms) is split over tp=2 ranks (TP + sequence parallel) and takes
one forward and backward of a padded batch, eagerly and compiled three ways:
- "hfnative": ``apply_compile(model, tensor_parallel=True)`` (static shapes, no compile caches);
- "block, dynamic shapes": each block compiled with ``dynamic=True``, as on one process;
- "block, static shapes, from the compile caches": each block compiled with static shapes a second time, reading
  the graphs the first compile left in torch's caches.
Rank 0 writes, per way, the loss's and the worst parameter gradient's difference from eager (max |g - g_eager| /
max |g_eager|), or the error the compiled run raised.
"""

from __future__ import annotations

import json
import sys
import traceback

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hfnative.losses import IGNORE_INDEX
from hfnative.models.args import ModelArgs
from hfnative.models.decoder import Transformer
from hfnative.parallel import ParallelDims, apply_compile, end_process_group
from hfnative.parallel.tensor_parallel import apply_tensor_parallel


VOCAB = 64


def tiny_model(qk_norm: bool) -> Transformer:
    torch.manual_seed(0)  # the same seed on every rank: the same weights, each rank keeping its part
    model = Transformer(ModelArgs(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                                  intermediate_size=64, qk_norm=qk_norm))
    model.init_weights()
    return model


def _block_compiled(model, dynamic: bool, **options) -> None:
    for block in model.layers:
        block.forward = torch.compile(block.forward, dynamic=dynamic, **options)


def _cached_block(model) -> None:
    """Each block compiled with static shapes and torch's compile caches on, a second time: the first compile (of a
    copy, through forward and backward) fills the caches, and after ``torch._dynamo.reset()`` this model's compile
    reads them."""
    import copy

    warm = copy.deepcopy(model)
    _block_compiled(warm, dynamic=False, options={"fx_graph_cache": True})
    _forward_backward(warm)
    torch._dynamo.reset()
    _block_compiled(model, dynamic=False, options={"fx_graph_cache": True})


WAYS = {
    "hfnative": lambda model: apply_compile(model, tensor_parallel=True),
    "block, dynamic shapes": lambda model: _block_compiled(model, dynamic=True, options={"fx_graph_cache": False}),
    "block, static shapes, from the compile caches": _cached_block,
}


def loss_and_gradients(mesh, way: str | None, qk_norm: bool) -> tuple[float, dict[str, torch.Tensor]]:
    model = tiny_model(qk_norm)
    apply_tensor_parallel(model, mesh)
    if way is not None:
        WAYS[way](model)
    return _forward_backward(model)


def _forward_backward(model) -> tuple[float, dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, VOCAB, (2, 16), generator=generator)
    labels = input_ids.clone()
    labels[1, 10:] = IGNORE_INDEX
    mask = torch.ones_like(input_ids)
    mask[1, 10:] = 0
    out = model(input_ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    grads = {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) for name, p in model.named_parameters()}
    return out.loss.item(), grads


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    mesh = ParallelDims(dp_shard=1, tp=2, world_size=2).build_mesh("cpu")["tp"]
    results = {}
    eager_runs = {qk_norm: loss_and_gradients(mesh, None, qk_norm) for qk_norm in (False, True)}
    for qk_norm, way in [(q, w) for q in (False, True) for w in WAYS]:
        eager_loss, eager = eager_runs[qk_norm]
        key = f"{way}{', q/k norms' if qk_norm else ''}"
        try:
            loss, grads = loss_and_gradients(mesh, way, qk_norm)
            results[key] = {
                "loss": abs(loss - eager_loss) / abs(eager_loss),
                "grad": max(float((grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-12)) for n, g in eager.items()),
            }
        except Exception as error:  # noqa: BLE001 - recorded: the test names what failed
            cause = "RecursionError" if "RecursionError" in str(error) else ""
            results[key] = {"error": f"{type(error).__name__} {cause}".strip(), "traceback": traceback.format_exc()[-2000:]}
        dist.barrier()
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    end_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
