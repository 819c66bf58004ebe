"""CPU microbenchmark of the paged KV ops at SmolLM2 shapes (one layer call each).

    .venv/bin/python benchmarks/src/pagedserve/benchmarks/paged_attention_cpu.py [--threads 2] [--repeats 30] [--cold-build]
        [--decode-only] [--no-fp8]

Decode: 64 sequences, context lengths uniform in [50, 400], one new token each (and 16
sequences of 1000-4000 tokens).
Prefill: 4 fresh sequences of 300 tokens; chunked prefill: 4 sequences with 200 cached
tokens and 100 new ones. paged_attention runs with impl="cpp" (the C++ decode kernel;
fp32 only) and impl="torch" (gathers + SDPA); prefill takes SDPA either way. Each is
compared with SDPA on K/V that are already contiguous and padded (the "no paging" bound:
no gather, no block tables). Timings are medians (and minima) over interleaved repeats,
since the machine may be shared.

FP8 (fp32 runs, unless --no-fp8): the decode cases also time the C++ kernel over the same
batch's cache quantized to fp8_e4m3 and fp8_e5m2 (1 byte per element instead of 4, widened
in the kernel), next to impl=cpp over the fp32 cache. --decode-only skips the prefill cases.

The C++ extension is built (or found in torch's extension cache) first and its load time
printed; --cold-build builds it from scratch in a fresh temporary extension directory.
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedserve.kernels import AttentionMetadata, build_attention_metadata, paged_attention, write_kv_cache
from pagedserve.kernels.backend import AttentionImpl
from pagedserve.kernels.cpu_ext import load_cpu_kernels
from pagedserve.kernels.fp8 import FP8_DTYPES, fp8_max, quantize_fp8
from pagedserve.kernels.metadata import DECODE_GROUP_MAX_SEQS, DECODE_GROUP_MAX_TOKENS

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


class Case:
    """One batch composition: random paged cache, metadata, inputs and the dense bound."""

    def __init__(
        self,
        query_lens: list[int],
        seq_lens: list[int],
        dtype: torch.dtype,
        group_tokens: int,
        group_seqs: int,
        group_min_seqs: int | None,
        rng: random.Random,
    ) -> None:
        nblocks = [(s + BLOCK_SIZE - 1) // BLOCK_SIZE for s in seq_lens]
        num_blocks = sum(nblocks) + 64
        # A random permutation, so sequences' blocks are scattered as after a long run.
        perm = rng.sample(range(num_blocks), num_blocks)
        self.block_tables: list[list[int]] = []
        i = 0
        for n in nblocks:
            self.block_tables.append(perm[i : i + n])
            i += n
        shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        self.key_cache = torch.randn(shape).to(dtype)
        self.value_cache = torch.randn(shape).to(dtype)
        self.query_lens, self.seq_lens = query_lens, seq_lens
        self.group_tokens, self.group_seqs, self.group_min_seqs = group_tokens, group_seqs, group_min_seqs
        self.meta = self.build()
        t = sum(query_lens)
        self.query = torch.randn(t, NUM_HEADS, HEAD_DIM).to(dtype)
        self.key = torch.randn(t, NUM_KV_HEADS, HEAD_DIM).to(dtype)
        self.value = torch.randn(t, NUM_KV_HEADS, HEAD_DIM).to(dtype)
        self.scale = HEAD_DIM**-0.5
        # The bound: every sequence's K/V already contiguous, padded to the longest.
        s, max_len = len(seq_lens), max(seq_lens)
        self.dense_k = torch.randn(s, NUM_KV_HEADS, max_len, HEAD_DIM).to(dtype)
        self.dense_v = torch.randn(s, NUM_KV_HEADS, max_len, HEAD_DIM).to(dtype)
        max_q = max(query_lens)
        self.dense_q = torch.randn(s, NUM_HEADS, max_q, HEAD_DIM).to(dtype)
        key_pos = torch.arange(max_len)[None, None, :]
        query_pos = (torch.tensor(seq_lens) - max_q)[:, None, None] + torch.arange(max_q)[None, :, None]
        self.dense_mask = (key_pos <= query_pos)[:, None]  # [S, 1, max_q, max_len]
        self.fresh = (
            all(q == s_ for q, s_ in zip(query_lens, seq_lens, strict=True)) and len(set(seq_lens)) == 1
        )

    def build(self) -> AttentionMetadata:
        return build_attention_metadata(
            self.query_lens,
            self.seq_lens,
            self.block_tables,
            BLOCK_SIZE,
            "cpu",
            decode_group_max_tokens=self.group_tokens,
            decode_group_max_seqs=self.group_seqs,
            decode_group_min_seqs=self.group_min_seqs,
        )

    def write(self) -> None:
        write_kv_cache(self.key, self.value, self.key_cache, self.value_cache, self.meta.slot_mapping)

    def build_with_groups(self) -> AttentionMetadata:
        # The torch path's decode groups are built on first use, once per step.
        meta = self.build()
        _ = meta.decode_groups
        return meta

    def attend(self, impl: AttentionImpl) -> torch.Tensor:
        return paged_attention(self.query, self.key_cache, self.value_cache, self.meta, self.scale, impl=impl)

    def fp8_caches(self, kv_cache_dtype: str) -> tuple[torch.Tensor, torch.Tensor, float]:
        """This case's (fp32) cache quantized with one per-tensor scale: keys, values, scale."""
        dtype = FP8_DTYPES[kv_cache_dtype]
        scale = float(self.key_cache.abs().max()) / fp8_max(dtype)
        return quantize_fp8(self.key_cache, scale, dtype), quantize_fp8(self.value_cache, scale, dtype), scale

    def attend_fp8(
        self, caches: tuple[torch.Tensor, torch.Tensor, float], impl: AttentionImpl
    ) -> torch.Tensor:
        key_cache, value_cache, kv_scale = caches
        return paged_attention(
            self.query,
            key_cache,
            value_cache,
            self.meta,
            self.scale,
            k_scale=kv_scale,
            v_scale=kv_scale,
            impl=impl,
        )

    def dense(self) -> torch.Tensor:
        if self.fresh:
            return F.scaled_dot_product_attention(
                self.dense_q, self.dense_k, self.dense_v, is_causal=True, scale=self.scale, enable_gqa=True
            )
        return F.scaled_dot_product_attention(
            self.dense_q,
            self.dense_k,
            self.dense_v,
            attn_mask=self.dense_mask,
            scale=self.scale,
            enable_gqa=True,
        )


