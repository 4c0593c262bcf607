"""The batched decoding loop (continuous batching) running in its own thread.

Every step: take new requests and aborts, admit waiting sequences while the KV cache has blocks for them (a cached prefix is shared), run one
forward over every sequence's pending tokens (one for decoding sequences, several for prefill
chunks and jump-forward continuations), fill constraint bitmasks on a worker thread while the
forward runs, sample all rows in one sampler pass, then append tokens,
detokenize, check stops and report one delta per sequence. Finished sequences leave the batch at
the end of the step; nothing ever waits for another request to finish.

Host and device work overlap. A step's integer inputs go to the device in one non-blocking copy
from a reused pinned buffer, and so do the bitmasks (:mod:`server.engine.host_buffers`); the
forward is then only queued. With ``overlap`` (default: wherever the forward runs asynchronously,
i.e. not on the CPU) the loop does not wait for a step's sampled ids before launching the next
step (:mod:`server.engine.inflight`):

    schedule → launch forward N+1 (rows sampled at N take their token from the device)
             → read step N's ids (one event) → matchers, detokenizer, stops, forced tokens
             → fill the masks of the rows sampled at N+1 → queue sampling N+1 → deliver, retire

so everything the host does per token runs while the device computes the next forward. A row
that finished at N, or whose token at N was followed by forced tokens (jump-forward, reasoning
markers) or replaced (close_on_length), is not sampled at N+1: its logits are at a position it no
longer samples from, and at most that one forward row is wasted. Sampling sees the same rows,
masks and RNG draws as in the synchronous loop (``overlap=False``: read the ids right after
sampling, before the next launch), so the output is the same. Steps whose inputs need the tokens
on the host first (draft proposals) read them before scheduling.

The step reads the device back once: the sampler's ids together with any logprobs (one more
transfer only for rows asking for hidden states, and per scored choice). Rows with a device DFA
read its state when a token is accepted.

Each feature lives in its own module behind a small interface, so the loop reads in order:
:mod:`server.engine.intake` is where every token enters a sequence (with
:mod:`server.engine.reasoning_gate` and :mod:`server.engine.closing`);
:mod:`server.engine.mask_fill` fills the constraint bitmasks on the mask thread;
:mod:`server.engine.draft_verifier` feeds predicted-output drafts and keeps what sampling agrees
with; :mod:`server.engine.scoring` scores every choice of a choice request in one pass;
:mod:`server.engine.inflight` hands the overlapped loop's sampled ids from one step to the next.

Failures stay as small as they can: whatever fails for one sequence (its matcher, detokenizer,
stop strings or sink) ends only that sequence with finish_reason "error"; a failed forward or
sampler pass ends only the sequences of that step. No step hangs on a row: every call into a
row's constraint (mask fill, accepting tokens, forced tokens, drafts) or client logit processor
runs under a time bound on a worker thread (:mod:`server.engine.row_calls`, one hand-off per
batch of calls); a call over it is abandoned with its matcher, and only its row ends. The
waiting queue is bounded (:class:`AdmissionControl`), and if the thread dies anyway every
pending sequence gets a final error delta and :attr:`Engine.alive` turns False.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from functools import partial

import torch

from kernels.cpu_fused import cpu_fused_ops
from sampler import Sampler
from sampler.params import PendingSample
from sampler.pool import to_device
from server.engine.admission import AdmissionControl
from server.engine.block_manager import BlockManager, BlockTable
from server.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from server.engine.draft_verifier import DraftVerifier
from server.engine.drafts import Draft
from server.engine.errors import EngineDead, EngineOverloaded, EngineUnavailable
from server.engine.failures import CONSTRAINT_LIMIT, CONSTRAINT_TIMEOUT, describe
from server.engine.host_buffers import HostStaging
from server.engine.inflight import SAMPLED, InFlight, device_event, resolve
from server.engine.intake import TokenIntake
from server.engine.kernel_warmup import WarmupTarget, warm_up_kernels
from server.engine.mask_fill import MaskFill
from server.engine.model import ModelRunner
from server.engine.overlap_policy import OverlapPolicy
from server.engine.prompt_lookup import PromptLookup
from server.engine.quantized_weights import dense_prompt_counts
from server.engine.row_calls import RowCalls
from server.engine.scheduler import Scheduler
from server.engine.scoring import ChoiceScorer
from server.engine.sequence import GenerationRequest, Sequence, SequenceDelta, error_delta
from server.engine.speculation import Speculator
from server.engine.step_batch import StepBatch
from server.engine.vision.step_inputs import StepVision

__all__ = ["CONSTRAINT_LIMIT", "CONSTRAINT_TIMEOUT", "Engine", "EngineDead", "EngineOverloaded", "EngineStats",
           "EngineUnavailable"]

log = logging.getLogger("trellis.engine")

DEFAULT_MAX_WAITING_SEQS = 256
DEFAULT_MAX_WAITING_TOKENS = 262144
DEFAULT_MAX_DRAFT_TOKENS = 32  # predicted-output tokens verified per sequence per step
DEFAULT_CONSTRAINT_CALL_TIMEOUT = 5.0  # seconds a per-row constraint or logit processor call may take


@dataclass
class EngineStats:
    steps: int = 0
    decode_tokens: int = 0
    extend_tokens: int = 0
    forced_tokens: int = 0
    draft_tokens: int = 0  # draft tokens fed for verification (predictions and prompt lookup)
    accepted_draft_tokens: int = 0  # of those, kept in the output
    lookup_draft_tokens: int = 0  # prompt-lookup draft tokens fed (part of draft_tokens)
    accepted_lookup_draft_tokens: int = 0
    scored_choices: int = 0  # choices scored as a whole sequence (choice logprobs)
    closing_steered: int = 0  # tokens close_on_length chose instead of the sampled one
    mask_fill_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    sampled_in_graph: int = 0  # sampler passes replayed from the runner's sampling graphs
    sampled_eagerly: int = 0  # sampler passes run by the eager sampler
    overlapped_steps: int = 0  # forwards launched before the previous step's tokens were read
    failed_sequences: int = 0  # finished with "error"
    failed_batches: int = 0  # forward or sampler passes that raised
    failed_steps: int = 0  # steps that raised out of Engine.step (a bug): the running batch failed


@dataclass
class StepPlan:
    """What one step runs: one-token decode rows, (sequence, tokens fed) extensions, choice
    scoring branches, and the rows that get a token sampled if nothing changes before."""

    decode_rows: list[Sequence]
    extend_plan: list[tuple[Sequence, int]]
    scoring: list
    candidates: list[Sequence]

    @property
    def rows(self) -> list[Sequence]:
        return self.decode_rows + [seq for seq, _ in self.extend_plan] + [seq for seq, _ in self.scoring]


class Engine:
    """Owns the model runner, the sampler and all sequences; thread-safe ``submit_all``/``abort``."""

    def __init__(
        self,
        runner: ModelRunner,
        tokenizer,
        *,
        max_batch_size: int,
        max_model_len: int,
        prefill_budget: int = 1024,
        jump_forward: bool = True,
        max_waiting_seqs: int = DEFAULT_MAX_WAITING_SEQS,
        max_waiting_tokens: int = DEFAULT_MAX_WAITING_TOKENS,
        max_draft_tokens: int = DEFAULT_MAX_DRAFT_TOKENS,
        enable_prefix_caching: bool = True,
        mask_fill_threads: int = 0,
        overlap: bool | None = None,
        speculation: bool = True,
        constraint_call_timeout: float = DEFAULT_CONSTRAINT_CALL_TIMEOUT,
        warm_up: bool | None = None,
    ) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        # every per-row call into a constraint backend or a client logit processor (0: no bound)
        self.bound = RowCalls(constraint_call_timeout, self._fail)
        self.sampler = Sampler(runner.vocab_size, runner.device, run_processor=self.bound.calls.call)
        self._graph_sampler = getattr(runner, "graph_sampler", None)  # a GraphedRunner's in-graph sampling pass
        self.max_batch_size = max_batch_size
        self.max_model_len = max_model_len
        self.prefill_budget = prefill_budget
        self.speculation = speculation  # prompt-lookup drafts for the constrained sequences that allow them
        self.max_draft_tokens = max_draft_tokens
        self.stats = EngineStats()
        self.last_step_at = time.monotonic()
        self._admission = AdmissionControl(max_waiting_seqs, max_waiting_tokens)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.blocks = BlockManager(runner.kv.num_blocks, runner.block_size, enable_prefix_caching)
        if self.blocks.capacity_tokens < max_model_len:
            raise ValueError(f"the KV cache holds {self.blocks.capacity_tokens} tokens, less than one "
                             f"sequence of max_model_len {max_model_len}")
        # a runner that computes each row alone (quantized, float32 packed panels) computes a token the
        # same way whatever shares its step and however its prompt was chunked: prompts cut at blocks
        chunk_multiple = runner.block_size if getattr(runner, "attends_outputs_alone", False) else 1
        self.scheduler = Scheduler(self.blocks, max_batch_size, prefill_budget, chunk_multiple)
        # the features, each behind its own small interface
        self.intake = TokenIntake(tokenizer, max_model_len=max_model_len, jump_forward=jump_forward,
                                  stats=self.stats, fail=self._fail)
        self.scorer = ChoiceScorer(self.blocks, runner, runner.vocab_size, self.intake, self.stats, self._fail)
        self.drafts = DraftVerifier(self.scheduler, self.stats, prefill_budget=prefill_budget,
                                    max_draft_tokens=max_draft_tokens, max_model_len=max_model_len)
        # 0: one fill thread per masked row up to one per core beside a GPU; on the CPU the
        # forward's torch threads already use every core, so the fill keeps to one thread
        fill_threads = mask_fill_threads if mask_fill_threads > 0 else int(runner.device.type != "cuda")
        self.masks = MaskFill(runner.vocab_size, runner.device, fill_threads, self.stats, self.bound.calls)
        self._step_staging = HostStaging(runner.device)  # the step's integer arrays (StepBatch.build)
        self.vision = StepVision(runner) if getattr(runner, "family", None) is not None else None
        self._step_hidden: torch.Tensor | None = None  # [C, D] for this step's sampling candidates
        # None: where the forward runs asynchronously, i.e. not on the CPU (see the module docstring)
        self.overlap = runner.device.type != "cpu" if overlap is None else overlap
        self.policy = OverlapPolicy(self.overlap)  # per step: launch before reading, or read first
        self._forward_events: tuple | None = None  # recorded around this step's forward launch
        self._forward_tokens = 0  # tokens this step's forward fed (the speculation policy's cost fit)
        self._forward_launch_s = 0.0  # host seconds this step's forward took to launch
        self._inflight: InFlight | None = None  # the last sampler pass, not yet read by the host
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        # None: where Triton compiles kernels (CUDA), every kind of step once before serving
        if runner.device.type == "cuda" if warm_up is None else warm_up:
            warm_up_kernels(WarmupTarget(runner, self.sampler, self.masks, max_batch_size, max_model_len))
        if runner.device.type == "cpu":  # the sampler's bitmask op: built (once per machine) before serving
            cpu_fused_ops()

    @property
    def jump_forward(self) -> bool:
        """Tokens a constraint forces are appended without sampling them."""
        return self.intake.jump_forward

    @jump_forward.setter
    def jump_forward(self, on: bool) -> None:
        self.intake.jump_forward = on

    @property
    def mask_fill_threads(self) -> int:
        return self.masks.threads

    # ------------------------------------------------------------------ public, any thread

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="trellis-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        """Stop the thread; sequences still pending get a final error delta."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.bound.shutdown()

    def submit(self, request: GenerationRequest) -> None:
        """Queue one sequence (see :meth:`submit_all`)."""
        self.submit_all([request])

    def check_admission(self, num_seqs: int, num_tokens: int) -> None:
        """Raise EngineOverloaded/EngineDead as :meth:`submit_all` would, without queueing anything."""
        self._admission.check(num_seqs, num_tokens)

    def submit_all(self, requests: list[GenerationRequest]) -> None:
        """Queue all sequences of one API request, or none of them.

        Deltas arrive through each ``request.sink`` (called on the engine thread).

        Raises:
            EngineOverloaded: the waiting queue has no room for all of them (``retry_after`` s).
            EngineDead: the engine thread has stopped.
        """
        if not requests:
            return

        def enqueue() -> None:
            for request in requests:
                self._inbox.put(("add", request))

        self._admission.reserve([len(r.prompt_token_ids) for r in requests], enqueue)
        self._wake.set()

    def abort(self, request_id: str) -> None:
        """Drop every sequence of ``request_id`` within one step (e.g. the client went away)."""
        self._inbox.put(("abort", request_id))
        self._wake.set()

    @property
    def alive(self) -> bool:
        """The engine thread is running and has not crashed."""
        thread = self._thread
        return thread is not None and thread.is_alive() and self._error is None and not self._stop.is_set()

    @property
    def error(self) -> BaseException | None:
        """What killed the engine thread (None while it lives or after a clean shutdown)."""
        return self._error

    @property
    def num_running(self) -> int:
        """Sequences in the running batch."""
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Sequences submitted but not yet running (including those not yet seen by the thread)."""
        return self._admission.waiting_seqs

    @property
    def waiting_tokens(self) -> int:
        """Prompt tokens of the waiting sequences."""
        return self._admission.waiting_tokens

    @property
    def admission(self) -> AdmissionControl:
        """The waiting queue's counters and the rates it measures (:mod:`server.engine.queue_wait`)."""
        return self._admission

    @property
    def kv_usage(self) -> float:
        """Fraction of the KV cache's blocks held by running sequences."""
        return self.blocks.usage

    # ------------------------------------------------------------------ engine thread

    def _loop(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # anything that ends the thread must be visible
            self._error = exc
            log.critical("engine thread died", exc_info=exc)
        finally:
            self._close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.scheduler.running and not self.scheduler.waiting and self._inbox.empty():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
            else:
                try:
                    self.step()
                except Exception as exc:  # a bug in the step itself: only the running batch pays
                    log.exception("engine step failed")
                    self.stats.failed_steps += 1
                    self._fail_running(f"engine step failed: {describe(exc)}")
            self.last_step_at = time.monotonic()

    def _close(self) -> None:
        """The thread ends: refuse new work, give every pending sequence a final error delta."""
        reason = f"engine stopped: {describe(self._error)}" if self._error else "engine shut down"
        try:
            self._admission.close(reason)
            self._fail_running(reason)
            waiting, self.scheduler.waiting = self.scheduler.waiting, []
            for seq in waiting:
                self._fail(seq, reason)
                self._deliver(seq)
                seq.row.release()
            for request in self._pending_adds():
                _send_quietly(request, error_delta(request, reason))
        except BaseException:
            log.exception("closing the engine failed")

    def _pending_adds(self) -> list[GenerationRequest]:
        requests = []
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return requests
            if kind == "add":
                requests.append(payload)

    @torch.inference_mode()
    def step(self) -> None:
        """One step: schedule → launch the forward → read the previous step's tokens (in the
        overlapped loop, while the device computes) → fill the masks → sample → report, retire."""
        started = time.perf_counter()
        self._drain_inbox()
        self._admit()
        if self._inflight is not None and self._needs_tokens_first():
            self._process_inflight()
        if self.scheduler.running:
            self.stats.steps += 1
            self._run(self._schedule())
        else:
            self._process_inflight()
        self._report_and_retire()
        self._admission.stepped(time.perf_counter() - started, self.stats)  # the expected-wait rates

    def _schedule(self) -> StepPlan:
        decode_rows, extend_plan = self.bound.plan_drafts(self.drafts.plan, *self.scheduler.schedule())
        scoring = self.scorer.plan(self.scheduler.running)
        candidates = decode_rows + [seq for seq, take in extend_plan if take == len(seq.pending) and not seq.scoring]
        return StepPlan(decode_rows, extend_plan, scoring, candidates)

    def _run(self, plan: StepPlan) -> None:
        # the matchers are current unless a pass is in flight: then the fill waits for its tokens
        fill = None if self._inflight is not None else self.masks.start(plan.candidates)
        try:
            logits = self._launch(plan)
        except Exception as exc:
            self.masks.wait_quietly(fill)  # its matchers must be idle before anyone touches them again
            self._process_inflight()  # the previous step's tokens are good
            self._fail_batch(plan.rows, f"model forward failed: {describe(exc)}")
            return
        sampled = plan.candidates
        if self._inflight is not None:
            self._process_inflight()  # overlapped: the device runs this step's forward meanwhile
            # a row whose last token ended it, or was followed by forced or replaced tokens, has
            # logits at a position it no longer samples from
            sampled = [seq for seq in plan.candidates if not seq.finished and not seq.pending]
            fill = self.masks.start(sampled)
        bitmask, indices = self.masks.finish(fill, sampled, self._fail, self.bound.abandon)
        self.policy.record_fill(1000 * self.masks.last_fill_s if fill is not None else 0.0)
        if logits is not None and sampled:
            self._sample(self._select_rows(logits, plan.candidates, sampled), sampled, bitmask, indices)
        drafting = [(seq, len(seq.output_ids)) for seq in sampled if seq.verify]
        if drafting or not self.policy.launch_first:
            self._process_inflight()
        self.drafts.verify(drafting, self._sample_draft_position)
        self._finish_scoring(plan.scoring)

    def _launch(self, plan: StepPlan) -> torch.Tensor | None:
        if self._inflight is not None:
            self.stats.overlapped_steps += 1
        try:
            return self._forward(plan.decode_rows, plan.extend_plan, plan.scoring)
        finally:
            self.scorer.free_branches(plan.scoring)

    def flush(self) -> None:
        """Read the tokens of a pass still in flight and report them (benchmarks, shutdown)."""
        with torch.inference_mode():
            self._process_inflight()
            self._report_and_retire()

    def _needs_tokens_first(self) -> bool:
        """Whether this step reads the in-flight tokens before it schedules: in the synchronous
        order (the loop's setting, or the policy's choice) and when draft proposals continue
        from them."""
        return not self.policy.launch_first or self.drafts.wants_tokens_first(self.scheduler.running)

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._add(payload)
            else:
                self._abort(payload)

    def _add(self, request: GenerationRequest) -> None:
        try:
            seq = self._new_sequence(request)
        except Exception as exc:
            log.warning("sequence of %s could not start: %s", request.request_id, describe(exc))
            self.stats.failed_sequences += 1
            self._admission.dropped(len(request.prompt_token_ids))
            _send_quietly(request, error_delta(request, f"sequence could not start: {describe(exc)}"))
            return
        self.scheduler.waiting.append(seq)

    def _new_sequence(self, request: GenerationRequest) -> Sequence:
        lora = self.runner.lora
        if request.adapter and (lora is None or not 0 < request.adapter <= len(lora.adapters)):
            raise ValueError(f"LoRA adapter id {request.adapter} is not loaded")
        row = self.sampler.new_row(request.params, request.prompt_token_ids)
        if request.token_dfa is not None and request.reasoning is None:
            row.attach_dfa(request.token_dfa)
        seq = Sequence(
            request=request,
            row=row,
            detokenizer=IncrementalDetokenizer(
                self.tokenizer, request.skip_special_tokens, request.spaces_between_special_tokens
            ),
            stops=StopStringMatcher(request.stop, request.include_stop_str_in_output, request.stop_regex),
            pending=_prompt_keys(request),
            matcher=request.matcher if request.reasoning is None else None,
            reasoning=request.reasoning,
            table=BlockTable(salt=request.adapter),
        )
        if seq.reasoning is not None:  # may hand the sequence to its constraint at once
            self.bound.run([(seq, partial(self.intake.reasoning.enter, seq))], "starting the constraint")
        seq.draft = self._speculator(request)
        if request.score_choices:
            ChoiceScorer.start(seq)
        return seq

    def _speculator(self, request: GenerationRequest) -> Speculator | None:
        """The sequence's draft sources: its prediction, and prompt lookup for a constrained
        sequence (extraction, tool calls: values copied from the prompt) unless speculation is
        off (server or request), the request scores choices instead of generating, or it wants
        hidden states (a verified draft token has none of its own, as a forced one). Free text
        does not draft: prompt lookup keeps under one draft token in ten there, and the mixed
        steps its drafts make cost more than that saves (``benchmarks/serve.py --speculation-ab``)."""
        prediction = Draft(request.prediction_token_ids) if request.prediction_token_ids else None
        lookup = None
        constrained = request.matcher is not None or request.token_dfa is not None
        if self.speculation and request.speculation and constrained and not request.score_choices \
                and not request.return_hidden_states:
            lookup = PromptLookup(request.prompt_token_ids)
        if prediction is None and lookup is None:
            return None
        return Speculator(prediction, lookup, self.max_draft_tokens)

    def _abort(self, request_id: str) -> None:
        for seq in self.scheduler.waiting + self.scheduler.running:
            if seq.request.request_id == request_id:
                seq.aborted = True
                seq.finish("abort")
        waiting = self.scheduler.waiting
        self.scheduler.waiting = [s for s in waiting if not s.aborted]
        for seq in waiting:
            if seq.aborted:  # running ones are reported and freed at the end of the step
                self._admission.dropped(len(seq.request.prompt_token_ids))
                self._deliver(seq)
                seq.row.release()

    def _admit(self) -> None:
        admitted, too_long = self.scheduler.admit()
        self._admission.admitted(admitted)
        for seq in too_long:
            self._admission.dropped(len(seq.request.prompt_token_ids))
            self._fail(seq, f"the sequence needs {len(seq.pending)} tokens of KV cache, more than the "
                            f"whole cache holds ({self.blocks.capacity_tokens})")
            self._deliver(seq)
            seq.row.release()

    @staticmethod
    def _prompt_tokens(rows, decode_rows, extend_plan) -> list[int]:
        """Per row, how many of its new tokens are prompt tokens (0 for scored choices); a
        quantized runner routes them apart."""
        seqs = decode_rows + [seq for seq, _ in extend_plan]
        counts = [max(0, min(len(new), len(seq.request.prompt_token_ids) - start))
                  for seq, (_, new, start) in zip(seqs, rows, strict=False)]
        return counts + [0] * (len(rows) - len(seqs))

    def _forward(self, decode_rows, extend_plan, scoring=()) -> torch.Tensor | None:
        """One model pass over every scheduled row; logits [R, V] for the rows that get a token
        this step (decode rows, then extensions whose pending tokens are all fed). Rows that
        verify a draft keep their per-position logits in ``seq.verify_logits``; choice-scoring
        rows are scored on the spot."""
        rows = [(seq.table.blocks, seq.pending[:1], seq.cached_len) for seq in decode_rows]
        rows += [(seq.table.blocks, seq.pending[:take] + seq.verify, seq.cached_len) for seq, take in extend_plan]
        rows += self.scorer.rows(scoring)
        if not rows:
            return None
        counts = [1] * len(decode_rows) + [1 + len(seq.verify) for seq, _ in extend_plan]
        counts += [len(new) for _, new, _ in rows[len(counts) :]]
        started = time.perf_counter()
        adapters = [seq.request.adapter for seq in decode_rows] + [seq.request.adapter for seq, _ in extend_plan]
        adapters += [seq.request.adapter for seq, choices in scoring for _ in choices]
        seqs = None if self.vision is None else (
            decode_rows + [seq for seq, _ in extend_plan] + [seq for seq, choices in scoring for _ in choices])
        prompt_counts = self._prompt_tokens(rows, decode_rows, extend_plan)
        # prompts a cache block per call (the same calls whatever the chunking or the prefix cache
        # hit); a float32 runner's steps without prompt tokens keep the batched attention (each
        # output token alone cost its drafts ~20%): only the quantized runners' drafts keep their bits
        quantized = getattr(self.runner, "quantized", None) is not None
        alone = quantized or (getattr(self.runner, "attends_outputs_alone", False) and any(prompt_counts))
        if quantized and any(prompt_counts):  # a prompt's last block is taken as output tokens are
            lengths = [len(seq.request.prompt_token_ids) for seq in decode_rows] + \
                [len(seq.request.prompt_token_ids) for seq, _ in extend_plan]
            lengths += [0] * (len(rows) - len(lengths))
            prompt_counts = dense_prompt_counts([start for _, _, start in rows], prompt_counts, lengths,
                                                self.runner.block_size)
        batch = StepBatch.build(rows, self.runner.block_size, self.runner.device,
                                logit_counts=counts if max(counts) > 1 else None, row_adapters=adapters,
                                staging=self._step_staging, prompt_counts=prompt_counts if alone else None,
                                position_offsets=self.vision.position_offsets(seqs) if seqs else None)
        if seqs:
            batch.media = self.vision.step_media(seqs, rows, self.runner.device)
        self._gather_sampled(decode_rows, extend_plan, batch)
        if self.policy.enabled:  # the forward's device time, for the overlap policy
            self._forward_events = (device_event(self.runner, timing=True), device_event(self.runner, timing=True))
            self._forward_events[0].record()
        logits = self.runner.forward(batch)
        if self._forward_events is not None:
            self._forward_events[1].record()
        elapsed = time.perf_counter() - started
        self.stats.forward_s += elapsed
        # the speculation policy prices decode and draft steps from their own costs: a step
        # with prompt tokens is left out of its fit (a prompt token can cost far less than an
        # output token: quantized runners take prompts through dense weights, GEMMs are
        # cheaper per row for a long chunk), else drafts would look cheaper than they are
        self._forward_tokens = 0 if any(prompt_counts) else int(batch.tokens.shape[0])
        self._forward_launch_s = elapsed
        if self.runner.device.type == "cpu":  # synchronous: the wall time is the forward's cost
            self.drafts.policy.record(self._forward_tokens, elapsed)
        first_rows = None  # with per-position logits: each row's first position
        if batch.logit_counts is not None:
            logits, first_rows = self._split_logits(logits, counts, extend_plan, scoring, len(decode_rows))
        for seq in decode_rows:
            seq.table.commit(seq.pending[:1])
            seq.pending.clear()
        self.stats.decode_tokens += len(decode_rows)
        complete = list(range(len(decode_rows)))
        for i, (seq, take) in enumerate(extend_plan):
            seq.table.commit(seq.pending[:take] + seq.verify)
            del seq.pending[:take]
            self.stats.extend_tokens += take
            if not seq.pending and not seq.scoring:
                complete.append(len(decode_rows) + i)
        self._step_hidden = None
        if len(complete) == len(decode_rows) + len(extend_plan) == logits.shape[0]:
            self._keep_hidden(decode_rows, extend_plan, first_rows, None)
            return logits
        if not complete:
            return None
        keep = to_device(complete, torch.long, logits.device)
        self._keep_hidden(decode_rows, extend_plan, first_rows, keep)
        return logits[keep]

    def _gather_sampled(self, decode_rows, extend_plan, batch: StepBatch) -> None:
        """Rows fed the token sampled last step take it from the device (overlapped loop):
        they are decode rows, so row i's token is token i of the batch."""
        inflight = self._inflight
        if inflight is None:
            return
        positions, rows = [], []
        for i, seq in enumerate(decode_rows):
            if seq.pending[0] == SAMPLED:
                positions.append(i)
                rows.append(inflight.row_of(seq))
        if any(SAMPLED in seq.pending[:take] for seq, take in extend_plan):
            raise RuntimeError("a sampled token still on the device was scheduled in an extension")
        if positions:
            inflight.gather_into(batch.tokens, positions, rows)

    def _keep_hidden(self, decode_rows, extend_plan, first_rows, keep: torch.Tensor | None) -> None:
        """The sampled rows' last-layer hidden states of this forward, when a sequence asks for them."""
        if any(s.request.return_hidden_states for s in decode_rows) or any(
            s.request.return_hidden_states for s, _ in extend_plan
        ):
            hidden = self.runner.last_hidden
            hidden = hidden if first_rows is None else hidden[first_rows]
            self._step_hidden = hidden if keep is None else hidden[keep]

    def _select_rows(self, logits: torch.Tensor, candidates: list[Sequence], sampled: list[Sequence]) -> torch.Tensor:
        """The logits (and hidden states) of ``sampled``, a subsequence of ``candidates``."""
        if len(sampled) == len(candidates):
            return logits
        position = {id(seq): i for i, seq in enumerate(candidates)}
        index = to_device([position[id(seq)] for seq in sampled], torch.long, logits.device)
        if self._step_hidden is not None:
            self._step_hidden = self._step_hidden.index_select(0, index)
        return logits.index_select(0, index)

    def _sample(self, logits: torch.Tensor, sampled: list[Sequence], bitmask, indices) -> None:
        """Queue the sampler pass over ``sampled``: each row's next token stays on the device
        (:data:`SAMPLED` in its pending tokens) until :meth:`_process_inflight` reads it."""
        started = time.perf_counter()
        try:
            pending = self._run_sampler(logits, [s.row for s in sampled], bitmask, indices)
        except Exception as exc:
            self._fail_batch(sampled, f"sampler failed: {describe(exc)}")
            return
        event = device_event(self.runner)
        event.record()
        hidden_rows = [i for i, seq in enumerate(sampled) if seq.request.return_hidden_states]
        hidden = self._step_hidden
        if hidden is not None and hidden_rows:  # a copy: a graph's buffer is overwritten next step
            hidden = hidden.index_select(0, to_device(hidden_rows, torch.long, hidden.device))
        for seq in sampled:
            seq.pending = [SAMPLED]
        self._inflight = InFlight(sampled, pending, event, hidden if hidden_rows else None, hidden_rows,
                                  forward_events=self._forward_events, forward_tokens=self._forward_tokens,
                                  forward_launch_s=self._forward_launch_s)
        self._forward_events = None  # draft positions sampled after it have no forward of their own
        self.stats.sample_s += time.perf_counter() - started

    def _process_inflight(self) -> None:
        """Read the in-flight pass's tokens and take each into its sequence (matcher, stops,
        detokenizer, forced tokens); nothing when no pass is in flight."""
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return
        try:
            result = inflight.wait()
            hidden = inflight.hidden_lists()
            forward_ms = inflight.forward_ms()
            self.policy.record_forward(forward_ms)
            if forward_ms is not None:
                self.drafts.policy.record_launched(inflight.forward_tokens, forward_ms / 1000, inflight.forward_launch_s)
        except Exception as exc:
            for seq in inflight.seqs:
                resolve(seq, 0)  # the placeholder must not stay in the cache's token record
            self._fail_batch(inflight.seqs, f"sampler failed: {describe(exc)}")
            return
        for i, message in result.failures.items():  # a row's own processing failed (client code)
            self._fail(inflight.seqs[i], message)
        constrained = []  # their matchers take the token under the time bound, in one batch
        for i, (seq, token, logprob) in enumerate(zip(inflight.seqs, result.token_ids, result.logprobs)):
            fed = resolve(seq, token)
            if i in hidden and not seq.finished:
                seq.step_hidden.append(hidden[i])
            if seq.request.matcher is None or seq.finished:
                self.intake.take_sampled(seq, token, logprob, fed)
            else:
                constrained.append((seq, partial(self.intake.take_sampled, seq, token, logprob, fed)))
        self.bound.run(constrained, "taking a token")

    def _run_sampler(self, logits: torch.Tensor, rows, bitmask, indices) -> PendingSample:
        """The in-graph sampling pass when the runner has one and every row qualifies, else the
        eager sampler (same tokens for greedy rows, same distributions for the others)."""
        pending = None
        if self._graph_sampler is not None:
            pending = self._graph_sampler.sample_async(logits, rows, bitmask, indices)
        if pending is not None:
            self.stats.sampled_in_graph += 1
            return pending
        self.stats.sampled_eagerly += 1
        return self.sampler.sample_async(logits, rows, bitmask, indices)

    # ------------------------------------------------------------------ predicted outputs

    def _sample_draft_position(self, rows: list[tuple[Sequence, int]]) -> None:
        """One sampler pass over the logits after draft token ``i`` of each (row, i)."""
        seqs = [seq for seq, _ in rows]
        logits = torch.stack([seq.verify_logits[position] for seq, position in rows])
        bitmask, indices = self.masks.finish(self.masks.start(seqs), seqs, self._fail, self.bound.abandon)
        hidden, self._step_hidden = self._step_hidden, None  # no forward of its own: no hidden states
        try:
            self._sample(logits, seqs, bitmask, indices)
            self._process_inflight()
        finally:
            self._step_hidden = hidden

    def _split_logits(self, logits, counts, extend_plan, scoring, n_decode) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-position logits [sum(counts), V] → one row per decode/extension row (its first
        position); the rest go to ``seq.verify_logits`` and to choice scoring."""
        starts = [0]
        for count in counts[:-1]:
            starts.append(starts[-1] + count)
        for i, (seq, _) in enumerate(extend_plan):
            if seq.verify:
                start = starts[n_decode + i]
                seq.verify_logits = logits[start + 1 : start + 1 + len(seq.verify)]
        row = n_decode + len(extend_plan)
        for seq, choices in scoring:
            for choice, _slot in choices:
                self.scorer.score(seq, choice, logits[starts[row] : starts[row] + counts[row]])
                row += 1
        first = to_device(starts[: n_decode + len(extend_plan)], torch.long, logits.device)
        return logits[first], first

    # ------------------------------------------------------------------ choice scoring

    def _finish_scoring(self, plan) -> None:
        """Emit the choices scored in full; a constrained one through its matcher, under the bound."""
        self.scorer.finish([(seq, choices) for seq, choices in plan if seq.matcher is None])
        self.bound.run([(seq, partial(self.scorer.finish, [(seq, choices)])) for seq, choices in plan
                        if seq.matcher is not None], "emitting a scored choice")

    # ------------------------------------------------------------------ failures

    def _fail(self, seq: Sequence, message: str, *, replace_finish: bool = False) -> None:
        """End ``seq`` with finish_reason "error" (reported and freed at the end of the step).

        A sequence already finished keeps its finish unless ``replace_finish`` (and it was
        neither aborted nor reported yet)."""
        if seq.closed or seq.aborted or seq.finish_reason == "error":
            return
        if seq.finished and not replace_finish:
            return
        log.warning("sequence of %s failed: %s", seq.request.request_id, message)
        self.stats.failed_sequences += 1
        seq.fail(message)

    def _fail_batch(self, seqs: list[Sequence], message: str) -> None:
        log.error("batch of %d sequences failed: %s", len(seqs), message)
        self.stats.failed_batches += 1
        for seq in seqs:
            self._fail(seq, message)

    def _fail_running(self, message: str) -> None:
        """Fail and free every running sequence without touching the KV cache (it may be what broke)."""
        self._inflight = None
        for seq in self.scheduler.release_all():
            self._fail(seq, message)
            self._deliver(seq)
            seq.row.release()

    # ------------------------------------------------------------------ reporting

    def _report_and_retire(self) -> None:
        """Report the step's deltas and free the finished sequences (in the overlapped loop this
        runs while the device computes the step just launched)."""
        for seq in self.scheduler.running:
            if seq.step_tokens or seq.finished:
                self._deliver(seq)
            self.blocks.register_full_blocks(seq.table)
        for seq in [s for s in self.scheduler.running if s.finished]:
            self._release(seq)
        if self.overlap and self.scheduler.waiting:
            self._report_preempted()

    def _report_preempted(self) -> None:
        """Sequences preempted while their last token was in flight took it afterwards."""
        for seq in self.scheduler.waiting:
            if seq.admitted and (seq.step_tokens or seq.finished):
                self._deliver(seq)
        done = [seq for seq in self.scheduler.waiting if seq.finished and seq.admitted]
        for seq in done:
            self.scheduler.waiting.remove(seq)
            seq.row.release()

    def _deliver(self, seq: Sequence) -> None:
        """Send the step's delta; a sink that raises fails only its own sequence."""
        if seq.closed:
            return
        seq.closed = seq.finished
        try:
            seq.request.sink(seq.take_delta())
        except Exception as exc:
            log.warning("delivering output of %s failed: %s", seq.request.request_id, describe(exc))
            if not seq.finished:
                self._fail(seq, f"output sink failed: {describe(exc)}")
                seq.closed = True
                _send_quietly(seq.request, seq.take_delta())  # one last try: it may have been transient

    def _release(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks (its full ones stay in the prefix cache) and sampler row."""
        self.scheduler.release(seq)
        self._admission.finished(len(seq.output_ids))
        seq.row.release()


def _prompt_keys(request: GenerationRequest) -> list[int]:
    """The prompt as the KV bookkeeping holds it: image positions keyed by the image's content."""
    if request.media is None:
        return list(request.prompt_token_ids)
    return request.media.cache_ids(request.prompt_token_ids)


def _send_quietly(request: GenerationRequest, delta: SequenceDelta) -> None:
    try:
        request.sink(delta)
    except Exception:
        log.exception("delivering output of %s failed", request.request_id)
