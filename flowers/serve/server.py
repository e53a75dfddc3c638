"""The HTTP side of ``flowers serve``, on LitServe.

LitServe runs this process (it starts the others and waits), an HTTP server (uvicorn), an inference worker that owns
the model, and a queue manager between the two. ``ImageSpec`` adds the routes: ``POST /predict`` reads the body itself,
because LitServe's own route parses any non-form body as JSON; the image is decoded and squashed to the model's
side in the HTTP process, so a bad upload is refused there and never reaches a shared batch. The worker collects
the squares into batches (``WindowedLoop``) and answers each with its top classes.

What a client may cost is bounded there too: ``HeaderDeadline`` and ``ImageSpec`` cut off slow clients and cap the
uploads read at once, and ``DecodeBudget`` the memory of the decodes running at once. ``FlowerServer`` watches the
worker from the main process, restarts it when it dies, and tells the HTTP process (``Lifeline``) to answer the
requests it held.
"""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
import signal
import sys
import threading
import time
import uuid
from collections import deque
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib import resources
from queue import Empty
from typing import TYPE_CHECKING

import litserve as ls
from fastapi import Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from litserve.loops import BatchedLoop
from litserve.specs.base import LitSpec
from litserve.utils import LitAPIStatus, ResponseBufferItem, WorkerSetupStatus
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from flowers.serve.uploads import (
    BadImage,
    give_back_memory,
    name_process,
    open_upload,
    return_large_frees,
    square_of,
)

if TYPE_CHECKING:
    from flowers.serve.model import ModelSource

RAW_TYPES = ("image/", "application/octet-stream")
QUEUE_TIMEOUT_S = 30.0  # LitServe's: a request that waited this long for the model answers 504
DECODE_WAIT_S = 30.0  # how long an upload may wait for room in the decode budget before it answers 503
# LitServe's request queue lives in its manager process, which runs each get() for the worker: the get of a
# worker killed mid-wait goes on there and would swallow a request, so no single wait outlasts a worker restart.
GET_SLICE_S = 0.25
WATCH_S = 0.25  # how often the worker's death is looked for, in the main process and by each waiting request
MAX_RESTARTS = 5  # worker deaths in RESTART_WINDOW_S after which the server stops instead of restarting it again
RESTART_WINDOW_S = 600.0


@dataclass(frozen=True)
class Settings:
    top_k: int = 3
    max_batch_size: int = 16
    batch_window_ms: float = 0.0
    max_body_bytes: int = 20 * 2**20
    device: str = "auto"
    body_timeout_s: float = 60.0
    max_uploads: int = 32
    decode_budget_bytes: int = 512 * 2**20


def error(status: int, message: str, *, close: bool = False) -> JSONResponse:
    """Every refusal: a status and one line of JSON, ``{"error": "..."}``; ``close`` ends the connection after it
    (the rest of an unread body is not waited for)."""
    headers = {"Connection": "close"} if close else None
    if status == 503:
        headers = {**(headers or {}), "Retry-After": "2"}
    return JSONResponse({"error": " ".join(message.split())}, status_code=status, headers=headers)


def log(message: str) -> None:
    print(f"flowers serve: {message}", file=sys.stderr, flush=True)


class Lifeline:
    """What the HTTP process knows of the inference worker, written by the main process's watch: whether one is
    ready, and how many have died. Shared memory, inherited by the forked HTTP process."""

    def __init__(self) -> None:
        self._ready = multiprocessing.RawValue("i", 1)
        self._deaths = multiprocessing.RawValue("i", 0)

    @property
    def ready(self) -> bool:
        return bool(self._ready.value)

    @ready.setter
    def ready(self, value: bool) -> None:
        self._ready.value = int(value)

    @property
    def deaths(self) -> int:
        return self._deaths.value

    def died(self) -> None:
        self._ready.value = 0
        self._deaths.value += 1


