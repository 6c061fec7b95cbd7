"""The one intake: a generation request's whole journey, whichever protocol it came in by.

A protocol handler decodes its wire message into a `GenerationAsk` (the input, the sampling values as asked,
and its own names for its fields, which refusals name) and renders the `Output`s the path yields as its own
messages; nothing protocol-specific is below it:

    async for output in path.generate(streaming, context, decode):   # decode(limits) -> GenerationAsk
        yield <the protocol's message(s) for output>

Inside: the request's lifecycle begins (the `frontend` stage starts at the handler's entry), the engine must
be ready, the request is decoded (cheap checks first, so a request refused under overload costs no
tokenising; KV-transfer parameters need the engine's KV connector), admitted, tokenised off the event loop,
truncated and checked against the context, its sampling validated (`validation.build_sampling`), handed to
the engine under an id of the engine's own, and each engine step becomes one `Output`. The lifecycle
(`lifecycle.py`) emits the request's records; it sees the path only through the `LifecycleDeps` the path builds for
every request.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from contextlib import aclosing, contextmanager
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

import grpc

from phasescope.engine.base import Engine, EngineStep, ModelDescription, unknown_adapter
from phasescope.engine.request import KvTransfer, ModelLimits, ParsedInput
from phasescope.errors import (
    EngineUnavailableError,
    NotConfiguredError,
    NotFoundError,
    NotReadyError,
    PhasescopeError,
)
from phasescope.serve.admission import Admission
from phasescope.serve.lifecycle import LifecycleDeps, RequestLifecycle
from phasescope.serve.status import rejection_reason
from phasescope.serve.validation import SamplingAsk, build_sampling, check_prompt_length, truncate_prompt
from phasescope.serve.watch import ServerFacts, TelemetrySource
from phasescope.telemetry.pipeline import FirstTokenWaits
from phasescope.telemetry.request.adapters import BASE_ADAPTER, AdapterLabels
from phasescope.telemetry.request.observer import RequestObserver
from phasescope.telemetry.request.phases import PhaseTimings, RequestParameters
from phasescope.telemetry.step.interference import NO_INTERFERENCE, Interference

logger = logging.getLogger(__name__)

ServicerContext = grpc.aio.ServicerContext[Any, Any]
# gRPC's deadline timer and the handler's reading of the remaining time disagree by a little: a
# cancellation this close to the deadline is the deadline.
_DEADLINE_SLACK_SECONDS = 0.05


class Deadlined(Protocol):
    """What the path reads of an RPC's context (grpc.aio's has it, whichever service)."""

    def time_remaining(self) -> float | None: ...


@dataclass(frozen=True, slots=True)
class GenerationAsk:
    """A generation request as its protocol's handler decoded it."""

    input: ParsedInput
    sampling: SamplingAsk
    input_field: str
    """The protocol's name for the input: what a prompt too long for the context is refused as."""
    sampling_prefix: str
    """The protocol's path to its sampling fields ("sampling." or "sampling_params."): refusals start with it."""
    request_id: str = ""
    """The client's id ("": the engine's own id is the request's)."""
    truncate_prompt_tokens: int | None = None
    """Keep only the prompt's last this many tokens (None: all)."""
    detokenize: bool = True
    """False: the engine makes token ids only."""
    stream_interval: int | None = None
    max_tokens_past_context: bool = False
    """Let the engine stop at the context's end when max_tokens asks for more (vLLM's worker does)."""
    abortable: bool = False
    """An engine-protocol `Abort` naming `request_id` stops it."""
    kv_transfer: KvTransfer | None = None
    """The KV connector's parameters (disaggregated prefill and decode), handed to the engine as they came; a
    worker without a connector refuses them."""
    adapter: str = ""
    """The LoRA adapter it runs with, by name ("": the base model)."""
    adapter_field: str = "adapter"
    """The protocol's name for where the adapter came from: what a refusal names."""


