"""Python client for pagedserve's gRPC API (sync and asyncio).

from pagedserve.clients.python import GenerationClient
with GenerationClient("127.0.0.1:50051") as client:
    print(client.generate("Hello", max_tokens=32)[0].text)
    # structured outputs: at most one of json_schema= (dict, JSON text or pydantic model class),
    # json_object=True, regex=, choice=[...], grammar=
    print(client.generate("Is the sky blue? Answer:", choice=["yes", "no"])[0].text)
    print(len(client.embed(["a text", "another"], pooling="mean")[1]))  # one vector per input
"""

from pagedserve.clients.python.client import (
    AsyncGenerationClient,
    Completion,
    GenerationClient,
    StreamChunk,
    build_request,
)
from pagedserve.clients.python.constraints import JsonSchema, SchemaModel
from pagedserve.clients.python.embeddings import build_embed_request
from pagedserve.clients.python.tools import ToolCall

__all__ = [
    "AsyncGenerationClient",
    "Completion",
    "GenerationClient",
    "JsonSchema",
    "SchemaModel",
    "StreamChunk",
    "ToolCall",
    "build_embed_request",
    "build_request",
]
