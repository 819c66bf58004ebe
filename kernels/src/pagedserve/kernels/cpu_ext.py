"""C++ CPU kernels (kernels/src/pagedserve/kernels/cpu/*.cpp), JIT-built with torch.utils.cpp_extension on first use.

Nothing is built at import: the first load_cpu_kernels() call compiles the extension (15-40 s
cold on 2 cores, longer while other work shares them; `pagedserve kernels build` does it ahead
of the first start) into `build_root()` ($TORCH_EXTENSIONS_DIR/pagedserve, else
~/.cache/torch_extensions/pagedserve), one folder per build named by the digest of what the
binary depends on (`build_name`): the CPU, the sources' contents, the flags, torch. The sources
are copied into that folder and built from there, so every checkout of the same sources shares
one build; later processes load the library as it is, without running the compiler or taking a
lock. A build holds an flock on its folder, which the OS drops when the builder exits or is
killed: an interrupted build never blocks a later start, and processes started together build
once. Within a process the result is memoised. If the build fails (no C++ compiler, no ninja) a
single warning is logged and callers fall back to the torch implementations.

One build per instruction-set level (kernels/src/pagedserve/kernels/cpu_isa.py picks it). The kernels size their
register tiles and panel widths for the level they are compiled for (kernels/src/pagedserve/kernels/cpu/vec.h); a level
other than the CPU's own is built for that level, not for this CPU. Each level registers its ops
under its own namespace (`pagedserve_cpu_<isa>`), so one process can load several (the tests
compare them). The CPU's model and flags are part of the build's name, so a cache directory
shared between different machines (an NFS home) never hands one CPU's build to another. A
compiler that rejects -march=native gets a second build without it.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedserve.kernels.cpu_isa import check_isa, cpu_fingerprint, native_isa, selected_isa

logger = logging.getLogger(__name__)

_CPU_DIR = Path(__file__).parent / "cpu"
_SOURCES = tuple(
    _CPU_DIR / name
    for name in (
        "paged_attention.cpp",
        "prefill_attention.cpp",
        "layer_ops.cpp",
        "cache_ops.cpp",
        "linear.cpp",
        "linear_bf16.cpp",
        "decoder_block.cpp",
        "linear_quant.cpp",
    )
)
# Included by the sources; their contents are part of the build's name like the sources'.
_HEADERS = tuple(
    _CPU_DIR / name
    for name in ("vec.h", "attention_checks.h", "panel.h", "panel_bf16.h", "panel_quant.h", "row_ops.h")
)


@dataclass(frozen=True)
class CpuKernels:
    """The loaded extension's ops (their contracts: the comments atop kernels/src/pagedserve/kernels/cpu/*.cpp)."""

    # paged_decode_attention(out, query, key_cache, value_cache, block_tables, seq_lens,
    #                        token_rows, scale, v_scale=1.0) -> None, writes out in place;
    # caches float32 or FP8 (float8_e4m3fn / float8_e5m2; scale then includes k_scale)
    paged_decode_attention: Callable[..., None]
    # kernels/src/pagedserve/kernels/cpu/prefill_attention.cpp: paged_prefill_attention(out, query, key_cache,
    #     value_cache, block_tables, seq_lens, query_starts, query_lens, scale) -> None, causal
    #     attention of the prefill rows, written in place; float32 query and caches only
    paged_prefill_attention: Callable[..., None]
    # kernels/src/pagedserve/kernels/cpu/layer_ops.cpp, all float32, all write in place and return None:
    # rms_norm(out, x, weight, eps); add_rms_norm(out, residual, delta, weight, eps) (also
    # residual += delta); silu_and_mul(out, gate_up); rotary_neox(qk, cos, sin) (qk in place)
    rms_norm: Callable[..., None]
    add_rms_norm: Callable[..., None]
    silu_and_mul: Callable[..., None]
    rotary_neox: Callable[..., None]
    # kernels/src/pagedserve/kernels/cpu/cache_ops.cpp: write_kv_cache(key_cache, value_cache, key, value,
    # slot_mapping), float32 caches, in place
    write_kv_cache: Callable[..., None]
    # kernels/src/pagedserve/kernels/cpu/linear.cpp: panel_linear(out, x, packed, bias), float32, out written; packed
    # by pagedserve.kernels.linear.pack_panels, bias empty for none
    panel_linear: Callable[..., None]
    # kernels/src/pagedserve/kernels/cpu/decoder_block.cpp, float32, a decoder layer's halves around attention:
    # decoder_attention_input(hidden, norm_weight, eps, qkv_packed, qkv_bias, qkv_features, cos,
    #     sin, rotary_heads) -> qkv (normed, projected, q/k rotated);
    # decoder_mlp(hidden, attn, o_packed, o_bias, norm_weight, eps, gate_up_packed, gate_up_bias,
    #     intermediate_size, down_packed, down_bias) -> None (o_proj, residual, norm, MLP,
    #     residual: hidden in place)
    decoder_attention_input: Callable[..., torch.Tensor]
    decoder_mlp: Callable[..., None]
    # kernels/src/pagedserve/kernels/cpu/linear.cpp: panel_width() -> int, the output columns per packed panel of
    # this build (two vectors of its ISA: 32 on AVX-512, 16 on AVX2, 8 on portable)
    panel_width: int
    # kernels/src/pagedserve/kernels/cpu/linear_bf16.cpp: panel_linear_bf16(out, x, packed, bias), x/out/bias
    # float32, packed bfloat16 by pagedserve.kernels.linear.pack_panels_bf16; bf16_dot_products: whether
    # this build computes it with AVX-512 BF16 dot products (x rounded to bf16)
    panel_linear_bf16: Callable[..., None]
    bf16_dot_products: bool
    # kernels/src/pagedserve/kernels/cpu/linear_quant.cpp: quant_panel_linear(out, x, packed, bias, int8_activations),
    # float32 x/out/bias, packed uint8 (4-bit) or int8 (8-bit) by
    # pagedserve.kernels.quant.pack_quant_panels, bias empty for none; int8_dot_products: how
    # this build sums int8_activations' integer products (INT8_DOT_PRODUCTS)
    quant_panel_linear: Callable[..., None]
    int8_dot_products: str
    isa: str
    library_path: str
    cflags: tuple[str, ...]


