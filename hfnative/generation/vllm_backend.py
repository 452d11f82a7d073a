"""The vLLM rollout backend: ``vllm.LLM`` in the trainer's process (colocate) or a running vLLM server.

Both return the native backend's ``Rollouts`` and take weights by Hub name
(``model.layers.0.self_attn.q_proj.weight``), as (name, tensor) pairs the caller gives (the trainers name a
native model's weights so with ``hfnative.converters.rollouts.hub_named_tensors``).
How weights reach vLLM after an update:
  colocate       handed in process to vLLM's model (CPU or GPU: nothing is copied through files).
  server "files" safetensors written to a folder the server reads, then the server reloads from it
                 (``/collective_rpc`` -> ``VLLMWorkerExtension.hfnative_reload_weights``: the server runs with
                 VLLM_SERVER_DEV_MODE=1 and ``--worker-extension-cls
                 hfnative.generation.vllm_backend.VLLMWorkerExtension``); works on CPU. The folder must be
                 on a disk both processes see.
  server "nccl"  vLLM's NCCL weight transfer (the server started with
                 ``--weight-transfer-config '{"backend": "nccl"}'``); GPU only.

Log-probs: vLLM is run with ``logprobs_mode="processed_logprobs"`` (as TRL runs it), which is
log_softmax(logits / temperature) — the native backend's definition — when top_k, top_p, min_p and the
repetition penalty are off (greedy: temperature 1); with those on, vLLM gives the log-prob under the
filtered, renormalized distribution it sampled from.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import urlsplit

import torch

from .rollouts import RolloutEngine, Rollouts, check_prompts
from .sampling import SamplingParams, row_seeds

WEIGHTS_FILE = "model.safetensors"
FILES_TRANSPORT_SERVER = (
    "for the files weight transport start the server as `VLLM_SERVER_DEV_MODE=1 vllm serve MODEL "
    "--worker-extension-cls hfnative.generation.vllm_backend.VLLMWorkerExtension` (hfnative installed beside vllm)"
)


# --- weights for the files transport -------------------------------------------------------------


def write_weights_folder(named_tensors: Iterable[tuple[str, torch.Tensor]], folder: str | os.PathLike) -> Path:
    """Write (Hub key, tensor) pairs as ``folder/model.safetensors`` (one file, CPU, contiguous), renamed
    into place when complete so a reader never sees half a file; returns its path."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, tensor in named_tensors:
        if name in tensors:
            raise ValueError(f"load_weights: tensor {name!r} given twice")
        tensors[name] = tensor.detach().to("cpu").contiguous()
    if not tensors:
        raise ValueError("load_weights: no tensors given")
    path = folder / WEIGHTS_FILE
    tmp = folder / f".{WEIGHTS_FILE}.tmp-{os.getpid()}"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path)
    return path


# --- sampling settings and outputs -------------------------------------------------------------------


def vllm_sampling_kwargs(sampling: SamplingParams) -> dict:
    """vLLM SamplingParams fields for ``sampling``: one completion per prompt, the sampled token's
    log-prob, stopping exactly on ``sampling.stop_ids`` (the model's own EOS is not added); a regex as
    ``structured_outputs`` ({"regex": ...}: the server's form; the colocated engine makes vLLM's
    StructuredOutputsParams of it)."""
    kwargs = dict(
        n=1,
        max_tokens=sampling.max_new_tokens,
        repetition_penalty=sampling.repetition_penalty,
        logprobs=0,
        ignore_eos=True,
        stop_token_ids=list(sampling.stop_ids),
        skip_special_tokens=False,
    )
    if sampling.do_sample:
        kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                      min_p=sampling.min_p)
        if sampling.seed is not None:
            kwargs["seed"] = sampling.seed
    else:
        kwargs.update(temperature=0.0)  # vLLM's greedy
    if sampling.regex is not None:  # vLLM's structured outputs (a dict, as the server takes them)
        kwargs["structured_outputs"] = {"regex": sampling.regex}
    return kwargs


def _finish_reason(reason: str | None, tokens: list[int], sampling: SamplingParams) -> str:
    if reason == "stop" or (tokens and tokens[-1] in sampling.stop_ids):
        return "stop"
    if reason in ("length", None):
        return "length"
    raise RuntimeError(f"vLLM ended a sequence with finish_reason={reason!r} (expected 'stop' or 'length')")


