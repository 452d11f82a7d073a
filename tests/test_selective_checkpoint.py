"""The GPU policy's selective activation checkpointing (hfnative.models.selective_checkpoint), run here on CPU: in
every family a checkpointed block keeps exactly the query, value and gate projections' results (the router's in a
MoE block) and the attention kernels', its gradients are bit-identical to the un-checkpointed model's (dense and
padded, fp32 and bf16 autocast), and only the ops inside the kept calls pass through the dispatch mode; the bytes
kept are what the default's estimate says, and the default keeps less when the device's free memory is short."""

from __future__ import annotations

import pytest
import torch
from hf_configs import ONE_PER_FAMILY, save_hf_model
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from hfnative.converters.loading import load_pretrained
from hfnative.device_policy import use_device_policy
from hfnative.models import selective_checkpoint
from hfnative.models.selective_checkpoint import ATTENTION, MATMULS
from hfnative.parallel import apply_activation_checkpointing

aten = torch.ops.aten


@pytest.fixture(scope="module", params=ONE_PER_FAMILY)
def checkpoint_dir(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    save_hf_model(request.param, directory)
    return directory


def _model(directory, checkpointed: bool):
    model = load_pretrained(directory).model
    model.train()
    return apply_activation_checkpointing(model, "full") if checkpointed else model


def _batch(vocab: int, padded: bool):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (3, 20), generator=generator)
    mask = torch.ones(3, 20, dtype=torch.long)
    if padded:
        mask[1, :4] = 0  # left padding: per-document attention
        mask[2, -6:] = 0
    return ids, mask


def _loss_and_grads(model, ids, mask, bf16: bool):
    model.zero_grad(set_to_none=True)
    with use_device_policy("gpu"), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        hidden = model(ids, attention_mask=mask).hidden_states
        weights = torch.linspace(-1.0, 1.0, hidden.numel()).view_as(hidden)  # every position's gradient differs
        loss = (hidden.float() * weights).sum()
        loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


class _Recorder:
    """What the forward kept (through the dispatch mode or a plain projection's ``_KeptProduct``: a matmul either
    way), and how many ops the dispatch mode saw."""

    def __init__(self, monkeypatch):
        self.kept, self.seen = [], 0
        dispatch, keep = selective_checkpoint._Keep.__torch_dispatch__, selective_checkpoint._Keep.keep

        def counting(mode, func, types, args=(), kwargs=None):
            self.seen += 1
            return dispatch(mode, func, types, args, kwargs)

        def recording(mode, func, out):
            keep(mode, func, out)
            matmul = func in MATMULS or func is selective_checkpoint._KeptProduct
            self.kept.append((aten.mm.default if matmul else func, out.shape[-1] if matmul else None))

        monkeypatch.setattr(selective_checkpoint._Keep, "__torch_dispatch__", counting)
        monkeypatch.setattr(selective_checkpoint._Keep, "keep", recording)


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _expected_widths(args) -> list[int]:
    """The kept matmuls' output widths for one block: query, value, then the gate (the router in a MoE block)."""
    gate = args.moe.num_experts if args.moe is not None else args.intermediate_size
    return [args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim, gate]


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
def test_checkpointed_blocks_keep_the_chosen_results_with_identical_gradients(checkpoint_dir, monkeypatch, padded,
                                                                              bf16):
    plain_model = _model(checkpoint_dir, checkpointed=False)
    ids, mask = _batch(plain_model.args.vocab_size, padded)
    plain = _loss_and_grads(plain_model, ids, mask, bf16)

    recorder = _Recorder(monkeypatch)
    model = _model(checkpoint_dir, checkpointed=True)
    checkpointed = _loss_and_grads(model, ids, mask, bf16)
    assert torch.equal(checkpointed[0], plain[0])
    assert checkpointed[1].keys() == plain[1].keys()
    for name, grad in plain[1].items():
        assert torch.equal(checkpointed[1][name], grad), name

    widths = [width for func, width in recorder.kept if func in MATMULS]
    assert widths == _expected_widths(model.args) * len(model.layers)
    attention = sum(func in ATTENTION for func, _ in recorder.kept)
    if model.args.attention_sinks:  # attention with sinks is explicit matmuls, recomputed
        assert attention == 0
    else:  # one kernel a block; padded, one a document (3 rows, one document each)
        assert attention == len(model.layers) * (3 if padded else 1)


