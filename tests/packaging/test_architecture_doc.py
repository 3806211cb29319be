"""docs/ARCHITECTURE.md's lists of files to touch stay true: for an event kind, the
shipped files that name an existing kind (host_hit) are exactly the list; for a page
format, the files that name an existing format (kivi4) are exactly that list. A file that
starts or stops handling kinds or formats must change the doc with it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "ARCHITECTURE.md"
SHIPPED = ("engine", "inspector", "kernels")
# one existing member of each kind of change, and the spellings code gives it
MARKERS = {"event-kind": re.compile(r"host_hit|HOST_HIT"),
           "page-format": re.compile(r"kivi4")}


def listed(section: str) -> set[str]:
    text = DOC.read_text()
    m = re.search(rf"<!-- files: {section} -->\n(.*?)<!-- end -->", text, re.S)
    assert m, f"docs/ARCHITECTURE.md has no '{section}' list"
    return {line[2:].split(":")[0].strip() for line in m.group(1).splitlines()
            if line.startswith("- ")}


def naming(marker: re.Pattern[str]) -> set[str]:
    return {str(p.relative_to(ROOT)) for room in SHIPPED for p in (ROOT / room).rglob("*")
            if p.suffix in (".py", ".c", ".h") and marker.search(p.read_text())}


def test_each_list_is_exactly_the_files_that_handle_that_kind_of_thing():
    for section, marker in MARKERS.items():
        doc, code = listed(section), naming(marker)
        assert doc == code, (f"docs/ARCHITECTURE.md '{section}': not listed "
                             f"{sorted(code - doc)}, listed but not naming it {sorted(doc - code)}")


def test_the_check_reads_the_lists():
    assert "engine/events/schema.py" in listed("event-kind")
    assert "kernels/block_quant.py" in listed("page-format")
