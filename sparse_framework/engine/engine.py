"""`Engine`: requests in, tokens out — the scheduler, the runner and the sampler in a loop.

    engine = Engine(model, model_config, {"algorithm": "quest"}, EngineConfig(max_num_seqs=8))
    engine.add_request("r1", prompt_ids, SamplingParams(max_tokens=64))
    while engine.has_unfinished():
        for out in engine.step():          # the requests that finished in this step
            print(out.request_id, out.token_ids, out.finish_reason)

Each `step()` asks the scheduler for a plan (decode rows and prefill chunks within the token
budget; admissions, preemptions and resumptions already reserved through `RunnerBudget`),
runs it as one packed forward (`ModelRunner.execute`), samples a token for every decode row
and every prompt the step completed, and reports them back. A request that can never run
(too long, bad sampling values, larger than the pools) finishes at once with
`finish_reason == "error"` and a message; the others are not affected.

Stop strings (`SamplingParams.stop`) are the engine's too: given a `tokenizer`, it keeps each
such request's text as its tokens arrive (engine/stop.py: incremental, O(new text) a token)
and ends the request with "stop" as soon as a stop string completes, exactly as a stop token
ends it (same step, same freeing; a step late under async scheduling, as a stop token); its
`RequestOutput.text` is the text cut there. `add_request(..., detokenize=True)` keeps the text
of a request without stop strings as well (a streaming server reads it: `output_text`).

Async scheduling (`EngineConfig.async_scheduling`, on by default on CUDA): a step's sampled
tokens stay on the device and the host goes on with the next step — schedules it, builds its
inputs (every host→device copy on the step's path is non-blocking: common/transfer.py) and
launches it — before reading them, so the GPU is not idle while the host works. The scheduler
records each sampled token as `PENDING` at once (lengths and `max_tokens` need no value); the
next step's decode rows take their token from the device (`TokenFeed`); the values are read
(and stop tokens seen) one step later. A request that hit a stop token has then already been
given one more decode row: that row's token is dropped and the request finishes with reason
"stop" exactly where it would have without async scheduling (its memory is freed then; the
device work already queued for it is ordered before any later use of that memory). Greedy
and seeded requests produce the same tokens either way (tests/test_engine_engine.py); rows
that draw from the engine's shared generator may not (an extra row changes the draw).
With tensor parallelism it is opt-in (`async_scheduling=True`; None is off there): rank 0's
sampled tokens are broadcast on the device (NCCL) and feed every rank's next step, and the
ranks compare their plans over a host-side gloo group, which does not wait for the GPU.

The parts that own state of their own sit beside it: request_output.py (`LiveRequest`, what is
kept of a request until its `RequestOutput`), async_steps.py (`AsyncSteps`: the step in flight,
its `TokenFeed`, `PENDING`), step_log.py (`StepLog`, `EngineStats`).
"""

from __future__ import annotations

import logging
import time
import zlib
from collections.abc import Callable
from typing import Any

import torch

from ..common.batch import Request
from ..common.errors import CapacityError, ConfigError, SparseFrameworkError
from ..config import SparseConfig, load_config
from .budget import RunnerBudget
from . import parallel
from .engine_config import KV_CACHE_DTYPES, EngineConfig, kv_store_dtype  # re-exported: their old home
from .memory import EngineMemoryPlan, host_budget, plan_for
from .models import ModelConfig
from .models.tensor_parallel import check_tensor_parallel
from .async_steps import PENDING, AsyncSteps
from .prefix_cache import PrefixCache, check_supported, swa_limit_pages
from .request_output import LiveRequest, RequestOutput, output_of
from .runner import DecodeRow, Model, ModelRunner
from .runner import PrefillChunk as RunnerChunk
from .sampling import Sampler, SamplingParams, finished
from .stop import RequestText, decoder
from .scheduler import FinishReason, Scheduler, Sequence, StepPlan
from .step_log import EngineStats, StepLog, engine_stats, step_stats
from .token_ids import token_ids
from .warm_up import WarmUpProgress, WarmUpReport, warm_up, warm_up_enabled

log = logging.getLogger(__name__)


STEP_FAILED = "the engine step failed"  # how the error of a request ended by a failed step begins