def test_only_the_kept_calls_pass_through_the_dispatch_mode(checkpoint_dir, monkeypatch):
    """Torch's selective-checkpoint contexts run every op of a block's forward and recompute through a Python policy
    (about 10 us each on a host); here the mode sees only the ops inside the kept calls."""
    plain_model = _model(checkpoint_dir, checkpointed=False)
    ids, mask = _batch(plain_model.args.vocab_size, padded=False)
    with use_device_policy("gpu"), _OpCounter() as counter:
        plain_model(ids, attention_mask=mask)
    recorder = _Recorder(monkeypatch)
    model = _model(checkpoint_dir, checkpointed=True)
    with use_device_policy("gpu"):
        model(ids, attention_mask=mask)
    assert 0 < recorder.seen < counter.count / 3, (recorder.seen, counter.count)


def test_plain_projections_are_kept_without_the_dispatch_mode(tmp_path, monkeypatch):
    """A plain linear projection (no bias, no adapter, a plain weight) is kept through one autograd function
    (``_KeptProduct``): the dispatch mode sees only the attention kernel's op; the test above checks its gradients
    to the bit (fp32 and bf16 autocast)."""
    save_hf_model("qwen3-gqa", tmp_path)
    model = _model(tmp_path, checkpointed=True)
    ids, mask = _batch(model.args.vocab_size, padded=False)
    recorder = _Recorder(monkeypatch)
    _loss_and_grads(model, ids, mask, bf16=False)
    assert recorder.seen == len(model.layers)  # the attention kernel (under autocast, q and k's casts too)
    per_block = [(aten.mm.default, model.args.n_heads * model.args.head_dim),
                 (aten.mm.default, model.args.n_kv_heads * model.args.head_dim),
                 (aten._scaled_dot_product_flash_attention_for_cpu.default, None),
                 (aten.mm.default, model.args.intermediate_size)]
    assert recorder.kept == per_block * len(model.layers)


def test_a_projection_with_module_hooks_runs_them(tmp_path, monkeypatch):
    """A hooked projection is called as a module (through the dispatch mode): its hooks run in forward and in the
    recompute, as on a block without the autograd function."""
    save_hf_model("qwen3-gqa", tmp_path)
    model = _model(tmp_path, checkpointed=True)
    calls = []
    model.layers[0].attention.wq.register_forward_hook(lambda *_: calls.append(None))
    ids, mask = _batch(model.args.vocab_size, padded=False)
    recorder = _Recorder(monkeypatch)
    _loss_and_grads(model, ids, mask, bf16=False)
    assert len(calls) == 2
    assert recorder.seen == len(model.layers) + 4  # the hooked projection's view, t, mm and view back


def test_the_recompute_takes_the_way_forward_took_when_hooks_come_or_go(tmp_path):
    """Module hooks registered between forward and backward (a profiler's global hooks) do not change how a kept
    projection is recomputed: the recompute follows what forward kept, and the gradients stay the plain model's."""
    save_hf_model("qwen3-gqa", tmp_path)
    plain_model = _model(tmp_path, checkpointed=False)
    ids, mask = _batch(plain_model.args.vocab_size, padded=False)
    plain = _loss_and_grads(plain_model, ids, mask, bf16=False)
    model = _model(tmp_path, checkpointed=True)
    with use_device_policy("gpu"):
        hidden = model(ids, attention_mask=mask).hidden_states
        weights = torch.linspace(-1.0, 1.0, hidden.numel()).view_as(hidden)
        handle = torch.nn.modules.module.register_module_forward_hook(lambda *_: None)
        try:
            (hidden * weights).sum().backward()
        finally:
            handle.remove()
    for name, grad in plain[1].items():
        assert torch.equal(dict(model.named_parameters())[name].grad, grad), name


