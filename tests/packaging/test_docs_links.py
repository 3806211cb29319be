"""The docs hold together: every relative link in README.md and docs/**/*.md resolves to a
file or folder of the repository, and a link's ``#anchor`` to a heading of the file it
points at; every repository path the docs name exists; and the README stays a front door
(under ``README_LIMIT`` characters).

Anchors are GitHub's: the heading's text as rendered (code spans keep their content,
links their text), lower-cased, every character that is not a letter, digit, ``_``,
``-`` or space dropped, spaces turned into ``-``; a repeated heading gets ``-1``, ``-2``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_LIMIT = 8_500

# The top-level rooms whose paths the docs name in prose and commands.
ROOMS = ("engine", "inspector", "kernels", "scripts", "tests", "assets", "docs")
_PATH = re.compile(r"(?<![\w./$~-])((?:" + "|".join(ROOMS) + r")/[\w./*-]*[\w*/])")
_BARE_MD = re.compile(r"(?<![\w./$~-])([A-Za-z][\w-]*\.md)\b")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")


def doc_files(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def _prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of every line outside fenced and indented code blocks."""
    fence: str | None = None
    prev_blank, prev_code = True, False
    for n, line in enumerate(text.splitlines(), 1):
        stripped = line.lstrip()
        if fence is not None:
            if stripped.startswith(fence):
                fence = None
            prev_blank, prev_code = False, True
            continue
        if stripped.startswith(("```", "~~~")):
            fence = stripped[:3]
            prev_blank, prev_code = False, True
            continue
        indented = line.startswith(("    ", "\t")) and bool(stripped)
        if indented and (prev_blank or prev_code):
            prev_blank, prev_code = False, True
            continue
        prev_blank, prev_code = not stripped, False
        yield n, line


def _plain(text: str) -> str:
    """A heading's text as GitHub renders it (before it makes the anchor)."""
    spans: list[str] = []

    def keep(m: re.Match[str]) -> str:
        spans.append(m.group(2).strip())
        return f"\x00{len(spans) - 1}\x00"

    text = _CODE_SPAN.sub(keep, text)
    text = re.sub(r"!\[([^\]]*)\]\([^)]*\)", r"\1", text)  # images: their alt text
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # links: their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = re.sub(r"(?<!\w)_(.+?)_(?!\w)", r"\1", text)  # _emphasis_
    return re.sub(r"\x00(\d+)\x00", lambda m: spans[int(m.group(1))], text)


def slug(heading: str) -> str:
    s = _plain(heading).strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of the markdown file ``path``."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    prev = ""
    for _, line in _prose_lines(path.read_text(encoding="utf-8")):
        m = re.match(r"^\s{0,3}#{1,6}\s+(.*?)(?:\s+#+)?\s*$", line)
        heading = m.group(1) if m else None
        if heading is None and prev.strip() and re.match(r"^\s{0,3}(=+|-+)\s*$", line) \
                and not prev.lstrip().startswith(("|", "-", "*", "#", ">")):
            heading = prev.strip()  # a setext heading: the line above, underlined
        prev = line
        if heading is None:
            continue
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> Iterator[tuple[int, str]]:
    """(line, target) of every link and image outside code."""
    for n, line in _prose_lines(path.read_text(encoding="utf-8")):
        m = _REF_DEF.match(line)
        if m:
            yield n, m.group(1)
            continue
        for m in _LINK.finditer(_CODE_SPAN.sub("code", line)):
            yield n, m.group(1)


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """What is wrong with the relative links of ``path``, one line each."""
    problems = []
    for n, target in links(path):
        where = f"{path.relative_to(root)}:{n}: {target!r}"
        if not target:
            problems.append(f"{where}: empty link")
            continue
        if _SCHEME.match(target):
            continue  # http:, https:, mailto:
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / unquote(file_part)).resolve() if file_part else path
        if root not in (dest, *dest.parents) or ".venv" in dest.relative_to(root).parts:
            problems.append(f"{where}: points outside the repository")
        elif not dest.exists():
            problems.append(f"{where}: no such file")
        elif anchor and dest.suffix == ".md" and unquote(anchor) not in anchors(dest):
            problems.append(f"{where}: no heading with that anchor in {dest.name}")
    return problems


def missing_paths(path: Path, root: Path = ROOT) -> list[str]:
    """Repository paths named in ``path`` (prose, code spans and commands) that do not
    exist: a moved file, or a note that never was in the repository."""
    problems = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        for m in _PATH.finditer(line):
            name = m.group(1)
            if not any(root.glob(name.rstrip("/"))):
                problems.append(f"{path.relative_to(root)}:{n}: {name} does not exist")
        for m in _BARE_MD.finditer(line):
            name = m.group(1)
            if not any((d / name).exists() for d in (root, root / "docs", path.parent)):
                problems.append(f"{path.relative_to(root)}:{n}: {name} does not exist")
    return problems


@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path) -> None:
    assert broken_links(doc) == []


@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_named_paths_exist(doc: Path) -> None:
    assert missing_paths(doc) == []


def test_readme_is_a_front_door() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text) < README_LIMIT, f"README.md has {len(text)} characters"
    # the quick check greps the README for the two commands
    assert "make demo" in text and "make test" in text


def test_slugs_are_githubs() -> None:
    assert slug("Workloads: kvscope load") == "workloads-kvscope-load"
    assert slug("Prefill attention: `kernels/cpu_paged_prefill.c`") == \
        "prefill-attention-kernelscpu_paged_prefillc"
    assert slug("HF transformers `generate`: `kvscope bench throughput`") == \
        "hf-transformers-generate-kvscope-bench-throughput"
    assert slug("The [router](scale-out.md) and **data parallel**") == \
        "the-router-and-data-parallel"
    assert slug("GPU rows: PENDING") == "gpu-rows-pending"


def test_the_checks_catch_what_they_should(tmp_path: Path) -> None:
    """A link to a missing file, to a missing heading, or out of the repository, and a
    named path that does not exist, are each reported; good links, code and URLs are not."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "real.py").write_text("")
    (tmp_path / "docs" / "page.md").write_text(
        "# Page\n\n## Tried and lost\n\n## Tried and lost\n\n### `make demo`: the main job\n")
    readme = tmp_path / "README.md"
    readme.write_text(
        "# Title\n\n"
        "[ok](docs/page.md) [ok anchor](docs/page.md#tried-and-lost-1) "
        "[ok code anchor](docs/page.md#make-demo-the-main-job) [self](#title) "
        "[web](https://example.com/x.md) ![img](engine/real.py) [dir](engine/)\n"
        "[gone](docs/gone.md)\n"
        "[bad anchor](docs/page.md#tried-and-lost-2)\n"
        "[outside](../elsewhere.md)\n"
        "`[not a link](nowhere.md)`\n\n"
        "    [in a code block](nowhere.md)\n")
    problems = broken_links(readme, tmp_path)
    assert [p.split(": ", 1)[0] for p in problems] == \
        ["README.md:4", "README.md:5", "README.md:6"]
    assert "no such file" in problems[0]
    assert "anchor" in problems[1]
    assert "outside" in problems[2]

    page = tmp_path / "docs" / "named.md"
    page.write_text("engine/real.py, `engine/` and docs/page.md exist\n"
                    "`engine/moved.py` and engine/*.py\n"
                    "    python scripts/gone.py      # a command\n"
                    "See NOTES.md, page.md and README.md.\n")
    assert missing_paths(page, tmp_path) == [
        "docs/named.md:2: engine/moved.py does not exist",
        "docs/named.md:3: scripts/gone.py does not exist",
        "docs/named.md:4: NOTES.md does not exist",
    ]
