"""``trellis`` command line: ``trellis serve [options]``."""

from __future__ import annotations

import argparse
import logging
import sys

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
    add_serve_arguments(serve)
    return parser


def serve(settings: Settings) -> int:
    """Load the model, then run the HTTP server until interrupted."""
    import uvicorn

    from server.app import create_app
    from server.model_loader import ModelLoadError
    from server.engine.model import UnsupportedModelError
    from server.state import build_state

    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        state = build_state(settings)
    except (ModelLoadError, UnsupportedModelError, RuntimeError, OSError) as exc:
        print(f"trellis: error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    app = create_app(settings, state)
    print(f"trellis: serving {state.model_name} on http://{settings.host}:{settings.port}/v1", file=sys.stderr)
    try:
        uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level, timeout_graceful_shutdown=5)
    finally:
        state.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command != "serve":
        parser.print_help()
        return 0 if args.command is None else 2
    return serve(settings_from_args(args))


if __name__ == "__main__":
    sys.exit(main())
