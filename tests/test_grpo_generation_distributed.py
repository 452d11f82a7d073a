"""GRPOTrainer generates in a 2-process run (torchrun, gloo): under FSDP2 and DDP each rank decodes its own prompts
on a replica of the sharded policy, gathered before each generation. Greedy completions through the trainer's
rollout component are a one-process forward's argmax (where no near-tie decides) with its log-probs (1e-4), on the
checkpoint (before training) and on the trained weights (after 2 steps of real GRPO: sampled completions, reward
functions, the loop), so the replica follows the policy. Every layout's training (TP, CP, EP included) is
tests/test_rl_layouts.py's."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_grpo import MODEL

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo-generation")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(HERE / "_grpo_generation_worker.py"), str(out)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-6000:]
    return out


def one_process_logprobs(prompt, completion, state=None) -> torch.Tensor:
    """Log-probs [T, V] of the next token at each completion position, from a one-process forward of the checkpoint
    (or of ``state``)."""
    import hfnative

    model = hfnative.load_pretrained(MODEL).model
    if state is not None:
        model.load_state_dict(state)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].double()
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) + len(completion) - 1], dim=-1)


def assert_greedy_like_one_process(prompts, completions, logprobs, state=None):
    """Each completion token is the one-process argmax wherever the top two are apart by more than round-off, and
    its log-prob is the one-process forward's (well-conditioned: no near-tie decides the comparison)."""
    for prompt, completion, sampled in zip(prompts, completions, logprobs):
        expected_TV = one_process_logprobs(prompt, completion, state)
        top2 = expected_TV.topk(2, dim=-1).values
        decisive = (top2[:, 0] - top2[:, 1]) > 1e-4
        argmax = expected_TV.argmax(-1)
        chosen = torch.tensor(completion)
        assert (argmax[decisive] == chosen[decisive]).all(), (completion, argmax.tolist())
        torch.testing.assert_close(torch.tensor(sampled, dtype=torch.float64),
                                   expected_TV.gather(1, chosen[:, None])[:, 0], atol=1e-4, rtol=0)


@pytest.mark.parametrize("layout", ["fsdp2", "ddp"])
def test_each_rank_generates_its_prompts_like_one_process(launched, layout):
    state = torch.load(launched / f"{layout}-state.pt", weights_only=True)
    for rank in (0, 1):
        result = json.loads((launched / f"{layout}-rank{rank}.json").read_text())
        assert_greedy_like_one_process(result["prompts"], result["before"], result["before_logprobs"])
        assert_greedy_like_one_process(result["prompts"], result["after"], result["after_logprobs"], state)
        assert result["after"] != result["before"]  # the policy moved (lr 1e-2) and the replica with it
        logs = result["logs"]
        assert len(logs) == 2 and all(torch.isfinite(torch.tensor([e["loss"], e["grad_norm"]])).all() for e in logs)
        assert {"reward", "completions/mean_length", "rewards/even_fraction/mean"} <= set(logs[0])