# --- inside vLLM's workers ------------------------------------------------------------------------------


def retie_output_head(model) -> None:
    """After an in-place reload, point a tied output head at the new embedding again.

    vLLM ties ``lm_head`` by sharing the embedding's Parameter, and on CPU the head keeps a packed GEMM
    copy of it made at load time; a reload refreshes the embedding only, so the logits would still come
    from the old weights."""
    config = getattr(model, "config", None)
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if not getattr(config, "tie_word_embeddings", False) or head is None or embed is None:
        return
    head.weight = embed.weight
    head.quant_method.process_weights_after_loading(head)  # CPU: repacks the head's own GEMM copy


def reload_in_worker(worker, weights_iterator=None, weights_path: str | None = None) -> None:
    """Run in a vLLM worker: reload the weights in place (from tensors or a folder), then re-tie the head."""
    worker.reload_weights(weights_iterator=weights_iterator, weights_path=weights_path, is_checkpoint_format=True)
    retie_output_head(worker.model_runner.get_model())


class VLLMWorkerExtension:
    """Methods for a vLLM server's workers: ``vllm serve MODEL --worker-extension-cls
    hfnative.generation.vllm_backend.VLLMWorkerExtension`` (with VLLM_SERVER_DEV_MODE=1 to reach them
    through ``/collective_rpc``)."""

    def hfnative_reload_weights(self, weights_path: str) -> None:
        reload_in_worker(self, weights_path=weights_path)


