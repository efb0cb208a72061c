"""Entry point of the ``kvsieve`` command: discovers the subcommands in this package."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from .. import __version__


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The command line's parser; given ``argv`` that names a command, only that command's (a command's
    options may import what another command's would not need, e.g. bench's the benchmark module and torch)."""
    parser = argparse.ArgumentParser(
        prog="kvsieve", description="Sparse attention for long-context LLM decoding."
    )
    parser.add_argument("--version", action="version", version=f"kvsieve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    import kvsieve.cli as package

    names = [info.name for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name)
             if info.name not in ("main", "help_format") and not info.name.startswith("_")]
    asked = next((a for a in argv or () if not a.startswith("-")), None)
    for name in [asked] if asked in names else names:
        module = importlib.import_module(f"kvsieve.cli.{name}")
        if hasattr(module, "register"):
            module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    try:
        return int(args.handler(args) or 0)
    except (ValueError, OSError) as e:
        # OSError: a missing or unreadable file, or a model the hub cannot serve (transformers raises
        # OSError for an unknown or unreachable repository): one line, no traceback
        print(f"kvsieve {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