class DecodeBudget:
    """Bytes of the HTTP process's memory that the decodes running at once may take together: a decode starts once
    its estimate fits beside the others', so a burst of large images queues instead of adding up."""

    def __init__(self, total: int) -> None:
        self.total, self.used = total, 0
        self._freed: asyncio.Condition | None = None  # made in the HTTP process's event loop

    @asynccontextmanager
    async def hold(self, cost: int):
        if self._freed is None:
            self._freed = asyncio.Condition()
        async with self._freed:
            try:
                async with asyncio.timeout(DECODE_WAIT_S):
                    await self._freed.wait_for(lambda: self.used + cost <= self.total)
            except TimeoutError:
                raise BadImage(503, f"the server is decoding other large images and had no room for this one "
                                    f"within {DECODE_WAIT_S:.0f} s: retry later") from None
            self.used += cost
        try:
            yield
        finally:
            async with self._freed:
                self.used -= cost
                self._freed.notify_all()


class WindowedLoop(BatchedLoop):
    """LitServe's batched loop, with a window that the first request opens.

    LitServe's own collection polls the queue while idle, every millisecond (with no pause at all for a window
    of 0). This one sleeps in blocking ``get`` calls of ``GET_SLICE_S`` until a request comes, then waits up to
    ``batch_timeout`` for more, up to ``max_batch_size`` (a window of 0: takes what is already queued).
    """

    def get_batch_requests(self, lit_api, request_queue, transport):
        try:
            items = [request_queue.get(timeout=GET_SLICE_S)]
        except Empty:
            return [], []
        deadline = time.monotonic() + lit_api.batch_timeout
        while len(items) < lit_api.max_batch_size:
            wait = deadline - time.monotonic()
            try:
                items.append(request_queue.get(timeout=min(wait, GET_SLICE_S)) if wait > 0 else
                             request_queue.get_nowait())
            except Empty:
                if wait <= GET_SLICE_S:
                    break
        batch, late, now = [], [], time.monotonic()
        for queue_id, uid, queued_at, square in items:
            if lit_api.request_timeout not in (-1, False, None) and now - queued_at > lit_api.request_timeout:
                late.append((queue_id, uid))  # LitServe answers these with 504
            else:
                batch.append((queue_id, uid, square))
        return batch, late


class FlowerAPI(ls.LitAPI):
    """The inference worker: squares in, ``{"prediction", "top", "batch_size"}`` out, one forward per batch."""

    def __init__(self, source: ModelSource, settings: Settings, spec: LitSpec) -> None:
        super().__init__(max_batch_size=settings.max_batch_size, batch_timeout=settings.batch_window_ms / 1000,
                         spec=spec, loop=WindowedLoop())
        self.source, self.settings = source, settings

    def setup(self, device: str) -> None:
        import torch

        from flowers.serve.model import Predictor

        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches every process; the main one stops this one
        name_process("flowers-model")
        if device == "cpu":
            # One core is left to the HTTP process: threads that wait for a busy core slow a forward pass manyfold.
            torch.set_num_threads(max(1, torch.get_num_threads() - 1))
        self.predictor = Predictor(self.source, device)
        gc.collect()
        give_back_memory()  # what loading the checkpoint freed (its optimizer state, say)
        print(f"flowers serve: model loaded on {device}", flush=True)

    def health(self) -> bool:
        # Runs in the HTTP process, for LitServe's /health: 503 from the moment the worker is seen dead until the
        # new one is ready.
        lifeline = getattr(self.spec, "lifeline", None)
        return lifeline is None or lifeline.ready

    def decode_request(self, request):
        return self.predictor.tensor(request)  # a square decoded by ImageSpec

    def batch(self, tensors):
        import torch

        return torch.stack(tensors)

    def predict(self, images):
        probs = self.predictor.probabilities(images)
        return [(row, len(images)) for row in probs]

    def unbatch(self, output):
        return output

    def encode_response(self, output):
        probs, batch_size = output
        return {**self.predictor.top(probs, self.settings.top_k), "batch_size": batch_size}


