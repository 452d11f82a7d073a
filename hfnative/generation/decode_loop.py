"""The decode loop's state, kept on the device, and the step that advances it: a generation of T tokens makes no
device->host sync and no host->device copy per token.

Shapes: B batch, P prompt slots, T new tokens, V vocabulary.

``DecodeBatch`` holds one batch shape's buffers (B rows, P prompt slots, T new tokens): the KV cache, the decoder's
tables (RoPE), the chosen tokens and their log-probs, each row's length and whether it has stopped, and the step
counter. They are made once per shape and refilled in place by ``start``, so a compiled step, and on CUDA the graph it
is captured in, reads and writes the same tensors at every call. ``advance`` is one step: decode the last chosen
token, choose the next, record it. A row that has stopped goes on being decoded (what it makes past its stop token is
cut on the host at the end, as its length says), so no step needs a value read back on the host.

``LiveRows`` learns on the host how many rows are still going without stalling the device, so a call whose rows all
stop early ends early, and one whose rows mostly stopped moves the others to the front of its buffers
(``compact_rows``, ``DecodeBatch.move_going_first``): the later steps decode only that front, a batch of views into the
same memory (no second cache). ``StepRunner`` runs a step eagerly, compiled, or replayed from a CUDA graph.
"""

from __future__ import annotations

import warnings
from collections import deque

import torch

from hfnative.models.decoder import Transformer

from .cached_decoder import DecoderTables, decode_step, prefill
from .kv_cache import KVCache
from .sampling import SamplingParams, choose_tokens


# the per-row state a call's outputs are read from, and what decoding reads besides the KV cache (seen_BV too, once made)
OUTPUT_STATE = ("tokens_BT", "logprobs_BT", "lengths_B", "finished_B", "origin_B")
ROW_STATE = OUTPUT_STATE + ("token_B", "keys_B")


