"""Python client for pagedserve's gRPC API (sync and asyncio).

from clients.python import GenerationClient
with GenerationClient("127.0.0.1:50051") as client:
    print(client.generate("Hello", max_tokens=32)[0].text)
"""

from clients.python.client import AsyncGenerationClient, Completion, GenerationClient, StreamChunk

__all__ = ["AsyncGenerationClient", "Completion", "GenerationClient", "StreamChunk"]
