"""Every relative link and every repository path that docs/ and the READMEs name exists: the
documents move with the code (a renamed module or a moved doc fails here, naming the file)."""

from __future__ import annotations

import glob
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = sorted(
    [
        ROOT / "README.md",
        *(ROOT / "docs").glob("*.md"),
        ROOT / "benchmarks" / "README.md",
        ROOT / "helm" / "README.md",
    ]
)
# [text](target): a relative target, without its #anchor (http(s) and mailto links are not ours).
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
# A path into the repository: a top-level folder, then anything path-like. It must not follow
# a word character, `/`, `.` or `~` (URLs, ~/... and /abs/... are not repository paths).
REPO_PATH = re.compile(
    r"(?<![\w/.~-])((?:docs|benchmarks|clients|common|helm|src|tests|dataplane|controlplane|kernels|protos)/[\w./*-]*\w)"
)


def _exists(path: Path) -> bool:
    return bool(glob.glob(str(path))) if "*" in str(path) else path.exists()


def links(document: Path) -> list[str]:
    return [t for t in LINK.findall(document.read_text()) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(document: Path) -> None:
    missing = [t for t in links(document) if not _exists(document.parent / t)]
    assert missing == []


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_repository_paths_exist(document: Path) -> None:
    # Code blocks whose language is unnamed draw trees (entries relative to the folder above).
    blocks = re.compile(r"^```(\w*)\n.*?^```", flags=re.S | re.M)
    text = blocks.sub(lambda block: block.group(0) if block.group(1) else "", document.read_text())
    # From the repository's root, or (a README below it) from the document's own folder.
    named = set(REPO_PATH.findall(text))
    missing = sorted(p for p in named if not (_exists(ROOT / p) or _exists(document.parent / p)))
    assert missing == []


def test_the_patterns_find_what_they_must() -> None:
    assert links(ROOT / "README.md"), "the README links to its docs"
    assert LINK.findall("see [the API](api.md#http) and [x](https://example.com)") == [
        "api.md",
        "https://example.com",
    ]
    assert REPO_PATH.findall(
        "in `dataplane/src/pagedserve/dataplane/engine/llm_engine.py`, not https://x.org/docs/a.md"
    ) == ["dataplane/src/pagedserve/dataplane/engine/llm_engine.py"]
