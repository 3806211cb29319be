"""`kvscope model pull|info`: fetch the default model, print a model's configuration."""

from __future__ import annotations

import argparse


def _pull(args: argparse.Namespace) -> int:
    from kvscope.engine.model.errors import ModelLoadError
    from kvscope.engine.model.pull import default_model_path, is_valid, pull

    try:
        if args.verify and not args.force:
            path = default_model_path()
            if not is_valid(path, full_check=True):
                print(f"{path}: missing or corrupt; pulling again")
        path = pull(force=args.force)
    except ModelLoadError as exc:
        print(f"kvscope model pull: {exc}")
        return 1
    print(f"model: {path}")
    return 0


def _info(args: argparse.Namespace) -> int:
    from kvscope.engine.model.errors import ModelLoadError
    from kvscope.engine.model.loader import read_config

    try:
        path, config = read_config(args.model)
    except ModelLoadError as exc:
        print(f"kvscope model info: {exc}")
        return 1
    print(f"path: {path}")
    for name, value in vars(config).items():
        print(f"{name}: {value}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("model", help="fetch the default model or show a model's configuration")
    model_sub = p.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    pull_p = model_sub.add_parser("pull", help="download the default model into $KVSCOPE_HOME")
    pull_p.add_argument("--force", action="store_true", help="download again even if present")
    pull_p.add_argument("--verify", action="store_true",
                        help="re-hash the present file instead of trusting its stamp")
    pull_p.set_defaults(func=_pull)
    info_p = model_sub.add_parser("info", help="print a model's configuration")
    info_p.add_argument("model", nargs="?", default="smollm2",
                        help="'smollm2', a .gguf file or an HF directory")
    info_p.set_defaults(func=_info)
