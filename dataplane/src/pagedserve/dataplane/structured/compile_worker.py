"""The grammar compiler's child process: `python -m pagedserve.dataplane.structured.compile_worker`.

It reads (tokenizer path, vocab size, stop ids) first, answers ("ready", None), then compiles
each Constraint it reads and answers ("ok", the compiled grammar's JSON) or ("error", the
reason). Messages on stdin/stdout are an 8-byte big-endian length, then a pickle; the parent
(compile_service.py) is the only writer, so unpickling is safe. Anything the libraries print
goes to stderr: stdout is kept for the protocol.
"""

from __future__ import annotations

import os
import pickle
import struct
import sys
from typing import IO, Any

_HEADER = struct.Struct(">Q")


def write_message(stream: IO[bytes], message: object) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def read_message(stream: IO[bytes]) -> Any:
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EOFError("the other side closed the pipe")
    (size,) = _HEADER.unpack(header)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("the other side closed the pipe mid-message")
    return pickle.loads(data)


def main() -> None:
    # The protocol's stdout is a private copy of fd 1; fd 1 itself now goes to stderr.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    inp = sys.stdin.buffer
    tokenizer_path, vocab_size, stop_ids = read_message(inp)
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from pagedserve.dataplane.structured.grammar import GrammarError, compile_constraint, tokenizer_info

    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
        compiler = xgr.GrammarCompiler(
            tokenizer_info(tokenizer, vocab_size, stop_ids), max_threads=1, cache_enabled=False
        )
    except Exception as exc:
        write_message(out, ("failed", f"{type(exc).__name__}: {exc}"))
        return
    write_message(out, ("ready", None))
    while True:
        try:
            constraint = read_message(inp)
        except EOFError:
            return
        try:
            compiled = compile_constraint(compiler, constraint)
            write_message(out, ("ok", compiled.serialize_json()))
        except GrammarError as exc:
            write_message(out, ("error", exc.reason))
        except Exception as exc:  # the backend's own failures are a refusal, not a crash
            write_message(out, ("error", f"could not be compiled: {type(exc).__name__}: {str(exc)[:500]}"))


if __name__ == "__main__":
    main()
