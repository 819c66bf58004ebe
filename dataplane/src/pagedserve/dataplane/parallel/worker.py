"""A tensor-parallel worker (rank 1..N-1): `python -m pagedserve.dataplane.parallel.worker`, started by
rank 0's `TensorParallelDriver`, never by hand.

It loads the same model, takes rank 0's layout (block counts, FP8 scales) from the store,
joins the group, shards the model and builds its runner; then, per step: read the plan's
length from stdin, take the plan in one broadcast, make its swaps and run its forward (the
row-parallel all-reduces meet rank 0's). End of stdin is the order to exit.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys

import torch

from pagedserve.common import settings
from pagedserve.common.lifecycle import exit_with_parent
from pagedserve.common.models import resolve_model_path
from pagedserve.dataplane.config import EngineConfig
from pagedserve.dataplane.models import CausalLM
from pagedserve.dataplane.parallel import step_plan
from pagedserve.dataplane.parallel.driver import LAYOUT_KEY, PLAN_LENGTH_BYTES, WorkerLayout, kv_pool_key
from pagedserve.dataplane.parallel.group import TensorParallelGroup, join_store, threads_per_rank
from pagedserve.dataplane.parallel.sharding import shard_model
from pagedserve.dataplane.runner.model_loader import DTYPES, load_model
from pagedserve.dataplane.runner.model_runner import ModelRunner
from pagedserve.kernels import kv_cache_torch_dtype


def build_worker_runner(
    config: EngineConfig, model: CausalLM, group: TensorParallelGroup, layout: WorkerLayout
) -> ModelRunner:
    """This rank's share of `model` behind a runner whose pools mirror rank 0's `layout`."""
    model_cfg = config.model
    shard_model(model, group)
    return ModelRunner(
        model,
        model_cfg,
        layout.num_blocks,
        config.cache.block_size,
        kv_cache_torch_dtype(config.cache.kv_cache_dtype, DTYPES[model_cfg.dtype]),
        kv_scales=layout.kv_scales(),
        num_host_blocks=layout.num_host_blocks,
        tensor_parallel_size=group.world_size,
    )


def serve_plans(runner: ModelRunner, group: TensorParallelGroup) -> None:
    """Run rank 0's plans until stdin ends."""
    stdin = sys.stdin.buffer
    while True:
        header = stdin.read(PLAN_LENGTH_BYTES)
        if len(header) < PLAN_LENGTH_BYTES:
            return  # rank 0 closed the pipe (or is gone)
        plan = torch.empty(int.from_bytes(header, "little"), dtype=torch.int64)
        group.broadcast(plan)
        runner.execute_inputs(step_plan.unpack(plan))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedserve.dataplane.parallel.worker")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--store-port", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--timeout-s", type=float, required=True)
    parser.add_argument("--config-json", required=True)
    args = parser.parse_args(argv)
    exit_with_parent(args.parent_pid)  # first: rank 0 gone means nothing left to serve
    # Ctrl-C reaches the whole process group: rank 0 alone decides (its exit ends this one).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    config = settings.from_json(EngineConfig, args.config_json)
    torch.set_num_threads(threads_per_rank(config.model.num_threads, args.world_size))
    torch.manual_seed(config.model.seed)
    model_cfg = config.model
    path = resolve_model_path(model_cfg.model, model_cfg.model_home)
    model = load_model(path, model_cfg.dtype, model_cfg.device, model_impl=model_cfg.model_impl)
    store = join_store(args.store_port, args.world_size, args.timeout_s)
    layout = WorkerLayout.from_json(store.get(LAYOUT_KEY))  # blocks until rank 0 has planned
    group = TensorParallelGroup(store, args.rank, args.world_size, args.timeout_s)
    runner = build_worker_runner(config, model, group, layout)
    # What this rank's pool holds, for rank 0 to report (each rank: 1/N of the KV heads).
    store.set(kv_pool_key(args.rank), json.dumps(list(runner.kv_caches[0][0].shape)))
    group.barrier()  # ready: rank 0's `connect` returns
    serve_plans(runner, group)
    return 0


if __name__ == "__main__":
    sys.exit(main())
