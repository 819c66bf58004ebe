"""For the hardening suites: a tiny random-weight model that also has a tokenizer and a chat
template, so text and chat prompts (surrogates, long strings, /tokenize) reach real servers
without the real model (the tokenizer is a byte-level BPE trained here in well under a second;
byte-level, so any Unicode text encodes), and a bare HTTP client that sends exactly the bytes
a test means."""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedserve.benchmarks.tiny_models import VOCAB, make_tiny_model

CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)
_CORPUS = [
    "Hello world, how are you? The capital of France is Paris.",
    "Say something nice. Once upon a time there was a tiny model.",
    "user: assistant: system: 0123456789 the a of and to in is",
]


def make_tiny_served_model(directory: Path) -> Path:
    """The tiny llama (vocabulary VOCAB) plus tokenizer.json (ids < VOCAB; 0 <pad>, 1 <s>,
    2 </s> as in the model's config) and a tokenizer_config.json with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    make_tiny_model("llama", directory)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 16,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS * 4, trainer)
    assert tokenizer.get_vocab_size() <= VOCAB
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode(errors="replace")

    def json(self) -> Any:
        return json.loads(self.content)


class Http:
    """A minimal HTTP/1.1 client over the standard library (one connection per request), so
    a test can send exactly the bytes it means: invalid JSON, lone surrogates, huge or
    chunked bodies."""

    def __init__(self, url: str, timeout_s: float = 60.0) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.host, self.port, self.timeout_s = host, int(port), timeout_s

    def request(
        self,
        method: str,
        path: str,
        content: bytes | str | Iterable[bytes] | None = None,
        headers: dict[str, str] | None = None,
    ) -> Reply:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        try:
            body = content.encode() if isinstance(content, str) else content
            chunked = body is not None and not isinstance(body, bytes)
            conn.request(method, path, body=body, headers=headers or {}, encode_chunked=chunked)
            response = conn.getresponse()
            return Reply(response.status, {k.lower(): v for k, v in response.getheaders()}, response.read())
        finally:
            conn.close()

    def get(self, path: str) -> Reply:
        return self.request("GET", path)

    def post(
        self, path: str, json_body: Any = None, content: bytes | str | Iterable[bytes] | None = None
    ) -> Reply:
        if json_body is not None:
            content = json.dumps(json_body)
        return self.request("POST", path, content, {"content-type": "application/json"})

    def raw_exchange(self, head: bytes, body_parts: Iterable[bytes] = ()) -> bytes:
        """Send `head` (request line and headers) and `body_parts` on a bare socket, then
        read until the server closes: for bodies the server refuses before reading them."""
        with socket.create_connection((self.host, self.port), timeout=self.timeout_s) as sock:
            sock.sendall(head)
            for part in body_parts:
                sock.sendall(part)
            out = b""
            while chunk := sock.recv(65536):
                out += chunk
            return out