class Engine:
    """Continuous batching of requests over one model and one SparseCoordinator."""

    def __init__(
        self,
        model: Model,
        model_config: ModelConfig,
        sparse_config: SparseConfig | dict[str, Any] | str,
        config: EngineConfig | None = None,
        *,
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
        tokenizer: Any | None = None,
    ) -> None:
        self.config = config = config or EngineConfig()
        # decodes the output of requests with stop strings (None: such requests are refused);
        # with tensor parallelism every rank's engine needs the same one
        self.tokenizer = tokenizer
        self.model_config = model_config
        # with tensor parallelism this rank's heads, KV heads and MLP columns: its layout, store and plan
        self.tp, local = self._tensor_parallel(model, model_config, config.tensor_parallel_size)
        first = next(iter(model.parameters())) if hasattr(model, "parameters") else None  # type: ignore[attr-defined]
        self.device = torch.device(device) if device is not None else (first.device if first is not None else torch.device("cpu"))
        dtype = dtype or (first.dtype if first is not None else torch.float32)
        max_model_len = config.max_model_len or model_config.max_position_embeddings
        layout = local.kv_layout(kv_store_dtype(config.kv_cache_dtype, model_config, dtype), self.device,
                                  max_model_len)  # the store's: full-attention layers
        sparse_config = load_config(sparse_config)
        rows, device_tokens, host_tokens = config.max_num_seqs, config.device_capacity_tokens, config.host_capacity_tokens
        self.memory_plan: EngineMemoryPlan | None = None
        if config.gpu_memory_utilization is not None:
            params = model.parameters() if hasattr(model, "parameters") else ()  # type: ignore[attr-defined]
            host_bytes = config.host_memory_bytes
            if self.tp is not None:  # the ranks share the host: each plans with its 1/N of the budget
                host_bytes = host_budget(host_bytes)[0] // self.tp.world_size
            self.memory_plan = plan = plan_for(
                params, local, layout, sparse_config, device=self.device, max_model_len=max_model_len,
                max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs,
                gpu_memory_utilization=config.gpu_memory_utilization, device_memory_bytes=config.device_memory_bytes,
                host_memory_bytes=host_bytes, max_prefill_chunk=config.max_prefill_chunk,
                staging_tokens=config.staging_tokens, dtype=dtype, prefix_caching=config.enable_prefix_caching,
                cuda_graphs=config.cuda_graphs, decode_graphs=config.decode_graphs,
            )
            log.info("%s", plan.describe())
            rows, device_tokens, host_tokens = plan.num_seqs, plan.device_capacity_tokens, plan.host_capacity_tokens
            if self.tp is not None:  # every rank takes the smallest plan: the same pools, the same admissions
                rows, device_tokens, host_tokens = (None if v < 0 else v for v in self.tp.min_ints(
                    [rows, -1 if device_tokens is None else device_tokens, -1 if host_tokens is None else host_tokens]))
                if rows < 1 and plan.num_seqs > 0:
                    raise CapacityError(f"tensor parallelism: another rank's memory plan has no room for one request "
                                        f"of max_model_len={max_model_len} (its own error says why)")
            plan.check()
        self.num_seqs = rows
        if sparse_config.prefetch != "off" and not hasattr(model, "early_query"):
            raise ConfigError(f"prefetch {sparse_config.prefetch!r}: the model ({type(model).__name__}) computes no "
                              "early query (engine/models' Llama-family DecoderModel does); use prefetch 'off'")
        supported = getattr(model, "supports_fused_ops", hasattr(model, "use_fused_ops"))
        fused = config.fused_ops if config.fused_ops is not None else self.device.type == "cuda" and supported
        if fused:
            if not supported:
                why = getattr(model, "fused_ops_unsupported", "engine/models' DecoderModel has one")
                raise ConfigError(f"EngineConfig.fused_ops=True: the model ({type(model).__name__}) has no fused path: "
                                  f"{why}")
            model.use_fused_ops()  # type: ignore[attr-defined]
        self.runner = ModelRunner(
            model, layout, sparse_config,
            num_q_heads=local.num_heads, max_num_seqs=rows, max_model_len=max_model_len,
            staging_tokens=config.staging_tokens or max_model_len,
            device_capacity_tokens=device_tokens, host_capacity_tokens=host_tokens,
            decode_graphs=config.decode_graphs, cuda_graphs=config.cuda_graphs,
            prefill_attention=config.prefill_attention, model_config=local, mla=model_config.mla,
            compute_dtype=dtype, ring_page_slack=config.enable_prefix_caching,
        )
        if self.tp is not None:
            self._check_selection_is_per_head(sparse_config)
        self.budget = RunnerBudget(self.runner)
        self.prefix_cache: PrefixCache | None = None
        if config.enable_prefix_caching:
            self.prefix_cache = self._make_prefix_cache(sparse_config)
            self.budget.cache = self.prefix_cache
            if self.runner.ring is not None:  # a hybrid's windows are snapshot at chunk ends too
                self.runner.chunk_hook = self.prefix_cache.on_chunk
            if self.prefix_cache.index_staging is not None:  # an indexer's keys, copied at the hand-over
                self.runner.commit_hook = self.prefix_cache.on_commit
                self.prefix_cache.index_reader = self._lossless_index_keys()
        self.scheduler = Scheduler(
            self.budget, max_num_batched_tokens=max(config.max_num_batched_tokens, rows),
            max_num_seqs=rows, max_prefill_chunk=config.max_prefill_chunk, max_model_len=max_model_len,
        )
        self.sampler = Sampler(config.seed)
        self.eos = model_config.eos_token_ids
        self.max_model_len = max_model_len
        self._live: dict[str, LiveRequest] = {}
        self._rejected: list[RequestOutput] = []  # outputs the next step() returns
        # with tensor parallelism async scheduling is opt-in (True; None means off there): the
        # ranks then check their steps over a host-side group and rank 0's tokens are broadcast
        # on the device. Not yet measured on GPUs, so the synchronous path stays the default
        self.async_scheduling = bool(config.async_scheduling) if self.tp is not None else (
            config.async_scheduling if config.async_scheduling is not None else self.device.type == "cuda")
        self._steps = StepLog()
        self.step_log = self._steps.entries  # per step run: (decode rows, prefill tokens, context, seconds)
        self.async_steps = AsyncSteps(self.scheduler, self._live, self.eos, self._steps, self.device)
        self.warm_up_report: WarmUpReport | None = None  # set by warm_up()

    # -- warm start (engine/warm_up.py) ---------------------------------------------------------
    @property
    def wants_warm_up(self) -> bool:
        """Whether EngineConfig.warm_up asks the owner to call `warm_up` before the first
        request (None: a CUDA device with cuda_graphs or decode_graphs)."""
        return warm_up_enabled(self.config, self.device)

    def warm_up(self, progress: WarmUpProgress | None = None) -> WarmUpReport:
        """Compile and capture every batch bucket's decode step over dummy requests, leaving
        no request, page, cache entry or logged step behind (engine/warm_up.py); kept as
        `warm_up_report` (with the graphs' measured bytes on CUDA). `progress(done, total,
        label)` before each bucket and at the end. Only before the first request."""
        self.warm_up_report = warm_up(self, progress)
        return self.warm_up_report

    # -- tensor parallelism --------------------------------------------------------------------
    @staticmethod
    def _tensor_parallel(model: Model, model_config: ModelConfig, size: int) -> tuple[parallel.TPContext | None, ModelConfig]:
        """This process's group and this rank's ModelConfig (the model's own for size 1);
        every refusal names tensor_parallel_size."""
        if size == 1:
            return None, model_config
        check_tensor_parallel(model_config, size)  # the family and the divisibility, by name
        ctx = parallel.current()
        if ctx is None or ctx.world_size != size:
            have = "no process group" if ctx is None else f"a group of {ctx.world_size}"
            raise ConfigError(f"EngineConfig.tensor_parallel_size={size} needs a process group of {size} ranks, found "
                              f"{have}: call parallel.init_tp / init_tp_from_env (torchrun) or run under parallel.spawn")
        shard = getattr(model, "tp", None)
        if shard is None or (shard.rank, shard.world_size) != (ctx.rank, size):
            raise ConfigError(f"EngineConfig.tensor_parallel_size={size}: the model is not rank {ctx.rank}'s shard of "
                              f"{size}; build it with random_model / load_model(..., tp=ctx.shard)")
        return ctx, model.local_config  # type: ignore[attr-defined]

    def _check_selection_is_per_head(self, sparse_config: SparseConfig) -> None:
        """A selection shared by all heads (DSA's indexer) would be computed from each rank's
        own heads and differ between ranks: refused. DSA over the keys selects per KV head
        whenever the model has several, and every split model has, so it stays (a rank with one
        KV head computes that head's own selection, which is TP=1's)."""
        algo = self.runner.coord.algorithm
        if type(algo).per_kv_head or getattr(getattr(algo, "options", None), "source", None) == "keys":
            return
        raise ConfigError(
            f"EngineConfig.tensor_parallel_size={self.tp.world_size if self.tp else 1}: algorithm "
            f"{sparse_config.algorithm!r} makes one selection per request from every head, which a rank (holding "
            "some heads) cannot compute alone; use a per-KV-head algorithm (quest, pqcache, snapkv, dsa with "
            "extra.source 'keys') or tensor_parallel_size=1"
        )

    @staticmethod
    def _digest(plan: Any) -> int:
        """A checksum of what a step does (rows, chunks, admissions, preemptions), equal on
        every rank that scheduled the same step."""
        parts = ([s.rid for s in plan.decode], [(c.seq.rid, c.start, c.end) for c in plan.prefill],
                 [s.rid for s in plan.preempted], [s.rid for s in plan.resumed], [s.rid for s in plan.admitted])
        return zlib.crc32(repr(parts).encode())

    def _make_prefix_cache(self, sparse_config: SparseConfig) -> PrefixCache:
        runner, algo = self.runner, self.runner.coord.algorithm
        store = runner.coord.store
        staged_index = runner.staging.index_k is not None
        check_supported(store, ring=runner.ring, prefill_inputs=list(algo.prefill_inputs),
                        query_rows=algo.prefill_query_rows, algorithm=sparse_config.algorithm,
                        staged_index_keys=staged_index)
        swa_limit = None if runner.ring is None else swa_limit_pages(self.num_seqs, runner.ring.window, store.page_size)
        return PrefixCache(store, query_rows=algo.prefill_query_rows or 0, headroom=self.budget.headroom,
                           ring=runner.ring, index_staging=runner.staging if staged_index else None,
                           swa_limit_pages=swa_limit)

    def _lossless_index_keys(self) -> Callable[[Request, int, int], torch.Tensor] | None:
        """Where DSA keeps the model's indexer keys as they are (stored in the model's dtype,
        not FP8) in every layer (no dense layer, which builds no representation), a reader of
        a sparse request's keys from its representation: the prefix cache can then cache
        generated tokens too. None otherwise (only prompt pages are cached)."""
        coord = self.runner.coord
        keys = getattr(coord.algorithm, "index_k", None)
        staged = self.runner.staging.index_k
        if keys is None or staged is None or keys.dtype != staged.dtype or coord.dense_layers:  # FP8: uint8 bits
            return None
        return lambda request, start, stop: keys[:, request.slot, start:stop]

    def clear_prefix_cache(self) -> int:
        """Evict every cached page no running request holds; the host pages freed."""
        return 0 if self.prefix_cache is None else self.prefix_cache.clear()

    # -- requests ----------------------------------------------------------------------------
    def add_request(self, rid: str, prompt_ids: list[int], params: SamplingParams | None = None, *,
                    detokenize: bool = False) -> None:
        """Queue a request. One that can never run (empty prompt, tokens outside the
        vocabulary, prompt + max_tokens beyond max_model_len or the pools, bad sampling
        values, stop strings without a tokenizer) is not an exception: it comes back from the
        next `step()` with finish_reason "error" and the reason, and the others run on.
        `detokenize`: keep its text as the tokens arrive even without stop strings
        (`output_text`; needs the tokenizer)."""
        params = params or SamplingParams()
        if detokenize and self.tokenizer is None:
            raise ValueError("add_request(detokenize=True) needs the engine's tokenizer (Engine(..., tokenizer=...))")
        now = time.perf_counter()
        if (rid in self._live or any(out.request_id == rid for out in self._rejected)
                or self.async_steps.holds_ended(rid)):
            raise ValueError(f"request {rid!r} is already queued or running (or its error output not yet returned)")
        ids, error = token_ids(prompt_ids)
        error = error or self._check(ids, params)
        seq = Sequence(rid, ids, params)
        if error is None and self.scheduler.add(seq):
            text = None
            if params.stop or detokenize:
                text = RequestText(decoder(self.tokenizer), params.stop, params.include_stop_str_in_output)
            self._live[rid] = LiveRequest(seq, params, params.make_generator(self.device), now, text=text)
            return
        why = error or seq.error or "rejected"
        self._rejected.append(RequestOutput(rid, ids, [], FinishReason.ERROR.value, why,
                                            arrival_time=now, finish_time=now))

    def _check(self, prompt_ids: list[int], params: SamplingParams) -> str | None:
        if not isinstance(params, SamplingParams):
            return f"sampling params must be a SamplingParams, got {type(params).__name__}"
        if len(prompt_ids) == 0:
            return "the prompt is empty"
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            return f"prompt token ids {bad[:5]} are outside the vocabulary 0..{vocab - 1}"
        try:
            params.check(vocab)
        except SparseFrameworkError as exc:
            return str(exc)
        if params.stop and self.tokenizer is None:
            return (f"SamplingParams.stop={list(params.stop)!r}: stop strings are matched against the output's text, "
                    "and this engine has no tokenizer to decode it (a model of token ids only); give the LLM a "
                    "tokenizer, or stop on token ids with stop_token_ids")
        return None

    def abort(self, rid: str) -> RequestOutput | None:
        """Stop a request and free everything it holds; its output so far, finish_reason
        "abort" (None if unknown). A request that already ended but whose output `step()` has
        not returned yet (rejected, or finished in the step in flight) gives that output here
        instead, and `step()` will not return it.

        If a hook raises while the request is freed (the prefix cache, the algorithm's
        `release`), the scheduler, the runner and the coordinator still free it
        (Scheduler.finish, RunnerBudget.free, SparseCoordinator.on_request_end): the error is
        logged and recorded in the output's `error`, not raised, so a server's loop goes on."""
        self._rejected.extend(self.async_steps.read_now())  # its tokens so far, values read
        for i, out in enumerate(self._rejected):
            if out.request_id == rid:
                return self._rejected.pop(i)
        live = self._live.pop(rid, None)
        error = None
        try:
            seq = self.scheduler.abort(rid)
        except Exception as exc:  # noqa: BLE001 - freed all the same; recorded in its output
            log.exception("aborting request %r: freeing it raised", rid)
            seq, error = (live.seq if live else None), f"freeing the aborted request raised {type(exc).__name__}: {exc}"
        if live is None or seq is None:
            return None
        return output_of(live, FinishReason.ABORT.value, error)

    def has_unfinished(self) -> bool:
        return bool(self._rejected) or self.scheduler.has_unfinished() or self.async_steps.step is not None

    def output_text(self, rid: str) -> RequestText | None:
        """The text the engine keeps of a queued or running request (stop strings, or
        detokenize=True), None otherwise; the object stays valid (and final) after it ends."""
        live = self._live.get(rid)
        return None if live is None else live.text

    def partial_outputs(self) -> dict[str, list[int]]:
        """Each unfinished request's output token ids so far, as the host has read them (tokens
        still on the device under async scheduling are left out): what a streaming server sends."""
        out = {}
        for seq in (*self.scheduler.running, *self.scheduler.preempted):
            ids = seq.output_ids
            out[seq.rid] = list(ids[: ids.index(PENDING)] if PENDING in ids else ids)
        return out

    def stats(self, store: bool = False) -> EngineStats:
        """The counters as of the last step; `store`: also the pools and the device buffer's hits
        (reading them may synchronise the device: a server asks at most once a second)."""
        return engine_stats(self.scheduler, self.runner.coord, self.prefix_cache, self.steps, store)

    @property
    def max_running(self) -> int:
        """Requests that can run at once (the scheduler's rows)."""
        return self.scheduler.max_num_seqs

    # -- a step --------------------------------------------------------------------------------
    @property
    def steps(self) -> int:
        """Steps run so far (plans with rows), also past the step log's limit."""
        return self._steps.steps

    def step(self) -> list[RequestOutput]:
        """Run one step; the requests that finished in it (rejected ones included)."""
        outputs, self._rejected = self._rejected, []
        self.budget.begin_plan()
        plan = self.scheduler.schedule()
        for seq in plan.finished:
            outputs.extend(self._ended_while_planning(seq))
        if plan.is_empty:
            outputs.extend(self.async_steps.read_now())
            return outputs
        started = time.perf_counter()
        try:
            outputs.extend(self._run_plan(plan, started))
        except BaseException as exc:
            if self.tp is not None:  # the other ranks wait in a collective: no local recovery
                raise
            outputs.extend(self._fail_step(plan, exc))
            if not isinstance(exc, Exception):  # Ctrl-C, SystemExit: consistent again, then raised
                self._rejected.extend(outputs)  # the next step() returns them
                raise
        return outputs

    def _ended_while_planning(self, seq: Sequence) -> list[RequestOutput]:
        """A sequence the scheduler ended while planning (`plan.finished`: it had to be
        preempted with nowhere to keep it): its output now, or, when its newest token is still
        on the device (async scheduling), once the step in flight is read (`AsyncSteps.read`)."""
        live = self._live.pop(seq.rid)
        if self.async_steps.end_later(seq, live):
            return []
        return [output_of(live, FinishReason.ERROR.value, seq.error)]

    def _fail_step(self, plan: StepPlan, exc: BaseException) -> list[RequestOutput]:
        """A step raised (a model error, a failed host write, an interrupt): end
        the requests its forward touched with finish_reason "error" and the reason, free
        their pages, and leave the engine ready for the next step. Requests the step did not
        touch (waiting, preempted, or only in the step in flight) go on; the step in flight,
        an earlier step that did run, is read first where its tokens can still be read. The
        runner has already abandoned the coordinator's open step (`abort_step`)."""
        why = f"{STEP_FAILED}: {type(exc).__name__}: {exc}"
        log.error("%s; ending the %d requests it touched", why, len(plan.decode) + len(plan.prefill))
        outputs: list[RequestOutput] = []
        try:
            outputs.extend(self.async_steps.read_now())
        except Exception:  # noqa: BLE001 - the device may be unusable: its tokens are lost
            self.async_steps.step = None
        touched = [s.rid for s in (*plan.decode, *plan.admitted, *plan.resumed)] + [c.seq.rid for c in plan.prefill]
        for rid in dict.fromkeys(touched):
            live = self._live.pop(rid, None)
            try:
                seq = self.scheduler.abort(rid)
            except Exception:  # noqa: BLE001 - freed all the same (Scheduler.finish); the others go on
                log.exception("ending request %r after the failed step: freeing it raised", rid)
                seq = live.seq if live else None
            if live is not None and seq is not None:
                outputs.append(output_of(live, FinishReason.ERROR.value, why))
        self.scheduler.drop_plan()
        return outputs

    def _run_plan(self, plan: StepPlan, started: float) -> list[RequestOutput]:
        """Run a plan with rows: the forward, sampling, and the scheduler's bookkeeping."""
        outputs: list[RequestOutput] = []
        if self.tp is not None:  # before the forward: ranks with other steps would mismatch its all-reduces
            self.tp.check_same_step(self._digest(plan), on_host=self.async_scheduling)
        context = sum(s.num_computed_tokens + 1 for s in plan.decode)
        decode = [DecodeRow(s.rid, s.last_token_id) for s in plan.decode]
        chunks = [RunnerChunk(c.seq.rid, tuple(c.seq.prompt_ids[c.start : c.end]), c.start, c.is_last) for c in plan.prefill]
        logits = self.runner.execute(decode, chunks, self.async_steps.feed(plan))
        sampled = plan.sampled
        lives = [self._live[s.rid] for s in sampled]
        tokens = None
        if sampled and (self.tp is None or self.tp.rank == 0):  # with TP rank 0 samples for all
            tokens = self.sampler.sample(logits, [x.params for x in lives], [x.generator for x in lives])
        if self.async_scheduling:
            if self.tp is not None and sampled:  # every rank feeds its next step rank 0's tokens
                tokens = self.tp.broadcast_tokens(tokens, len(sampled))
            return self.async_steps.launch(plan, lives, tokens, started, context)
        values = tokens.tolist() if tokens is not None else []
        if self.tp is not None and sampled:
            values = self.tp.share_tokens(values if self.tp.rank == 0 else None, len(sampled))
        now = time.perf_counter()
        self._steps.add((*step_stats(plan, context), now - started))
        new_tokens, stops = {}, {}
        for live, token in zip(lives, values):
            seq = live.seq
            new_tokens[seq.rid] = token
            if live.first_token is None:
                live.first_token = now
            reason = finished(live.params, token, len(seq.output_ids) + 1, self.eos or None)
            if live.take(token):  # a stop string: ends it like a stop token
                reason = FinishReason.STOP.value
            if reason is not None:
                stops[seq.rid] = reason
        for seq in self.scheduler.on_step_done(plan, new_tokens, stops):
            live = self._live.pop(seq.rid)
            outputs.append(output_of(live, str(seq.finish_reason.value), seq.error))
        return outputs

    def run_to_completion(self) -> list[RequestOutput]:
        """Step until every request has finished; their outputs in finishing order."""
        done: list[RequestOutput] = []
        while self.has_unfinished():
            done.extend(self.step())
        return done
