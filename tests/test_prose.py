"""Comments and docstrings say why, not when: none cites a commit, a date or a measured speedup
(history lives in git, figures in the benchmark tables)."""

from __future__ import annotations

import io
import re
import subprocess
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CODE = (
    "controlplane",
    "dataplane",
    "kernels",
    "clients",
    "benchmarks",
    "protos",
    "common",
    "src",
    "helm",
    "tests",
)
# A hexadecimal word of 7-40 characters with at least one digit and one letter: what `git log
# --oneline` prints, and what a full hash is.
HEX_WORD = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
# What a measurement leaves in a comment: a date (when it ran) or a speed ratio ("2-3x slower",
# "~5% faster"). Durations and sizes are left alone: configured timeouts and limits read the same.
MEASURED = re.compile(
    r"\b20\d\d-[01]\d-[0-3]\d\b"
    r"|\b\d+(?:\.\d+)?(?:\s?[-–]\s?\d+(?:\.\d+)?)?\s?(?:[x×]|%)\s+(?:faster|slower)\b"
)
# The benchmarks describe what they measure; their figures move to the results tables.
MEASURING = ("benchmarks",)


def is_comment_or_docstring(text: str) -> bool:
    """A comment, or a triple-quoted string (a docstring; a one-line string is data)."""
    return text.startswith("#") or text.lstrip("rbfuRBFU").startswith(('"""', "'''"))


def python_files() -> list[Path]:
    """Our Python sources, each once, without the generated protobuf code."""
    seen: dict[Path, Path] = {}
    for area in CODE:
        for path in sorted((ROOT / area).rglob("*.py")):
            real = path.resolve()
            generated = real.is_relative_to(ROOT / "protos/src/pagedserve/protos/pagedserve")
            if ".venv" not in real.parts and "build" not in real.parts and not generated:
                seen.setdefault(real, path)
    return sorted(seen)


def prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and string literal of a Python source."""
    out: list[tuple[int, str]] = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in (tokenize.COMMENT, tokenize.STRING):
            out.append((token.start[0], token.string))
    return out


def commit_prefixes() -> set[str]:
    """Every commit of this repository's history, as the 7- to 40-character prefixes a text
    could cite; empty outside a git checkout (the word pattern alone then decides)."""
    try:
        run = subprocess.run(
            ["git", "-C", str(ROOT), "rev-list", "--all"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return set()
    return set(run.stdout.split())


def cites_commit(text: str, commits: set[str]) -> list[str]:
    words = HEX_WORD.findall(text)
    if not commits:
        return words
    return [w for w in words if any(c.startswith(w) for c in commits)]


def test_no_comment_or_docstring_cites_a_commit() -> None:
    commits = commit_prefixes()
    found = []
    for path in python_files():
        for line, text in prose(path.read_text()):
            for word in cites_commit(text, commits):
                found.append(f"{path.relative_to(ROOT)}:{line}: {word}")
    assert not found, "comments/docstrings citing commits:\n" + "\n".join(found)


def test_the_check_sees_a_cited_commit() -> None:
    source = '# measured at 0a1b2c3, see there\nx = "plain text"\n'
    texts = [text for _, text in prose(source)]
    assert cites_commit(texts[0], {"0a1b2c3d0123456789abcdef0123456789abcdef"}) == ["0a1b2c3"]
    assert cites_commit(texts[0], set()) == ["0a1b2c3"]
    assert cites_commit("decade deadbeef is a word, 1234567 a number", set()) == []


def test_no_comment_or_docstring_carries_a_measured_figure() -> None:
    found = []
    for path in python_files():
        if path.relative_to(ROOT).parts[0] in MEASURING or path == Path(__file__).resolve():
            continue
        for line, text in prose(path.read_text()):
            if is_comment_or_docstring(text):
                found += [f"{path.relative_to(ROOT)}:{line}: {m}" for m in MEASURED.findall(text)]
    assert not found, "comments/docstrings with measured figures:\n" + "\n".join(found)


def test_the_check_sees_a_measured_figure() -> None:
    figures = "# measured 2-3x slower, ~5% faster, 1.8× slower on 2026-12-03"
    assert is_comment_or_docstring(figures) and is_comment_or_docstring('"""Slower."""')
    assert not is_comment_or_docstring('"FP8 1.87x faster than 16-bit"')  # data, as a report renders it
    assert MEASURED.findall(figures) == ["2-3x slower", "5% faster", "1.8× slower", "2026-12-03"]
    assert MEASURED.findall("a 10 s timeout, 4x the blocks, 2 M ids, 20261130-120000") == []
