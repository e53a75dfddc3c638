"""``flowers serve``: a checkpoint or an export behind HTTP, with a page to try it, on LitServe.

  POST /predict  an image (raw bytes with an image/* Content-Type, or a multipart field ``file``) ->
                 ``{"prediction": "rose", "top": [{"class": "rose", "probability": 0.91}, ...]}``
  GET  /         a page: pick or drop a photo, see the top classes with probability bars
  GET  /health   200 once the model is loaded
  GET  /info     classes, image size, checkpoint, backbone, normalisation and the server's limits
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import signal
import socket
import sys
from pathlib import Path

from flowers.errors import ConfigError

# The addresses LitServe binds: this computer only, every IPv4 interface, every interface.
HOSTS = {"127.0.0.1": "127.0.0.1", "localhost": "127.0.0.1", "0.0.0.0": "0.0.0.0", "::": "::"}
# Each number option's range: (lowest, whether the lowest itself is allowed, highest or None, unit of a float).
RANGES = {
    "--port": (1024, True, 65535, None),
    "--top_k": (1, True, None, None),
    "--max_batch_size": (1, True, None, None),
    "--image_size": (8, True, None, None),
    "--max_uploads": (1, True, None, None),
    "--batch_window_ms": (0, True, 10_000, "milliseconds"),  # the worker's queue wait must stay a sane timeout
    "--max_body_mb": (0, False, None, "MiB"),
    "--body_timeout_s": (0, False, None, "seconds"),
    "--decode_budget_mb": (1, True, None, "MiB"),
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flowers serve", description=__doc__.split("\n")[0], allow_abbrev=False,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ckpt_path", required=True,
                   help="a checkpoint written by `fit` (.ckpt), an export (.onnx, .torchscript.pt), an export folder, "
                        "or best or last: the newest run's best or last checkpoint under runs/flowers/")
    p.add_argument("--host", default="127.0.0.1",
                   help="127.0.0.1 serves this computer only; 0.0.0.0 or :: let other computers in")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--top_k", type=int, default=3, help="classes listed in each answer")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: a GPU when there is one")
    p.add_argument("--image_size", type=int,
                   help="side the model evaluates at (default: the run's data.eval_image_size or data.image_size "
                        "from its config.yaml; an ONNX export's own; else 224)")
    p.add_argument("--eval_hflip", choices=("true", "false"),
                   help="average each image with its mirror image (default: the run's model.eval_hflip)")
    p.add_argument("--max_batch_size", type=int, default=16, help="requests that share one forward pass at most")
    p.add_argument("--batch_window_ms", type=float, default=0.0,
                   help="how long the first request of a batch waits for others; 0 batches the requests that queued "
                        "while the model was busy, without waiting")
    p.add_argument("--max_body_mb", type=float, default=20.0, help="largest request body, in MiB")
    p.add_argument("--body_timeout_s", type=float, default=60.0,
                   help="seconds a client may take to send a request's headers, and then its body; a slower one is "
                        "answered 408 and cut off")
    p.add_argument("--max_uploads", type=int, default=32,
                   help="requests whose image is read and decoded at once; more are answered 503 at once")
    p.add_argument("--decode_budget_mb", type=float, default=512.0,
                   help="memory, in MiB, that the images decoded at once may take together (estimated from their "
                        "headers); a larger image waits its turn, one that needs more than all of it is refused (413)")
    return p


class Stopped(Exception):
    """The server stopped while serving (its inference worker kept dying): exit status 1, for a supervisor."""


def main(args: list[str] | None = None) -> int:
    options = parser().parse_args(args)
    try:
        return serve(options)
    except ConfigError as refused:
        print(f"flowers serve: error: {refused}", file=sys.stderr)
        return 2
    except Stopped as failed:
        print(f"flowers serve: error: {failed}", file=sys.stderr)
        return 1


def check_numbers(options: argparse.Namespace) -> None:
    """One sentence for the first number option out of its range (NaN and infinity are out of every range)."""
    for name, (low, low_allowed, high, unit) in RANGES.items():
        value = getattr(options, name[2:])
        if value is None:
            continue
        above_low = value >= low if low_allowed else value > low
        if math.isfinite(value) and above_low and (high is None or value <= high):
            continue
        if high is not None:
            bounds = f"from {low} to {high}" if low_allowed else f"above {low} and at most {high}"
        else:
            bounds = f"at least {low}" if low_allowed else f"above {low}"
        kind = f"a finite number of {unit}, " if unit else ""
        raise ConfigError(f"{name} must be {kind}{bounds}, got {value}.")


def check_model_path(ckpt_path: str) -> None:
    """Before the slow imports: the path exists, and is a file or a folder (a FIFO would hang the first read)."""
    path = Path(ckpt_path)
    if not path.exists():
        if ckpt_path in ("best", "last"):  # the newest run's, found later
            return
        raise ConfigError(f"--ckpt_path {ckpt_path!r} does not exist.")
    if not (path.is_file() or path.is_dir()):
        raise ConfigError(f"--ckpt_path {ckpt_path!r} is neither a regular file nor a folder (a FIFO, a socket or "
                          "a device): pass a checkpoint, an export or an export folder.")


def serve(options: argparse.Namespace) -> int:
    host = HOSTS.get(options.host)
    if host is None:
        raise ConfigError(f"--host {options.host!r} can't be served: LitServe binds 127.0.0.1 (this computer only, "
                          "the default), 0.0.0.0 (every IPv4 interface) or :: (every interface).")
    check_numbers(options)
    check_model_path(options.ckpt_path)
    try:
        import litserve  # noqa: F401
    except ImportError:
        raise ConfigError("serving needs LitServe: pip install 'flowers[serve]' (`make install` includes it).") \
            from None
    _check_port_free(host, options.port)
    import torch

    if options.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda, but torch sees no CUDA GPU: use --device cpu or auto.")
    from flowers.serve.model import describe
    from flowers.serve.server import Settings, before_fork, build, uvicorn_options
    from flowers.serve.uploads import name_process

    name_process("flowers-serve")  # and its forks: LitServe's queue manager; the HTTP process renames itself

    eval_hflip = None if options.eval_hflip is None else options.eval_hflip == "true"
    source = describe(options.ckpt_path, image_size=options.image_size, eval_hflip=eval_hflip)
    settings = Settings(top_k=options.top_k, max_batch_size=options.max_batch_size,
                        batch_window_ms=options.batch_window_ms, max_body_bytes=int(options.max_body_mb * 2**20),
                        device=options.device, body_timeout_s=options.body_timeout_s, max_uploads=options.max_uploads,
                        decode_budget_bytes=int(options.decode_budget_mb * 2**20))
    server = build(source, settings)
    shown = f"[{host}]" if ":" in host else host
    print(f"flowers serve: {source.format} {source.path} ({len(source.classes)} classes, {source.image_size} px, "
          f"mirror-image evaluation {'on' if source.eval_hflip else 'off'}) on http://{shown}:{options.port}/ "
          "(Ctrl-C stops it)", flush=True)
    for signum in (signal.SIGINT, signal.SIGTERM):  # Ctrl-C or `kill` stops the worker processes too
        signal.signal(signum, functools.partial(_stop, os.getpid()))
    before_fork()
    try:
        server.run(host=host, port=options.port, log_level="warning", generate_client_file=False,
                   **uvicorn_options(settings))
    except RuntimeError as failed:  # the worker failed or died while loading the model; it logged any cause above
        raise ConfigError(f"the model could not be loaded in the server's worker ({failed}); anything it logged "
                          "is above.") from None
    if server.failure:
        raise Stopped(f"{server.failure}; the server stopped, for a supervisor to start it again.")
    return 0


def _stop(main_pid: int, signum, frame) -> None:
    if os.getpid() == main_pid:
        raise KeyboardInterrupt  # LitServe's way out: it stops the HTTP and worker processes
    raise SystemExit(0)  # an HTTP process inherits the handler; uvicorn calls it once it has shut down


def _check_port_free(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a closing socket is fine
        try:
            probe.bind((host, port))
        except OSError as taken:
            raise ConfigError(f"port {port} on {host} can't be used ({taken.strerror}): another server may be "
                              "running there; pick another with --port.") from None