def test_a_second_backward_through_a_selectively_checkpointed_block_is_refused(checkpoint_dir):
    model = _model(checkpoint_dir, checkpointed=True)
    ids, mask = _batch(model.args.vocab_size, padded=False)
    with use_device_policy("gpu"):
        loss = model(ids, attention_mask=mask).hidden_states.sum()
        loss.backward(retain_graph=True)
        with pytest.raises(RuntimeError, match="runs once"):
            loss.backward()


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_lora_projections_keep_their_adapter_matmuls_with_identical_gradients(tmp_path, monkeypatch, dropout, bf16):
    """LoRA projections keep their base and adapter matmuls' results (through the dispatch mode: one autograd function
    a matmul measured no faster there); the gradients are the plain model's to the bit, the adapters' dropout drawing
    the same masks in the recompute."""
    from hfnative.converters.peft import apply_lora

    save_hf_model("qwen3-gqa", tmp_path)

    def lora_model(checkpointed: bool):
        converted = load_pretrained(tmp_path)
        torch.manual_seed(0)  # the adapters' initialization
        apply_lora(converted, dict(r=4, lora_alpha=8, lora_dropout=dropout, target_modules="all-linear"))
        generator = torch.Generator().manual_seed(2)
        with torch.no_grad():  # lora_B starts at zero: make the adapters' gradients depend on both factors
            for name, param in sorted(converted.model.named_parameters()):
                if "lora_" in name:
                    param.add_(torch.randn(param.shape, generator=generator) * 0.1)
        model = converted.model.train()
        return apply_activation_checkpointing(model, "full") if checkpointed else model

    ids, mask = _batch(96, padded=False)
    plain_model = lora_model(False)
    torch.manual_seed(5)  # the dropout masks
    plain = _loss_and_grads(plain_model, ids, mask, bf16=bf16)
    recorder = _Recorder(monkeypatch)
    model = lora_model(True)
    torch.manual_seed(5)
    checkpointed = _loss_and_grads(model, ids, mask, bf16=bf16)
    assert torch.equal(checkpointed[0], plain[0])
    assert checkpointed[1].keys() == plain[1].keys() and any("lora_A" in name for name in plain[1])
    for name, grad in plain[1].items():
        assert torch.equal(checkpointed[1][name], grad), name
    # the query, value and gate projections each keep the base matmul and the two adapter factors'
    assert sum(func in MATMULS for func, _ in recorder.kept) == 3 * 3 * len(model.layers)


@pytest.mark.parametrize("policy", ["gpu", "cpu"])
@pytest.mark.parametrize("keep", ["attention", "nothing"])
@pytest.mark.parametrize("family", ["qwen3-gqa", "qwen3moe-topk-norm", "gemma3-softcap-linear-untied"])
def test_what_a_checkpointed_block_keeps_can_be_chosen(family, tmp_path, monkeypatch, keep, policy):
    """TRL's ``gradient_checkpointing_kwargs={"selective": True}`` keeps the attention's results only, ``False``
    nothing (full recompute), on either device policy; the gradients stay bit-identical."""
    checkpoint_dir = tmp_path
    save_hf_model(family, checkpoint_dir)
    plain_model = _model(checkpoint_dir, checkpointed=False)
    ids, mask = _batch(plain_model.args.vocab_size, padded=True)
    plain = _loss_and_grads(plain_model, ids, mask, bf16=False)
    recorder = _Recorder(monkeypatch)
    model = apply_activation_checkpointing(load_pretrained(checkpoint_dir).model.train(), "full", keep=keep)
    calls = [0]
    for block in model.layers:  # a checkpointed block runs its forward twice
        block.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    with use_device_policy(policy):
        checkpointed = _loss_and_grads(model, ids, mask, bf16=False)
    assert torch.equal(checkpointed[0], plain[0])
    for name, grad in plain[1].items():
        assert torch.equal(checkpointed[1][name], grad), name
    assert calls[0] == 2 * len(model.layers)
    if keep == "attention":
        assert [func in ATTENTION for func, _ in recorder.kept] == [True] * (3 * len(model.layers))
    else:
        assert recorder.kept == [] and recorder.seen == 0


def test_the_trainer_reads_trls_selective_key():
    from hfnative import SFTConfig

    def keeps(**kwargs):
        config = SFTConfig(output_dir="unused", report_to="none", use_cpu=True, **kwargs)
        config.check_checkpointing()  # as a trainer does when it is built
        return config.checkpoint_keeps

    assert keeps(gradient_checkpointing=True) is None
    assert keeps(gradient_checkpointing=True, gradient_checkpointing_kwargs={"selective": True}) == "attention"
    assert keeps(gradient_checkpointing=True, gradient_checkpointing_kwargs={"selective": False}) == "nothing"
    with pytest.raises(ValueError, match="requires `gradient_checkpointing=True`"):
        keeps(gradient_checkpointing=False, gradient_checkpointing_kwargs={"selective": True})
    with pytest.raises(ValueError, match="non-reentrant"):
        keeps(gradient_checkpointing=True, gradient_checkpointing_kwargs={"selective": True, "use_reentrant": True})
    with pytest.raises(ValueError, match="keeps one of"):
        apply_activation_checkpointing(torch.nn.Module(), "full", keep="everything")


