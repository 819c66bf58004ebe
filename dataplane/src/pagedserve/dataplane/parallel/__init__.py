"""Tensor parallelism inside one data plane: N processes split each decoder layer's heads and
MLP (Megatron style) and run every step together; rank 0 is the engine, ranks 1..N-1 are
workers it starts and supervises.

- `group.py`: the gloo process group (rendezvous through a TCP store, collectives with a timeout).
- `sharding.py`: the transform that keeps a rank's share of each layer's linears.
- `step_plan.py`: one step's runner inputs packed into one int64 tensor, broadcast by rank 0.
- `driver.py`: rank 0's side: start the workers, broadcast plans, watch the workers' lives.
- `worker.py`: a worker's main loop (`python -m pagedserve.dataplane.parallel.worker`).
"""
