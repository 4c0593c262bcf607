"""``trellis`` command line: ``trellis serve [MODEL] [options]``, ``trellis download MODEL``."""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time

from server.config import Settings, add_serve_arguments, settings_from_args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trellis",
        description="Trellis: an OpenAI-compatible LLM server built around structured generation.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="serve a model over the OpenAI-compatible HTTP API",
        description="Serve a model over the OpenAI-compatible HTTP API. Every option can also be set "
        "through the environment variable named in its help.",
    )
    serve.add_argument("model_arg", nargs="?", metavar="MODEL", help="the model, as --model (vllm serve's form)")
    add_serve_arguments(serve)
    serve.set_defaults(model_default=serve.get_default("model"))
    download = commands.add_parser(
        "download",
        help="fetch a hub model into the cache ahead of time",
        description="Fetch a hub model (org/name, or org/name:file.gguf) into huggingface_hub's cache, where "
        "`trellis serve` (and any other tool) finds it. HF_TOKEN authenticates for gated models.",
    )
    download.add_argument("model", metavar="MODEL", help="hub id: org/name or org/name:file.gguf")
    download.add_argument("--revision", default="", help="branch, tag or commit (default: main)")
    download.add_argument("--download-dir", default="", help="cache folder (default: HF_HUB_CACHE, else HF_HOME/hub)")
    download.add_argument("--gguf-file", default="", help="the .gguf file of the repository to fetch")
    return parser


def serve_settings(args: argparse.Namespace) -> Settings:
    """The settings of parsed ``trellis serve`` arguments: the positional MODEL is ``--model``."""
    if args.model_arg is not None:
        if args.model not in (args.model_default, args.model_arg):
            print(f"trellis: error: two models named: {args.model_arg} and --model {args.model}", file=sys.stderr)
            raise SystemExit(2)
        args.model = args.model_arg
    return settings_from_args(args)


def download(args: argparse.Namespace) -> int:
    """``trellis download``: fetch into the cache; with the hub offline, say so in one line."""
    from server.model_loader import ModelLoadError, download_model, hub_offline

    try:
        path = download_model(args.model, revision=args.revision, download_dir=args.download_dir,
                              gguf_file=args.gguf_file)
    except ModelLoadError as exc:
        print(f"trellis: error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    if hub_offline():
        print(f"trellis: the hub is offline (HF_HUB_OFFLINE=1): nothing downloaded; {args.model} is in the cache "
              f"at {path}", file=sys.stderr)
    else:
        print(f"trellis: {args.model} is in {path}", file=sys.stderr)
    return 0


def serve(settings: Settings) -> int:
    """Load the model, then run the HTTP server until SIGTERM/SIGINT (drained) or an engine failure."""
    import uvicorn

    from server.app import create_app
    from server.model_loader import ModelLoadError
    from server.engine.model import UnsupportedModelError
    from server.state import build_state

    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if settings.ray:
        from server.scaleout.launch import run

        return run(settings)
    try:
        state = build_state(settings)
    except (ModelLoadError, UnsupportedModelError, RuntimeError, OSError) as exc:
        print(f"trellis: error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    _say_how_open(settings)
    app = create_app(settings, state)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            timeout_graceful_shutdown=5)
    server = DrainingServer(config, state, settings.drain_timeout)
    print(f"trellis: serving {state.model_name} on http://{settings.host}:{settings.port}/v1", file=sys.stderr)
    try:
        server.run()
    finally:
        state.close()
    if server.engine_failed:
        print(f"trellis: error: the engine stopped: {state.engine.error}", file=sys.stderr)
        return 1
    return 0


def _say_how_open(settings: Settings) -> None:
    if settings.allow_client_chat_template:
        logging.getLogger("trellis").info(
            "requests may send their own chat_template (sandboxed worker process); --allow-client-chat-template off refuses them"
        )


class DrainingServer:
    """uvicorn, with SIGTERM/SIGINT draining: refuse new work (503), let running requests finish up to
    ``drain_timeout`` seconds, then exit; and an engine watchdog that stops the process if the engine dies."""

    def __init__(self, config, state, drain_timeout: float) -> None:
        import uvicorn

        outer = self

        class _Server(uvicorn.Server):
            def handle_exit(self, sig, frame) -> None:  # runs in the signal handler
                outer.begin_drain()

        self._server = _Server(config)
        self._state = state
        self._drain_timeout = drain_timeout
        self._draining = threading.Event()
        self.engine_failed = False

    def run(self) -> None:
        threading.Thread(target=self._watch_engine, name="trellis-watchdog", daemon=True).start()
        self._server.run()

    def begin_drain(self) -> None:
        if self._draining.is_set():  # a second signal: stop now
            self._server.should_exit = True
            self._server.force_exit = True
            return
        self._draining.set()
        self._state.draining = True
        threading.Thread(target=self._drain, name="trellis-drain", daemon=True).start()

    def _drain(self) -> None:
        deadline = time.monotonic() + self._drain_timeout
        envelope = getattr(self._server.config.app.state, "envelope", None)
        while time.monotonic() < deadline:
            busy = envelope.inflight if envelope is not None else 0
            if not busy and not self._state.engine.num_running and not self._state.engine.num_waiting:
                break
            time.sleep(0.1)
        self._server.should_exit = True

    def _watch_engine(self) -> None:
        while not self._server.should_exit:
            if not self._state.engine.alive:
                logging.getLogger("trellis").error("the engine stopped (%s); exiting", self._state.engine.error)
                self.engine_failed = True
                self._server.should_exit = True
                return
            time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "download":
        return download(args)
    if args.command != "serve":
        parser.print_help()
        return 0 if args.command is None else 2
    return serve(serve_settings(args))


if __name__ == "__main__":
    sys.exit(main())
