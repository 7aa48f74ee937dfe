"""LLMEngine: tokenizes, admits and aborts requests, and runs one scheduler step at a time.

With --kv-offload it also owns the KV connector and its store (engine/kv_offload.py):
its stats, the admin operations (pin, unpin, flush) and its shutdown. A segmented prompt
(engine/blend) goes to the `Blender`, which hands it to the scheduler once blended.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

import kvkernels
from engine.blend import Blender, SegmentedTokens, Segments, split_text, tokenize_segments
from engine.builtin_models import resolve_model
from engine.config import ConfigError, EngineConfig, host_memory, resident_memory
from engine.cpu_seat import SeatKeeper, wants_seat_keeper
from engine.cpu_threads import bind_threads, plan_for_this_process
from engine.detokenizer import IncrementalDetokenizer
from engine.hashing import BlockHasher, ModelFingerprint
from engine.kv_cache_manager import KVCacheManager
from engine.kv_events import KVEventsEndpointError, start_kv_events
from engine.kv_offload import build_connector
from engine.kv_security import warn_if_shared_without_secret
from engine.logprobs import PromptLogprobs, SampleLogprobs, logprob_entries, token_text_function
from engine.model_runner import KVLoadError, ModelRunner, SampledTokens, allocate_kv_cache
from engine.models import ModelSpec, load_model, load_tokenizer, tokenizer_digest
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams, SamplingParamsError
from engine.scheduler import Scheduler, SchedulerOutput
from engine.structured_output import Grammar, GrammarCompiler

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_MEMORY = 1024**3
CUDA_KV_CACHE_FRACTION = 0.5
# How long an idle step (only KV loads or remote index probes in flight) waits for one to finish.
LOAD_WAIT_S = 0.01


Failure = tuple[Request, str]  # a request that made its step raise, and the error


class DuplicateRequestError(ValueError):
    """A request id that is already in flight was submitted again."""


@dataclass
class _Tracked:
    """Engine-side bookkeeping of one request beyond what the scheduler keeps."""

    request: Request
    prompt: str | None
    detokenizer: IncrementalDetokenizer
    sent_tokens: int = 0
    logprobs: SampleLogprobs = field(default_factory=list)  # vLLM's, of the output tokens so far
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, once all are computed


@dataclass
class _Group:
    """A request with n > 1: its sequences run as requests `{id}/{index}` (seed + index
    with a seed, as vLLM), reported together as one RequestOutput of n completions."""

    request_id: str
    sequence_ids: list[str]
    completions: list[CompletionOutput | None]
    error: str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # sequence 0's (the one that computes them)

    @property
    def finished(self) -> bool:
        return all(c is not None and c.finish_reason is not None for c in self.completions)


class LLMEngine:
    def __init__(self, config: EngineConfig, *, resident_host_memory: bool = False,
                 owns_process: bool = False) -> None:
        """`resident_host_memory`: fault in the store's host memory before returning
        (KVConnector.make_resident; a server asks for it), on a thread of its own while
        the weights are packed and the fused ops compiled. `owns_process`: the engine is
        the process's reason to be (a server), so on CPU it sizes and binds the intra-op
        threads of the thread building it per --cpu-threads-bind; an engine inside someone
        else's process (`LLM(...)`) does so only when the option was given, and otherwise
        leaves torch's threads as its caller set them."""
        self.device = resolve_device(config.device)
        manages_threads = owns_process or "cpu_threads_bind" in config.model_fields_set
        self.thread_plan = plan_for_this_process(config.cpu_threads_bind) \
            if self.device.type == "cpu" and manages_threads else None
        if self.thread_plan is not None:
            torch.set_num_threads(self.thread_plan.num_threads)  # bound below, once compiled
        torch.manual_seed(config.seed)
        kvkernels.set_backend(config.attention_backend)
        model_path = resolve_model(config.model)
        self.model, self.spec = load_model(model_path, config.dtype, self.device)
        self.dtype = next(self.model.parameters()).dtype
        self.tokenizer = load_tokenizer(model_path, config.tokenizer)
        self._token_text = token_text_function(self.tokenizer)  # logprobs' decoded tokens
        if config.chat_template is not None:
            self.tokenizer.chat_template = config.chat_template
        self.model_path = model_path
        self.config = config.model_copy(
            update={"model": model_path, "max_model_len": self._max_model_len(config.max_model_len)}
        )
        self.fingerprint = model_fingerprint(
            self.spec, self.dtype, config.block_size, tokenizer_digest(self.tokenizer)
        )
        self.num_kv_blocks = self._num_kv_blocks()
        kv_cache = allocate_kv_cache(
            self.num_kv_blocks, self.spec.num_layers, config.block_size,
            self.spec.num_kv_heads, self.spec.head_dim, self.dtype, self.device,
        )
        self.connector = build_connector(self.config, kv_cache, self.fingerprint.digest)
        try:
            with _meanwhile(self.connector.make_resident if resident_host_memory else None):
                self.model.pack_weights()
                if config.fuse_elementwise:
                    self.model.fuse_large_steps()
        except BaseException:
            self.connector.close()
            raise
        warn_if_shared_without_secret(self.config)
        self.seat_keeper: SeatKeeper | None = None
        if self.thread_plan is not None:
            plan = self.thread_plan
            if wants_seat_keeper(config.cpu_seat_keeper, plan):
                self.seat_keeper = SeatKeeper()  # before binding: a child inherits its parent thread's CPUs
            bind_threads(plan)
            logger.info("%s%s", plan.summary(), ", seat keeper on" if self.seat_keeper else "")
        self.kv_cache_manager = KVCacheManager(self.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        try:
            self.kv_events = start_kv_events(config.kv_events_config, config.block_size)
        except KVEventsEndpointError as exc:
            self.connector.close()
            if self.seat_keeper is not None:
                self.seat_keeper.close()
            raise ConfigError("kv_events_config", str(exc)) from None
        if self.kv_events is not None:
            self.kv_cache_manager.block_pool.listener = self.kv_events.device
            self.connector.watch_blocks(self.kv_events.tiers)
        self.block_hasher = BlockHasher(self.fingerprint.digest, config.block_size)
        self.scheduler = Scheduler(self.config, self.kv_cache_manager, self.block_hasher, self.connector)
        self.runner = ModelRunner(self.model, kv_cache, config.block_size, self.connector)
        self.blender = Blender(self.config, self.runner, self.kv_cache_manager, self.scheduler, self.connector,
                               self.block_hasher)
        self.grammars = GrammarCompiler(self.tokenizer, self.spec.vocab_size, self.spec.eos_token_ids)
        self._tracked: dict[str, _Tracked] = {}
        self._groups: dict[str, _Group] = {}  # requests with n > 1, by id
        self._sequences: dict[str, tuple[_Group, int]] = {}  # their sequences' ids -> (group, index)

    # ---- requests -------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int] | Segments,
        params: SamplingParams,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        group: str | None = None,
    ) -> Request:
        """Tokenize and queue a request (n > 1: its n sequences, see _Group); a segmented
        one (`Segments`, `SegmentedTokens`, or text with --kv-blend-separator) with n = 1 is
        blended. Requests of one `group` (the prompts of one API call; default: this
        request alone) share one place in the scheduler's fair admission. Raises
        ValueError subclasses for bad input."""
        if request_id in self._tracked or request_id in self._groups:
            raise DuplicateRequestError(f"request id {request_id!r} is already in flight")
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if asked is not None and asked > self.config.max_logprobs:
                raise SamplingParamsError(name, f"at most {self.config.max_logprobs} (--max-logprobs), got {asked}")
        token_ids = self.encode(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty")
        if any(t < 0 or t >= self.spec.vocab_size for t in token_ids):
            raise ValueError(f"prompt token ids must be in [0, {self.spec.vocab_size})")
        arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        ids = [f"{request_id}/{index}" for index in range(params.n)] if params.n > 1 else [request_id]
        grammars = [self._grammar(params) for _ in ids]  # each sequence follows its own
        requests = [
            Request(
                request_id=sequence_id,
                prompt_token_ids=list(token_ids),
                sampling_params=_sequence_params(params, index),
                eos_token_ids=frozenset(self.spec.eos_token_ids),
                cache_salt=cache_salt,
                arrival_time=arrival_time,
                grammar=grammars[index],
            )
            for index, sequence_id in enumerate(ids)
        ]
        # n > 1 shares one prefill among its sequences (a group), which a blend does not do,
        # and prompt logprobs need the logits of every prompt position, which a blend does
        # not compute: such a request runs as the plain prompt
        blended = (params.n == 1 and params.prompt_logprobs is None and self.blender.accepts(token_ids)
                   and self.blender.add(requests[0], token_ids))
        if not blended:
            self.scheduler.add_request(requests[0], requests[1:], group or request_id)
        text = prompt if isinstance(prompt, str) else None
        for request in requests:
            detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids)
            self._tracked[request.request_id] = _Tracked(request, text, detok)
        if params.n > 1:
            group = self._groups[request_id] = _Group(request_id, ids, [None] * params.n)
            self._sequences.update((sequence_id, (group, i)) for i, sequence_id in enumerate(ids))
        return requests[0]

    def _grammar(self, params: SamplingParams) -> Grammar | None:
        """The structured-output state of one new sequence (GrammarError if it cannot be
        compiled)."""
        if params.structured_outputs is None:
            return None
        return self.grammars.compile(params.structured_outputs)

    def abort_request(self, request_ids: Iterable[str]) -> None:
        """Abort requests (every sequence of one with n > 1); unknown ids are ignored."""
        ids = []
        for rid in request_ids:
            group = self._groups.get(rid)
            ids += [rid] if group is None else self._forget_group(group)
        ids = [rid for rid in ids if rid in self._tracked]
        self.blender.abort(ids)
        self.scheduler.abort_requests(ids)
        for rid in ids:
            self._forget(rid)
        self._hold_seat()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self.blender.has_waiting()

    def encode(
        self, prompt: str | Sequence[int] | Segments, separator: str | None = None
    ) -> list[int] | SegmentedTokens:
        """Token ids of a prompt; `SegmentedTokens` for segments, or for text that the
        separator (`separator`, else --kv-blend-separator) splits."""
        if isinstance(prompt, SegmentedTokens):
            return prompt
        if isinstance(prompt, str):
            segments = split_text(prompt, separator or self.config.kv_blend_separator)
            if segments is None:
                return self._encode_text(prompt, True)
            prompt = segments
        if isinstance(prompt, Segments):
            return tokenize_segments(self._encode_text, prompt, add_special_tokens=True)
        return list(prompt)

    def _encode_text(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def encode_chat(
        self, messages: list[dict], chat_template: str | None = None, add_generation_prompt: bool = True,
        separator: str | None = None,
    ) -> list[int] | SegmentedTokens:
        """`messages` through the chat template (`chat_template`, else the model's or
        --chat-template's), tokenized; segmented where the separator (`separator`, else
        --kv-blend-separator) occurs in a message."""
        separator = separator or self.config.kv_blend_separator
        if separator and any(separator in m["content"] for m in messages):
            text = self.tokenizer.apply_chat_template(
                messages, chat_template=chat_template, add_generation_prompt=add_generation_prompt, tokenize=False)
            segments = split_text(text, separator)
            if segments is not None:  # the template carries its own special tokens
                return tokenize_segments(self._encode_text, segments, add_special_tokens=False)
        encoded = self.tokenizer.apply_chat_template(
            messages, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
            tokenize=True, return_dict=False,
        )
        return list(encoded)

    # ---- the step loop --------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, and report every request that changed. A request
        that makes the step raise fails alone (finish reason "error"); see `_isolate`.
        Blended prefills run first, so their requests take part in this step."""
        self._hold_seat()
        try:
            return self._step()
        finally:
            self._hold_seat()

    def _hold_seat(self) -> None:
        """The seat keeper holds the CPU share while any request is unfinished."""
        if self.seat_keeper is not None:
            self.seat_keeper.hold(self.has_unfinished_requests())

    def _step(self) -> list[RequestOutput]:
        outputs = [self._make_output(self._tracked[r.request_id], "", []) for r in self.blender.step()]  # failed
        out = self.scheduler.schedule()
        if not out.requests:
            if self.scheduler.num_loading:
                self.connector.wait_for_loads(LOAD_WAIT_S)
            else:
                self.blender.wait_for_probes(LOAD_WAIT_S)
            return outputs
        sampled, failures = self._execute(out)
        outputs += self._fail(failures)
        finished = {r.request_id for r in self.scheduler.update_from_output(out, sampled)}
        for request in out.requests:
            if request.request_id not in sampled and request.request_id not in finished:
                continue
            tracked = self._tracked.get(request.request_id)
            if tracked is not None:
                outputs.append(self._output_for(tracked))
        return self._grouped(outputs)

    def _grouped(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """The outputs of the sequences of a request with n > 1 merged into one output of
        that request (each completion with its index), where the first of them was."""
        merged: list[RequestOutput] = []
        by_group: dict[str, RequestOutput] = {}
        for output in outputs:
            group, index = self._sequences.get(output.request_id, (None, 0))
            if group is None:
                merged.append(output)
                continue
            group.completions[index] = dataclasses.replace(output.outputs[0], index=index)
            group.error = group.error or output.error
            if index == 0 and output.prompt_logprobs is not None:
                group.prompt_logprobs = output.prompt_logprobs
            known = by_group.get(group.request_id)
            if known is None:
                known = by_group[group.request_id] = dataclasses.replace(
                    output, request_id=group.request_id, new_token_ids=[]
                )
                merged.append(known)
            known.new_token_ids += output.new_token_ids
            if output.finished:  # the group finishes with its last sequence: its timings
                known.metrics = output.metrics
        for output in by_group.values():
            group = self._groups[output.request_id]
            output.outputs = [c for c in group.completions if c is not None]
            output.finished, output.error = group.finished, group.error
            output.prompt_logprobs = group.prompt_logprobs
            if output.finished:
                self._forget_group(group)
        return merged

    def _forget_group(self, group: _Group) -> list[str]:
        """Drop a request with n > 1 from the books; its sequences' ids."""
        del self._groups[group.request_id]
        for sequence_id in group.sequence_ids:
            del self._sequences[sequence_id]
        return group.sequence_ids

    def _output_for(self, tracked: _Tracked) -> RequestOutput:
        """Detokenize the new tokens, apply stop strings, and build the request's output.

        While a request runs, text that could still be the start of a stop string is held
        back, so a streamed prefix never has to be taken back."""
        request = tracked.request
        new_ids = request.output_token_ids[tracked.sent_tokens :]
        tracked.sent_tokens = request.num_output_tokens
        delta = tracked.detokenizer.append(new_ids)
        stops = request.sampling_params.stop
        text = tracked.detokenizer.text
        if stops:
            stop_string = tracked.detokenizer.check_stop(stops, len(delta))
            if stop_string is not None:
                text = tracked.detokenizer.text
                request.stop_reason = stop_string
                if not request.is_finished:
                    self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)
            elif not request.is_finished:
                text = text[: max(0, len(text) - (max(map(len, stops)) - 1))]
        return self._make_output(tracked, text, new_ids)

    def _make_output(self, tracked: _Tracked, text: str, new_ids: list[int]) -> RequestOutput:
        request = tracked.request
        if request.is_finished:
            self._forget(request.request_id)
        with_logprobs = request.sampling_params.logprobs is not None
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=list(request.output_token_ids),
            finish_reason=request.finish_reason,
            logprobs=self._logprobs_of(tracked) if with_logprobs else None,
            top_logprobs=list(request.output_top_logprobs) if with_logprobs else None,
            stop_reason=request.stop_reason,
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=tracked.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=request.is_finished,
            metrics=request_metrics(request),
            error=request.error,
            new_token_ids=new_ids,
            prompt_logprobs=self._prompt_logprobs_of(tracked),
        )

    def _logprobs_of(self, tracked: _Tracked) -> SampleLogprobs:
        """vLLM's logprobs of the request's output tokens, each token's built once."""
        request, built = tracked.request, tracked.logprobs
        for position in range(len(built), len(request.output_logprobs)):
            built.append(logprob_entries(
                request.output_token_ids[position], request.output_logprobs[position],
                request.output_top_logprobs[position], self._token_text,
            ))
        return list(built)

    def _prompt_logprobs_of(self, tracked: _Tracked) -> PromptLogprobs | None:
        """vLLM's prompt logprobs of the request once all are computed (built once)."""
        request = tracked.request
        if tracked.prompt_logprobs is None and request.sampling_params.prompt_logprobs is not None \
                and not request.num_prompt_logprobs_missing:
            tracked.prompt_logprobs = [None] + [
                logprob_entries(token_id, logprob, top, self._token_text)
                for token_id, logprob, top in zip(
                    request.prompt_token_ids[1:], request.prompt_logprobs, request.prompt_top_logprobs, strict=True
                )
            ]
        return tracked.prompt_logprobs

    def _execute(self, out: SchedulerOutput) -> tuple[SampledTokens, list[Failure]]:
        """Run the step; if it raises, find the requests that make it raise."""
        try:
            return self.runner.execute(out), []
        except KVLoadError as exc:  # the loaded KV may be half written: nothing can run again
            logger.exception("KV load failed; failing the %d requests of this step", len(out.requests))
            return {}, [(request, _describe(exc)) for request in out.requests]
        except Exception as exc:  # one bad request must not take its batch down
            logger.exception("model step failed; running its %d requests again without the "
                             "failing ones", len(out.requests))
            return self._isolate(out, exc)

    def _isolate(self, out: SchedulerOutput, error: Exception) -> tuple[SampledTokens, list[Failure]]:
        """Bisect a failed step: run each half again (which rewrites whatever KV the failed
        run left) and a half that fails again recursively; a request failing on its own is
        a culprit, and the KV its step left is zeroed. The parts skip the connector: this step's loads are in the cache, its
        saves are dropped (they would copy the culprits' KV)."""
        if len(out.requests) == 1:
            self.runner.clear_step_kv(out)
            return {}, [(out.requests[0], _describe(error))]
        sampled: SampledTokens = {}
        failures: list[Failure] = []
        middle = len(out.requests) // 2
        for part in (_part(out, slice(None, middle)), _part(out, slice(middle, None))):
            try:
                sampled.update(self.runner.execute(part))
            except Exception as exc:
                part_sampled, part_failures = self._isolate(part, exc)
                sampled.update(part_sampled)
                failures += part_failures
        return sampled, failures

    def _fail(self, failures: list[Failure]) -> list[RequestOutput]:
        """Finish failed requests with their error; their final outputs."""
        for request, message in failures:
            request.error = message
        self.scheduler.finish_requests([r.request_id for r, _ in failures], RequestStatus.FINISHED_ERROR)
        outputs = []
        for request, _ in failures:
            tracked = self._tracked.get(request.request_id)
            if tracked is not None:
                outputs.append(self._make_output(tracked, tracked.detokenizer.text, []))
        return outputs

    def _forget(self, request_id: str) -> None:
        self._tracked.pop(request_id, None)
        self.runner.release(request_id)

    # ---- sizing and stats -----------------------------------------------------------------

    @property
    def block_bytes(self) -> int:
        per_token = 2 * self.spec.num_layers * self.spec.num_kv_heads * self.spec.head_dim
        return per_token * self.config.block_size * self.dtype.itemsize

    def _max_model_len(self, requested: int | None) -> int:
        limit = self.spec.max_position_embeddings
        if requested is not None and requested > limit:
            raise ConfigError("max_model_len", f"{requested} exceeds the model's max_position_embeddings ({limit})")
        return requested or limit

    def _num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        budget = self.config.kv_cache_memory
        if budget is None and self.config.gpu_memory_utilization is not None:
            budget = _kv_memory_from_share(self.device, self.config.gpu_memory_utilization)
        if budget is None:
            budget = _default_kv_cache_memory(self.device)
        blocks = budget // self.block_bytes
        if blocks < 1:
            raise ConfigError("kv_cache_memory", f"{budget} bytes is smaller than one KV block ({self.block_bytes} bytes)")
        return int(blocks)

    def stats(self) -> dict:
        """Flat counters (scheduler, device pool, `kv_*` connector counters), plus
        `kv_tiers` (see kv_store_stats) when a store is configured."""
        stats = dict(self.scheduler.stats())
        stats.update(num_kv_blocks=self.num_kv_blocks, block_size=self.config.block_size)
        stats.update(self.blender.stats())
        stats.update(self.connector.stats())
        if self.config.kv_offload:
            stats["kv_tiers"] = self.kv_store_stats()
        return stats

    # ---- KV store administration ----------------------------------------------------------
    # Each raises connectors.KVStoreNotConfiguredError when there is no --kv-offload.

    def kv_store_stats(self) -> dict[str, dict]:
        """Per tier: store counters, hit/miss tokens, usage, health and latency histograms
        (the `kv_tiers` contract of engine/server/metrics.py)."""
        return self.connector.tier_stats()

    def kv_pin(
        self, token_ids: Sequence[int], ttl: float | None = None, cache_salt: str | None = None
    ) -> dict[str, int | str]:
        """Keep the stored chunks of this prompt's prefix in the cpu and disk tiers for
        `ttl` seconds (None: until unpinned); chunks not saved yet are pinned when saved.
        Takes token ids: a prompt is tokenized before it reaches the engine thread. The
        answer says how many chunks are pinned and stored, and, when that is not every
        chunk of the prompt, why (`reason`): a pin that does nothing must say so."""
        chunks, stored = self.connector.pin(self.block_hasher.hashes(token_ids, cache_salt), ttl)
        chunk_tokens = self.config.kv_chunk_tokens
        answer: dict[str, int | str] = {
            "pinned_chunks": chunks, "pinned_tokens": chunks * chunk_tokens, "stored_chunks": stored,
        }
        if chunks == 0:
            answer["reason"] = (
                f"nothing to pin: the prompt has {len(token_ids)} tokens, fewer than one chunk "
                f"({chunk_tokens} tokens), and the store keeps whole chunks only"
            )
        elif stored < chunks:
            answer["reason"] = (
                f"{chunks - stored} of the {chunks} chunks are not stored yet (this prompt was not "
                "computed, or its chunks were evicted): they stay pinned from when a request saves them"
            )
        return answer

    def kv_unpin(self, token_ids: Sequence[int], cache_salt: str | None = None) -> dict[str, int]:
        return {"unpinned_chunks": self.connector.unpin(self.block_hasher.hashes(token_ids, cache_salt))}

    def kv_stored_in(self, token_ids: Sequence[int], tier: str, cache_salt: str | None = None) -> tuple[int, int]:
        """(leading full blocks of `token_ids` that `tier` holds, full blocks in all): whether
        a prompt's KV has reached a shared tier, for a decode instance to load it."""
        hashes = self.block_hasher.hashes(token_ids, cache_salt)
        return self.connector.stored_blocks_in(hashes, tier), len(hashes)

    def kv_flush(self, tiers: Sequence[str] | None = None) -> concurrent.futures.Future[dict[str, int]]:
        """Start dropping this model's unpinned chunks from the given tiers (default all);
        returns at once with the future of the count per tier (see TieredStore.flush)."""
        return self.connector.flush(tiers)

    def shutdown(self) -> None:
        """Close the KV store: pending saves are written out (bounded wait); then the KV
        events publisher, after the last events."""
        if self.seat_keeper is not None:
            self.seat_keeper.close()
        self.connector.close()
        if self.kv_events is not None:
            self.kv_events.close()


