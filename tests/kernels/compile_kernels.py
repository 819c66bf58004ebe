"""Compile the Triton kernels for real GPU targets, without a GPU (run by test_triton_kernels).

The interpreter runs the kernels' Python, not Triton's compiler: type errors in loop-carried
values, constexpr branches or unsupported dtypes on an architecture only show when the
kernels are compiled. triton.compile needs no device for that (TTIR -> PTX -> cubin with the
wheel's ptxas). Must run without TRITON_INTERPRET (it makes @triton.jit return interpreted
functions). Prints one line per kernel configuration; exits non-zero on the first failure.
"""

from __future__ import annotations

import inspect
import os
import sys
from typing import Any

if os.environ.get("TRITON_INTERPRET"):
    sys.exit("run without TRITON_INTERPRET")

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from pagedserve.kernels.triton_ops import jit

TL = {"fp32": tl.float32, "bf16": tl.bfloat16, "fp16": tl.float16}


def compile_kernel(fn: Any, types: dict[str, str], constexprs: dict[str, Any], arch: int) -> None:
    names = list(inspect.signature(fn.fn).parameters)
    signature = {n: "constexpr" if n in constexprs else types[n] for n in names}
    src = ASTSource(
        fn=fn, signature=signature, constexprs={(names.index(k),): v for k, v in constexprs.items()}
    )
    triton.compile(src, target=GPUTarget("cuda", arch, 32))


def attention(arch: int, qdt: str, kvdt: str, block_q: int, tile_n: int, splits: int) -> None:
    types = {
        "out_ptr": f"*{qdt}",
        "query_ptr": f"*{qdt}",
        "key_cache_ptr": f"*{kvdt}",
        "value_cache_ptr": f"*{kvdt}",
        **dict.fromkeys(
            [
                "block_tables_ptr",
                "work_row_ptr",
                "work_num_queries_ptr",
                "work_first_pos_ptr",
                "work_table_row_ptr",
            ],
            "*i32",
        ),
        **dict.fromkeys(["partial_out_ptr", "partial_max_ptr", "partial_sum_ptr"], "*fp32"),
        "qk_scale": "fp32",
        "v_scale": "fp32",
        **dict.fromkeys(
            ["stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_cs", "stride_ch", "stride_bt"], "i32"
        ),
        "stride_cb": "i64",
        "split_len": "i32",
        "block_size": "i32",
    }
    constexprs = {
        "GROUP": 4,
        "HEADS_PAD": 4,
        "BLOCK_Q": block_q,
        "HEAD_DIM": 128,
        "DIM_PAD": 128,
        "TILE_N": tile_n,
        "NUM_SPLITS": splits,
        "DOT_DTYPE": TL[qdt],
        "IEEE_DOT": qdt == "fp32",
        "INTERPRET": False,
    }
    compile_kernel(jit.paged_attention_kernel, types, constexprs, arch)
    if splits > 1:
        types = {
            "out_ptr": f"*{qdt}",
            **dict.fromkeys(["partial_out_ptr", "partial_max_ptr", "partial_sum_ptr"], "*fp32"),
            "work_row_ptr": "*i32",
            "v_scale": "fp32",
            "stride_ot": "i32",
            "stride_oh": "i32",
        }
        constexprs = {"HEAD_DIM": 128, "DIM_PAD": 128, "NUM_SPLITS": splits, "INTERPRET": False}
        compile_kernel(jit.reduce_splits_kernel, types, constexprs, arch)


def write(arch: int, cache: str, src: str, fp8: tuple[float, int, int] | None) -> None:
    types = {
        "key_ptr": f"*{src}",
        "value_ptr": f"*{src}",
        "key_cache_ptr": f"*{cache}",
        "value_cache_ptr": f"*{cache}",
        "slot_mapping_ptr": "*i64",
        "k_inv_scale": "fp32",
        "v_inv_scale": "fp32",
        **dict.fromkeys(
            [
                "stride_kt",
                "stride_kh",
                "stride_vt",
                "stride_vh",
                "stride_cb",
                "stride_cs",
                "stride_ch",
                "block_size",
            ],
            "i32",
        ),
    }
    fp8_max, mant, min_exp = fp8 or (0.0, 0, 0)
    constexprs = {
        "NUM_KV_HEADS": 8,
        "HEAD_DIM": 128,
        "HEADS_PAD": 8,
        "DIM_PAD": 128,
        "FP8": fp8 is not None,
        "FP8_MAX": fp8_max,
        "MANT_BITS": mant,
        "MIN_EXP": min_exp,
    }
    compile_kernel(jit.write_kv_cache_kernel, types, constexprs, arch)


def main() -> int:
    # The launch configurations the launchers use: prefill (64 rows), decode (16 rows) with
    # splits, fp32 (32 x 32 tiles); Hopper, and Ampere without e4m3 (the engine uses torch there).
    jobs = [
        ("attention sm90 bf16 prefill", lambda: attention(90, "bf16", "bf16", 16, 64, 1)),
        ("attention sm90 bf16 / e4m3 decode split 4", lambda: attention(90, "bf16", "fp8e4nv", 4, 64, 4)),
        ("attention sm90 fp32 / fp32", lambda: attention(90, "fp32", "fp32", 8, 32, 1)),
        ("attention sm80 fp16 / e5m2 decode split 2", lambda: attention(80, "fp16", "fp8e5", 4, 64, 2)),
        ("write sm90 bf16 -> e4m3", lambda: write(90, "fp8e4nv", "bf16", (448.0, 3, -6))),
        ("write sm80 fp32 -> e5m2", lambda: write(80, "fp8e5", "fp32", (57344.0, 2, -14))),
        ("write sm90 bf16", lambda: write(90, "bf16", "bf16", None)),
        (
            "copy sm90",
            lambda: compile_kernel(
                jit.copy_blocks_kernel,
                {
                    "src_ptr": "*i16",
                    "dst_ptr": "*i16",
                    "src_ids_ptr": "*i64",
                    "dst_ids_ptr": "*i64",
                    "block_numel": "i32",
                },
                {"CHUNK": 4096},
                90,
            ),
        ),
    ]
    for name, job in jobs:
        job()
        print(f"compiled: {name}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
