"""The CPU engine's HTTP server: SGLang's endpoints and JSON shapes.

Handlers never block the event loop: generation runs on the scheduler thread, lock waits and process-group calls
in worker threads. The model loads in the background; /health answers 503 until it is ready. Torch is imported only
there, so the fake-compute mode (--fake-compute) starts without it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from services.common import auth
from services.common.errors import FailedPrecondition, InvalidArgument, NotFound, PhysarumError, Unavailable
from services.common.rest import RestServer
from services.common.sglang import CPU_ENGINE, DEFAULT_GROUP_NAME
from services.engine.config import EngineConfig
from services.engine.fake import FakeEngine, FakeWeights, read_model_config
from services.engine.protocol import parse_generate, to_response
from services.engine.scheduler import Request as GenRequest
from services.engine.scheduler import SamplingParams, Scheduler
from services.engine.streaming import stream_chunks

log = logging.getLogger(__name__)

VERSION = f"{CPU_ENGINE} 0.1.0"
HEALTH_GENERATE_TIMEOUT_S = 20.0  # SGLANG_HEALTH_CHECK_TIMEOUT's default
HEALTH_GENERATE_POLL_S = 0.05


class EngineState:
    """The engine and its weight updater once the model is loaded (None before)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_path = str(Path(config.model_path).resolve())
        self.model_config = read_model_config(self.model_path)
        self.engine: Scheduler | None = None
        self.updater = None  # weights.WeightUpdater, or fake.FakeWeights in fake-compute mode
        self.load_error: str | None = None

    def load(self) -> None:
        start = time.monotonic()
        if self.config.fake_compute:
            engine = FakeEngine(self.model_path, per_token_delay_s=self.config.per_token_delay_s,
                                max_batch_size=self.config.max_batch_size, seed=self.config.seed,
                                weight_version=self.config.weight_version).start()
            self.updater = FakeWeights(engine, self.config.weight_sync_timeout_s)
            self.engine = engine
            log.info("fake compute: %.3f s per token, vocabulary %d", self.config.per_token_delay_s, engine.vocab_size)
            return
        import torch

        from services.engine.generation import Engine, load_model
        from services.engine.vision import Vision
        from services.engine.weights import WeightUpdater

        torch.set_num_threads(self.config.num_threads)
        torch.manual_seed(self.config.seed)
        try:
            model, tokenizer = load_model(self.model_path, device=self.config.device, dtype=self.config.dtype)
        except Exception as err:
            self.load_error = f"{type(err).__name__}: {err}"
            log.exception("could not load the model from %s", self.model_path)
            return
        try:
            vision = Vision.load(self.model_path, model)
        except Exception as err:
            self.load_error = f"{type(err).__name__}: {err}"
            log.exception("could not load the image processor from %s", self.model_path)
            return
        engine = Engine(model, tokenizer, max_batch_size=self.config.max_batch_size, seed=self.config.seed,
                        weight_version=self.config.weight_version,
                        per_token_delay_s=self.config.per_token_delay_s, vision=vision).start()
        self.updater = WeightUpdater(engine, self.config.weight_sync_timeout_s)
        if self.config.enable_lora and not self._serve_adapters(engine, model):
            return
        self.engine = engine
        log.info("model %s loaded in %.1f s (%d parameters, context %d)", self.model_path, time.monotonic() - start,
                 sum(p.numel() for p in model.parameters()), engine.context_len)

    def _serve_adapters(self, engine, model) -> bool:
        """--enable-lora: adapter layers on the model and the --lora-paths adapters loaded; False (load_error set)
        when they cannot be."""
        from services.engine.lora import LoRAServing, parse_lora_paths

        config = self.config
        try:
            engine.serve_adapters(LoRAServing(model, max_loras_per_batch=config.max_loras_per_batch,
                                              max_lora_rank=config.max_lora_rank,
                                              target_modules=config.lora_target_modules))
            for name, path in parse_lora_paths(config.lora_paths):
                self.updater.load_lora_adapter(name, path)
        except Exception as err:
            self.load_error = f"LoRA: {type(err).__name__}: {err}"
            log.exception("could not set up LoRA serving")
            engine.stop()
            return False
        log.info("LoRA serving: %d target modules (%s), up to %d adapters a batch", len(engine.lora.layers),
                 ", ".join(engine.lora.target_modules), config.max_loras_per_batch)
        return True

    def ready(self) -> Scheduler:
        if self.engine is None:
            raise Unavailable(f"model failed to load: {self.load_error}" if self.load_error
                              else "the model is still loading")
        return self.engine

    def model_info(self) -> dict:
        return {"model_path": self.model_path, "served_model_name": self.config.served_model_name or self.model_path,
                "tokenizer_path": self.model_path, "is_generation": True, "preferred_sampling_params": None,
                "weight_version": self.ready().weight_version, "load_format": "auto", "reasoning_parser": None,
                "tool_call_parser": None, "disaggregation_mode": "null", "has_image_understanding": False,
                "has_audio_understanding": False, "model_type": self.model_config.get("model_type"),
                "architectures": list(self.model_config.get("architectures") or [])}

    def server_info(self) -> dict:
        engine = self.ready()
        running, waiting = engine.num_requests()
        return {**dataclasses.asdict(self.config), "model_path": self.model_path, "version": VERSION,
                "max_context_length": engine.context_len, "max_total_num_tokens": engine.context_len
                * self.config.max_batch_size, "tp_size": 1, "dp_size": 1, "weight_version": engine.weight_version,
                "internal_states": [{"num_running_reqs": running, "num_waiting_reqs": waiting,
                                     "paused": engine.is_paused}]}