class ImageSpec(LitSpec):
    """``POST /predict``: the raw image bytes or a multipart field ``file``, checked here and queued for the worker.

    At most ``max_uploads`` requests are read and decoded at once (more get 503 at once), each body must arrive
    within ``body_timeout_s``, and the decodes share ``decode_budget_bytes`` of memory.
    """

    def __init__(self, source: ModelSource, settings: Settings, lifeline: Lifeline) -> None:
        super().__init__()
        self.api_path = "/predict"
        self.source, self.settings, self.lifeline = source, settings, lifeline
        self.budget = DecodeBudget(settings.decode_budget_bytes)
        self.uploads = 0  # requests reading or decoding their image now, in this HTTP process
        self.add_endpoint("/predict", self.predict, ["POST"])

    def __getstate__(self):
        state = super().__getstate__()
        # The worker needs none of the HTTP side: the budget is bound to the HTTP process's event loop, and
        # shared memory is inherited, not pickled.
        state["budget"] = state["lifeline"] = None
        return state

    def decode_request(self, request, context_kwargs=None):
        return request

    def encode_response(self, output, context_kwargs=None):
        return output

    def info(self) -> dict:
        settings = self.settings
        return {**self.source.info(), "top_k": settings.top_k, "device": settings.device,
                "max_batch_size": settings.max_batch_size, "batch_window_ms": settings.batch_window_ms,
                "max_body_bytes": settings.max_body_bytes, "body_timeout_s": settings.body_timeout_s,
                "max_uploads": settings.max_uploads, "decode_budget_bytes": settings.decode_budget_bytes}

    async def predict(self, request: Request) -> Response:
        if not self.lifeline.ready:
            return error(503, "the model's worker process is restarting: retry in a few seconds")
        if self.uploads >= self.settings.max_uploads:
            return error(503, f"the server is receiving {self.uploads} other uploads, its limit (--max_uploads): "
                              "retry in a few seconds", close=True)
        self.uploads += 1
        try:
            square = await self._square(request)
        except BadImage as refused:
            return error(refused.status, str(refused), close=refused.status in (408, 413))
        except ClientDisconnect:
            log(f"{_client(request)} went away before its upload was complete")
            return Response(status_code=400)  # nobody is left to read it
        finally:
            self.uploads -= 1
        return await self._answer(square)

    async def _square(self, request: Request):
        data = await self._upload(request)
        image, cost = await run_in_threadpool(open_upload, data, self.source.image_size, self.budget.total)
        async with self.budget.hold(cost):
            return await run_in_threadpool(square_of, image, self.source.image_size)

    async def _answer(self, square) -> Response:
        deaths = self.lifeline.deaths
        uid = str(uuid.uuid4())
        item = ResponseBufferItem(event=asyncio.Event())
        self.response_buffer[uid] = item
        self.request_queue.put((self.response_queue_id, uid, time.monotonic(), square))
        deadline = time.monotonic() + QUEUE_TIMEOUT_S + 30  # the worker answers 504 itself after QUEUE_TIMEOUT_S
        while not item.event.is_set():
            if self.lifeline.deaths != deaths:  # the worker that held it is gone, and the answer with it
                self.response_buffer.pop(uid, None)
                return error(503, "the model's worker process died while it held this request (a new one is "
                                  "loading the model): retry in a few seconds")
            if time.monotonic() > deadline:
                self.response_buffer.pop(uid, None)
                return error(504, "the model did not answer this request in time")
            try:
                async with asyncio.timeout(WATCH_S):
                    await item.event.wait()
            except TimeoutError:
                pass
        answer, status = self.response_buffer.pop(uid).response
        if status != LitAPIStatus.OK:
            code = getattr(answer, "status_code", 500)
            return error(code, "the request waited too long for the model" if code == 504 else
                         "the model failed on this image: the server's log says why")
        batch_size = answer.pop("batch_size")
        return JSONResponse(answer, headers={"X-Batch-Size": str(batch_size)})

    async def _upload(self, request: Request) -> bytes:
        """The image's bytes, from a raw body or a multipart field ``file``; at most ``max_body_bytes`` read, within
        ``body_timeout_s``."""
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        multipart = kind == "multipart/form-data"
        if not multipart and not kind.startswith(RAW_TYPES):
            given = f"Content-Type {kind!r} is not accepted" if kind else "the request has no Content-Type"
            raise BadImage(415, f"{given}: send the image's bytes as image/jpeg, image/png, ... or "
                                "application/octet-stream, or a multipart form with a field 'file'")
        limit = self.settings.max_body_bytes
        too_large = BadImage(413, f"the body is over the limit of {limit} bytes (--max_body_mb)")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        chunks, size = [], 0
        timeout = self.settings.body_timeout_s
        try:
            async with asyncio.timeout(timeout):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise too_large
                    chunks.append(chunk)
        except TimeoutError:
            log(f"{_client(request)} sent {size} bytes of its body in {timeout:g} s, and was cut off "
                "(--body_timeout_s)")
            raise BadImage(408, f"the body did not arrive within {timeout:g} s (--body_timeout_s)") from None
        body = b"".join(chunks)
        if not multipart:
            return body
        return await _form_file(request, body)


