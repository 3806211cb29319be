"""Build a ``Router`` from the command line's words: replica specs, a policy, the model
whose tokenizer and chat template predict each request's prompt tokens. Shared by
``kvscope route`` and ``kvscope serve --data-parallel-size N``."""

from __future__ import annotations

import argparse


def add_router_args(p: argparse.ArgumentParser) -> None:
    from kvscope.engine.router.policy import POLICIES

    p.add_argument("--policy", default="prefix", choices=POLICIES,
                   help="prefix: least uncached prompt tokens + load (default); "
                        "least-load; round-robin")
    p.add_argument("--load-cost-tokens", type=int, default=32, metavar="T",
                   help="prefix policy: each request queued or running on a replica counts "
                        "as T prompt tokens to compute there")


def build_router(specs: list[str], policy: str, load_cost_tokens: int, model: str | None,
                 chat_template: str | None = None, keys: str | None = None):
    """(Router, error message): the error is for the user, the router None then.
    ``chat_template``: the replicas' --chat-template (a path or the template); ``keys``:
    CURVE client keys for the replicas' event streams."""
    from kvscope.engine.router.app import Router
    from kvscope.engine.router.policy import Policy
    from kvscope.engine.router.replica import Replica, parse_replica

    try:
        parsed = [parse_replica(s) for s in specs]
        pol = Policy(policy, load_cost_tokens)
    except ValueError as e:
        return None, str(e)
    tokenizer = None
    if model is not None:
        from kvscope.engine.model.chat_template import load_chat_template
        from kvscope.engine.model.errors import ModelLoadError
        from kvscope.engine.model.loader import load_tokenizer

        try:
            tokenizer = load_tokenizer(model)
        except (ModelLoadError, OSError, ValueError) as e:
            return None, f"cannot load the tokenizer of {model!r}: {e}"
        if tokenizer is not None and chat_template is not None:
            try:  # the prompts the replicas will render, for the prefix prediction
                tokenizer.chat_template = load_chat_template(chat_template)
            except (ValueError, OSError) as e:
                return None, str(e)
    try:
        replicas = [Replica(f"r{i}", url, ev, snap, keys=keys)
                    for i, (url, ev, snap) in enumerate(parsed)]
    except ValueError as e:  # unreadable keys
        return None, str(e)
    return Router(replicas, pol, tokenizer), None