def test_torchs_variable_length_attention_is_kept_as_attention():
    try:
        import torch.nn.attention.varlen  # noqa: F401
    except ImportError:
        pytest.skip("this torch has no variable-length attention")
    assert torch.ops.torch_attn._varlen_attn.default in ATTENTION


def _tensor_bytes(value) -> int:
    """The bytes ``value``'s tensors take here (a DTensor's: its local tensor's, this rank's)."""
    return sum((t._local_tensor if isinstance(t, DTensor) else t).numel() * t.element_size()
               for t in torch.utils._pytree.tree_leaves(value) if isinstance(t, torch.Tensor))


class _KeptBytes:
    """The bytes of every result the forward kept (less those it let go again: ``_Keep.unread``)."""

    def __init__(self, monkeypatch):
        self.bytes, self.let_go = 0, 0
        keep, unread = selective_checkpoint._Keep.keep, selective_checkpoint._Keep.unread

        def recording(mode, func, out):
            keep(mode, func, out)
            self.bytes += _tensor_bytes(mode.kept[-1][1])

        def letting_go(mode, addend):
            before = [kept for _, kept, _ in mode.kept]
            unread(mode, addend)
            for was, (_, now, _) in zip(before, mode.kept):
                if now is not was:
                    self.bytes -= _tensor_bytes(was)
                    self.let_go += 1

        monkeypatch.setattr(selective_checkpoint._Keep, "keep", recording)
        monkeypatch.setattr(selective_checkpoint._Keep, "unread", letting_go)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("keep", ["attention_and_projections", "attention"])
@pytest.mark.parametrize("family", ["qwen3-gqa", "qwen3moe-topk-norm", "gemma3-softcap-linear-untied"])
def test_the_kept_bytes_estimate_is_what_a_block_keeps(family, tmp_path, monkeypatch, keep, bf16):
    """``kept_bytes_per_token`` (which the GPU policy's default weighs against the free memory) equals the bytes
    the checkpointed forward's kept results take, on a dense batch (one attention kernel a block)."""
    save_hf_model(family, tmp_path)
    model = apply_activation_checkpointing(load_pretrained(tmp_path).model.train(), "full", keep=keep)
    ids, mask = _batch(model.args.vocab_size, padded=False)
    counted = _KeptBytes(monkeypatch)
    _loss_and_grads(model, ids, None, bf16)
    element_size = 2 if bf16 else 4
    estimate = ids.numel() * sum(selective_checkpoint.kept_bytes_per_token(block, keep, element_size)
                                 for block in model.layers)
    assert counted.bytes == estimate


@pytest.mark.parametrize("available, expected", [
    (None, "attention_and_projections"), (10**12, "attention_and_projections"), ("between", "attention"),
    ("tight", "nothing"),
])
def test_the_gpu_default_keeps_what_fits(tmp_path, monkeypatch, available, expected):
    """With no choice made, the GPU policy keeps the attention and projections' results where they take at most half
    the device's free memory, else the attention's where those do, else nothing (full checkpointing); the gradients
    are the same whatever it keeps."""
    save_hf_model("qwen3-gqa", tmp_path)
    model = apply_activation_checkpointing(load_pretrained(tmp_path).model.train(), "full")
    ids, mask = _batch(model.args.vocab_size, padded=False)
    per_token = {keep: sum(selective_checkpoint.kept_bytes_per_token(block, keep, 4) for block in model.layers)
                 for keep in ("attention_and_projections", "attention")}
    # set aside first: the parameters' gradients the backward will make, the checkpointed blocks' fp32 inputs
    reserve = sum(p.numel() * 4 for p in model.parameters()) + len(model.layers) * ids.numel() * model.args.dim * 4
    if available == "between":  # room for the attention's results, not for the projections' too
        available = reserve + 2 * ids.numel() * per_token["attention"] + 2
    elif available == "tight":
        available = reserve + 2 * ids.numel() * per_token["attention"] - 2
    from hfnative.models import decoder

    monkeypatch.setattr(decoder, "available_device_bytes", lambda device: available)
    chosen = []
    real = decoder.selective_checkpoint_context
    monkeypatch.setattr(decoder, "selective_checkpoint_context", lambda keep: chosen.append(keep) or real(keep))
    _loss_and_grads(model, ids, None, bf16=False)
    assert set(chosen) <= {expected} and (chosen or expected == "nothing"), chosen