# --- colocate ------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _address_towards(host: str, port: int) -> str:
    """This machine's address on the route to host (no packet is sent: a UDP socket only picks the route)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((host, port))
        return sock.getsockname()[0]


class VLLMColocateEngine(RolloutEngine):
    """``vllm.LLM`` in this process (``distributed_executor_backend="external_launcher"``, as TRL runs it).

    model: a Hub-format folder (or Hub id) vLLM loads first. In a torch.distributed run every rank holds
    one engine; with ``tensor_parallel_size`` > 1 consecutive ranks form one vLLM instance, which generates
    for the prompts of all of them (every rank gets its own prompts' rollouts back). ``load_weights``
    takes (Hub key, tensor) pairs — all of the model's weights — and resets vLLM's prefix cache (its KV
    blocks were computed with the old weights). skip_tokenizer_init: False where rollouts are constrained to a regex
    (SamplingParams.regex: vLLM compiles it over the tokenizer's vocabulary). llm_kwargs go to ``vllm.LLM`` unchanged.
    """

    def __init__(self, model: str | os.PathLike, *, tensor_parallel_size: int = 1,
                 gpu_memory_utilization: float = 0.3, max_model_len: int | None = None,
                 max_num_seqs: int | None = None, enable_sleep_mode: bool = False, model_impl: str = "vllm",
                 dtype: str = "auto", seed: int | None = None, skip_tokenizer_init: bool = True, **llm_kwargs):
        from vllm import LLM

        rank, world = 0, 1
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        if world % tensor_parallel_size:
            raise ValueError(f"vllm_tensor_parallel_size={tensor_parallel_size} must divide the world size ({world})")
        # the external launcher reads the process's place from the environment, as torchrun sets it
        os.environ.setdefault("RANK", str(rank))
        os.environ.setdefault("LOCAL_RANK", str(rank))
        os.environ.setdefault("WORLD_SIZE", str(world))
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        self.tp_group = None
        if tensor_parallel_size > 1:  # ranks [0, tp), [tp, 2 tp), ...: each group runs one vLLM on all its prompts
            self.tp_group, _ = torch.distributed.new_subgroups_by_enumeration(
                [list(range(start, start + tensor_parallel_size)) for start in range(0, world, tensor_parallel_size)]
            )
        self.enable_sleep_mode = enable_sleep_mode
        self.llm = LLM(
            model=str(model),
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            enable_sleep_mode=enable_sleep_mode,
            model_impl=model_impl,
            dtype=dtype,
            distributed_executor_backend="external_launcher",
            seed=rank // tensor_parallel_size if seed is None else seed,  # one stream per tensor-parallel group
            logprobs_mode="processed_logprobs",
            # prompts and completions are token ids; a regex (structured outputs) needs the tokenizer
            skip_tokenizer_init=skip_tokenizer_init,
            **llm_kwargs,
        )
        self.vocab_size = self.llm.llm_engine.model_config.get_vocab_size()
        if enable_sleep_mode:
            self.llm.sleep(level=1)

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> Rollouts:
        from vllm import SamplingParams as VLLMSamplingParams

        prompts = check_prompts(prompts, self.vocab_size)
        kwargs = vllm_sampling_kwargs(sampling)
        # seeded: a seed per row (SamplingParams' row streams), so that repeated prompts are not sampled alike
        seeds = row_seeds(sampling, len(prompts)) if "seed" in kwargs else [None] * len(prompts)
        mine = slice(0, len(prompts))
        if self.tp_group is not None:  # the group's ranks must hand vLLM the same batch: gather, keep our share
            size = torch.distributed.get_world_size(self.tp_group)
            gathered = [None] * size
            torch.distributed.all_gather_object(gathered, list(zip(prompts, seeds)), group=self.tp_group)
            start = sum(len(part) for part in gathered[: torch.distributed.get_rank(self.tp_group)])
            rows = [row for part in gathered for row in part]
            prompts, seeds, mine = [r[0] for r in rows], [r[1] for r in rows], slice(start, start + len(prompts))
        kwargs.pop("seed", None)
        if "structured_outputs" in kwargs:
            from vllm.sampling_params import StructuredOutputsParams

            kwargs["structured_outputs"] = StructuredOutputsParams(**kwargs["structured_outputs"])
        params = [VLLMSamplingParams(**kwargs, seed=seed, detokenize=False) for seed in seeds]
        if self.enable_sleep_mode:
            self.llm.wake_up()
        try:
            outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)[mine]
        finally:
            if self.enable_sleep_mode:
                self.llm.sleep(level=1)
        completion_ids, logprobs, finish_reason = [], [], []
        for output in outputs:
            completion = output.outputs[0]
            tokens = list(completion.token_ids)
            completion_ids.append(tokens)
            logprobs.append([float(step[token].logprob) for step, token in zip(completion.logprobs, tokens)])
            finish_reason.append(_finish_reason(completion.finish_reason, tokens, sampling))
        return Rollouts(completion_ids, logprobs, finish_reason)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.enable_sleep_mode:
            self.llm.wake_up(tags=["weights"])
        try:
            # in process (external launcher): the iterator reaches vLLM's model as is, no copy
            self.llm.collective_rpc(reload_in_worker, kwargs={"weights_iterator": iter(named_tensors)})
        finally:
            if self.enable_sleep_mode:
                self.llm.sleep(level=1)
        self.llm.reset_prefix_cache()


# --- server --------------------------------------------------------------------------------------------


class VLLMServerEngine(RolloutEngine):
    """A running vLLM server (``vllm serve MODEL``, or TRL's ``trl vllm-serve``, which starts one with the
    NCCL weight transfer): rollouts through its OpenAI completions endpoint with token-id prompts, weights
    through ``weight_transport``. Start the server with ``--logprobs-mode processed_logprobs`` (as
    ``trl vllm-serve`` does) for the log-probs the colocated engine returns; vLLM's default gives the
    log-probs at temperature 1.

    base_url: e.g. "http://127.0.0.1:8000" (else built from host and port). timeout: seconds to wait
    for the server's /health. weight_transport: "files" (see the module docstring for the server's flags),
    "nccl" (needs the server's ``--weight-transfer-config '{"backend": "nccl"}'`` and CUDA here) or
    "auto" (nccl when CUDA is available, else files). weights_dir: the folder of the files transport
    (default: a new temporary folder, so the server must run on this machine). group_port: the
    NCCL rendezvous port.
    """

    def __init__(self, base_url: str | None = None, *, host: str = "0.0.0.0", port: int = 8000,
                 timeout: float = 240.0, weight_transport: str = "auto",
                 weights_dir: str | os.PathLike | None = None, group_port: int = 51216,
                 request_timeout: float = 3600.0):
        import requests

        if weight_transport == "auto":
            weight_transport = "nccl" if torch.cuda.is_available() else "files"
        if weight_transport not in ("files", "nccl"):
            raise ValueError(f"weight_transport={weight_transport!r}: expected 'files', 'nccl' or 'auto'")
        self.base_url = (base_url or f"http://{host}:{port}").rstrip("/")
        self.weight_transport, self.group_port, self.request_timeout = weight_transport, group_port, request_timeout
        self.session = requests.Session()
        self._wait_until_up(timeout)
        models = self._get("/v1/models")["data"]
        self.model_name = models[0]["id"]
        self.vocab_size = None  # the server checks token ids itself
        self._weights_dir = Path(weights_dir) if weights_dir is not None else None
        self._nccl = None

    def _wait_until_up(self, timeout: float) -> None:
        import requests

        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.session.get(f"{self.base_url}/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise ConnectionError(
                    f"no vLLM server answered at {self.base_url}/health within {timeout:.0f} s; start one with "
                    "`vllm serve MODEL` (and VLLM_SERVER_DEV_MODE=1 for the files weight transport)"
                )
            time.sleep(1.0)

    def _get(self, path: str) -> dict:
        response = self.session.get(f"{self.base_url}{path}", timeout=self.request_timeout)
        response.raise_for_status()
        return response.json()

    def _post(self, path: str, body: dict) -> dict | None:
        response = self.session.post(f"{self.base_url}{path}", json=body, timeout=self.request_timeout)
        if response.status_code == 404 and path in ("/collective_rpc", "/reset_prefix_cache"):
            raise RuntimeError(f"{self.base_url}{path} is not served: {FILES_TRANSPORT_SERVER}")
        if not response.ok and path == "/collective_rpc" and "attribute 'hfnative_reload_weights'" in response.text:
            raise RuntimeError(f"the vLLM server's workers cannot reload from files: {FILES_TRANSPORT_SERVER}")
        if not response.ok:
            raise RuntimeError(f"vLLM server {path}: HTTP {response.status_code}: {response.text[:500]}")
        return response.json() if response.content else None

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> Rollouts:
        prompts = check_prompts(prompts, 2**63)
        body = {"model": self.model_name, "prompt": prompts, "return_token_ids": True, **vllm_sampling_kwargs(sampling)}
        choices = sorted(self._post("/v1/completions", body)["choices"], key=lambda choice: choice["index"])
        if len(choices) != len(prompts):
            raise RuntimeError(f"vLLM server returned {len(choices)} completions for {len(prompts)} prompts")
        completion_ids, logprobs, finish_reason = [], [], []
        for choice in choices:
            tokens = list(choice["token_ids"])
            completion_ids.append(tokens)
            logprobs.append([float(lp) for lp in choice["logprobs"]["token_logprobs"]])
            finish_reason.append(_finish_reason(choice.get("finish_reason"), tokens, sampling))
        return Rollouts(completion_ids, logprobs, finish_reason)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.weight_transport == "files":
            if self._weights_dir is None:
                self._weights_dir = Path(tempfile.mkdtemp(prefix="hfnative-vllm-weights-"))
            write_weights_folder(named_tensors, self._weights_dir)
            self._post("/collective_rpc", {
                "method": "hfnative_reload_weights",
                "kwargs": {"weights_path": str(self._weights_dir.resolve())},
            })
        else:
            self._send_nccl(list(named_tensors))
        self._post("/reset_prefix_cache", {})

    def _send_nccl(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """vLLM's trainer-side NCCL engine: this process is rank 0 of a group with the server's workers."""
        from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine

        class Tensors(WeightSource):
            def __init__(self):
                self.named = []

            def metadata(self):
                return [ParamMeta(name=n, dtype=t.dtype, shape=tuple(t.shape)) for n, t in self.named]

            def __iter__(self):
                return iter(self.named)

        if self._nccl is None:
            source = Tensors()
            world = 1 + self._get("/get_world_size")["world_size"]
            host = urlsplit(self.base_url).hostname or "127.0.0.1"
            # rank 0 (this process) hosts the rendezvous: the address the server reaches us at
            address = _address_towards(host, urlsplit(self.base_url).port or 80)
            init = NCCLTrainerInitInfo(master_address=address, master_port=self.group_port, world_size=world, rank=0)
            client = HTTPVLLMWeightSyncClient(self.base_url, timeout=self.request_timeout)
            self._nccl = (source, NCCLTrainerWeightTransferEngine.trainer_init(init, client=client, source=source))
        source, engine = self._nccl
        device = torch.device("cuda", torch.cuda.current_device())
        source.named = [(name, tensor.detach().to(device)) for name, tensor in named_tensors]
        engine.send_weights()
        source.named = []