def _client(request: Request) -> str:
    client = request.client
    return f"the client {client.host}:{client.port}" if client else "a client"


async def _form_file(request: Request, body: bytes) -> bytes:
    async def replay():
        yield body

    try:
        form = await MultiPartParser(request.headers, replay(), max_files=1, max_fields=16).parse()
    except MultiPartException as refused:
        raise BadImage(400, f"the multipart form could not be read: {refused.message}") from None
    upload = form.get("file")
    if upload is None or isinstance(upload, str):
        raise BadImage(400, "the multipart form has no file field named 'file'")
    return await upload.read()


class HeaderDeadline(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
    """uvicorn's HTTP protocol, closing a connection whose request headers are not complete ``header_timeout``
    after it opened or after their first bytes came (uvicorn waits for them forever). Idle kept-alive connections
    are uvicorn's to close; the body's deadline is ImageSpec's."""

    header_timeout = 60.0

    def connection_made(self, transport) -> None:
        self._deadline: asyncio.TimerHandle | None = None
        self._header_bytes = 0
        super().connection_made(transport)
        self._deadline = self.loop.call_later(self.header_timeout, self._headers_due)

    def data_received(self, data: bytes) -> None:
        if self._between_requests():
            self._header_bytes += len(data)
            if self._deadline is None:
                self._deadline = self.loop.call_later(self.header_timeout, self._headers_due)
        super().data_received(data)

    def on_response_complete(self) -> None:
        self._cancel_deadline()
        self._header_bytes = 0
        super().on_response_complete()

    def connection_lost(self, exc) -> None:
        self._cancel_deadline()
        super().connection_lost(exc)

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _headers_due(self) -> None:
        self._deadline = None
        if not self._between_requests() or self.transport.is_closing():
            return  # the headers came: the request is the app's now
        if self._header_bytes:  # a connection that sent nothing at all is closed without a word, as uvicorn does
            where = f"the client {self.client[0]}:{self.client[1]}" if self.client else "a client"
            log(f"{where} sent {self._header_bytes} bytes but no complete request headers in "
                f"{self.header_timeout:g} s, and was cut off (--body_timeout_s)")
        self.transport.close()


class FlowerServer(ls.LitServer):
    """LitServe's server, with a watch on its inference worker that restarts it when it dies (the kernel's
    out-of-memory killer, say), tells the HTTP process to answer the requests it held with 503, and stops the
    server, saying why in ``failure``, when a worker dies before it is ready or dies too often."""

    def __init__(self, *args, lifeline: Lifeline, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lifeline = lifeline
        self.failure: str | None = None
        self._stopping = threading.Event()
        self._restarting = threading.Lock()
        self._deaths: deque[float] = deque()

    def verify_worker_status(self) -> None:
        # LitServe's waits forever for a worker killed while it loads the model (it never says "error").
        while not any(status == WorkerSetupStatus.READY for status in self.workers_setup_status.values()):
            if any(status == WorkerSetupStatus.ERROR for status in self.workers_setup_status.values()):
                raise RuntimeError("the worker's setup failed")
            dead = next((process for process in self.inference_workers if not process.is_alive()), None)
            if dead is not None:
                raise RuntimeError(f"the worker {_ended(dead.exitcode)} while it loaded the model")
            time.sleep(0.05)

    def _start_worker_monitoring(self, manager, uvicorn_workers) -> None:  # replaces LitServe's watch
        threading.Thread(target=self._watch, name="flowers-serve-watch", daemon=True).start()

    def _perform_graceful_shutdown(self, *args, **kwargs) -> None:
        self._stopping.set()
        with self._restarting:  # a worker being started now is stopped as well
            super()._perform_graceful_shutdown(*args, **kwargs)

    def _watch(self) -> None:
        try:
            while not self._stopping.wait(WATCH_S):
                with self._restarting:
                    if self._stopping.is_set():
                        return
                    if not self._check_workers():
                        self._shutdown_event.set()  # run() returns, after its own clean shutdown
                        return
        except Exception:  # noqa: BLE001 - the manager process is gone: the server is stopping anyway
            return

    def _check_workers(self) -> bool:
        """Restarts each dead worker; False (and ``failure`` says why) when the server should stop instead."""
        for index, process in enumerate(self.inference_workers):
            if process.is_alive():
                continue
            was_ready = all(status == WorkerSetupStatus.READY for status in self.workers_setup_status.values())
            self.lifeline.died()
            how = _ended(process.exitcode)
            now = time.monotonic()
            self._deaths.append(now)
            while self._deaths and now - self._deaths[0] > RESTART_WINDOW_S:
                self._deaths.popleft()
            if not was_ready:
                self.failure = f"the inference worker {how} before it had loaded the model"
                return False
            if len(self._deaths) > MAX_RESTARTS:
                self.failure = (f"the inference worker {how}, for the {len(self._deaths)}th time in "
                                f"{RESTART_WINDOW_S / 60:.0f} minutes")
                return False
            log(f"the inference worker (PID {process.pid}) {how}; the requests it held get 503, and a new worker "
                "is loading the model")
            self._drop_queued()
            self.inference_workers[index] = self.launch_single_inference_worker(self.lit_api, index)
        if not self.lifeline.ready and all(status == WorkerSetupStatus.READY
                                           for status in self.workers_setup_status.values()):
            self.lifeline.ready = True
            log("the new inference worker is ready")
        return True

    def _drop_queued(self) -> None:
        # Their HTTP handlers have answered 503 already: the new worker would work for nobody.
        queue = self._get_request_queue(self.lit_api.api_path)
        try:
            while True:
                queue.get_nowait()
        except Empty:
            pass


def _ended(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        oom = " (what the kernel's out-of-memory killer sends)" if -exitcode == signal.SIGKILL else ""
        return f"was killed by {name}{oom}"
    return f"exited with status {exitcode}"


def build(source: ModelSource, settings: Settings) -> FlowerServer:
    page = resources.files("flowers.serve").joinpath("page.html").read_text(encoding="utf-8")
    lifeline = Lifeline()
    spec = ImageSpec(source, settings, lifeline)
    accelerator = {"auto": "auto", "cpu": "cpu", "cuda": "cuda"}[settings.device]
    server = FlowerServer(FlowerAPI(source, settings, spec), accelerator=accelerator, devices=1,
                          timeout=QUEUE_TIMEOUT_S, disable_openapi_url=True, lifeline=lifeline)
    app = server.app
    # LitServe's own "/" and "/info" answer for LitServe; these answer for the model. Its /health stays.
    app.router.routes = [r for r in app.router.routes if getattr(r, "path", None) not in ("/", "/info")]

    litserve_lifespan = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(app):  # runs in the HTTP process, as it starts
        name_process("flowers-http")
        async with litserve_lifespan(app) as state:
            yield state

    app.router.lifespan_context = lifespan

    @app.get("/")
    async def page_route() -> HTMLResponse:
        return HTMLResponse(page)

    @app.get("/info")
    async def info_route() -> JSONResponse:
        return JSONResponse(spec.info())

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, refused: StarletteHTTPException) -> JSONResponse:
        return error(refused.status_code, str(refused.detail))

    return server


def uvicorn_options(settings: Settings) -> dict:
    """What ``server.run`` passes on to uvicorn: the protocol with the header deadline."""
    protocol = type("HeaderDeadline", (HeaderDeadline,), {"header_timeout": settings.body_timeout_s})
    return {"http": protocol}


def before_fork() -> None:
    """In the main process, just before LitServe forks its HTTP process from it: memory that loading the model to
    check it freed goes back to the system, and what is left is shared with the forks instead of copied."""
    gc.collect()
    give_back_memory()
    return_large_frees()  # the HTTP process's large decodes go back to the system once freed
    gc.freeze()  # the collector would otherwise write to, and so copy, every page of objects the forks inherit
