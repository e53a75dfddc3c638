"""The HTTP side of ``flowers serve``, on LitServe.

LitServe runs this process (it starts the others and waits), an HTTP server (uvicorn), an inference worker that owns
the model, and a queue manager between the two. ``ImageSpec`` adds the routes: ``POST /predict`` reads the body itself,
because LitServe's own route parses any non-form body as JSON; the image is decoded and squashed to the model's
side in the HTTP process, so a bad upload is refused there and never reaches a shared batch. The worker collects
the squares into batches (``WindowedLoop``) and answers each with its top classes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from dataclasses import dataclass
from importlib import resources
from queue import Empty

import litserve as ls
import torch
from fastapi import Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from litserve.loops import BatchedLoop
from litserve.specs.base import LitSpec
from litserve.utils import LitAPIStatus, ResponseBufferItem
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.formparsers import MultiPartException, MultiPartParser

from flowers.serve.model import BadImage, ModelSource, Predictor, decode_upload

RAW_TYPES = ("image/", "application/octet-stream")
# Uploads decoded at once in the HTTP process: each may briefly hold a full-size photo (up to PIL's 89 M pixels).
DECODE_SLOTS = min(4, os.cpu_count() or 1)


@dataclass(frozen=True)
class Settings:
    top_k: int = 3
    max_batch_size: int = 16
    batch_window_ms: float = 0.0
    max_body_bytes: int = 20 * 2**20
    device: str = "auto"


def error(status: int, message: str) -> JSONResponse:
    """Every refusal: a status and one line of JSON, ``{"error": "..."}``."""
    return JSONResponse({"error": " ".join(message.split())}, status_code=status)


class WindowedLoop(BatchedLoop):
    """LitServe's batched loop, with a window that the first request opens.

    LitServe's own collection polls the queue while idle, every millisecond (with no pause at all for a window
    of 0). This one sleeps in a blocking ``get`` until a request comes, then waits up to ``batch_timeout`` for
    more, up to ``max_batch_size`` (a window of 0: takes what is already queued).
    """

    def get_batch_requests(self, lit_api, request_queue, transport):
        try:
            items = [request_queue.get(timeout=1.0)]
        except Empty:
            return [], []
        deadline = time.monotonic() + lit_api.batch_timeout
        while len(items) < lit_api.max_batch_size:
            wait = deadline - time.monotonic()
            try:
                items.append(request_queue.get(timeout=wait) if wait > 0 else request_queue.get_nowait())
            except Empty:
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
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches every process; the main one stops this one
        if device == "cpu":
            # One core is left to the HTTP process: threads that wait for a busy core slow a forward pass manyfold.
            torch.set_num_threads(max(1, torch.get_num_threads() - 1))
        self.predictor = Predictor(self.source, device)
        print(f"flowers serve: model loaded on {device}", flush=True)

    def decode_request(self, request):
        return self.predictor.tensor(request)  # a square decoded by ImageSpec

    def batch(self, tensors):
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
    """``POST /predict``: the raw image bytes or a multipart field ``file``, checked here and queued for the worker."""

    def __init__(self, source: ModelSource, settings: Settings) -> None:
        super().__init__()
        self.api_path = "/predict"
        self.source, self.settings = source, settings
        self._decoding: asyncio.Semaphore | None = None
        self.add_endpoint("/predict", self.predict, ["POST"])

    def __getstate__(self):
        state = super().__getstate__()
        state["_decoding"] = None  # bound to the HTTP process's event loop
        return state

    def decode_request(self, request, context_kwargs=None):
        return request

    def encode_response(self, output, context_kwargs=None):
        return output

    def info(self) -> dict:
        settings = self.settings
        return {**self.source.info(), "top_k": settings.top_k, "device": settings.device,
                "max_batch_size": settings.max_batch_size, "batch_window_ms": settings.batch_window_ms,
                "max_body_bytes": settings.max_body_bytes}

    async def predict(self, request: Request) -> Response:
        try:
            data = await self._upload(request)
            if self._decoding is None:
                self._decoding = asyncio.Semaphore(DECODE_SLOTS)
            async with self._decoding:
                square = await run_in_threadpool(decode_upload, data, self.source.image_size)
        except BadImage as refused:
            return error(refused.status, str(refused))
        uid = str(uuid.uuid4())
        item = ResponseBufferItem(event=asyncio.Event())
        self.response_buffer[uid] = item
        self.request_queue.put((self.response_queue_id, uid, time.monotonic(), square))
        await item.event.wait()
        answer, status = self.response_buffer.pop(uid).response
        if status != LitAPIStatus.OK:
            code = getattr(answer, "status_code", 500)
            return error(code, "the request waited too long for the model" if code == 504 else
                         "the model failed on this image: the server's log says why")
        batch_size = answer.pop("batch_size")
        return JSONResponse(answer, headers={"X-Batch-Size": str(batch_size)})

    async def _upload(self, request: Request) -> bytes:
        """The image's bytes, from a raw body or a multipart field ``file``; at most ``max_body_bytes`` read."""
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
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
        body = b"".join(chunks)
        if not multipart:
            return body
        return await _form_file(request, body)


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


def build(source: ModelSource, settings: Settings) -> ls.LitServer:
    page = resources.files("flowers.serve").joinpath("page.html").read_text(encoding="utf-8")
    spec = ImageSpec(source, settings)
    accelerator = {"auto": "auto", "cpu": "cpu", "cuda": "cuda"}[settings.device]
    server = ls.LitServer(FlowerAPI(source, settings, spec), accelerator=accelerator, devices=1,
                          disable_openapi_url=True)
    app = server.app
    # LitServe's own "/" and "/info" answer for LitServe; these answer for the model. Its /health stays.
    app.router.routes = [r for r in app.router.routes if getattr(r, "path", None) not in ("/", "/info")]

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