def _sequence_params(params: SamplingParams, index: int) -> SamplingParams:
    """The parameters of sequence `index` of a request: n = 1, and seed + index when a
    seed is given (each sequence reproducible, no two alike), as vLLM does."""
    if params.n == 1:
        return params
    seed = None if params.seed is None else (params.seed + index) % 2**63
    # prompt logprobs come from sequence 0, which computes the prompt (the others fork it)
    prompt_logprobs = params.prompt_logprobs if index == 0 else None
    return dataclasses.replace(params, n=1, seed=seed, prompt_logprobs=prompt_logprobs)


def _describe(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"


def _part(out: SchedulerOutput, rows: slice) -> SchedulerOutput:
    """Some requests of a step, without its connector work."""
    return SchedulerOutput(
        requests=out.requests[rows], num_new_tokens=out.num_new_tokens[rows],
        start_positions=out.start_positions[rows], block_tables=out.block_tables[rows],
        sample=out.sample[rows],
    )


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    return device


def model_fingerprint(
    spec: ModelSpec, kv_dtype: torch.dtype, block_size: int, tokenizer_digest: str
) -> ModelFingerprint:
    """The fingerprint of this engine's KV: the model's weights and parsed config
    (`spec`), the tokenizer's identity, the KV dtype and block size."""
    return ModelFingerprint(
        architecture=spec.architecture,
        num_layers=spec.num_layers,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        kv_dtype=str(kv_dtype).removeprefix("torch."),
        block_size=block_size,
        weights_digest=spec.weights_digest,
        config_digest=spec.config_digest,
        tokenizer_digest=tokenizer_digest,
    )


def request_metrics(request: Request) -> RequestMetrics:
    return RequestMetrics(
        arrival_time=request.arrival_time,
        first_scheduled_time=request.first_scheduled_time,
        first_token_time=request.first_token_time,
        finish_time=request.finish_time,
        num_cached_tokens=max(request.num_cached_tokens, 0),
        num_external_tokens=request.num_external_tokens,
        num_preemptions=request.num_preemptions,
    )


def _default_kv_cache_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * CUDA_KV_CACHE_FRACTION)
    return DEFAULT_CPU_KV_CACHE_MEMORY


def _kv_memory_from_share(device: torch.device, share: float) -> int:
    """vLLM's --gpu-memory-utilization: the instance may hold `share` of the device's
    memory (the host's on CPU); the KV pool gets what the weights, loaded by now, leave."""
    if device.type == "cuda":
        total, held = torch.cuda.mem_get_info(device)[1], torch.cuda.memory_reserved(device)
    else:
        total, held = host_memory(), resident_memory() or 0
    budget = int(total * share) - held
    if budget <= 0:
        raise ConfigError("gpu_memory_utilization", (
            f"{share} of {total / 1024**3:.1f} GiB leaves nothing for the KV pool beside the "
            f"{held / 1024**3:.1f} GiB this instance holds already"))
    return budget


@contextlib.contextmanager
def _meanwhile(work: Callable[[], None] | None) -> Iterator[None]:
    """Run `work` on a thread of its own while the block runs; wait for it at the end and
    raise what it raised."""
    if work is None:
        yield
        return
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine-start") as pool:
        done = pool.submit(work)
        yield
        done.result()
