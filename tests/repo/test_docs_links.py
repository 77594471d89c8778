"""No reference to a file that does not exist: relative links in the Markdown pages, `docs/...` paths named in
the source, and Markdown file names the source cites (a design file kept outside the repository reads as a
broken promise to a newcomer). Model-free, seconds."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests import ROOT

PAGES = sorted([ROOT / "README.md", ROOT / "results" / "README.md", *(ROOT / "docs").rglob("*.md")])
SOURCE_DIRS = ("trtllm_backend", "tools", "engines", "plugins", "model_repository", "tests")
SOURCE_SUFFIXES = {".py", ".cpp", ".h", ".sh", ".pbtxt", ".yaml", ".toml"}

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
DOCS_PATH = re.compile(r"(?<![\w./-])docs/[\w./-]*[\w/]")
CAPS_MD = re.compile(r"(?<![\w./-])([A-Z][A-Z_-]+\.md)\b")  # README.md, CHANGELOG.md ...
SKIP_DIRS = {".git", ".venv", "build", "fragments", "__pycache__"}


def walk(top: Path):
    """Files under `top`, without descending into generated folders (the venv alone holds ~100k files)."""
    for folder, dirs, files in os.walk(top):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS]
        yield from (Path(folder) / f for f in files)


def source_files() -> list[Path]:
    this = Path(__file__).resolve()
    return sorted(p for d in SOURCE_DIRS for p in walk(ROOT / d) if p.suffix in SOURCE_SUFFIXES and p != this)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = page.read_text()
    found = {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}
    return found | set(re.findall(r'<a id="([^"]+)"', text))


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading or id {anchor!r} in {dest.name}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path):
    assert page.exists(), f"{page.relative_to(ROOT)} is missing"
    assert broken_links(page) == []


def test_docs_paths_in_the_source_exist():
    missing = sorted(
        {
            f"{src.relative_to(ROOT)}: {path}"
            for src in source_files()
            for path in DOCS_PATH.findall(src.read_text(errors="replace"))
            if not (ROOT / path).exists()
        }
    )
    assert missing == [], "the source names docs that do not exist"


def test_markdown_files_the_source_cites_are_in_the_repository():
    names = {p.name for p in walk(ROOT) if p.suffix == ".md"}
    cited = sorted(
        {
            f"{src.relative_to(ROOT)}: {name}"
            for src in source_files()
            for name in CAPS_MD.findall(src.read_text(errors="replace"))
            if name not in names
        }
    )
    assert cited == [], "the source cites Markdown files the repository does not have"


def test_checker_sees_a_broken_link(tmp_path: Path):
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("# A heading\n")
    page.write_text("[ok](there.md#a-heading) [gone](missing.md) [bad anchor](there.md#nope) [web](https://x.org)\n")
    assert broken_links(page) == ["missing.md: no such file", "there.md#nope: no heading or id 'nope' in there.md"]
