"""The `kvscope` command line. Each subcommand lives in its own module under
``engine/commands/`` and exposes ``register(subparsers)``, which adds its parser and sets
``func(args) -> int``. Modules import heavy dependencies (torch, Qt) inside ``func`` only,
so ``kvscope --help`` stays fast."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from kvscope.engine import commands


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvscope",
        description="An LLM inference engine whose paged KV cache you can see.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"kvscope.engine.commands.{info.name}")
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except ModuleNotFoundError as e:  # a command of an extra that is not installed
        from kvscope.engine.extras import missing_extra_message

        msg = missing_extra_message(args.command, e)
        if msg is None:
            raise
        print(msg, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
