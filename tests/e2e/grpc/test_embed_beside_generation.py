"""64 Embed calls interleaved with 16 greedy Generate streams over gRPC (tiny random model,
a small KV pool, prefill chunks of 8): no stream's token changes, every vector equals the
one computed alone, and every KV block comes back."""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch

from pagedserve.dataplane.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pagedserve.protos.pagedserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.e2e.harness import ServerThread

POOLINGS = (common_pb2.PoolingParams.POOLING_TYPE_LAST, common_pb2.PoolingParams.POOLING_TYPE_MEAN)


@pytest.fixture(scope="module")
def server(tiny: Path) -> Iterator[ServerThread]:
    config = EngineConfig(
        model=ModelConfig(model=str(tiny), num_threads=1),
        cache=CacheConfig(num_gpu_blocks_override=96, block_size=4, enable_prefix_caching=True),
        scheduler=SchedulerConfig(max_model_len=128, max_num_seqs=16, max_num_batched_tokens=8),
    )
    srv = ServerThread(config, tiny)
    yield srv
    srv.close()


def generate(stub: generation_pb2_grpc.GenerationServiceStub, prompt: list[int]) -> list[int]:
    request = generation_pb2.GenerateRequest(
        token_ids=generation_pb2.TokenIds(ids=prompt),
        sampling_params=common_pb2.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
    )
    return [t for r in stub.Generate(request, timeout=300) if r.HasField("chunk") for t in r.chunk.token_ids]


def embed(stub: generation_pb2_grpc.GenerationServiceStub, prompt: list[int], i: int) -> list[float]:
    request = generation_pb2.EmbedRequest(
        inputs=[generation_pb2.EmbedInput(token_ids=generation_pb2.TokenIds(ids=prompt))],
        pooling=common_pb2.PoolingParams(pooling_type=POOLINGS[i % 2]),
    )
    return list(stub.Embed(request, timeout=300).embeddings[0].values)


def test_embeddings_beside_generation_change_no_token(server: ServerThread) -> None:
    rng = random.Random(11)
    streams = [[rng.randrange(3, 384) for _ in range(rng.randrange(4, 24))] for _ in range(16)]
    inputs = [[rng.randrange(3, 384) for _ in range(rng.randrange(1, 40))] for _ in range(64)]
    with grpc.insecure_channel(server.grpc_address) as channel, ThreadPoolExecutor(80) as pool:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        alone_tokens = list(pool.map(lambda p: generate(stub, p), streams))
        alone_vectors = [embed(stub, p, i) for i, p in enumerate(inputs)]
        tokens = [pool.submit(generate, stub, p) for p in streams]
        vectors = [pool.submit(embed, stub, p, i) for i, p in enumerate(inputs)]
        assert [t.result() for t in tokens] == alone_tokens
        for future, alone in zip(vectors, alone_vectors, strict=True):
            assert torch.allclose(torch.tensor(future.result()), torch.tensor(alone), atol=1e-5, rtol=0)
    idle = server.wait_idle()
    assert idle.snapshot.stats.free_blocks == idle.snapshot.stats.total_blocks
    assert not idle.requests