class DecodeBatch:
    """One batch shape's buffers on ``device``, made once and refilled by ``start`` at every call of that shape.

    ``front(b)`` is the batch of its first b rows: views into the same buffers (cache included), sharing the step
    counter, stop ids and tables, kept per b with its own steps (a captured step holds the views' addresses, which are
    the buffers'). ``origin_B`` says which row of the call each row holds once rows have moved."""

    def __init__(self, model: Transformer, batch_size: int, prompt_slots: int, new_tokens: int,
                 cache_dtype: torch.dtype, device: torch.device):
        args = model.args
        B = self.B = batch_size
        self.P, self.T = prompt_slots, new_tokens
        self.cache = KVCache(
            [layer.is_sliding for layer in model.layers], args.sliding_window, B, args.n_kv_heads, args.head_dim,
            self.P + self.T, torch.zeros(B, dtype=torch.long, device=device), cache_dtype, device,
        )
        self.tables = DecoderTables(model, self.P + self.T, device)
        self.tokens_BT = torch.zeros(B, self.T, dtype=torch.long, device=device)
        self.logprobs_BT = torch.zeros(B, self.T, dtype=torch.float32, device=device)
        self.lengths_B = torch.zeros(B, dtype=torch.long, device=device)
        self.finished_B = torch.zeros(B, dtype=torch.bool, device=device)
        self.token_B = torch.zeros(B, dtype=torch.long, device=device)  # the last chosen token of each row
        self.origin_B = torch.arange(B, device=device)  # the row of the call each row holds (rows move to the front)
        self.step = torch.zeros((), dtype=torch.long, device=device)  # the index of the token chosen next
        self.keys_B = torch.zeros(B, dtype=torch.long, device=device)  # each row's sampling stream (seeded calls)
        self.seen_BV: torch.Tensor | None = None  # tokens each row has seen (repetition penalty), made when first asked
        self.stop_ids = torch.zeros(0, dtype=torch.long, device=device)
        self._stop_ids: dict[int, torch.Tensor] = {}  # one buffer per count of stop ids: a captured step keeps its own
        self.runners: dict[tuple, StepRunner] = {}  # this shape's steps by sampling kind (NativeRolloutEngine's)
        self.graph_weights: tuple | None = None  # the weights' addresses its (and its fronts') captured steps read
        self.vocab_size, self.device = args.vocab_size, device
        self.root, self._fronts = self, {}  # the batch whose buffers these are; its fronts by row count

    def start(self, model: Transformer, prompts: list[list[int]], sampling: SamplingParams,
              keys_B: torch.Tensor | None) -> torch.Tensor:
        """Refill for a call: each prompt left-padded to P slots, the call's stop ids, row keys (seeded calls) and seen
        tokens (a repetition penalty: the prompt's tokens count as seen, as in transformers); then prefill. Returns
        the logits of each prompt's last token [B, V]."""
        device, B = self.device, len(prompts)
        self.cache.reset(torch.tensor([self.P - len(p) for p in prompts], device=device))
        for buffer in (self.tokens_BT, self.logprobs_BT, self.lengths_B, self.finished_B, self.token_B, self.step):
            buffer.zero_()
        torch.arange(B, out=self.origin_B)
        self._set_stop_ids(torch.tensor(sampling.stop_ids, dtype=torch.long))
        if keys_B is not None:
            self.keys_B.copy_(keys_B)
        if sampling.repetition_penalty != 1.0:
            if self.seen_BV is None:
                self.seen_BV = torch.zeros(B, self.vocab_size, dtype=torch.bool, device=device)
            self.seen_BV.zero_()
            rows = torch.repeat_interleave(torch.arange(B), torch.tensor([len(p) for p in prompts]))
            self.seen_BV[rows.to(device), torch.tensor([t for p in prompts for t in p], device=device)] = True
        return prefill(model, prompts, self.P, self.cache, self.tables)

    def _set_stop_ids(self, stop_ids: torch.Tensor) -> None:
        n = stop_ids.shape[0]
        if n not in self._stop_ids:
            self._stop_ids[n] = torch.zeros(n, dtype=torch.long, device=self.device)
        self.stop_ids = self._stop_ids[n]
        self.stop_ids.copy_(stop_ids)

    def front(self, rows: int) -> "DecodeBatch":
        """The batch of the first ``rows`` rows of this one's buffers (views; made at first use and kept)."""
        root = self.root
        view = root._fronts.get(rows)
        if view is None:
            view = object.__new__(DecodeBatch)
            view.B, view.P, view.T, view.root, view._fronts = rows, root.P, root.T, root, {}
            view.cache, view.tables, view.step = root.cache.front(rows), root.tables, root.step
            for name in ROW_STATE:
                setattr(view, name, getattr(root, name)[:rows])
            view._stop_ids, view.runners = root._stop_ids, {}
            view.vocab_size, view.device = root.vocab_size, root.device
            root._fronts[rows] = view
        view.stop_ids = root.stop_ids  # this call's (one buffer per count of ids)
        view.seen_BV = None if root.seen_BV is None else root.seen_BV[:rows]
        return view

    def move_going_first(self, rows: int) -> "DecodeBatch":
        """Move the rows still going to the front, in order (a stable sort of the stop flags, on the device: nothing
        read on the host), the stopped ones after them, and return the front of ``rows`` rows, which holds every row
        still going when at most ``rows`` are. The outputs (and each row's place) move whole; what only decoding reads
        (KV cache, padding, last token, stream, seen tokens) only into the front (a stopped row's is never read
        again), the cache through a copy of at most ``rows`` rows of one layer at a time."""
        order_B = torch.sort(self.finished_B.to(torch.uint8), stable=True).indices
        for name in OUTPUT_STATE:
            buffer = getattr(self, name)
            buffer.copy_(buffer[order_B])
        kept = order_B[:rows]
        decoding = [self.token_B, self.keys_B, self.cache.pad_B, *self.cache.keys, *self.cache.values]
        for buffer in decoding + ([self.seen_BV] if self.seen_BV is not None else []):
            buffer[:rows] = buffer[kept]
        return self.front(rows)

    def outputs(self, moved: bool = False) -> tuple[list[list[int]], list[list[float]], list[bool]]:
        """Each row's tokens and log-probs up to its stop token (included), and whether it stopped, in the call's
        order: read once, at the end of the call. moved: rows have moved (``origin_B`` is read too)."""
        state = (self.tokens_BT, self.logprobs_BT, self.lengths_B, self.finished_B)
        if moved:  # row i of the call is where origin_B holds i
            at_B = torch.argsort(self.origin_B)
            state = tuple(buffer[at_B] for buffer in state)
        tokens, logprobs, lengths, finished = (buffer.tolist() for buffer in state)
        return [r[:n] for r, n in zip(tokens, lengths)], [r[:n] for r, n in zip(logprobs, lengths)], finished


