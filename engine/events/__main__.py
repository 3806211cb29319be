"""``python -m engine.events``: the event protocol's kinds and the step statistics, as
tables generated from their types (engine.events.schema, engine.events.stats)."""

from __future__ import annotations

from engine.events import schema as S


def main() -> None:
    print(f"kvscope event protocol {S.PROTOCOL_VERSION} (readers take "
          f"{', '.join(map(str, S.READABLE_VERSIONS))}); ?: optional, ids: a block id list")
    print()
    print(S.kinds_table())


if __name__ == "__main__":
    main()
