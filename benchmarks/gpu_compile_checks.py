"""A compiled block's activation checkpoint on a device (``gpu_checks.py compile`` runs it): on this torch and device,
the checkpoint inside the block's graph keeps what it is told to (hfnative/parallel/compile.py: the kept ops are
annotated while compiling, ``torch.fx.traceback.annotate``, and torch's selective checkpoint policy reads the
annotation). The graphs inductor's partitioner makes are captured instead of compiled: backward recomputes 6 matmuls
a block under full checkpointing and 3 when the attention and the query, value and gate projections are kept, none
without checkpointing; the gradients are the eager model's. Where the annotation did not reach the policy, keeping
would silently recompute as much as full checkpointing (correct, slower): this says which.

Packed and padded batches compiled (``packed_in_graph``): where ``varlen_attn`` serves the attention (CUDA, bf16
autocast) its call is traced into each block's graph: no graph break, no new graph after the first two batches of a
kind (packed layouts, paddings), the eager model's loss and gradients, and a checkpointed block recomputes inside its
graph (called once a step, not twice).
"""

from __future__ import annotations

import copy
import functools
from collections import Counter
from unittest import mock

import torch

from hfnative.models.args import ModelArgs
from hfnative.models.decoder import Transformer
from hfnative.parallel import apply_activation_checkpointing, apply_compile


def _tiny(device: torch.device) -> Transformer:
    torch.manual_seed(0)
    args = ModelArgs(vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, intermediate_size=128,
                     qk_norm=True)
    model = Transformer(args)
    model.init_weights()
    return model.to(device)


def _loss_and_grads(model, input_ids, autocast: bool):
    model.zero_grad(set_to_none=True)
    with torch.autocast(input_ids.device.type, dtype=torch.bfloat16, enabled=autocast):
        loss = model(input_ids, labels=input_ids).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def checkpoint_in_graph(tally, device: torch.device) -> None:
    from _compile_graphs import capturing_backend  # tests/ (gpu_checks.py puts it on the path)

    backend, graphs = capturing_backend()
    input_ids = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1)).to(device)
    for autocast in (False, True) if device.type == "cuda" else (False,):
        label = f"compiled checkpoint inside the graph{', bf16 autocast' if autocast else ', fp32'}"
        eager = _tiny(device)
        loss, grads = _loss_and_grads(eager, input_ids, autocast)
        recomputed, worst = {}, 0.0
        try:
            for keep in (None, "nothing", "attention_and_projections"):
                torch._dynamo.reset()
                graphs["forward"].clear(), graphs["backward"].clear()
                with mock.patch.object(torch, "compile", functools.partial(torch.compile, backend=backend)):
                    model = apply_compile(copy.deepcopy(eager))
                if keep is not None:
                    apply_activation_checkpointing(model, "full", keep=keep)
                c_loss, c_grads = _loss_and_grads(model, input_ids, autocast)
                worst = max([worst, abs(c_loss - loss).item()]
                            + [((c_grads[n] - g).norm() / g.norm().clamp_min(1e-12)).item() for n, g in grads.items()])
                ops = Counter(str(node.target) for graph in graphs["backward"] for node in graph.graph.nodes
                              if node.op == "call_function")
                recomputed[keep] = ops["aten.mm.default"]
        except Exception as err:  # reported; the next dtype still runs
            tally("FAIL", label, f"{type(err).__name__}: {str(err).splitlines()[0][:120]}")
            continue
        full, kept = recomputed["nothing"] - recomputed[None], recomputed["attention_and_projections"] - recomputed[None]
        close = worst <= (2e-2 if autocast else 1e-4)
        tally.check(close and full == 6 and kept == 3, label,
                    f"backward recomputes {full} matmuls a block under full checkpointing (6 expected), {kept} keeping "
                    f"attention and projections (3 expected{'' if kept == 3 else '; 6: the annotation did not reach the policy'}); "
                    f"worst difference from eager {worst:.1e}")


