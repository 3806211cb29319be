"""``python -m engine.events``: the event protocol's kinds and the step statistics, as
tables generated from their types (engine.events.schema, engine.events.stats)."""

from __future__ import annotations

import textwrap

from kvscope.engine.events import schema as S
from kvscope.engine.events import stats


def main() -> None:
    print(f"kvscope event protocol {S.PROTOCOL_VERSION} (readers take "
          f"{', '.join(map(str, S.READABLE_VERSIONS))}); ?: optional, ids: a block id list")
    print()
    print(S.kinds_table())
    print()
    print("step stats (a batch's \"stats\" map, engine.events.stats.StepStats; None: not "
          "reported):")
    print(textwrap.fill(stats.fields_text(), 88, initial_indent="  ", subsequent_indent="  "))


if __name__ == "__main__":
    main()
