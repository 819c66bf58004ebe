"""The hostile side of `pagedserve bench guard`: one case, in a process of its own.

    python -m pagedserve.benchmarks.guard_cases CASE GRPC DATAPLANE TOKEN_FILE MODEL ROUNDS

It prepares (connects, builds its messages, warms up), prints `ready`, waits for a line on
stdin, runs the case ROUNDS times (1 s apart) and prints one line per round. Each case is
legal input a client or a stray process may send; none may stall the guard stream.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from pagedserve.clients.python.client import GenerationClient
from pagedserve.common.lifecycle import free_port
from pagedserve.common.tls import read_token_file, token_metadata
from pagedserve.protos.pagedserve.v1 import common_pb2, dataplane_pb2, dataplane_pb2_grpc, generation_pb2

CASES = ("halfclose", "killcp", "burst", "n128", "stopids", "busy")


def _prompt(i: int, length: int) -> list[int]:
    return [3 + (7 * i + 11 * k) % 300 for k in range(length)]


class RawLink:
    """A raw data-plane `Connect` stream, as a control plane (or any local process) opens it."""

    def __init__(self, dataplane: str, token_file: str) -> None:
        self.metadata = token_metadata(read_token_file(token_file))
        self.stub = dataplane_pb2_grpc.DataPlaneServiceStub(grpc.insecure_channel(dataplane))
        self.stub.GetState(dataplane_pb2.GetStateRequest(), metadata=self.metadata, timeout=30)

    def open(self) -> tuple[queue.Queue[Any], Any]:
        outbox: queue.Queue[Any] = queue.Queue()

        def requests() -> Iterator[Any]:
            while (item := outbox.get()) is not None:
                yield item

        return outbox, self.stub.Connect(requests(), metadata=self.metadata)


def _submit(request_id: str, prompt: list[int], max_tokens: int) -> Any:
    params = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return dataplane_pb2.ConnectRequest(
        submit=dataplane_pb2.SubmitCommand(
            request_id=request_id, prompt_token_ids=prompt, sampling_params=params
        )
    )


def half_close(link: RawLink) -> Callable[[int], str]:
    """20 submits (30-token prompts, 64 tokens each), then the stream half-closes after 1 s."""

    def round_(r: int) -> str:
        outbox, responses = link.open()
        got = {"tokens": 0, "finished": 0}

        def read() -> None:
            try:
                for m in responses:
                    got["tokens"] += sum(len(d.token_ids) for d in m.deltas)
                    got["finished"] += len(m.finished)
            except grpc.RpcError:
                pass

        reader = threading.Thread(target=read)
        reader.start()
        for i in range(20):
            outbox.put(_submit(f"h{r}-{i}", _prompt(i, 30), 64))
        time.sleep(1.0)
        outbox.put(None)
        reader.join(60)
        return f"{got['tokens']} tokens streamed, {got['finished']} finished before the half-close ended them"

    return round_


def burst(link: RawLink) -> Callable[[int], str]:
    """1,000 submits at once on one stream (12-token prompts, 4 tokens each), read to the end."""

    def round_(r: int) -> str:
        messages = [_submit(f"b{r}-{i}", _prompt(i, 12), 4) for i in range(1000)]
        outbox, responses = link.open()
        start = time.monotonic()
        for m in messages:
            outbox.put(m)
        ended: set[str] = set()
        for m in responses:
            ended.update(f.request_id for f in m.finished)
            ended.update(x.request_id for x in m.rejected)
            if len(ended) >= len(messages):
                break
        outbox.put(None)
        responses.cancel()
        return f"{len(ended)} ended in {time.monotonic() - start:.1f} s"

    return round_


def kill_control_plane(dataplane: str, token_file: str, model: str) -> Callable[[int], str]:
    """A second control plane on the same data plane opens 20 streams (64 tokens each) and is
    SIGKILLed 1 s later; each round starts a new one."""

    def start() -> tuple[subprocess.Popen[bytes], GenerationClient, int]:
        port = free_port()
        cmd = [sys.executable, "-m", "pagedserve", "controlplane", "--dataplane", dataplane]
        cmd += ["--dataplane-token-file", token_file, "--model", model, "--grpc-port", str(port)]
        cmd += ["--http-port", "0"]
        proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        client = GenerationClient(f"127.0.0.1:{port}", timeout=60)
        for _ in range(240):
            try:
                client.generate([5, 6, 7], max_tokens=1, temperature=0.0)
                return proc, client, port
            except grpc.RpcError:
                time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGKILL)
        raise RuntimeError("the second control plane did not start")

    def round_(r: int) -> str:
        proc, client, _ = start()
        broken: list[str] = []

        def stream(i: int) -> None:
            try:
                for _ in client.generate_stream(
                    f"Story {r}-{i} about a lighthouse.", max_tokens=64, temperature=0.0
                ):
                    pass
            except grpc.RpcError as e:
                broken.append(e.code().name)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(20)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        os.killpg(proc.pid, signal.SIGKILL)
        for t in threads:
            t.join(60)
        proc.wait()
        return f"killed with {len(broken)} of 20 streams open"

    return round_


def n128(address: str) -> Callable[[int], str]:
    """`n` 128 completions with 20 logprobs each, one token each."""
    client = GenerationClient(address, timeout=600)
    client.generate([5, 6, 7], max_tokens=1, temperature=0.0)  # connected and warm

    def round_(r: int) -> str:
        outs = client.generate(
            _prompt(r, 16),
            n=128,
            logprobs=20,
            max_tokens=1,
            temperature=1.0,
            seed=r,
        )
        return f"{len(outs)} completions"

    return round_


def stop_ids(address: str) -> Callable[[int], str]:
    """2 M `stop_token_ids` (`n` 16, 4 tokens), serialized before the clock starts."""
    message = generation_pb2.GenerateRequest()
    message.token_ids.ids.extend(_prompt(0, 8))
    message.sampling_params.n = 16
    message.sampling_params.max_tokens = 4
    message.sampling_params.stop_token_ids.extend(range(2_000_000))
    raw = message.SerializeToString()
    channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 64 << 20)])
    call = channel.unary_stream(
        "/pagedserve.v1.GenerationService/Generate",
        request_serializer=lambda b: b,
        response_deserializer=lambda b: b,
    )

    def round_(r: int) -> str:
        try:
            for _ in call(raw, timeout=30):
                pass
            return "accepted"
        except grpc.RpcError as e:
            return f"{e.code().name}"

    return round_


def busy() -> Callable[[int], str]:
    """Another process keeps a core busy for 1 s (a sidecar, a second server on the node)."""
    code = "import time\nt = time.monotonic()\nwhile time.monotonic() - t < 1.0:\n    pass\n"

    def round_(r: int) -> str:
        subprocess.run([sys.executable, "-c", code], check=True)
        return "1 s of CPU"

    return round_


def main(argv: list[str]) -> int:
    case, address, dataplane, token_file, model, rounds = argv
    if case == "halfclose":
        round_ = half_close(RawLink(dataplane, token_file))
    elif case == "burst":
        round_ = burst(RawLink(dataplane, token_file))
    elif case == "killcp":
        round_ = kill_control_plane(dataplane, token_file, model)
    elif case == "n128":
        round_ = n128(address)
    elif case == "stopids":
        round_ = stop_ids(address)
    elif case == "busy":
        round_ = busy()
    else:
        raise SystemExit(f"unknown case {case!r}; one of {', '.join(CASES)}")
    print("ready", flush=True)
    sys.stdin.readline()
    for r in range(int(rounds)):
        if r:
            time.sleep(1.0)
        print(f"round {r}: {round_(r)}", flush=True)
    sys.stdout.flush()
    os._exit(0)  # no lingering gRPC threads at exit


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