@pytest.mark.parametrize("bf16, weights", [(False, torch.float32), (True, torch.float32), (True, torch.bfloat16)],
                         ids=["fp32", "bf16-autocast", "bf16-weights-bf16-autocast"])
def test_the_kept_bytes_estimate_counts_lora_adapters(tmp_path, monkeypatch, bf16, weights):
    """A LoRA projection keeps its adapter's rank-wide product and the sum its up-projection's matmul makes (not the base
    product, that matmul's addend only)."""
    from hfnative.converters.peft import apply_lora

    save_hf_model("qwen3-gqa", tmp_path)
    converted = load_pretrained(tmp_path, dtype=weights)
    apply_lora(converted, dict(r=4, lora_alpha=8, target_modules="all-linear"))  # float32 adapters, as peft makes
    model = apply_activation_checkpointing(converted.model.train(), "full", keep="attention_and_projections")
    ids, _ = _batch(model.args.vocab_size, padded=False)
    counted = _KeptBytes(monkeypatch)
    _loss_and_grads(model, ids, None, bf16)
    estimate = ids.numel() * sum(selective_checkpoint.kept_bytes_per_token(block, "attention_and_projections",
                                                                           2 if bf16 else 4, autocast=bf16)
                                 for block in model.layers)
    assert counted.bytes == estimate
    assert counted.let_go == 3 * len(model.layers)  # the query, value and gate projections' base products


def test_dora_projections_leave_the_default_keeping_the_attention(tmp_path):
    """A DoRA projection also keeps weight-sized products (no count per token): the default keeps the attention's
    results only."""
    from hfnative.converters.peft import apply_lora

    save_hf_model("qwen3-gqa", tmp_path)
    converted = load_pretrained(tmp_path)
    apply_lora(converted, dict(r=4, lora_alpha=8, target_modules="all-linear", use_dora=True))
    blocks = list(converted.model.layers)
    assert selective_checkpoint.kept_bytes_per_token(blocks[0], "attention_and_projections", 4) is None
    assert selective_checkpoint.affordable_keep(blocks, 60, 4, 10**12) == "attention"


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
def test_an_8bit_bases_products_are_kept_as_matmuls(tmp_path, monkeypatch, bf16):
    """LoRA on an 8-bit base (load_in_8bit: the base product is one custom op, hfnative::int8_linear): a block that
    keeps its projections keeps that product as it keeps a matmul's (the bytes the estimate counts), and its
    gradients are bit-identical to the un-checkpointed model's."""
    from hfnative.converters.peft import apply_lora

    save_hf_model("qwen3-gqa", tmp_path)

    def adapted(checkpointed: bool):
        converted = load_pretrained(tmp_path)
        torch.manual_seed(0)  # the same adapters in both models
        apply_lora(converted, dict(r=4, target_modules=["q_proj", "v_proj", "gate_proj"], init_lora_weights="gaussian"),
                   load_in_8bit=True)
        model = converted.model.train()
        return apply_activation_checkpointing(model, "full", keep="attention_and_projections") if checkpointed else model

    ids, mask = _batch(adapted(False).args.vocab_size, padded=False)
    expected_loss, expected = _loss_and_grads(adapted(False), ids, None, bf16)
    model = adapted(True)
    counted = _KeptBytes(monkeypatch)
    loss, grads = _loss_and_grads(model, ids, None, bf16)
    assert torch.equal(loss, expected_loss) and grads.keys() == expected.keys() and grads
    assert all(torch.equal(grads[name], expected[name]) for name in grads), "gradients differ"
    element_size = 2 if bf16 else 4
    estimate = ids.numel() * sum(selective_checkpoint.kept_bytes_per_token(block, "attention_and_projections",
                                                                           element_size) for block in model.layers)
    assert counted.bytes == estimate