# kernels/src/pagedserve/kernels/cpu/linear_quant.cpp quant_int_dot_products(), by its number: "avx2" is vpmaddubsw
# + vpmaddwd, "avx512bw" the same on AVX-512 without VNNI.
INT8_DOT_PRODUCTS = ("generic", "avx2", "avx_vnni", "avx512bw", "avx512_vnni")

_lock = threading.Lock()
# Per ISA, once loaded: the kernels, or the exception the build failed with.
_loaded: dict[str, CpuKernels | BaseException] = {}


def load_cpu_kernels(
    *, strict: bool = False, verbose: bool = False, isa: str | None = None
) -> CpuKernels | None:
    """Build (first call, or after a source change) and load the C++ CPU kernels.

    isa: one of CPU_ISAS; None means `selected_isa()` ($PAGEDSERVE_CPU_ISA, else the best
    level this CPU runs). Returns None when they cannot be built (one warning is logged for
    the process), or raises RuntimeError instead with strict=True (for tests, where a
    missing kernel is a failure). verbose shows the compiler's command lines and output.
    A level this CPU cannot execute, or an unknown name, raises ValueError either way.
    """
    chosen = selected_isa() if isa is None else check_isa(isa)
    # Fast path, no lock: the engine asks on every layer call once the build is done.
    result = _loaded.get(chosen)
    if result is None:
        result = _load_once(chosen, verbose)
    if isinstance(result, BaseException):
        if strict:
            raise RuntimeError(f"the C++ CPU kernels ({chosen}) could not be built: {result}") from result
        return None
    return result