def measure(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, tuple[float, float]]:
    """Interleave the candidates so background load hits them alike; (median, min) in ms."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: (statistics.median(ts), min(ts)) for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--group-tokens", type=int, default=DECODE_GROUP_MAX_TOKENS)
    parser.add_argument("--group-seqs", type=int, default=DECODE_GROUP_MAX_SEQS)
    parser.add_argument("--group-min-seqs", type=int, default=None, help="default: the thread count")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--cold-build", action="store_true", help="build the C++ extension from scratch in a temp dir"
    )
    parser.add_argument("--decode-only", action="store_true", help="skip the prefill cases")
    parser.add_argument(
        "--no-fp8", action="store_true", help="skip the C++ kernel over FP8 copies of the decode caches"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    dtype = getattr(torch, args.dtype)

    if args.cold_build:
        # torch's cpp_extension reads this when it builds; a fresh directory means no cache.
        os.environ["TORCH_EXTENSIONS_DIR"] = tempfile.mkdtemp(prefix="pagedserve_ext_")
    t0 = time.perf_counter()
    kernels = load_cpu_kernels(strict=True, verbose=args.cold_build)
    build_s = time.perf_counter() - t0
    assert kernels is not None
    print(
        f"C++ extension {'cold build' if args.cold_build else 'load (cached build, if any)'}: "
        f"{build_s:.2f} s, cflags {' '.join(kernels.cflags)}"
    )
    impls: list[AttentionImpl] = ["cpp", "torch"] if dtype == torch.float32 else ["torch"]

    grouping = (args.group_tokens, args.group_seqs, args.group_min_seqs)
    cases = {
        "decode 64 x ctx 50-400": Case(
            [1] * 64, [rng.randint(50, 400) for _ in range(64)], dtype, *grouping, rng
        ),
        "decode 16 x ctx 1000-4000": Case(
            [1] * 16, [rng.randint(1000, 4000) for _ in range(16)], dtype, *grouping, rng
        ),
    }
    if not args.decode_only:
        cases["prefill 4 x 300"] = Case([300] * 4, [300] * 4, dtype, *grouping, rng)
        cases["chunked prefill 4 x (200 cached + 100 new)"] = Case(
            [100] * 4, [300] * 4, dtype, *grouping, rng
        )
    fp8_formats = [] if args.no_fp8 or dtype != torch.float32 else list(FP8_DTYPES)
    print(
        f"threads={args.threads} dtype={args.dtype} heads={NUM_HEADS}/{NUM_KV_HEADS} head_dim={HEAD_DIM} "
        f"block_size={BLOCK_SIZE} decode groups: <= {args.group_tokens} tokens, <= {args.group_seqs} seqs, "
        f">= {args.group_min_seqs or min(args.group_seqs, args.threads)} seqs"
    )
    for name, case in cases.items():
        # Host-side metadata work is timed apart from the attention calls: right after one of
        # those (tens of MB through the caches) the same build measures ~3x slower.
        host: dict[str, Callable[[], object]] = {"build_attention_metadata (once per step)": case.build}
        if case.meta.num_decode_tokens:
            host["  with the torch path's decode groups"] = case.build_with_groups
        fns: dict[str, Callable[[], object]] = {"write_kv_cache": case.write}
        for impl in impls:
            fns[f"paged_attention impl={impl}"] = functools.partial(case.attend, impl)
        if case.meta.num_decode_tokens and not case.meta.prefills:
            for kv_cache_dtype in fp8_formats:
                caches = case.fp8_caches(kv_cache_dtype)
                fns[f"paged_attention impl=cpp {kv_cache_dtype}"] = functools.partial(
                    case.attend_fp8, caches, "cpp"
                )
        fns["SDPA, contiguous padded K/V (bound)"] = case.dense
        res = measure(host, args.repeats) | measure(fns, args.repeats)
        extra = f", {len(case.meta.decode_groups)} decode groups" if case.meta.decode_groups else ""
        print(f"\n{name} (T={case.meta.num_tokens}{extra})")
        for label, (med, mn) in res.items():
            print(f"  {label:42s} median {med:7.3f} ms   min {mn:7.3f} ms")


if __name__ == "__main__":
    main()
