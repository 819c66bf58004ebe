"""One step's plan (the runner's `StepInputs`) as one int64 tensor, and back.

Rank 0 broadcasts it once per forward; every worker unpacks the same inputs and runs the same
forward. One flat tensor (not a pickled object) keeps the step to a single collective.

Layout: [MAGIC, tokens T, sequences S, swap-outs O, swap-ins I,
         input_ids (T), positions (T), query_lens (S), seq_lens (S), block-table lengths (S),
         block tables (concatenated), swap_out pairs (2*O), swap_in pairs (2*I)]
"""

from __future__ import annotations

import torch

from pagedserve.dataplane.runner.model_runner import StepInputs

# Guards against a worker reading something that is not a plan (a protocol drift between ranks).
MAGIC = 0x7E9A_0001
HEADER = 5


def pack(inputs: StepInputs) -> torch.Tensor:
    tables = inputs.block_tables
    values: list[int] = [
        MAGIC,
        len(inputs.input_ids),
        len(inputs.query_lens),
        len(inputs.swap_out),
        len(inputs.swap_in),
    ]
    values += inputs.input_ids
    values += inputs.positions
    values += inputs.query_lens
    values += inputs.seq_lens
    values += [len(t) for t in tables]
    for table in tables:
        values += table
    for pairs in (inputs.swap_out, inputs.swap_in):
        for a, b in pairs:
            values += (a, b)
    return torch.tensor(values, dtype=torch.int64)


def unpack(plan: torch.Tensor) -> StepInputs:
    values: list[int] = plan.tolist()
    magic, num_tokens, num_seqs, num_out, num_in = values[:HEADER]
    if magic != MAGIC:
        raise ValueError(f"not a step plan (magic {magic:#x}, expected {MAGIC:#x})")
    at = HEADER

    def take(n: int) -> list[int]:
        nonlocal at
        part = values[at : at + n]
        at += n
        return part

    input_ids, positions = take(num_tokens), take(num_tokens)
    query_lens, seq_lens, table_lens = take(num_seqs), take(num_seqs), take(num_seqs)
    block_tables = [take(n) for n in table_lens]
    out_flat, in_flat = take(2 * num_out), take(2 * num_in)
    if at != len(values):
        raise ValueError(f"step plan of {len(values)} values, its header describes {at}")
    return StepInputs(
        input_ids,
        positions,
        query_lens,
        seq_lens,
        block_tables,
        list(zip(out_flat[0::2], out_flat[1::2], strict=True)),
        list(zip(in_flat[0::2], in_flat[1::2], strict=True)),
    )