def choose(batch: DecodeBatch, logits_BV: torch.Tensor, sampling: SamplingParams, seeded: bool) -> None:
    """Choose each row's next token from its logits [B, V] and record it at ``batch.step``; a row's length counts the
    tokens up to and including its first stop token. seeded: draw from the rows' streams (``batch.keys_B``)."""
    token_B, logprob_B = choose_tokens(logits_BV, sampling, batch.seen_BV, batch.keys_B if seeded else None, batch.step)
    at_1 = batch.step.reshape(1)
    batch.tokens_BT.index_copy_(1, at_1, token_B[:, None])
    batch.logprobs_BT.index_copy_(1, at_1, logprob_B[:, None])
    batch.lengths_B.add_(batch.finished_B, alpha=-1).add_(1)  # + 1 where not finished
    batch.finished_B.logical_or_((token_B[:, None] == batch.stop_ids[None, :]).any(-1))
    if batch.seen_BV is not None:
        batch.seen_BV.scatter_(1, token_B[:, None], True)
    batch.token_B.copy_(token_B)
    batch.step.add_(1)


def advance(model: Transformer, batch: DecodeBatch, sampling: SamplingParams, seeded: bool,
            read_upto: int | None = None, by_kernel: bool | None = None) -> None:
    """One decode step: the last chosen token of each row at its slot (P + step - 1), then the next token chosen.
    read_upto, by_kernel: as ``decode_step``'s (read_upto None: the whole cache, masked, one shape at every step; a
    fixed length past the slot written: that prefix of it, masked)."""
    slot = batch.step + (batch.P - 1)
    logits_BV = decode_step(model, batch.token_B, slot, batch.cache, batch.tables, read_upto, by_kernel)
    choose(batch, logits_BV, sampling, seeded)


class GraphCapture:
    """What an engine's captured steps share: the memory pool of their CUDA graphs (a step's temporaries are dead once
    it has run, and the graphs replay one at a time on one stream: what one graph keeps it keeps in the batch's
    buffers, allocated outside every graph), made at the first capture, so a graph per read length, batch shape and
    sampling kind does not each hold a step's temporaries; and whether a capture failed (``failed``: its error), after
    which no step of the engine tries again."""

    def __init__(self):
        self._pool, self.failed = None, None

    @property
    def pool(self):
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    def fail(self, error: Exception) -> None:
        # (a failed capture raises again as it ends: the op that broke it is the first error, its context)
        first = error.__context__ if isinstance(error.__context__, RuntimeError) else error
        if self.failed is None:
            warnings.warn(f"the decode step could not be captured in a CUDA graph ({first}); this engine's steps run "
                          "uncaptured from now on (NativeRolloutEngine(cuda_graph=False) says so without trying)",
                          stacklevel=3)
        self.failed = str(first)


