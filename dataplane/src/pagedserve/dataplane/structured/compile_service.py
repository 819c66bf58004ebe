"""Compiles constraints off the step loop, under a time limit, with an LRU cache.

Compiling a JSON schema against a 50k-token vocabulary takes milliseconds to seconds, and a
pathological schema (deep `oneOf` nests, huge alternations) can take much longer. So:

- compiles run in a child process, one at a time, never on the engine's thread;
  a compile that outlives `timeout_s` is ended by killing that process (a thread could not be
  stopped, and would keep one of the cores busy), its requests fail with GrammarError, and
  the next compile starts a fresh child;
- the child sends the compiled grammar back serialized (xgrammar's JSON form), and the
  parent rebuilds it against its own copy of the tokenizer info;
- results are cached by constraint (LRU, `cache_size` entries), and concurrent requests for
  one constraint share one compile;
- `submit` returns at once; its callback runs on the service's thread (the engine loop posts
  it back into its own inbox). `compile` blocks, for the offline API.
"""

from __future__ import annotations

import os
import queue
import select
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import xgrammar as xgr

import pagedserve
from pagedserve.common.constraints import Constraint
from pagedserve.common.log import get_logger
from pagedserve.dataplane.structured.compile_worker import read_message, write_message
from pagedserve.dataplane.structured.grammar import GrammarError, tokenizer_info

log = get_logger(__name__)

Done = Callable[[xgr.CompiledGrammar | None, GrammarError | None], None]
"""A submit's callback: the compiled grammar, or the error that refused it."""

MAX_QUEUED_COMPILES = 256
"""Distinct constraints waiting for the compiler at once; more are refused (the queue is
bounded like everything else a client controls)."""


@dataclass(frozen=True)
class CompileStats:
    """What the service has done, for metrics."""

    compiles: int = 0
    cache_hits: int = 0
    failures: int = 0
    timeouts: int = 0


@dataclass
class _Job:
    constraint: Constraint
    waiters: list[Done] = field(default_factory=list)


def _child_env() -> dict[str, str]:
    """The parent's environment, one thread for torch (imported by xgrammar, unused), and the
    folders the `pagedserve` namespace was imported from first on the path (a source checkout
    that was never installed still works)."""
    # `pagedserve` is a namespace package: one folder per distribution that holds a part of it.
    root = os.pathsep.join(dict.fromkeys(str(Path(p).parent) for p in pagedserve.__path__))
    path = os.environ.get("PYTHONPATH")
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": root if not path else root + os.pathsep + path,
    }


class _Worker:
    """One compile child (`python -m pagedserve.dataplane.structured.compile_worker`) and its pipes.

    A separate interpreter, not multiprocessing: a spawned child would re-import the caller's
    main module (a script without a `__main__` guard would run again), and a forked one would
    inherit torch's threads. Messages are length-prefixed pickles (compile_worker.py)."""

    def __init__(
        self, tokenizer_path: str, vocab_size: int, stop_ids: Sequence[int], start_timeout_s: float
    ) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pagedserve.dataplane.structured.compile_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=_child_env(),
        )
        self.send((tokenizer_path, vocab_size, list(stop_ids)))
        status, payload = self.receive(start_timeout_s, "start")
        if status != "ready":
            self.kill()
            raise RuntimeError(f"the grammar compiler did not start: {payload}")

    def send(self, message: object) -> None:
        assert self.process.stdin is not None
        write_message(self.process.stdin, message)

    def receive(self, timeout_s: float, what: str) -> tuple[str, Any]:
        """The child's next answer; raises TimeoutError past `timeout_s`, EOFError if it died."""
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], timeout_s)
        if not ready:
            raise TimeoutError(f"no {what} within {timeout_s:g} s")
        answer: tuple[str, Any] = read_message(self.process.stdout)
        return answer

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(timeout=10)
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                pipe.close()


