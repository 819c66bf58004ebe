"""Generate the gRPC code of every client language from protos/ (`make protos`), or check it.

    python -m pagedserve.protos.generate                  # Python, Go and Java
    python -m pagedserve.protos.generate --lang python    # one language (repeatable)
    python -m pagedserve.protos.generate --check          # fail if committed code differs from a fresh generation

Python: all of protos/src/pagedserve/protos/pagedserve/v1/*.proto (the control plane and the data plane use them),
with typed stubs, written next to the .proto files. protoc names imports after the proto path
(`from pagedserve.v1 import common_pb2`); the generated modules live in the `protos` package,
so imports are rewritten to `from pagedserve.protos.pagedserve.v1 import ...`. Nothing else changes.
The compiler is grpcio-tools' (a Python dev dependency).

Go and Java: the public API only (generation.proto and common.proto), into
clients/go/pagedservev1/ (protoc-gen-go + protoc-gen-go-grpc) and
clients/java/src/main/java/io/pagedserve/v1/ (protoc's Java output + grpc_java_plugin). They
use Debian 12's protoc 3.21.12: the Java code must match the protobuf-java 3.21 runtime the
client builds against, and the Go code records the compiler version. The tools come from apt
(docs/api.md lists the packages). `--check` skips a language whose tools are missing, saying
so, unless PAGEDSERVE_REQUIRE_CLIENTS=1 (set by CI) makes that a failure.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent
REPO = ROOT.parents[3]  # protos/src/pagedserve/protos
PACKAGE_DIR = Path("pagedserve") / "v1"
PUBLIC_PROTOS = ("pagedserve/v1/common.proto", "pagedserve/v1/generation.proto")
PROTOC_VERSION = "3.21.12"  # Debian 12's protobuf-compiler; matches its libprotobuf-java runtime
GO_MODULE = "github.com/pagedserve/pagedserve/clients/go"
APT_PACKAGES = {
    "go": "protobuf-compiler protoc-gen-go protoc-gen-go-grpc",
    "java": "protobuf-compiler protobuf-compiler-grpc-java-plugin",
}
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")
_IMPORT_PATTERNS = [
    (re.compile(r"^from pagedserve\.v1 import ", re.M), "from pagedserve.protos.pagedserve.v1 import "),
    (re.compile(r"^import pagedserve\.v1\.", re.M), "import pagedserve.protos.pagedserve.v1."),
    (re.compile(r"(?<![\w.])pagedserve\.v1\.(\w+_pb2)\b"), r"pagedserve.protos.pagedserve.v1.\1"),
]


class MissingTools(Exception):
    """A language's code generators are not installed (or are the wrong version)."""


@dataclass(frozen=True)
class Language:
    name: str
    committed: Path  # where the generated files live in the repository
    generated_in: Path  # the same directory relative to the generator's output root
    is_generated: Callable[[str], bool]
    generate: Callable[[Path], None]  # writes into an output root


