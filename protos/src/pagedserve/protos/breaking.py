"""`buf breaking` on the public API (generation.proto, common.proto) against a git reference,
offline: buf reads the reference from the local .git (`make lint` runs this).

    python -m pagedserve.protos.breaking            # pick the reference as below
    python -m pagedserve.protos.breaking --against REF

The reference, the first that applies:
1. `--against REF` or $PAGEDSERVE_BREAKING_AGAINST (e.g. origin/main in a pull-request build);
2. the latest release tag `v*` reachable from HEAD;
3. the merge base of HEAD with main (or origin/main), when HEAD is not on main;
4. on main itself: the parent of the last commit that changed the public protos, so the newest
   change (and any uncommitted edit) is checked against the version before it;
5. HEAD, when that parent has no public protos or is missing (a shallow clone): then only
   uncommitted edits are checked.
docs/api.md says what v1 allows.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
REPO = ROOT.parents[3]  # protos/src/pagedserve/protos
PUBLIC = ("pagedserve/v1/generation.proto", "pagedserve/v1/common.proto")
# Where the buf module sits in the repository, now and before the protos became a distribution:
# an older reference is compared at its own place.
SUBDIRS = ("protos/src/pagedserve/protos", "protos")


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
    except FileNotFoundError:  # no git at all
        return None
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else None


def _subdir(ref: str, path: str) -> str | None:
    """Where `ref` keeps the buf module that holds `path`, or None."""
    for subdir in SUBDIRS:
        if _git("cat-file", "-t", f"{ref}:{subdir}/{path}") is not None:
            return subdir
    return None


def _has(ref: str, path: str) -> bool:
    return _subdir(ref, path) is not None


def choose_reference() -> tuple[str, str]:
    """(git ref, why) to compare against."""
    env = os.environ.get("PAGEDSERVE_BREAKING_AGAINST")
    if env:
        return env, "$PAGEDSERVE_BREAKING_AGAINST"
    tag = _git("describe", "--tags", "--abbrev=0", "--match", "v*", "HEAD")
    if tag:
        return tag, "the latest release tag"
    head = _git("rev-parse", "HEAD")
    for main in ("main", "origin/main"):
        base = _git("merge-base", "HEAD", main)
        if base and base != head:
            return base, f"the merge base with {main}"
    last = _git("log", "-1", "--format=%H", "--", *(f"{SUBDIRS[0]}/{p}" for p in PUBLIC))
    if last and _git("rev-parse", "--verify", "--quiet", f"{last}^") and _has(f"{last}^", PUBLIC[0]):
        return f"{last}^", f"the parent of {last[:12]}, the last commit that changed the public protos"
    return "HEAD", "no earlier version of the protos: uncommitted edits only"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--against", help="a git ref (default: chosen as above)")
    args = parser.parse_args(argv)
    if _git("rev-parse", "--git-dir") is None:
        print("protos: buf breaking: skipped, not a git checkout (nothing to compare with)")
        return 0
    ref, why = (args.against, "--against") if args.against else choose_reference()
    sha = _git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
    if sha is None:
        print(f"protos: buf breaking: unknown git reference {ref!r}", file=sys.stderr)
        return 1
    present = [p for p in PUBLIC if _has(sha, p)]
    if not present:
        print(f"protos: buf breaking: {ref} ({why}) has no public protos: nothing to break")
        return 0
    buf = shutil.which("buf", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if buf is None:
        print("protos: buf not found (pip install buf-bin)", file=sys.stderr)
        return 1
    git_dir = Path(_git("rev-parse", "--absolute-git-dir") or REPO / ".git")
    against = f"{os.path.relpath(git_dir, ROOT)}#ref={sha},subdir={_subdir(sha, present[0])}"
    paths = [arg for p in present for arg in ("--path", p)]
    done = subprocess.run([buf, "breaking", "--against", against, *paths], cwd=ROOT)
    if done.returncode != 0:
        print(
            f"protos: breaking change against {ref} ({why}): v1 allows additive changes only; "
            "see docs/api.md (Versioning)",
            file=sys.stderr,
        )
        return 1
    print(f"protos: buf breaking: no breaking change against {ref} ({why})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