@dataclass(frozen=True, slots=True)
class SampleEnd:
    """A sample's last step: how it ended, and its stages."""

    finish_reason: str | None
    timings: PhaseTimings


@dataclass(frozen=True, slots=True)
class RequestEnd:
    """The request's last step (every sample has ended): its totals, and the first sample's stages."""

    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    timings: PhaseTimings


@dataclass(frozen=True, slots=True)
class Output:
    """One engine step's output for the request, as a handler renders it."""

    request_id: str
    prompt_tokens: int
    first_prompt_token: int
    """The prompt's first token: its log probabilities start after it (nothing precedes it)."""
    step: EngineStep
    sample_end: SampleEnd | None = None
    request_end: RequestEnd | None = None
    adapter: str = ""
    """The LoRA adapter the request runs with ("": the base model), which its Timings name."""


def new_engine_request_id() -> str:
    """An id no other request of this engine has (client ids may collide: the engine's is always ours)."""
    return uuid.uuid4().hex


async def _nothing() -> None:
    return None


@dataclass(frozen=True)
class Attached:
    """A started engine wired in, in one step (`phasescope.serve.build.Built.attach_engine`): what every request
    and both protocols' telemetry RPCs read from the path from then on."""

    engine: Engine
    interference: Callable[[int], Interference]
    """An engine's running interference totals (its step aggregator's)."""
    facts: ServerFacts
    """What WatchTelemetry and GetModelInfo say of the server: the device, the dtype, the peaks."""
    telemetry: TelemetrySource
    """The engine-side figures WatchTelemetry, GetLoads and the KV-event stream's load records read."""


