"""Decode paged-attention bandwidth: Triton on CUDA (16-bit vs FP8 cache), torch/C++ on the CPU.

    .venv/bin/python -m pagedserve.benchmarks.attention_kernels [--json PATH]

One decode step of one layer: `--seqs` sequences of `--context` tokens each, one query
token per sequence, heads `--heads` / `--kv-heads`, `--head-dim`, `--block-size`, blocks
scattered at random through the pool. Decode attention is memory-bound: the figure of
merit is bytes moved (the K and V of every context token, plus queries, outputs and block
tables) per second.

On CUDA (goal: >= 70 % of HBM peak at 32 sequences x 4k context): the Triton kernel with
a 16-bit cache (`--dtype`, default bfloat16) and with an fp8_e4m3 cache (half the bytes;
the FP8 speed-up over 16-bit is reported), split-KV chosen as the engine would, and the
torch gather + SDPA path for reference. Peak = the device's datasheet HBM bandwidth when
its name is in PEAK_GBPS, and in any case the measured device-to-device copy bandwidth.
Timing: CUDA events, median over `--repeats` after warm-up.

On the CPU (no Triton outside its interpreter, which is not a performance path): the C++
decode kernel (fp32) and the torch path (fp32, bfloat16, fp8_e4m3), against the measured
memory copy bandwidth, at a smaller default shape. Wall-clock medians; on a shared
machine read only the ratios.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagedserve.common.settings import ArgumentParser
from pagedserve.kernels import build_attention_metadata, paged_attention
from pagedserve.kernels.backend import AttentionImpl
from pagedserve.kernels.fp8 import quantize_fp8

# Datasheet HBM/GDDR bandwidth, GB/s, by a substring of torch.cuda.get_device_name().
PEAK_GBPS = {
    "H200": 4800.0,
    "H100 SXM": 3350.0,
    "H100 80GB HBM3": 3350.0,
    "H100 PCIe": 2000.0,
    "H100 NVL": 3900.0,
    "GH200": 4000.0,
    "A100-SXM4-80GB": 2039.0,
    "A100 80GB PCIe": 1935.0,
    "A100-SXM4-40GB": 1555.0,
    "A100-PCIE-40GB": 1555.0,
    "L40S": 864.0,
    "L4": 300.0,
    "A10G": 600.0,
    "RTX 4090": 1008.0,
    "V100": 900.0,
}


@dataclass
class Case:
    name: str
    impl: AttentionImpl
    cache_dtype: torch.dtype
    query_dtype: torch.dtype


def datasheet_peak(name: str) -> float | None:
    for key, gbps in sorted(PEAK_GBPS.items(), key=lambda kv: -len(kv[0])):
        if key in name:
            return gbps
    return None


def time_fn(fn: Callable[[], Any], device: torch.device, repeats: int, warmup: int = 5) -> float:
    """Median seconds per call."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, repeats: int) -> float:
    """Measured copy bandwidth (GB/s, read + write) of a 512 MiB buffer on `device`."""
    src = torch.empty(512 * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = time_fn(lambda: dst.copy_(src), device, max(3, repeats // 5), warmup=2)
    return 2 * src.numel() / seconds / 1e9


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    seqs = args.seqs or (32 if cuda else 8)
    context = args.context or (4096 if cuda else 2048)
    bs, kvh, heads, d = args.block_size, args.kv_heads, args.heads, args.head_dim
    half = {"bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    if cuda:
        cases = [
            Case(f"triton {args.dtype} cache", "triton", half, half),
            Case("triton fp8_e4m3 cache", "triton", torch.float8_e4m3fn, half),
            Case(f"torch gather+SDPA {args.dtype}", "torch", half, half),
        ]
    else:
        cases = [
            Case("C++ kernel fp32", "cpp", torch.float32, torch.float32),
            Case("torch gather+SDPA fp32", "torch", torch.float32, torch.float32),
            Case("torch gather+SDPA bfloat16", "torch", torch.bfloat16, torch.bfloat16),
            Case("torch fp8_e4m3 cache, fp32 query", "torch", torch.float8_e4m3fn, torch.float32),
        ]
    gen = torch.Generator().manual_seed(0)
    blocks_per_seq = (context + bs - 1) // bs
    num_blocks = seqs * blocks_per_seq + 8
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [perm[i * blocks_per_seq : (i + 1) * blocks_per_seq] for i in range(seqs)]
    meta = build_attention_metadata([1] * seqs, [context] * seqs, tables, bs, device)
    base_k = torch.randn(num_blocks, bs, kvh, d, device=device)
    base_v = torch.randn(num_blocks, bs, kvh, d, device=device)
    query32 = torch.randn(seqs, heads, d, device=device)
    scale = d**-0.5
    peak_copy = copy_bandwidth(device, args.repeats)
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    peak_sheet = datasheet_peak(name) if cuda else None
    rows: list[dict[str, Any]] = []
    for case in cases:
        fp8 = case.cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        k_scale = v_scale = 0.02 if fp8 else 1.0
        if fp8:
            kc, vc = (
                quantize_fp8(base_k, k_scale, case.cache_dtype),
                quantize_fp8(base_v, v_scale, case.cache_dtype),
            )
        else:
            kc, vc = base_k.to(case.cache_dtype), base_v.to(case.cache_dtype)
        q = query32.to(case.query_dtype)

        call = functools.partial(
            paged_attention, q, kc, vc, meta, scale, k_scale=k_scale, v_scale=v_scale, impl=case.impl
        )

        try:
            seconds = time_fn(call, device, args.repeats)
        except (RuntimeError, ValueError) as exc:  # e.g. the C++ kernel cannot be built here
            rows.append({"case": case.name, "error": str(exc).splitlines()[0]})
            continue
        kv_bytes = 2 * seqs * context * kvh * d * kc.element_size()
        io_bytes = 2 * q.numel() * q.element_size() + meta.decode_block_tables.numel() * 4
        gbps = (kv_bytes + io_bytes) / seconds / 1e9
        rows.append(
            {
                "case": case.name,
                "ms": seconds * 1e3,
                "kv_bytes": kv_bytes,
                "gbps": gbps,
                "pct_copy_bw": 100 * gbps / peak_copy,
                "pct_datasheet": None if peak_sheet is None else 100 * gbps / peak_sheet,
            }
        )
        del kc, vc
    by_name = {r["case"]: r for r in rows if "ms" in r}
    fp8_speedup = None
    if cuda and f"triton {args.dtype} cache" in by_name and "triton fp8_e4m3 cache" in by_name:
        fp8_speedup = by_name[f"triton {args.dtype} cache"]["ms"] / by_name["triton fp8_e4m3 cache"]["ms"]
    splits = None
    if cuda:
        from pagedserve.kernels.triton_ops.attention import choose_num_splits

        splits = choose_num_splits(seqs, kvh, context, device)
    return {
        "device": name,
        "shape": {
            "seqs": seqs,
            "context": context,
            "heads": heads,
            "kv_heads": kvh,
            "head_dim": d,
            "block_size": bs,
        },
        "copy_bandwidth_gbps": peak_copy,
        "datasheet_gbps": peak_sheet,
        "num_splits": splits,
        "fp8_speedup_vs_16bit": fp8_speedup,
        "rows": rows,
    }


def print_report(rep: dict[str, Any]) -> None:
    s = rep["shape"]
    print(
        f"\nDecode paged attention on {rep['device']}: {s['seqs']} seqs x {s['context']} ctx, "
        f"{s['heads']}/{s['kv_heads']} heads, head_dim {s['head_dim']}, block {s['block_size']}"
        + (f", split-KV {rep['num_splits']}" if rep["num_splits"] else "")
    )
    sheet = rep["datasheet_gbps"]
    print(
        f"measured copy bandwidth {rep['copy_bandwidth_gbps']:.0f} GB/s"
        + (f"; datasheet peak {sheet:.0f} GB/s" if sheet else "; datasheet peak unknown for this device")
    )
    print("\n| case | ms | GB/s | % of copy BW | % of datasheet peak |\n|---|---|---|---|---|")
    for r in rep["rows"]:
        if "error" in r:
            print(f"| {r['case']} | — | — | — | {r['error']} |")
            continue
        pct_sheet = "—" if r["pct_datasheet"] is None else f"{r['pct_datasheet']:.1f} %"
        print(f"| {r['case']} | {r['ms']:.3f} | {r['gbps']:.1f} | {r['pct_copy_bw']:.1f} % | {pct_sheet} |")
    if rep["fp8_speedup_vs_16bit"]:
        print(f"\nFP8 cache vs 16-bit: {rep['fp8_speedup_vs_16bit']:.2f}x faster")
    if rep["device"] == "cpu":
        print("\n(no GPU: Triton is not timed; the CPU paths above are what runs here)")


def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="pagedserve bench attention-kernels", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="torch device (cuda when one is available, else cpu)",
    )
    ap.add_argument(
        "--seqs", type=int, default=None, help="sequences in the batch (default: 32 on CUDA, 8 on CPU)"
    )
    ap.add_argument(
        "--context",
        type=int,
        default=None,
        help="context tokens per sequence (default: 4096 on CUDA, 2048 on CPU)",
    )
    ap.add_argument("--heads", type=int, default=32, help="query heads")
    ap.add_argument("--kv-heads", type=int, default=8, help="K/V heads")
    ap.add_argument("--head-dim", type=int, default=128, help="head dimension")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    ap.add_argument(
        "--dtype", default="bfloat16", choices=["bfloat16", "float16"], help="16-bit cache/query dtype"
    )
    ap.add_argument("--repeats", type=int, default=50, help="timed repeats (the median is reported)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (CPU) (default: torch's own)")
    ap.add_argument("--json", default=None, help="write the report here (default: print only)")
    return ap


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with torch.inference_mode():
        rep = run(args)
    print_report(rep)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rep, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
