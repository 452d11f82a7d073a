"""One rank of a 2-process colocated run with vllm_tensor_parallel_size=2 (launched by torch.distributed.run).

Each rank hands its own prompts (a different number per rank); both share one vLLM instance. Writes
{"greedy": ..., "native": ..., "updated": ..., "native_updated": ...} to OUT_DIR/rank{N}.json.
"""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from hfnative.converters.loading import load_pretrained
from hfnative.converters.rollouts import hub_named_tensors
from hfnative.generation import NativeRolloutEngine, SamplingParams
from hfnative.trainers.rollout.engines import make_rollout_engine

model_dir, out_dir = sys.argv[1], Path(sys.argv[2])
dist.init_process_group("gloo")
rank = dist.get_rank()
args = SimpleNamespace(use_vllm=True, vllm_mode="colocate", vllm_tensor_parallel_size=2, vllm_max_model_length=128)
engine = make_rollout_engine(model_dir, args, enforce_eager=True)
prompts = [[[1, 882, 198, 383], [17, 29, 400, 5, 6]], [[100, 200, 300], [640, 760, 287, 3, 4, 5], [9, 9]]][rank]
greedy = SamplingParams(max_new_tokens=10, do_sample=False)
result = {
    "greedy": engine.generate(prompts, greedy).completion_ids,
    "native": NativeRolloutEngine(load_pretrained(model_dir).model).generate(prompts, greedy).completion_ids,
}
updated = load_pretrained(model_dir)
generator = torch.Generator().manual_seed(3)  # the same update on both ranks
with torch.no_grad():
    for parameter in updated.model.parameters():
        parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.3 * parameter.abs().mean())
engine.load_weights(hub_named_tensors(updated))
result["updated"] = engine.generate(prompts, greedy).completion_ids
result["native_updated"] = NativeRolloutEngine(updated.model).generate(prompts, greedy).completion_ids
(out_dir / f"rank{rank}.json").write_text(json.dumps(result))
dist.barrier()
# a normal exit: vLLM's CPU tensor-parallel group unlinks its shared-memory files (/dev/shm/*cpushm*) then;
# their names do not change between runs, so files left behind would stop the next run
