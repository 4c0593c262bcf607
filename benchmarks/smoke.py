"""The ``--smoke`` flag every benchmark has: a run small enough for the test suite."""

from __future__ import annotations

import argparse


def parse_with_smoke(parser: argparse.ArgumentParser, argv: list[str] | None, smoke: dict,
                     help: str) -> argparse.Namespace:
    """``parser``'s arguments plus ``--smoke``, whose sizes (``smoke``) become the defaults:
    flags given on the command line still win."""
    parser.add_argument("--smoke", action="store_true", help=help)
    args = parser.parse_args(argv)
    if args.smoke:
        parser.set_defaults(**smoke)
        args = parser.parse_args(argv)
    return args