class RequestPath:
    """What every request shares, whichever protocol it came in by: the engine, admission, the observers, the
    requests in flight (for WatchTelemetry, GetLoads and Abort)."""

    def __init__(
        self,
        observer: RequestObserver,
        admission: Admission,
        model_name: str,
        *,
        first_token_waits: FirstTokenWaits | None = None,
        trace_id: Callable[[], str | None] = lambda: None,
        capture_text: bool = False,
        identify: Callable[[ServicerContext], str] = lambda context: "",
        on_engine_dead: Callable[[], Awaitable[None]] = _nothing,
        adapter_labels: AdapterLabels | None = None,
    ) -> None:
        """`first_token_waits` counts the requests waiting for their first chunk (the telemetry pipeline waits
        while any does). `trace_id` names the current trace for exemplars (tracing hands one in; the path never
        imports OpenTelemetry). `capture_text` puts prompt and output text in the record. `identify` names the
        caller for the per-client limit (phasescope.serve.auth.caller_identity). `on_engine_dead` is awaited
        once when a request finds the engine dead, before its UNAVAILABLE leaves (the server turns health
        NOT_SERVING there, so no client hears of the death before the health service says so). `adapter_labels`
        names each request's adapter in its series (bounded: --max-adapter-labels)."""
        self.observer = observer
        self.admission = admission
        self.model_name = model_name
        self.first_token_waits = first_token_waits if first_token_waits is not None else FirstTokenWaits()
        self.trace_id = trace_id
        self.capture_text = capture_text
        self._identify = identify
        self._on_engine_dead = on_engine_dead
        self.adapter_labels = adapter_labels if adapter_labels is not None else AdapterLabels()
        self._engine_death_told = False
        self.attached: Attached | None = None
        """The engine and its telemetry, once started (`attach`); until then requests are refused as not ready."""
        self.draining = False
        self.in_flight: set[RequestLifecycle] = set()
        """Admitted requests, from their permit to their end."""
        # What each request's lifecycle uses of the above: these objects, as held now (the interference comes
        # with the engine, so it is read when asked).
        self._lifecycle_deps = LifecycleDeps(
            observer=self.observer,
            model_name=self.model_name,
            first_token_waits=self.first_token_waits,
            interference=self._read_interference,
            trace_id=self.trace_id,
            capture_text=self.capture_text,
            admission=self.admission,
            in_flight=self.in_flight,
            count_refusal=self.count_refusal,
            engine_died=self.engine_died,
        )

    def attach(self, attached: Attached) -> None:
        """The engine has started: requests run from now on. Once per path."""
        if self.attached is not None:
            raise RuntimeError("an engine is already attached to this request path")
        self.attached = attached

    def _read_interference(self, engine: int) -> Interference:
        attached = self.attached
        return attached.interference(engine) if attached is not None else NO_INTERFERENCE

    def ready(self) -> Attached:
        """The engine and its telemetry, or the reason no request can run now."""
        if self.draining:
            raise NotReadyError("the server is shutting down and takes no new requests")
        attached = self.attached
        if attached is None:
            raise NotReadyError("the engine is still starting; wait for the health service to say SERVING")
        if attached.engine.is_dead:
            raise EngineUnavailableError("the engine is dead; the server must be restarted")
        return attached

    def ready_engine(self) -> Engine:
        """The engine, or the reason no request can run now."""
        return self.ready().engine

    def caller(self, context: ServicerContext) -> str:
        """Who is asking, for the per-client limit (read only when that limit is on)."""
        return self._identify(context) if self.admission.per_client else ""

    def count_refusal(self, exc: BaseException | None, adapter: str = BASE_ADAPTER) -> None:
        """The one place a refused request is counted, under the reason the status table gives it (and the adapter
        label of what it asked for, once decoded)."""
        reason = rejection_reason(exc) if isinstance(exc, PhasescopeError) else None
        if reason is not None:
            self.observer.request_rejected(self.model_name, reason, adapter)

    @contextmanager
    def refusals(self) -> Iterator[None]:
        """Counts a request refused inside it (RPCs without a lifecycle, such as Tokenize)."""
        try:
            yield
        except PhasescopeError as exc:
            self.count_refusal(exc)
            raise

    async def engine_died(self) -> None:
        """A request found the engine dead: the server is told once."""
        if not self._engine_death_told:
            self._engine_death_told = True
            await self._on_engine_dead()

    def begin(self, streaming: bool, context: Deadlined) -> RequestLifecycle:
        """A request entering its handler now, on the RPC whose `context` tells a cancellation by the client
        from one by its deadline (gRPC cancels the handler either way)."""

        def deadline_passed() -> bool:
            remaining = context.time_remaining()
            return remaining is not None and remaining <= _DEADLINE_SLACK_SECONDS

        return RequestLifecycle(self._lifecycle_deps, streaming, deadline_passed)

    async def tokenize(self, engine: Engine, parsed: ParsedInput) -> list[int]:
        """Token ids for the input; text is tokenised on a worker thread (vLLM's tokenizer is thread-safe), so a
        long prompt does not stall every other stream on the event loop."""
        if parsed.kind == "token_ids":
            return list(parsed.token_ids)
        return await asyncio.to_thread(engine.tokenize, parsed)

    async def generate(
        self, streaming: bool, context: ServicerContext, decode: Callable[[ModelLimits], GenerationAsk]
    ) -> AsyncGenerator[Output, None]:
        """The request's journey (the module docstring); `decode` reads the protocol's message against the
        model's limits, raising InvalidRequestError naming a field it cannot serve."""
        async with self.begin(streaming, context) as lifecycle:
            engine = self.ready_engine()
            ask = decode(engine.limits)
            served = not ask.adapter or any(adapter.name == ask.adapter for adapter in engine.adapters)
            lifecycle.adapter = self.adapter_labels.label(ask.adapter, served)
            check_kv_transfer(ask.kv_transfer, engine.description)
            if not served:
                refuse_adapter(ask.adapter, ask.adapter_field, engine)
            async with lifecycle.admitted(self.caller(context)):
                prompt = await self.tokenize(engine, ask.input)
                prompt = truncate_prompt(
                    prompt, ask.truncate_prompt_tokens, engine.limits, f"{ask.sampling_prefix}truncate_prompt_tokens"
                )
                check_prompt_length(len(prompt), engine.limits, ask.input_field)
                sampling = build_sampling(
                    ask.sampling,
                    ask.sampling_prefix,
                    len(prompt),
                    engine.limits,
                    detokenize=ask.detokenize,
                    stream_interval=ask.stream_interval,
                    max_tokens_past_context=ask.max_tokens_past_context,
                    kv_transfer=ask.kv_transfer,
                )
                engine_request_id = new_engine_request_id()
                # Nothing reaches the engine until the steps are iterated; sampling it refuses raises here.
                steps = engine.generate(engine_request_id, prompt, sampling, ask.adapter)
                parameters = RequestParameters(
                    operation="chat" if ask.input.kind == "chat" else "text_completion",
                    max_tokens=sampling.max_tokens,
                    temperature=sampling.temperature,
                    top_p=sampling.top_p,
                    constraint=sampling.structured.kind if sampling.structured is not None else "",
                    samples=sampling.n,
                    adapter=ask.adapter,
                )
                request_id = ask.request_id or engine_request_id
                lifecycle.handed_to_engine(
                    len(prompt),
                    request_id,
                    engine_request_id,
                    parameters,
                    _prompt_text(ask.input) if self.capture_text else "",
                    abortable=ask.abortable,
                )
                async with aclosing(steps):
                    async for step in steps:
                        lifecycle.took(step)
                        yield _output(lifecycle, request_id, prompt[0], step)
                        lifecycle.chunk_written()

    async def abort(self, request_ids: set[str]) -> None:
        """Stop the abortable requests of these client ids in the engine (each then ends with "abort")."""
        attached = self.attached
        if attached is None:
            return
        for request in list(self.in_flight):
            if request.abortable and request.request_id in request_ids and request.engine_request_id:
                await attached.engine.abort(request.engine_request_id)


