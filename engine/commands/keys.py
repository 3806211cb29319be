"""`kvscope keys DIR`: make the CURVE keys that let an event stream leave the machine.

    kvscope keys ~/.kvscope/keys            server and client key pairs, allowed_clients/
    kvscope serve --events tcp://0.0.0.0:5557 --events-keys ~/.kvscope/keys
    kvscope inspect --connect tcp://GPU-HOST:5557 --keys ~/.kvscope/keys

The layout and who checks whom: ``engine.events.wire.keys``. The watching machine needs
``server.key`` and ``client.key_secret`` (and ``client.key``); ``server.key_secret``
stays on the engine's machine.
"""

from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("keys", help="make CURVE keys for a remote event stream "
                                    "(serve --events-keys, inspect --keys)")
    p.add_argument("directory", metavar="DIR", help="where to write the key files")
    p.add_argument("--force", action="store_true",
                   help="replace keys already in DIR (clients holding the old ones are "
                        "refused from then on)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from kvscope.engine.events.wire.keys import KeysError, curve_available, make_keys

    if not curve_available():
        print("kvscope keys: this pyzmq's libzmq has no CURVE support", file=sys.stderr)
        return 1
    try:
        paths = make_keys(args.directory, force=args.force)
    except (KeysError, OSError) as e:
        print(f"kvscope keys: {e}", file=sys.stderr)
        return 2
    d = args.directory
    print(f"wrote {paths['server_public']}, {paths['server_secret']} (the engine's pair),\n"
          f"      {paths['client_public']}, {paths['client_secret']} (a client's pair),\n"
          f"      {paths['allowed_client']} (clients the engine accepts)\n"
          f"engine:  kvscope serve --events tcp://0.0.0.0:5557 --events-keys {d}\n"
          f"         (vLLM: KVSCOPE_EVENTS=tcp://0.0.0.0:5557 KVSCOPE_EVENTS_KEYS={d})\n"
          f"watcher: copy server.key, client.key and client.key_secret to a directory "
          f"there, then\n"
          f"         kvscope inspect --connect tcp://ENGINE-HOST:5557 --keys THAT_DIR")
    return 0
