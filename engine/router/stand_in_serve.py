"""``python -m engine.router.stand_in_serve [kvscope serve flags]``: a ``kvscope serve``
whose model is a StandInModel (engine/model/stand_in.py): every part is real except the
forward pass, which sleeps for the real model's measured cost. For cluster benchmarks
only (``kvscope bench route --stand-in``); never a way to serve answers."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    import engine.engine
    from engine.cli import main as cli_main
    from engine.model.stand_in import load_stand_in

    # The one seam: LLMEngine loads its model through this name (no other change).
    engine.engine.load_model = load_stand_in
    return cli_main(["serve", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