def _load_once(isa: str, verbose: bool) -> CpuKernels | BaseException:
    with _lock:
        if isa not in _loaded:
            try:
                _loaded[isa] = _build(isa, verbose)
            except Exception as exc:  # any build or load failure means: use the torch path
                logger.warning(
                    "pagedserve: the C++ CPU kernels (%s) could not be built, using the slower "
                    "torch attention path (needs a C++ compiler and ninja: pip install ninja): %s",
                    isa,
                    _summarise(exc),
                )
                _loaded[isa] = exc
        return _loaded[isa]


def _summarise(exc: BaseException, max_lines: int = 15) -> str:
    lines = str(exc).strip().splitlines()
    if len(lines) <= max_lines:
        return " | ".join(lines)
    return " | ".join(["...", *lines[-max_lines:]])


def _cflag_attempts(isa: str) -> list[list[str]]:
    """Compiler flags to try in turn for a build at `isa` on this CPU."""
    if isa == native_isa():
        # The CPU's own level: tune and target it exactly; a compiler that rejects
        # -march=native gets the architecture's baseline (correct, slower).
        return [["-O3", "-march=native"], ["-O3"]]
    if isa == "avx2":
        return [["-O3", "-march=x86-64-v3", "-mtune=native"]]
    return [["-O3"]]  # portable below a better native level: the baseline only


def _path_with_ninja() -> str:
    """PATH, plus the pip ninja's directory when no ninja is on it.

    torch runs `ninja` by name; a venv's ninja is not on PATH when the venv's python is run
    without activating the venv (as CI and `make` do).
    """
    path = os.environ.get("PATH", "")
    if shutil.which("ninja") is not None:
        return path
    try:
        import ninja

        bin_dir = str(ninja.BIN_DIR)
    except (ImportError, AttributeError):
        return path
    return os.pathsep.join([bin_dir, path]) if path else bin_dir


def build_root() -> Path:
    """Where the builds live: $TORCH_EXTENSIONS_DIR (as torch reads it), else torch's default
    root (~/.cache/torch_extensions), in a pagedserve/ folder of their own."""
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    return Path(root) / "pagedserve"


def build_name(isa: str, cflags: Sequence[str]) -> str:
    """The build's folder and library name: its ISA and a digest of everything the binary
    depends on (the CPU, the sources' and headers' contents, the flags, torch and Python),
    never of the checkout's path, so every checkout with these sources shares one build."""
    digest = hashlib.sha256(cpu_fingerprint().encode())
    for path in (*_SOURCES, *_HEADERS):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    digest.update("\n".join([*cflags, torch.__version__, platform.python_version()]).encode())
    return f"pagedserve_cpu_{isa}_{digest.hexdigest()[:16]}"


# How long a start waits for another process's build of the same kernels before it gives up
# (and falls back to the torch path): a cold build takes 15-40 s on 2 cores, more when they are busy.
BUILD_WAIT_S = 600.0