PUBLIC_PATHS = frozenset({"/generate", "/model_info", "/get_model_info", "/server_info", "/get_server_info"})
MAX_BODY_BYTES = 16 << 20  # a longer request body is refused unread (413): parsing it would hold the engine


# Bodies up to this size parse on the event loop: faster than the hop to a worker thread, and too short to stall it.
INLINE_PARSE_BYTES = 64 * 1024


async def _body(request: Request) -> dict:
    """The JSON object of a request body of at most MAX_BODY_BYTES, parsed off the event loop when it is over
    INLINE_PARSE_BYTES; its size goes to `request.state.body_bytes`."""
    if int(request.headers.get("content-length") or 0) > MAX_BODY_BYTES:
        raise BodyTooLarge(f"request body over {MAX_BODY_BYTES} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise BodyTooLarge(f"request body over {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
    raw = b"".join(chunks)
    request.state.body_bytes = len(raw)
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw) if len(raw) <= INLINE_PARSE_BYTES else await asyncio.to_thread(json.loads, raw)
    except ValueError as err:
        raise InvalidArgument(f"request body is not valid JSON: {err}") from err
    except RecursionError:
        raise InvalidArgument("request body is not valid JSON: nested too deeply") from None
    if not isinstance(body, dict):
        raise InvalidArgument(f"request body must be a JSON object, got {type(body).__name__}")
    return body


class BodyTooLarge(InvalidArgument):
    """Answered with HTTP 413."""


def _required(body: dict, *keys: str) -> None:
    missing = [k for k in keys if body.get(k) is None]
    if missing:
        raise InvalidArgument(f"missing required field(s): {', '.join(missing)}")


async def _in_thread(fn: Callable[..., str | dict], **kwargs) -> tuple[str | dict | None, str | None]:
    """fn(**kwargs) in a thread: (its result, None), or (None, the error's message), logged."""
    try:
        return await asyncio.to_thread(fn, **kwargs), None
    except Exception as err:
        expected = isinstance(err, (PhysarumError, ValueError))
        if expected:
            log.warning("%s failed: %s", fn.__name__, err)
        else:
            log.exception("%s failed", fn.__name__)
        return None, str(err) if expected else f"{type(err).__name__}: {err}"


async def _update_call(fn: Callable[..., str | dict], **kwargs) -> JSONResponse:
    """Run a weight-update call in a thread; SGLang's {"success", "message"}, HTTP 400 on failure."""
    message, error = await _in_thread(fn, **kwargs)
    if error is not None:
        return JSONResponse({"success": False, "message": error}, status_code=400)
    if isinstance(message, dict):  # a call with more to say than a message (a delta's failed tensors)
        return JSONResponse({"success": True, "message": f"{fn.__name__} done", **message})
    return JSONResponse({"success": True, "message": message})


async def _lora_call(fn: Callable[..., dict], loaded_on_error: Callable[[], dict | None] = lambda: None,
                     **kwargs) -> JSONResponse:
    """An adapter call in a thread; SGLang's LoRAUpdateOutput: {"success", "error_message", "loaded_adapters"},
    HTTP 400 on failure. `loaded_on_error`: what SGLang lists on failure (a failed load: the adapters still loaded;
    an unload of an unknown name, refused before the scheduler: none)."""
    result, error = await _in_thread(fn, **kwargs)
    if error is not None:
        return JSONResponse({"success": False, "error_message": error, "loaded_adapters": loaded_on_error()},
                            status_code=400)
    return JSONResponse({"success": True, "error_message": "", **result})


def _loaded_adapters(state: EngineState) -> dict | None:
    """The engine's adapters, name -> where from (None without --enable-lora, as SGLang answers then)."""
    lora = state.ready().lora
    return lora.loaded() if lora is not None else None


def _updater_call(state: EngineState, name: str) -> Callable[..., str | dict]:
    """The weight updater's method `name`; FailedPrecondition where this engine's updater has none (fake compute)."""
    method = getattr(state.updater, name, None)
    if method is None:
        raise FailedPrecondition(f"{name}: not available in this engine mode (fake compute loads only from disk)")
    return method


async def _wait_for(engine: Scheduler, requests: list[GenRequest]) -> None:
    """Submit and wait for every request; cancelled waits abort their requests."""
    loop = asyncio.get_running_loop()
    futures = [loop.create_future() for _ in requests]
    for request, future in zip(requests, futures, strict=True):
        request.on_finish = lambda r, f=future: loop.call_soon_threadsafe(lambda: f.done() or f.set_result(r))
    engine.submit(requests)
    try:
        await asyncio.gather(*futures)
    except asyncio.CancelledError:
        for request in requests:
            engine.abort(request.rid, message="client went away")
        raise


def create_app(state: EngineState) -> FastAPI:
    app = FastAPI(title="Physarum CPU engine (SGLang HTTP API)", version=VERSION)
    # admin calls (weights, pause, abort, flush) only from holders of the engine token: the manager and the trainer
    auth.require_bearer(app, auth.read_token("engine"), "engine", auth.OPEN_PATHS | PUBLIC_PATHS)
    timeout_s = state.config.weight_sync_timeout_s

    @app.exception_handler(PhysarumError)
    async def physarum_error(request: Request, err: PhysarumError) -> JSONResponse:
        status = {BodyTooLarge: 413, InvalidArgument: 400, FailedPrecondition: 400, NotFound: 404,
                  Unavailable: 503}.get(type(err), 500)
        return JSONResponse({"error": {"message": str(err)}}, status_code=status)

    @app.exception_handler(ValueError)
    async def value_error(request: Request, err: ValueError) -> JSONResponse:
        return JSONResponse({"error": {"message": f"invalid request: {err}"}}, status_code=400)

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Response:
        engine = state.ready()
        body = await _body(request)
        if "text" in body or "image_data" in body or request.state.body_bytes > INLINE_PARSE_BYTES:  # off the loop
            call = await asyncio.to_thread(parse_generate, body, engine)
        else:
            call = parse_generate(body, engine)
        if body.get("stream"):
            return StreamingResponse(stream_chunks(engine, call), media_type="text/event-stream")
        await _wait_for(engine, call.requests)
        outs = [to_response(r, lp, i if call.listed else None)
                for i, (r, lp) in enumerate(zip(call.requests, call.return_logprob, strict=True))]
        return JSONResponse(outs if call.listed else outs[0])

    @app.get("/health")
    async def health() -> Response:
        state.ready()
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        """SGLang's check: 200 as soon as the engine makes progress (the probe or any other request gets a token)."""
        engine = state.ready()
        probe = GenRequest(rid=f"HEALTH_CHECK_{uuid.uuid4().hex}", input_ids=[0],
                           params=SamplingParams(max_new_tokens=1, temperature=0.0))
        since = time.monotonic()
        engine.submit([probe])
        try:
            while not (probe.finished or engine.last_progress_s > since):
                if time.monotonic() - since > HEALTH_GENERATE_TIMEOUT_S:
                    return Response(status_code=503)
                await asyncio.sleep(HEALTH_GENERATE_POLL_S)
        finally:
            engine.abort(probe.rid, message="health check done")
        return Response(status_code=200)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> dict:
        return state.model_info()

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> dict:
        return state.server_info()

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> PlainTextResponse:
        engine = state.ready()
        if any(engine.num_requests()):
            return PlainTextResponse("Cache not flushed: there are running or waiting requests.\n", status_code=400)
        with engine.prefix_lock:
            engine.prefix_index.clear()
        return PlainTextResponse("Cache flushed.\n")

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> dict:
        engine, body = state.ready(), await _body(request)
        await asyncio.to_thread(engine.pause, body.get("mode") or "abort", timeout_s)
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation() -> dict:
        state.ready().resume()
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        engine, body = state.ready(), await _body(request)
        engine.abort(str(body.get("rid") or ""), bool(body.get("abort_all", False)))
        return Response(status_code=200)

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> dict:
        engine, body = state.ready(), await _body(request)
        _required(body, "new_version")
        if body.get("abort_all_requests", True):
            engine.abort(abort_all=True, message="Abort by update_weight_version")
        engine.weight_version = str(body["new_version"])
        return {"success": True, "message": f"Weight version updated to {engine.weight_version}",
                "new_version": engine.weight_version}

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(request: Request) -> list:
        state.ready()
        body = await _body(request)
        _required(body, "name")
        return state.updater.get_weights(str(body["name"]), int(body.get("truncate_size", 100)))

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request) -> JSONResponse:
        state.ready()
        body = await _body(request)
        _required(body, "master_address", "master_port", "rank_offset", "world_size")
        return await _update_call(state.updater.init_group, master_address=str(body["master_address"]),
                                  master_port=int(body["master_port"]), rank_offset=int(body["rank_offset"]),
                                  world_size=int(body["world_size"]),
                                  group_name=body.get("group_name") or DEFAULT_GROUP_NAME,
                                  backend=body.get("backend") or "nccl")

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request) -> JSONResponse:
        state.ready()
        body = await _body(request)
        return await _update_call(state.updater.destroy_group,
                                  group_name=body.get("group_name") or DEFAULT_GROUP_NAME)

    @app.post("/begin_weight_update")
    async def begin_weight_update(request: Request) -> JSONResponse:
        state.ready()
        body = await _body(request)
        return await _update_call(state.updater.begin, selector=body.get("selector") or "all")

    @app.post("/end_weight_update")
    async def end_weight_update() -> JSONResponse:
        state.ready()
        return await _update_call(state.updater.end)

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request) -> JSONResponse:
        state.ready()
        body = await _body(request)
        _required(body, "names", "dtypes", "shapes")
        return await _update_call(state.updater.update_from_distributed, names=list(body["names"]),
                                  dtypes=list(body["dtypes"]), shapes=list(body["shapes"]),
                                  group_name=body.get("group_name") or DEFAULT_GROUP_NAME,
                                  weight_version=body.get("weight_version"), load_format=body.get("load_format"),
                                  abort_all_requests=bool(body.get("abort_all_requests", False)))

    @app.post("/update_weights_delta_from_distributed")
    async def update_weights_delta_from_distributed(request: Request) -> JSONResponse:
        """Physarum's delta push: receive one delta blob of num_bytes over the group and apply it."""
        state.ready()
        body = await _body(request)
        _required(body, "num_bytes")
        return await _update_call(_updater_call(state, "update_delta_from_distributed"),
                                  num_bytes=int(body["num_bytes"]), group_name=body.get("group_name") or
                                  DEFAULT_GROUP_NAME)

    @app.post("/pull_weights")
    async def pull_weights(request: Request) -> JSONResponse:
        """slime's delta pull: bring the weights to target_version from the deltas and snapshots in source_dir."""
        state.ready()
        body = await _body(request)
        _required(body, "source_dir", "target_version")
        return await _update_call(_updater_call(state, "pull"), source_dir=str(body["source_dir"]),
                                  target_version=str(body["target_version"]))

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> JSONResponse:
        """SGLang's: load PEFT's adapter directory lora_path as lora_name."""
        state.ready()
        body = await _body(request)
        _required(body, "lora_name", "lora_path")
        return await _lora_call(_updater_call(state, "load_lora_adapter"), lambda: _loaded_adapters(state),
                                lora_name=str(body["lora_name"]),
                                lora_path=str(body["lora_path"]), pinned=bool(body.get("pinned", False)),
                                weight_version=body.get("weight_version"))

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> JSONResponse:
        state.ready()
        body = await _body(request)
        _required(body, "lora_name")
        return await _lora_call(_updater_call(state, "unload_lora_adapter"), lora_name=str(body["lora_name"]))

    @app.post("/load_lora_adapter_from_distributed")
    async def load_lora_adapter_from_distributed(request: Request) -> JSONResponse:
        """Physarum's adapter push (a LoRA job's weight sync): receive the adapter's tensors over the weight-update
        group and serve them as lora_name, replacing its earlier version."""
        state.ready()
        body = await _body(request)
        _required(body, "lora_name", "config", "names", "dtypes", "shapes")
        return await _lora_call(_updater_call(state, "load_lora_adapter_from_distributed"),
                                lora_name=str(body["lora_name"]), config=body["config"], names=list(body["names"]),
                                dtypes=list(body["dtypes"]), shapes=list(body["shapes"]),
                                group_name=body.get("group_name") or DEFAULT_GROUP_NAME,
                                weight_version=body.get("weight_version"))

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> JSONResponse:
        state.ready()
        body = await _body(request)
        _required(body, "model_path")
        return await _update_call(state.updater.update_from_disk, model_path=str(body["model_path"]),
                                  weight_version=body.get("weight_version"),
                                  abort_all_requests=bool(body.get("abort_all_requests", False)))

    return app


@dataclass
class EngineServer:
    """The running HTTP server and the engine state behind it."""

    rest: RestServer
    state: EngineState
    loading: asyncio.Task

    @property
    def port(self) -> int:
        return self.rest.port

    async def stop(self) -> None:
        """Abort what is running (its callers get finish_reason abort), then stop serving."""
        await asyncio.shield(self.loading)
        if self.state.engine is not None:
            await asyncio.to_thread(self.state.engine.stop)
        await self.rest.stop()


async def create_server(config: EngineConfig) -> EngineServer:
    """Serve on config.host:port at once and load the model in the background."""
    state = EngineState(config)
    rest = RestServer(create_app(state), config.host, config.port)
    await rest.start()
    loading = asyncio.create_task(asyncio.to_thread(state.load))
    log.info("engine listening on http://%s:%d, loading %s", config.host, rest.port, state.model_path)
    return EngineServer(rest, state, loading)
