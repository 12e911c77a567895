"""Continuous-batching decode over paged KV: requests join and leave at every step.

    step = schedule -> run -> postprocess

- schedule: give every running request a cache slot for its next token, preempting the
  newest requests when the cache is full (their KV is dropped and recomputed when they are
  admitted again); then admit waiting requests, oldest first, while the batch is under
  `max_batch`, the predicted step time (`step_time_fn(batch_size, total_context_len)`)
  stays under `max_step_time_s` (the TBT SLO), and their blocks fit. A request admitted
  without its KV (new here, or preempted) is prefilled locally first; with a
  `PrefixCache`, the blocks of its longest cached prefix are reused, not computed.
- run: one forward pass over the batch, one new token per request. Guided requests' token
  masks are filled meanwhile, on the grammar engine's thread (model/grammar.py).
- postprocess: sample (the masks applied to the guided rows), stream the tokens
  (`TokenEvent`s), retire finished requests.

Every output token is sampled here, the first one too: a prefill node computes the KV of
the prompt but its last token, which the first decode step feeds (`DecodeSubmitMsg`). A
guided request's matcher is made when it is added (`bind_grammar`), from its spec and the
output it produced before, if it was placed again (`Sequence.num_resumed`); a preempted
request keeps its matcher, which has seen exactly its output.

A request of `params.n` > 1 choices is added as one `Sequence` (choice 0). Once admitted
and its prompt's KV is in the cache (prefilled here, or written by a prefill node), it is
forked: choices 1 .. n-1 share its blocks that are full of prompt KV (a reference each,
`BlockAllocator.share` / `PrefixCache.share`) and join the queue's front, ahead of the
requests that came after it. A choice writes only past the shared blocks: the last prompt
block, partly filled, is copied into a block of each choice's own (copy on write, as
vLLM's forked sequences). Under tensor parallelism (a copy here would miss the other
ranks' caches) or with no block free for the copies now, a choice instead gets its own
last block empty and recomputes those at most `block_tokens - 1` prompt tokens into it
on admission. The choices then decode as independent rows (a guided one with a copy of
the matcher). An abort ends every choice of its request; a choice's finish says whether
others go on (`TokenEvent.more_choices`).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, wait

import numpy as np
import torch

from mooncake.errors import ApiError, ConfigError
from mooncake.model.cudagraph import DecodeGraphs
from mooncake.model.grammar import GrammarEngine
from mooncake.model.kvcache import PagedKVCache
from mooncake.model.llama import Model
from mooncake.model.prefill import check_token_ids
from mooncake.model.prefixcache import PrefixCache
from mooncake.model.sampler import SamplingBatch, sample
from mooncake.model.sequence import Sequence, TokenEvent
from mooncake.model.step import StepBuilder

log = logging.getLogger(__name__)


class DecodeRunner:
    """Owns the running batch and the waiting queue of one decode instance."""

    def __init__(
        self,
        model: Model,
        cache: PagedKVCache,
        *,
        max_batch: int = 128,
        max_step_time_s: float | None = None,
        step_time_fn: Callable[[int, int], float] | None = None,
        chunk_tokens: int = 1024,
        prefix_cache: PrefixCache | None = None,
        cuda_graphs: bool | None = None,
        max_model_len: int = 0,
        grammar: GrammarEngine | None = None,
    ):
        """`cuda_graphs`: replay decode steps as CUDA graphs (None: on a GPU whose
        attention backend allows it), captured now for contexts up to `max_model_len`
        (0: the model's). `grammar`: the engine of guided requests (None: they are
        refused)."""
        assert model.is_first and model.is_last, "decode runs the whole model"
        self.model, self.cache, self.max_batch = model, cache, max_batch
        self.max_step_time_s, self.step_time_fn = max_step_time_s, step_time_fn
        self.chunk_tokens = chunk_tokens
        self.steps = StepBuilder(model, cache.block_tokens)
        self.graphs: DecodeGraphs | None = None
        on_gpu = model.inv_freq.device.type == "cuda"
        if cuda_graphs is None:
            cuda_graphs = on_gpu and model.attention.captures_graphs
        if cuda_graphs:
            if not on_gpu or not model.attention.captures_graphs:
                raise ConfigError(
                    "model.cuda_graphs needs a GPU and an attention backend that reads "
                    f"nothing from the host per step (triton), not {model.attention.name} "
                    f"on {model.inv_freq.device}"
                )
            max_len = max_model_len or model.spec.max_position_embeddings
            self.graphs = DecodeGraphs(model, cache, self.steps, max_batch, max_len)
        assert prefix_cache is None or prefix_cache.cache is cache, "a prefix cache of another"
        self.prefix_cache = prefix_cache
        assert grammar is None or grammar.num_words * 32 >= model.spec.vocab_size, (
            "a grammar engine of a smaller vocabulary",
            grammar.num_words,
            model.spec.vocab_size,
        )
        self.grammar = grammar
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order; preemption takes the last
        self.num_preemptions = 0
        self.num_prefill_tokens = 0  # tokens whose KV was computed here (prefill on admission)
        self._choices_left: dict[int, int] = {}  # seq_id -> its choices not finished
        self._to_fork: list[Sequence] = []  # admitted with their KV, choices not made yet

    def add(self, seq: Sequence) -> None:
        """Queue a request (with its KV in `seq.block_ids` already, or not); raises ApiError
        for token ids outside the vocabulary."""
        check_token_ids(seq.token_ids, self.model.spec.vocab_size)
        self.bind_grammar(seq)
        assert seq.seq_id not in self._choices_left, f"req {seq.seq_id} added twice"
        self._choices_left[seq.seq_id] = 1  # more once it forks
        self.waiting.append(seq)

    def bind_grammar(self, seq: Sequence) -> None:
        """Give a guided request its matcher, past the output it resumes with; raises
        ApiError (GrammarError) when it cannot. Thread-safe; a no-op for the others."""
        guided = seq.params.guided
        if guided is None or seq.grammar is not None:
            return
        if self.grammar is None:
            raise ApiError(
                "structured outputs are off on this node (its log says why): "
                f"{guided.kind} cannot be held"
            )
        seq.grammar = self.grammar.matcher(guided, seq.guided_ids)

    def abort(self, seq_id: int) -> list[TokenEvent]:
        """Drop every choice of a request wherever it is; returns their final events (the
        last one ends the request), or [] if unknown."""
        seqs = [s for s in [*self.running, *self.waiting] if s.seq_id == seq_id]
        for seq in seqs:
            self._retire(seq)
        self._to_fork = [s for s in self._to_fork if s.seq_id != seq_id]
        self._choices_left.pop(seq_id, None)
        events = [seq.finish("abort") for seq in seqs]
        for e in events[:-1]:
            e.more_choices = True
        return events

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def step(self) -> list[TokenEvent]:
        """One iteration; returns the tokens produced (and requests ended) in it."""
        events = self._schedule()
        if self.running:
            masks = self._start_masks()
            try:
                logits = self._run()
            finally:  # NOTE: the matchers are the mask thread's until it is done
                if masks is not None:
                    wait([masks])
            events += self._postprocess(logits, masks.result() if masks else None)
        return events

    def _start_masks(self) -> Future[np.ndarray] | None:
        """The guided rows' token masks, filled beside the forward pass; None without any."""
        rows = [(i, s.grammar) for i, s in enumerate(self.running) if s.grammar is not None]
        if not rows:
            return None
        assert self.grammar is not None
        return self.grammar.start_masks(rows, len(self.running))

    def _schedule(self) -> list[TokenEvent]:
        bt = self.cache.block_tokens
        for seq in list(self.running):
            while seq in self.running and (len(seq.token_ids) - 1) // bt >= len(seq.block_ids):
                ids = self._allocate(1)
                if ids is not None:
                    seq.block_ids += ids
                else:
                    self._preempt(self.running[-1])
        events = self._admit()
        while self._to_fork:  # NOTE: the choices join at the front, admitted right away
            parents, self._to_fork = self._to_fork, []
            for parent in parents:
                self._fork(parent)
            events += self._admit()
        return events

    def _admit(self) -> list[TokenEvent]:
        """Admit waiting requests, oldest first, while they fit (module docstring)."""
        events: list[TokenEvent] = []
        admitted: list[Sequence] = []
        context = sum(len(s.token_ids) for s in self.running)
        while self.waiting and len(self.running) < self.max_batch:
            seq = self.waiting[0]
            if self.running and self._too_slow(len(self.running) + 1, context + len(seq.token_ids)):
                break
            self._match_prefix(seq)
            need = self.cache.blocks_for(len(seq.token_ids)) - len(seq.block_ids)
            ids = self._allocate(need) if need > 0 else []
            if ids is None:
                self._unmatch_prefix(seq)
                if not self.running:  # it would not fit even alone
                    log.warning(
                        "req %d: %d tokens exceed the KV cache", seq.seq_id, len(seq.token_ids)
                    )
                    events += self.abort(seq.seq_id)
                    continue
                break
            self.waiting.popleft()
            seq.block_ids += ids
            self.running.append(seq)  # NOTE: before the fill, so a failed fill frees its blocks
            admitted.append(seq)
            if self.prefix_cache is not None:  # NOTE: filled and named before the next match
                self._fill_kv(admitted)
                admitted = []
            context += len(seq.token_ids)
        self._fill_kv(admitted)
        return events

    def _fork(self, parent: Sequence) -> None:
        """Make choices 1 .. n-1 of `parent` (its prompt's KV computed), sharing its blocks
        full of prompt KV and each with a copy of its partly filled last one, at the front
        of the queue."""
        n, bt = parent.params.n, self.cache.block_tokens
        num_cached = parent.num_cached_tokens
        num_shared = num_cached // bt
        shared = parent.block_ids[:num_shared]
        copies: list[int] | None = []
        if num_cached % bt:  # the last prompt block is partly filled
            copies = self._allocate(n - 1) if self.model.on_step is None else None
            if copies is not None:
                self.cache.copy_blocks([parent.block_ids[num_shared]] * (n - 1), copies)
        children = []
        for index in range(1, n):
            if self.prefix_cache is not None:
                self.prefix_cache.share(shared)
            else:
                self.cache.allocator.share(shared)
            if copies is None:  # NOTE: recomputed on admission
                children.append(parent.fork(index, list(shared), num_shared * bt))
            else:
                own = copies[index - 1 : index]
                children.append(parent.fork(index, [*shared, *own], num_cached))
        parent.is_forked = True
        self._choices_left[parent.seq_id] += n - 1
        self.waiting.extendleft(reversed(children))

    def _allocate(self, n: int) -> list[int] | None:
        if self.prefix_cache is not None:
            return self.prefix_cache.allocate(n)
        return self.cache.allocator.allocate(n)

    def _free(self, seq: Sequence) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.release(seq.token_ids, seq.block_ids, seq.num_cached_tokens)
        else:
            self.cache.free(seq.block_ids)
        seq.block_ids, seq.num_cached_tokens = [], 0

    def _match_prefix(self, seq: Sequence) -> None:
        """Start a request holding no KV at its longest cached prefix."""
        if self.prefix_cache is None or seq.block_ids:
            return
        seq.block_ids = self.prefix_cache.match(seq.token_ids)
        seq.num_cached_tokens = len(seq.block_ids) * self.cache.block_tokens
        if not seq.output_ids and not seq.num_preemptions:
            seq.num_reused_tokens = seq.num_cached_tokens

    def _unmatch_prefix(self, seq: Sequence) -> None:
        """Give back the prefix `_match_prefix` took for a request that must wait."""
        if self.prefix_cache is not None and seq.block_ids:
            self._free(seq)

    def _too_slow(self, batch_size: int, context_len: int) -> bool:
        if self.step_time_fn is None or self.max_step_time_s is None:
            return False
        return self.step_time_fn(batch_size, context_len) > self.max_step_time_s

    def _fill_kv(self, seqs: list[Sequence]) -> None:
        """Prefill locally whatever of each admitted request's token_ids[:-1] is not in
        the cache yet: the requests' chunks side by side in forwards of up to
        `chunk_tokens` tokens (short prompts share one, for larger matmuls). With a
        prefix cache one request at a time, so the next one admitted matches its prompt."""
        todo = [s for s in seqs if s.num_cached_tokens < len(s.token_ids) - 1]
        while todo:
            pieces, budget = [], self.chunk_tokens
            for s in todo:
                take = min(len(s.token_ids) - 1 - s.num_cached_tokens, budget)
                pieces.append((s, s.num_cached_tokens, s.num_cached_tokens + take))
                budget -= take
                if budget == 0:
                    break
            self._prefill_pieces(pieces)
            for s, start, end in pieces:
                s.num_cached_tokens = end
                self.num_prefill_tokens += end - start
            todo = [s for s in todo if s.num_cached_tokens < len(s.token_ids) - 1]
        if self.prefix_cache is not None:  # later requests may share their prompts from now on
            for s in seqs:
                self.prefix_cache.register(s.token_ids, s.block_ids, len(s.token_ids) - 1)
        self._to_fork += [s for s in seqs if not s.is_forked]

    @torch.inference_mode()
    def _prefill_pieces(self, pieces: list[tuple[Sequence, int, int]]) -> None:
        """One forward writing the KV of tokens [start, end) of each piece's request."""
        step = self.steps.build(
            [s.block_ids for s, _, _ in pieces],
            [end for _, _, end in pieces],
            [end - start for _, start, end in pieces],
            [t for s, start, end in pieces for t in s.token_ids[start:end]],
        )
        self.model.run_layers(step, self.cache.layer)

    def _preempt(self, seq: Sequence) -> None:
        log.info("req %d preempted: KV cache full", seq.seq_id)
        self.running.remove(seq)
        self._free(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    @torch.inference_mode()
    def _run(self) -> torch.Tensor:
        model, seqs = self.model, self.running
        lens = [len(s.token_ids) for s in seqs]
        tables, tokens = [s.block_ids for s in seqs], [s.token_ids[-1] for s in seqs]
        logits = None
        if self.graphs is not None:
            logits = self.graphs.run(tables, lens, tokens)
        if logits is None:
            step = self.steps.build(tables, lens, [1] * len(seqs), tokens)
            logits = model(step, self.cache.layer)  # (batch, vocab) float32
        for s, n in zip(seqs, lens, strict=True):
            s.num_cached_tokens = n
        return logits

    def _postprocess(self, logits: torch.Tensor, masks: np.ndarray | None) -> list[TokenEvent]:
        seqs = self.running
        params = [s.params for s in seqs]
        needs_history = any(p.has_penalty for p in params)
        batch = SamplingBatch.build(
            params,
            [s.seed for s in seqs],
            [len(s.token_ids) for s in seqs],
            [s.token_ids for s in seqs] if needs_history else None,
            [s.prompt_len for s in seqs] if needs_history else None,
            logits.device,
            torch.from_numpy(masks) if masks is not None else None,
            min_tokens_stops=[s.min_tokens_stops for s in seqs],
        )
        out = sample(logits, batch).to_host()
        events = [
            s.append(t, lp, top)
            for s, t, lp, top in zip(
                seqs, out.token_ids, out.logprobs, out.top_logprobs, strict=True
            )
        ]
        for s, e in [(s, e) for s, e in zip(seqs, events, strict=True) if s.is_finished]:
            self._retire(s)
            left = self._choices_left.pop(s.seq_id, 1) - 1
            if left:
                self._choices_left[s.seq_id] = left
            e.more_choices = left > 0
        return events

    def _retire(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.block_ids:
            self._free(seq)

    def run_until_done(self) -> dict[int, list[TokenEvent]]:
        """Step until every request has finished; events per request id (tests, benches)."""
        by_seq: dict[int, list[TokenEvent]] = {}
        while self.has_work:
            for e in self.step():
                by_seq.setdefault(e.seq_id, []).append(e)
        return by_seq