def _packed(documents: list[list[int]], device: torch.device, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, 64, (len(documents), sum(documents[0])), generator=generator).to(device)
    position_ids = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in documents]).to(device)
    return dict(input_ids=input_ids, position_ids=position_ids, labels=input_ids)


def _padded(padding: list[int], device: torch.device, seed: int) -> dict:
    """Rows of 128 tokens, each left-padded by its count of ``padding``; padding carries no label."""
    generator = torch.Generator().manual_seed(100 + seed)
    input_ids = torch.randint(0, 64, (len(padding), 128), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    for row, count in enumerate(padding):
        attention_mask[row, :count] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return {name: x.to(device) for name, x in
            dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels).items()}


def _packed_loss_and_grads(model, input_ids, labels, **inputs):
    model.zero_grad(set_to_none=True)
    with torch.autocast(input_ids.device.type, dtype=torch.bfloat16):
        loss = model(input_ids, labels=labels, **inputs).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


PACKED_LAYOUTS = ([[40, 60, 28], [100, 28]], [[16, 16, 16, 80], [128]], [[64, 64], [20, 90, 18]],
                  [[1, 127], [30, 30, 30, 38]])
PADDINGS = ([30, 0], [0, 77], [5, 12])


def packed_in_graph(tally, device: torch.device) -> None:
    from torch._dynamo.utils import counters

    from hfnative.models.attention import flash_varlen_serves

    label = "packed batches compiled around varlen_attn, bf16 autocast"
    if not flash_varlen_serves(device, torch.bfloat16, 16):
        tally("SKIP", label, f"varlen_attn does not serve {device.type} on torch {torch.__version__}: packed blocks "
                             "attend per document between two graphs")
        return
    try:
        for keep in (None, "attention_and_projections"):
            torch._dynamo.reset()
            counters.clear()
            eager = _tiny(device)
            model = apply_compile(copy.deepcopy(eager))
            if keep is not None:
                apply_activation_checkpointing(model, "full", keep=keep)
            calls = [0] * len(model.layers)
            for index, block in enumerate(model.layers):
                block.register_forward_pre_hook(lambda module, args, index=index: calls.__setitem__(index, calls[index] + 1))
            worst, graphs = 0.0, None
            # four packed layouts, then three paddings (the kernel over the real tokens: an index of a new length);
            # each kind may compile its graphs on its first two batches, none after
            batches = [_packed(documents, device, index) for index, documents in enumerate(PACKED_LAYOUTS)]
            batches += [_padded(padding, device, index) for index, padding in enumerate(PADDINGS)]
            settled = {1: None, len(PACKED_LAYOUTS) - 1: None, len(PACKED_LAYOUTS) + 1: None, len(batches) - 1: None}
            for index, batch in enumerate(batches):
                loss, grads = _packed_loss_and_grads(eager, **batch)
                c_loss, c_grads = _packed_loss_and_grads(model, **batch)
                worst = max([worst, abs(c_loss - loss).item()]
                            + [((c_grads[n] - g).norm() / g.norm().clamp_min(1e-12)).item() for n, g in grads.items()])
                if index in settled:
                    settled[index] = counters["stats"]["unique_graphs"]
            marks = list(settled.values())
            breaks, recompiled = sum(counters["graph_break"].values()), (marks[1] - marks[0]) + (marks[3] - marks[2])
            once = calls == [len(batches)] * len(calls)
            tally.check(not breaks and not recompiled and worst <= 5e-2 and once,  # bf16 products, fused otherwise
                        f"{label}{', checkpointed (keeping attention and projections)' if keep else ''}",
                        f"{breaks} graph breaks, {recompiled} graphs after the second batch of a kind, blocks called "
                        f"{calls} times over {len(batches)} steps (packed, then padded), worst difference from eager "
                        f"{worst:.1e}")
    except Exception as err:
        tally("FAIL", label, f"{type(err).__name__}: {str(err).splitlines()[0][:120]}")