class CompileService:
    """See the module docstring. `tokenizer` is the parent's tokenizer object (for
    deserializing); `tokenizer_path` is where the child loads the same one from."""

    def __init__(
        self,
        tokenizer: Any,
        tokenizer_path: str,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        timeout_s: float,
        cache_size: int = 256,
        start_timeout_s: float = 120.0,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self._info = tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        self._spawn_args = (tokenizer_path, vocab_size, tuple(stop_token_ids), start_timeout_s)
        self._cache: OrderedDict[tuple[str, str, tuple[str, ...]], xgr.CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._pending: dict[tuple[str, str, tuple[str, ...]], _Job] = {}
        self._lock = threading.Lock()
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._worker: _Worker | None = None
        self._stats = CompileStats()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="pagedserve-grammar-service", daemon=True)
        self._thread.start()

    # -- the API ---------------------------------------------------------------------------------
    def submit(self, constraint: Constraint, done: Done) -> None:
        """Compile `constraint` (or take it from the cache) and call `done` with the result:
        at once on a cache hit, else from the service's thread."""
        key = constraint.key
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                self._bump(cache_hits=1)
            elif self._closed:
                error: GrammarError | None = GrammarError(
                    constraint.kind, "could not be compiled: the server is stopping"
                )
            else:
                job = self._pending.get(key)
                if job is not None:
                    job.waiters.append(done)
                    return
                if len(self._pending) >= MAX_QUEUED_COMPILES:
                    error = GrammarError(
                        constraint.kind,
                        f"could not be compiled now: {MAX_QUEUED_COMPILES} other compiles are queued",
                    )
                else:
                    job = _Job(constraint, [done])
                    self._pending[key] = job
                    self._jobs.put(job)
                    return
        if compiled is not None:
            done(compiled, None)
        else:
            done(None, error)

    def compile(self, constraint: Constraint) -> xgr.CompiledGrammar:
        """Blocking compile (the offline API); raises GrammarError."""
        finished = threading.Event()
        result: list[Any] = []

        def done(compiled: xgr.CompiledGrammar | None, error: GrammarError | None) -> None:
            result.extend((compiled, error))
            finished.set()

        self.submit(constraint, done)
        finished.wait()
        compiled, error = result
        if error is not None:
            raise error
        assert compiled is not None
        return compiled

    @property
    def stats(self) -> CompileStats:
        with self._lock:
            return self._stats

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._jobs.put(None)
        self._thread.join(timeout=10)
        if self._worker is not None:
            self._worker.kill()
            self._worker = None

    # -- the service thread ------------------------------------------------------------------------
    def _bump(self, **counts: int) -> None:
        """Add to the named counters (call with the lock held)."""
        self._stats = replace(self._stats, **{k: getattr(self._stats, k) + v for k, v in counts.items()})

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                break
            compiled, error = self._run(job.constraint)
            with self._lock:
                self._pending.pop(job.constraint.key, None)
                waiters = list(job.waiters)
                if compiled is not None:
                    self._cache[job.constraint.key] = compiled
                    while len(self._cache) > self._cache_size:
                        self._cache.popitem(last=False)
            for done in waiters:
                try:
                    done(compiled, error)
                except Exception:
                    log.exception("grammar_callback_failed")
        # Stopping: whatever is still queued is refused.
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                for done in job.waiters:
                    done(
                        None,
                        GrammarError(job.constraint.kind, "could not be compiled: the server is stopping"),
                    )

    def _run(self, constraint: Constraint) -> tuple[xgr.CompiledGrammar | None, GrammarError | None]:
        started = time.perf_counter()
        try:
            if self._worker is None or not self._worker.alive:
                self._worker = _Worker(*self._spawn_args)
            worker = self._worker
            worker.send(constraint)
            try:
                status, payload = worker.receive(self.timeout_s, "grammar")
            except TimeoutError:
                worker.kill()
                self._worker = None
                with self._lock:
                    self._bump(timeouts=1, failures=1)
                log.warning(
                    "grammar_compile_timeout", constraint=constraint.describe(), timeout_s=self.timeout_s
                )
                return None, GrammarError(
                    constraint.kind,
                    f"could not be compiled within the compile timeout ({self.timeout_s:g} s)",
                )
        except (OSError, EOFError, RuntimeError, TimeoutError) as exc:  # the child died or could not start
            if self._worker is not None:
                self._worker.kill()
                self._worker = None
            with self._lock:
                self._bump(failures=1)
            log.error("grammar_compiler_failed", constraint=constraint.describe(), error=str(exc))
            return None, GrammarError(constraint.kind, f"could not be compiled: the compiler failed ({exc})")
        seconds = time.perf_counter() - started
        with self._lock:
            self._bump(compiles=1, failures=int(status != "ok"))
        if status != "ok":
            log.warning(
                "grammar_compile_refused",
                constraint=constraint.describe(),
                reason=payload,
                seconds=round(seconds, 3),
            )
            return None, GrammarError(constraint.kind, payload)
        return xgr.CompiledGrammar.deserialize_json(payload, self._info), None