class StepRunner:
    """Runs one batch shape's step, ``step()``, for one sampling kind: as it is (eager or compiled) or, with
    ``capture`` (a ``GraphCapture``), replayed from a CUDA graph captured at its third call (the first two, real steps,
    compile and warm up on a side stream, as capture asks), in the capture's memory pool. The graph holds the
    addresses the step read at capture: the batch's buffers and the model's parameters. A capture that fails (an op
    that cannot be captured) leaves the step running as it is, and the engine's other steps too."""

    WARMUP_CALLS = 2

    def __init__(self, step, capture: GraphCapture | None = None):
        self.step, self.capture = step, capture
        self.calls, self.graph = 0, None

    def __call__(self, *args) -> None:
        if self.graph is not None:
            self.graph.replay()
        elif self.capture is None or self.capture.failed is not None:
            self.step(*args)
        elif self.calls < self.WARMUP_CALLS:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.step(*args)
            torch.cuda.current_stream().wait_stream(side)
            self.calls += 1
        else:
            graph, stream = torch.cuda.CUDAGraph(), torch.cuda.current_stream()
            try:
                # thread_local: only this thread is barred from calls a capture cannot take (with torch's "global",
                # another thread's, e.g. a DataLoader pinning memory, would fail while the step is captured)
                with torch.cuda.graph(graph, pool=self.capture.pool, capture_error_mode="thread_local"):
                    self.step(*args)
            except RuntimeError as err:  # an op that cannot be captured: the step runs as it is from now on
                # (torch.cuda.graph ends a failed capture without restoring the stream it made current)
                torch.cuda.set_stream(stream)
                torch.cuda.synchronize()
                self.capture.fail(err)
                self.step(*args)
                return
            graph.replay()  # capture records the step without running it
            self.graph = graph


def compact_rows(live: int, rows: int, smallest: int) -> int | None:
    """The rows of the smaller batch ``live`` rows still going in a batch of ``rows`` move to: the power of two that
    holds them (at least ``smallest``), when it is at most half the batch (a batch of 24 rows moves once 8 are going,
    to 8); None: stay. Halving at least, a call moves rows at most log2(rows) times, and its copies of the cache add up
    to less than one cache; powers of two keep the shapes (compiled steps, CUDA graphs) few and shared between calls."""
    target = max(smallest, 1 << max(live - 1, 0).bit_length())
    return target if 2 * target <= rows else None


class LiveRows:
    """How many rows of a call are still going, learnt on the host without stalling the device. Every ``every`` steps
    a count of the device's going rows is queued to (pinned) host memory behind an event; the host reads a count once
    its event has passed, and waits for one only when it has queued ``lead`` steps beyond it (the device still has
    those to run), which bounds the steps launched after the rows stop. A count read is an upper bound on the rows
    going now (rows only stop), whatever batch they have moved to since. On the CPU each copy is done when queued: a
    call knows its count at every step, and nothing is waited for."""

    def __init__(self, device: torch.device, every: int = 8, lead: int = 32):
        self.cuda = device.type == "cuda"
        self.every, self.lead = (every, lead) if self.cuda else (1, 0)
        self.pending: deque[tuple[int, torch.Tensor, torch.cuda.Event | None]] = deque()
        self.known: int | None = None  # the latest count read (None: none yet)

    def count(self, step: int, finished_B: torch.Tensor) -> int | None:
        """After the tokens of ``step`` were chosen (queued): the most rows that may still be going, from the latest
        count read (None: none read yet)."""
        if (step + 1) % self.every == 0:
            count = torch.empty((), dtype=torch.long, pin_memory=self.cuda)
            count.copy_(finished_B.numel() - finished_B.sum(), non_blocking=True)
            event = None
            if self.cuda:
                event = torch.cuda.Event()
                event.record()
            self.pending.append((step, count, event))
        while self.pending:
            posted, count, event = self.pending[0]
            if event is not None and not event.query():
                if step - posted < self.lead:
                    break
                event.synchronize()
            self.pending.popleft()
            self.known = int(count.numpy())  # host memory the copy has landed in: reading it waits for nothing
        return self.known