@contextlib.contextmanager
def _build_lock(folder: Path, timeout_s: float) -> Iterator[None]:
    """One builder per build folder across processes: an flock, which the OS releases when
    its holder exits or is killed, so an interrupted build can never leave a lock behind."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "pagedserve-build.lock"
    with open(path, "a+") as handle:
        try:
            import fcntl
        except ImportError:  # not POSIX: no cross-process lock
            yield
            return
        deadline = time.monotonic() + timeout_s
        announced = False
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not announced:
                    handle.seek(0)
                    holder = handle.read().strip() or "unknown"
                    logger.warning(
                        "pagedserve: waiting for another process (pid %s) building the C++ CPU kernels in %s",
                        holder,
                        folder,
                    )
                    announced = True
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"another process held the kernel build lock {path} for over {timeout_s:.0f} s"
                    ) from None
                time.sleep(0.2)
        try:
            handle.seek(0)
            handle.truncate()
            handle.write(str(os.getpid()))
            handle.flush()
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _staged_sources(folder: Path) -> list[str]:
    """The sources and headers copied into the build folder: the build reads those, so its
    build.ninja names the same paths whichever checkout started it (no rebuild when another
    checkout with the same sources starts next)."""
    src = folder / "src"
    src.mkdir(parents=True, exist_ok=True)
    for path in (*_SOURCES, *_HEADERS):
        target = src / path.name
        data = path.read_bytes()
        if not target.exists() or target.read_bytes() != data:
            target.write_bytes(data)
    return [str(src / path.name) for path in _SOURCES]


def _load_or_build(name: str, cflags: list[str], verbose: bool) -> str:
    """The built library's path: loaded as it is when a previous start built it, else built
    (once, under the folder's lock) and loaded."""
    from torch.utils import cpp_extension

    folder = build_root() / name
    library = folder / f"{name}.so"
    if library.exists():
        torch.ops.load_library(str(library))
        return str(library)
    with _build_lock(folder, BUILD_WAIT_S):
        if library.exists():  # built by the process we waited for
            torch.ops.load_library(str(library))
            return str(library)
        # torch's own lock file, left by a build that was killed: we hold the folder's flock,
        # so nobody is building here now.
        (folder / "lock").unlink(missing_ok=True)
        logger.warning(
            "pagedserve: building the C++ CPU kernels %s (once per CPU and kernel source version; "
            "about 15-40 s on 2 cores, longer while other work shares them) in %s",
            name,
            folder,
        )
        started = time.perf_counter()
        cpp_extension.load(
            name=name,
            sources=_staged_sources(folder),
            extra_cflags=cflags,
            build_directory=str(folder),
            is_python_module=False,
            verbose=verbose,
        )
        logger.warning("pagedserve: built the C++ CPU kernels in %.1f s", time.perf_counter() - started)
    return str(library)


def _build(isa: str, verbose: bool) -> CpuKernels:
    # The source uses only torch's stable ABI; parallelism comes from libtorch's own
    # parallel_for, so no OpenMP flags (see kernels/src/pagedserve/kernels/cpu/paged_attention.cpp).
    namespace = f"pagedserve_cpu_{isa}"
    old_path = os.environ.get("PATH")
    errors: list[str] = []
    # torch's build reads PATH when it runs; restored below.
    os.environ["PATH"] = _path_with_ninja()
    try:
        for flags in _cflag_attempts(isa):
            cflags = [*flags, f"-DPAGEDSERVE_OPS={namespace}"]
            try:
                library = _load_or_build(build_name(isa, cflags), cflags, verbose)
            except Exception as exc:
                errors.append(f"{' '.join(cflags)}: {exc}")
                # A missing toolchain (or another process's build we gave up waiting on) fails
                # both attempts alike; only a rejected flag warrants the portable retry.
                if isinstance(exc, TimeoutError) or (
                    "ninja" in str(exc).lower() and "required" in str(exc).lower()
                ):
                    break
                continue
            ops = getattr(torch.ops, namespace)
            return CpuKernels(
                paged_decode_attention=ops.paged_decode_attention.default,
                paged_prefill_attention=ops.paged_prefill_attention.default,
                rms_norm=ops.rms_norm.default,
                add_rms_norm=ops.add_rms_norm.default,
                silu_and_mul=ops.silu_and_mul.default,
                rotary_neox=ops.rotary_neox.default,
                write_kv_cache=ops.write_kv_cache.default,
                panel_linear=ops.panel_linear.default,
                decoder_attention_input=ops.decoder_attention_input.default,
                decoder_mlp=ops.decoder_mlp.default,
                panel_width=int(ops.panel_width.default()),
                panel_linear_bf16=ops.panel_linear_bf16.default,
                bf16_dot_products=bool(ops.bf16_dot_products.default()),
                quant_panel_linear=ops.quant_panel_linear.default,
                int8_dot_products=INT8_DOT_PRODUCTS[int(ops.quant_int_dot_products.default())],
                isa=isa,
                library_path=library,
                cflags=tuple(cflags),
            )
    finally:
        if old_path is None:
            del os.environ["PATH"]
        else:
            os.environ["PATH"] = old_path
    raise RuntimeError("\n".join(errors))