def check_kv_transfer(kv_transfer: KvTransfer | None, description: ModelDescription) -> None:
    """KV-transfer parameters need the engine's KV connector: without one vLLM would drop them with a warning and
    serve the request on its own (a decode leg would prefill again what it was sent), so they are refused."""
    if kv_transfer is not None and description.kv_connector is None:
        raise NotConfiguredError(
            kv_transfer.field,
            "this worker runs no KV connector, so it cannot take part in disaggregated prefill and decode: start "
            "the worker with --kv-transfer-config",
        )


def refuse_adapter(adapter: str, field: str, engine: Engine) -> NoReturn:
    """A request for an adapter the engine does not serve: NOT_FOUND naming the field (and the served ones), or
    FAILED_PRECONDITION from a worker that runs none."""
    if not engine.description.max_loras:
        raise NotConfiguredError(field, "this worker runs no LoRA adapters (start it with --lora-modules NAME=PATH)")
    raise NotFoundError(field, unknown_adapter(adapter, (served.name for served in engine.adapters)))


def _output(lifecycle: RequestLifecycle, request_id: str, first_prompt_token: int, step: EngineStep) -> Output:
    sample_end = request_end = None
    if step.finish_reason is not None or step.finished:
        sample_end = SampleEnd(step.finish_reason, lifecycle.final_timings(step.index))
    if step.finished:
        request_end = RequestEnd(
            prompt_tokens=lifecycle.prompt_tokens,
            completion_tokens=lifecycle.completion_tokens,
            cached_prompt_tokens=lifecycle.cached_prompt_tokens,
            # The first sample's stages (its final ones, when this step ended it).
            timings=sample_end.timings if step.index == 0 and sample_end is not None else lifecycle.final_timings(),
        )
    return Output(
        request_id, lifecycle.prompt_tokens, first_prompt_token, step, sample_end, request_end, lifecycle.adapter_name
    )


def _prompt_text(parsed: ParsedInput) -> str:
    if parsed.kind == "prompt":
        return parsed.prompt
    if parsed.kind == "chat":
        return "\n".join(f"{turn.role}: {turn.content}" for turn in parsed.chat)
    return " ".join(map(str, parsed.token_ids))