def _python(out_dir: Path) -> None:
    from grpc_tools import protoc  # dev dependency: only needed to regenerate

    protos = sorted(str(p.relative_to(ROOT)) for p in (ROOT / PACKAGE_DIR).glob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    bin_dir = Path(sys.executable).parent  # mypy-protobuf's plugins sit beside the interpreter
    args = [
        "protoc",
        f"--plugin=protoc-gen-mypy={bin_dir / 'protoc-gen-mypy'}",
        f"--plugin=protoc-gen-mypy_grpc={bin_dir / 'protoc-gen-mypy_grpc'}",
        f"-I{ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--mypy_out={out_dir}",
        f"--mypy_grpc_out={out_dir}",
        *protos,
    ]
    code = protoc.main(args)
    if code != 0:
        raise SystemExit(f"protoc failed with exit code {code}")
    for path in (out_dir / PACKAGE_DIR).iterdir():
        if path.name.endswith(GENERATED_SUFFIXES):
            text = path.read_text()
            for pattern, repl in _IMPORT_PATTERNS:
                text = pattern.sub(repl, text)
            path.write_text(text)


def _tool(name: str, env_var: str, language: str) -> str:
    path = os.environ.get(env_var) or shutil.which(name)
    if not path:
        raise MissingTools(f"{name} not found (apt-get install {APT_PACKAGES[language]})")
    return path


def _protoc(language: str) -> str:
    protoc = _tool("protoc", "PROTOC", language)
    version = subprocess.run([protoc, "--version"], capture_output=True, text=True).stdout.split()[-1:]
    if version != [PROTOC_VERSION]:
        raise MissingTools(
            f"{protoc} is version {' '.join(version) or '?'}, the stubs are generated with "
            f"{PROTOC_VERSION} (Debian 12's protobuf-compiler)"
        )
    return protoc


def _run_protoc(argv: list[str]) -> None:
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{done.stderr}")


def _go(out_dir: Path) -> None:
    protoc = _protoc("go")
    go = _tool("protoc-gen-go", "PROTOC_GEN_GO", "go")
    go_grpc = _tool("protoc-gen-go-grpc", "PROTOC_GEN_GO_GRPC", "go")
    _run_protoc(
        [
            protoc,
            f"--plugin=protoc-gen-go={go}",
            f"--plugin=protoc-gen-go-grpc={go_grpc}",
            "-I.",
            f"--go_out={out_dir}",
            f"--go_opt=module={GO_MODULE}",
            f"--go-grpc_out={out_dir}",
            f"--go-grpc_opt=module={GO_MODULE}",
            *PUBLIC_PROTOS,
        ]
    )


def _java(out_dir: Path) -> None:
    protoc = _protoc("java")
    plugin = _tool("grpc_java_plugin", "PROTOC_GEN_GRPC_JAVA", "java")
    _run_protoc(
        [
            protoc,
            f"--plugin=protoc-gen-grpc-java={plugin}",
            "-I.",
            f"--java_out={out_dir}",
            f"--grpc-java_out={out_dir}",
            *PUBLIC_PROTOS,
        ]
    )


LANGUAGES = {
    lang.name: lang
    for lang in (
        Language(
            "python", ROOT / PACKAGE_DIR, PACKAGE_DIR, lambda n: n.endswith(GENERATED_SUFFIXES), _python
        ),
        Language(
            "go",
            REPO / "clients" / "go" / "pagedservev1",
            Path("pagedservev1"),
            lambda n: n.endswith(".pb.go"),
            _go,
        ),
        Language(
            "java",
            REPO / "clients" / "java" / "src" / "main" / "java" / "io" / "pagedserve" / "v1",
            Path("io") / "pagedserve" / "v1",
            lambda n: n.endswith(".java"),
            _java,
        ),
    )
}


def _generated(lang: Language, directory: Path) -> list[str]:
    if not directory.is_dir():
        return []
    return sorted(p.name for p in directory.iterdir() if lang.is_generated(p.name))


def _check(lang: Language, fresh: Path) -> list[str]:
    """Names of committed files that differ from (or are missing in / extra to) `fresh`."""
    names = _generated(lang, fresh)
    committed = lang.committed
    stale = [
        n
        for n in names
        if not (committed / n).exists() or not filecmp.cmp(fresh / n, committed / n, shallow=False)
    ]
    return stale + sorted(set(_generated(lang, committed)) - set(names))


def _write(lang: Language, fresh: Path) -> int:
    lang.committed.mkdir(parents=True, exist_ok=True)
    for name in _generated(lang, lang.committed):
        (lang.committed / name).unlink()
    names = _generated(lang, fresh)
    for name in names:
        shutil.copyfile(fresh / name, lang.committed / name)
    return len(names)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    parser.add_argument(
        "--lang",
        action="append",
        choices=sorted(LANGUAGES),
        help="only this language (repeatable; default: all)",
    )
    args = parser.parse_args(argv)
    required = os.environ.get("PAGEDSERVE_REQUIRE_CLIENTS") == "1"
    failed = False
    for name in args.lang or list(LANGUAGES):
        lang = LANGUAGES[name]
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp)
            try:
                lang.generate(out)
            except MissingTools as exc:
                if args.check and not required:
                    print(f"protos: {name}: skipped, {exc}")
                    continue
                print(f"protos: {name}: {exc}", file=sys.stderr)
                failed = True
                continue
            fresh = out / lang.generated_in
            rel = lang.committed.relative_to(REPO)
            if args.check:
                stale = _check(lang, fresh)
                if stale:
                    more = f" and {len(stale) - 8} more" if len(stale) > 8 else ""
                    print(
                        f"protos: {name}: generated code in {rel} is out of date "
                        f"({', '.join(stale[:8])}{more}): run `make protos`",
                        file=sys.stderr,
                    )
                    failed = True
                else:
                    print(f"protos: {name}: {len(_generated(lang, fresh))} generated files match")
            else:
                print(f"protos: {name}: wrote {_write(lang, fresh)} files to {rel}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
