"""Native CPU kernels for float32 decode steps.

Why: a decode step of a few sequences is memory-bound on CPU (the weights stream from memory
once per step; the 2-core hosts measured below read 27-35 GB/s with both cores) and pays a few
microseconds per torch op, of which a hybrid MoE layer issues dozens. MKL's single-precision GEMM
reads a weight at 14-17 GB/s from 4 to 48 rows (it packs the weight first); for 1-3 rows at full
speed on the Intel host below but at only 7-18 GB/s on the AMD EPYC one; and each MoE expert
costs a dozen small torch ops around its two products. The kernels
here, each one call per layer per step:

- :func:`matmul_rows`: ``x W^T`` as blocked dot products that read each weight row once for all
  input rows (4 input rows per register block; with AVX-512 16, 8 or 6 weight rows per block for
  1, 2-3 and 4+ input rows, else 4), used by :func:`~.linear.linear` for :data:`NATIVE_ROWS`;
- :func:`matmul_bcast`: ``x W^T`` for 25-64 rows without AVX-512 (:func:`bcast_rows`), x
  transposed once and each weight element broadcast against 16 input rows (a 32-token prompt's
  dense products, decode steps of 25-64 sequences), 1.14-1.63x MKL's product there;
- :func:`swiglu_experts_native`: a whole MoE layer (sort by expert, gate/up, SwiGLU, down,
  weighted sum per token) in one OpenMP region with no barrier between experts;
- :func:`limited_swiglu_experts_native`: the same body with a clipped or clamped SwiGLU (Ling 3,
  GLM-5.3-Flash), summed in slot order;
- :func:`relu2_experts_native`: the same for non-gated ``down(relu(up x)^2)`` experts
  (Nemotron-H / Nemotron-3);
- :func:`delta_step_native`: the decode step of the gated delta rule and of KDA (a decay per
  head or per key channel) in one pass over the state;
- :func:`conv_decode_step_native`: the causal-conv decode step (window shift in place);
- :func:`~.mamba2_cpu.ssd_step_native` (its own module): the Mamba-2 SSD decode step;
- :func:`~.mamba1_cpu.selective_scan_step_native` (its own module): the Mamba-1 decode step;
- :func:`rms_norm_native`: RMS norm, plain, zero-centred or gated, in one pass;
- :func:`paged_decode_attention_native`: decode attention reading each cached key/value row
  once per KV head group, online softmax, no gathered copy;
- the DSA decode step (:mod:`.dsa_decode`, its own module): the lightning indexer's pool
  selection and the attention over the selected latent rows;
- the fused decode ops (:mod:`.fused_decode`, their own module): a Gated DeltaNet layer's step
  between its products (also row after row over short prompts), Qwen-MoE routing with the
  shared expert's activation, an attention layer's prologue (with or without q/k norms), a
  residual add with its RMS norm, the absorbed MLA step between its products, the DeepSeek-V3
  group-limited router;
- the fused recurrent decode ops (:mod:`.fused_recurrent`): a KDA layer's and a Mamba-2 layer's
  whole decode step between their products.

Models never call these: the registry's CPU implementations do (``rms_norm`` and
``gated_rms_norm`` in :mod:`.norm`, ``moe_experts``, ``limited_swiglu_experts`` and ``relu2_experts`` in :mod:`.moe`,
``paged_decode_attention`` in :mod:`.attention`), as do the decode steps inside the ``gated_delta_rule_varlen`` and
``causal_conv1d_varlen`` implementations and :func:`~.linear.linear`; each returns ``None``
here when it does not apply and the caller runs torch.

Measured on a 2-core Intel host with the first form of the product (4 weight rows per block;
weights streamed from memory, not cache, best of 3):

    dense decode projections of the 99M benchmark model, 185 MB, by input rows:
        rows     1     2     3     4     8    16    32
        torch  6.5   6.8   6.9  10.6  11.8  12.6  16.0 ms   (MKL, in the faster orientation)
        native 6.5   6.9   7.5   7.5   8.5  11.7  17.4 ms
    MoE experts of a batch-16 step (8 layers, 16 experts, top-2; ~670 MB): torch 33.5, native 29.0 ms
    a whole batch-16 decode step: torch kernels 67 ms, native 55 ms (same process, interleaved)

and on the 2-core AMD EPYC host of the recorded benchmarks (40 weights of 3088 x 1024, 506 MB,
best of 5, 2 threads), where MKL's GEMV is slow for 1-3 rows:

        rows                     1            2          3
        MKL (F.linear)      28-29 ms       55 ms     69-75 ms    (17.3-17.9, 9, 7 GB/s)
        native, 4 wide      14-17 ms     16-18 ms    17-20 ms    (30-35, 28-32, 26-30 GB/s)

With one thread (so that the other developers' load on the shared host enters less), the
first form against the widened blocks of the AVX-512 build, same weights, GB/s:

        rows                     1      2      3      4      8     16
        native, 4 wide        17.1   15.1   13.6   12.0    8.0    4.9
        native, widened       20.2   18.7   17.6   15.5   10.6    7.0

so :func:`~.linear.linear` uses it for 1-24 rows (:data:`NATIVE_ROWS`; MKL keeps more). The rule
is fixed, not a timing taken when a process starts: a choice that could differ between two
processes would change the float rounding between an engine and a fresh process restoring its
state. On the Intel host this costs at most 9 % at 3 rows (the first form's figures above);
on the AMD host it halves the time of a batch-1 product.

Built from ``csrc/cpu_native.c`` (prototypes in ``csrc/cpu_native.h``; :data:`_ARGTYPES` binds them
and tests/test_cpu_native.py checks the two agree) with the system C compiler (``$CC``, else
``cc``, ``gcc`` or ``clang``; ``-O3 -march=native -fopenmp -Wall -Wextra``) when a CPU engine starts (and on first use elsewhere),
into ``kernels`` under :func:`~lmdeploy.pytorch.config.cache_root` (``$LMDEPLOY_CACHE_DIR``, else
``$XDG_CACHE_HOME/lmdeploy``, else ``~/.cache/lmdeploy``), else a folder of the user's in the
system temporary folder; one file per source and CPU. The library runs in
this process, so only a :func:`_trusted_folder` is used and only a private file is loaded
(:func:`_load`). It links the OpenMP runtime by its standard name, so in a process where
``torch`` is imported it shares torch's own thread pool. Without a compiler, on a build error,
or with ``LMDEPLOY_CPU_KERNELS=0`` the torch implementations run (:func:`native_library`
returns ``None``; the reason is logged once at INFO). float32 only, except the delta-rule step,
whose state is float32 in every model dtype.

The dot products sum in a different order than MKL: results agree with the torch path to
float32 rounding (relative ~1e-7), not bit for bit.
"""
from __future__ import annotations

import collections
import ctypes
import hashlib
import logging
import os
import platform
import stat
import tempfile
import threading

import torch

from ..config import cache_root
from . import native_build

__all__ = ['CALLS', 'is_plain', 'state_step_library', 'native_library', 'native_available', 'SOURCE', 'HEADER',
           'compile_command', 'matmul_rows', 'matmul_bcast', 'bcast_rows', 'swiglu_experts_native',
           'limited_swiglu_experts_native',
           'LIMITED_SWIGLU_ACTS', 'relu2_experts_native', 'NATIVE_ROWS',
           'NATIVE_EXPERT_TOKENS', 'delta_step_native',
           'conv_decode_step_native', 'rms_norm_native',
           'paged_decode_attention_native']

logger = logging.getLogger('lmdeploy')

# input rows for which linear() uses the native product (float32, CPU) whenever the library is
# built: a fixed rule on every host (see the module docstring)
NATIVE_ROWS = range(1, 25)
# tokens up to which a MoE layer runs the native experts kernel (decode steps and short prompts:
# 4 x 32 prompt tokens of the 99M benchmark model, 16 rows per expert, 8 layers, one thread's CPU
# time: 129 ms against 153 for the per-expert loop, whose products are the same native ones at
# 16 rows but each its own call and parallel region; longer prefill chunks have many rows per
# expert, where MKL's packed GEMM is the faster one)
NATIVE_EXPERT_TOKENS = 128

# the C source (a real file, compiled with warnings on; shipped as package data, see setup.py)
SOURCE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'csrc')
SOURCE = os.path.join(SOURCE_DIR, 'cpu_native.c')
HEADER = os.path.join(SOURCE_DIR, 'cpu_native.h')

# native kernel calls made in this process, by kernel (the benchmark's op profile reads it)
CALLS: collections.Counter = collections.Counter()

_LOCK = threading.Lock()
_LIB: ctypes.CDLL | None = None
# lm_bcast_rows_max() of the library built for this process (0 without one), asked once at load:
# never through a decode graph's recording stand-in, whose every call a replay would repeat.
# bcast_rows() derives from it (a benchmark sets it to 0 to run those rows on MKL)
_BCAST_MAX = 0
_TRIED = False


def _trusted_folder(path: str) -> bool:
    """True when ``path`` is a real folder (not a symlink) owned by this user that nobody else
    can write, below ancestors that no other user can rename it out of (each ancestor is owned
    by this user or root, or is not writable by others, or has the sticky bit). A library loaded
    from it runs in this process, so nobody else may be able to put one there."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        return False
    parent = os.path.dirname(os.path.realpath(path))
    while True:
        try:
            pst = os.stat(parent)
        except OSError:
            return False
        if pst.st_uid not in (0, os.getuid()) and pst.st_mode & 0o022 and not pst.st_mode & stat.S_ISVTX:
            return False
        up = os.path.dirname(parent)
        if up == parent:
            return True
        parent = up


def _candidate_folders():
    """Yield ``kernels`` under :func:`~lmdeploy.pytorch.config.cache_root`, then a folder of
    this user's in the system temporary folder — created (mode 0700) only when the caller asks
    for it, that is when the first one did not serve, so a normal run leaves nothing in /tmp —
    each kept only when :func:`_trusted_folder`."""
    for path in (str(cache_root() / 'kernels'), os.path.join(tempfile.gettempdir(), f'lmdeploy-kernels-{os.getuid()}')):
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
        except OSError:
            pass
        if _trusted_folder(path):
            yield path


def _cpu_flags() -> str:
    try:
        with open('/proc/cpuinfo') as f:
            for line in f:
                if line.startswith(('flags', 'Features')):
                    return line
    except OSError:
        pass
    return platform.processor()


_ARGTYPES = {   # C signature of each entry point: (argument types, result type)
    'lm_matmul_rows': ('p i32 i32 i64 p i32 i64 p i64 i32', None),
    'lm_matmul_bcast': ('p i32 i32 i64 p i32 i64 p i64 i32', 'i32'),
    'lm_bcast_rows_max': ('', 'i32'),
    'lm_swiglu_experts': ('p i32 i32 i32 i32 p p p p i32 p p p p p i32', 'i32'),
    'lm_limited_swiglu_experts': ('p i32 i32 i32 i32 p p p p i32 i32 f32 p p p p p i32', 'i32'),
    'lm_moe_route': ('p i64 i32 i32 i32 i32 i32 p p p i32', None),
    'lm_delta_step': ('p p p i32 p p i32 i32 i32 i32 i64 i64 i64 p i32', None),
    'lm_gdn_decode': ('p i64 p p p i64 i64 p p f32 p i64 i64 i64 p f32 i32 i32 i32 i32 i32 i32 p p i32', None),
    'lm_kda_decode': ('p i64 p i64 p i64 p i64 p p p p p p i64 i64 p p i32 f32 p i64 i64 i64 p f32 i32 i32 i32 i32 p '
                      'i32', None),                                  # wrapped in fused_recurrent.py
    'lm_mamba2_decode': ('p i64 p p p i64 i64 p p p f32 f32 p i64 i64 i64 p f32 i32 i32 i32 i32 i32 i32 p p i32',
                         None),                                      # wrapped in fused_recurrent.py
    'lm_gdn_varlen': ('p i64 p p p i64 i64 p p f32 p i64 i64 i64 p f32 p p p i32 i32 i32 i32 i32 i32 p p i32',
                      None),
    'lm_conv_decode_step': ('p i64 p i64 i64 p p i32 i32 i32 i32 p i32', None),
    'lm_ssd_step': ('p p p p p p p i32 i32 i32 i32 i32 i64 i64 i64 p i32', None),   # wrapped in mamba2_cpu.py
    'lm_selective_step': ('p p p p p p p i32 i32 i32 i64 i64 p i32', None),   # wrapped in mamba1_cpu.py
    'lm_rms_norm': ('p i64 i32 i64 p f32 i32 p i64 p i32', None),
    'lm_add_rms_norm': ('p p i64 i32 p f32 i32 p p i32', None),
    'lm_binary_f32': ('p p p i64 i32', None),     # the decode graph's replay (engine/decode_graph.py)
    'lm_qk_norm_rope_store': ('p i64 i32 i32 i32 i32 i32 p p f32 i32 f32 p p i32 p p p p i64 i64 i64 p p i64 i32 '
                              'i32', 'i32'),
    'lm_mla_decode': ('p p i64 i64 p i64 p f32 p p i32 p i64 i64 p p p i64 p i32 i32 i32 i32 i32 i32 i64 f32 p '
                      'i32', 'i32'),
    'lm_group_route': ('p i64 p i32 i32 i32 i32 i32 i32 f32 p p i32', None),
    'lm_relu2_experts': ('p i32 i32 i32 i32 p p p p i32 p p p p p i32', 'i32'),
    'lm_paged_decode_attention': ('p p p i64 i64 i64 p i64 p i32 i32 i32 i32 i32 i32 i64 f32 p i32', 'i32'),
    'lm_dsa_select': ('p p p i64 i64 p p i64 p i32 i32 i32 i32 i32 i32 i32 i64 f32 p p i32', 'i32'),  # dsa_decode.py
    'lm_dsa_attend': ('p p i64 i64 p i64 p p i32 i32 i32 i32 i32 i32 i32 i32 i64 f32 p i32', 'i32'),   # dsa_decode.py
}
_CTYPES = native_build.CTYPES
# -Wall -Wextra -Wmissing-prototypes: warnings (with real line numbers) surface when the source is
# edited; tests/test_cpu_native.py builds with -Werror so none is committed. -Wno-psabi: on a CPU
# without AVX-512, GCC notes that a 64-byte vector argument or result (the kernels' 16-float
# vectors) is passed differently from an AVX-512 build; every such function is static inside this
# one library, so no call ever crosses the two conventions and the note says nothing about this code
_FLAGS = ['-O3', '-march=native', '-fopenmp', '-shared', '-fPIC', '-std=gnu11', '-Wall', '-Wextra',
          '-Wmissing-prototypes', '-Wno-psabi']


def _source_text() -> str:
    """The C source and its header (what the library is built from)."""
    parts = []
    for path in (SOURCE, HEADER):
        with open(path) as f:
            parts.append(f.read())
    return '\0'.join(parts)


def _library_name() -> str:
    """File name of this source's library: it depends on the source, the flags and the CPU it is
    tuned for, not on which compiler built it."""
    key = hashlib.sha256('\0'.join([_source_text(), ' '.join(_FLAGS), platform.machine(), _cpu_flags()]).encode())
    return f'cpu_native_{key.hexdigest()[:20]}.so'


def compile_command(cc: str, out: str, extra: tuple[str, ...] = ()) -> list[str]:
    """The compiler command that builds :data:`SOURCE` into ``out`` (``extra`` flags last, e.g.
    ``-Werror`` in the tests)."""
    return [cc, *_FLAGS, *extra, '-I', SOURCE_DIR, SOURCE, '-o', out, '-lm']


def _compile(path: str) -> str | None:
    """Compile the source to ``path`` (:func:`~.native_build.compile_library`); the reason on
    failure, None on success."""
    return native_build.compile_library(path, compile_command, 'cpu_native_', 'native CPU kernels')


def _load(path: str) -> ctypes.CDLL:
    """Load ``path`` when it is a private file of this user's, its entry points bound
    (:func:`~.native_build.load_private`)."""
    return native_build.load_private(path, _ARGTYPES)


def _build() -> ctypes.CDLL | None:
    """The library from the first cache folder that has it or can build it
    (:func:`~.native_build.build_library`); None with the reasons logged once at INFO."""
    return native_build.build_library(_candidate_folders(), _library_name(), _compile, _load,
                                      'native CPU kernels', 'torch kernels run')


def native_library() -> ctypes.CDLL | None:
    """The loaded native library, built on the first call (thread-safe); ``None`` when it
    cannot be built or ``LMDEPLOY_CPU_KERNELS=0`` (decided once per process)."""
    global _LIB, _TRIED, _BCAST_MAX
    if not _TRIED:
        with _LOCK:
            if not _TRIED:
                try:
                    _LIB = _build()
                except Exception as err:   # noqa: BLE001  (never fail the engine over an optional speed-up)
                    logger.info('native CPU kernels unavailable (%s): torch kernels run', err)
                    _LIB = None
                _BCAST_MAX = _LIB.lm_bcast_rows_max() if _LIB is not None else 0
                _TRIED = True
    return _LIB


def native_available() -> bool:
    """Whether the native library is loaded (built on the first call): the availability check of
    the registry's native CPU implementations."""
    return native_library() is not None


def is_plain(t: torch.Tensor) -> bool:
    """Whether the native kernels may take `t`: float32 on CPU, not part of an autograd graph."""
    return t.dtype == torch.float32 and t.device.type == 'cpu' and not (torch.is_grad_enabled() and t.requires_grad)


def state_step_library(inputs: tuple[torch.Tensor, ...], state: torch.Tensor, shapes_ok: bool) -> ctypes.CDLL | None:
    """The library when a native decode step may run on ``inputs`` and ``state`` (the callers'
    common precondition), else None: the shapes agree (``shapes_ok``, the caller's check), every
    tensor :func:`is_plain`, the state has unit stride along its last dim (a view of the cache's
    rows is fine), and the library is built."""
    if not (shapes_ok and state.stride(-1) == 1 and is_plain(state) and all(is_plain(t) for t in inputs)):
        return None
    return native_library()


def matmul_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """``x @ weight^T`` by the native kernel, or ``None`` when it does not apply.

    Args:
        x: float32 ``[M, K]``, unit stride along K (any row stride).
        weight: float32 ``[N, K]``, unit stride along K.

    Returns:
        float32 ``[M, N]``, contiguous; ``None`` for other dtypes, devices, shapes or strides,
        inside autograd, or without the library.
    """
    if not (x.dim() == 2 and weight.dim() == 2 and is_plain(x) and is_plain(weight) and x.stride(1) == 1
            and weight.stride(1) == 1 and x.shape[1] == weight.shape[1]):
        return None
    lib = native_library()
    if lib is None:
        return None
    M, K = x.shape
    N = weight.shape[0]
    y = torch.empty(M, N, dtype=torch.float32)
    if M and N:
        CALLS['matmul_rows'] += 1
        lib.lm_matmul_rows(x.data_ptr(), M, K, x.stride(0), weight.data_ptr(), N, weight.stride(0), y.data_ptr(),
                           N, torch.get_num_threads())
    return y


def bcast_rows() -> range:
    """Row counts for which :func:`~.linear.linear` uses :func:`matmul_bcast`: ``25 ..
    lm_bcast_rows_max()`` (64) in a library built without AVX-512, empty with AVX-512 (measured on
    an AVX2 host only; MKL keeps those rows there) or without the library. Fixed per build, so
    every process on one host rounds these products alike."""
    native_library()
    return range(NATIVE_ROWS.stop, max(NATIVE_ROWS.stop, _BCAST_MAX + 1))


def matmul_bcast(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """``x @ weight^T`` by the native broadcast-form kernel (``lm_matmul_bcast`` in
    ``csrc/cpu_native.c``: x transposed once, blocks of 16 input rows x 6 weight rows, each
    element summed in k order within chunks of 64 columns, the chunk sums added in order; the
    order depends on nothing but K, so a row's result does not depend on the row count), or
    ``None`` when it does not apply.

    Args:
        x: float32 ``[M, K]``, unit stride along K (any row stride), ``M`` at most
            ``bcast_rows().stop - 1``.
        weight: float32 ``[N, K]``, unit stride along K.

    Returns:
        float32 ``[M, N]``, contiguous; ``None`` for other dtypes, devices, shapes or strides,
        more rows than the kernel takes (or an AVX-512 build), inside autograd, without the
        library, or when its scratch copy of ``x`` (``M`` rounded up to 16 x ``K`` floats) could
        not be allocated.
    """
    if not (x.dim() == 2 and weight.dim() == 2 and is_plain(x) and is_plain(weight) and x.stride(1) == 1
            and weight.stride(1) == 1 and x.shape[1] == weight.shape[1] and x.shape[0] and x.shape[1]
            and weight.shape[0]):
        return None
    lib = native_library()
    if lib is None or x.shape[0] > _BCAST_MAX:
        return None
    M, K = x.shape
    N = weight.shape[0]
    y = torch.empty(M, N, dtype=torch.float32)
    if lib.lm_matmul_bcast(x.data_ptr(), M, K, x.stride(0), weight.data_ptr(), N, weight.stride(0), y.data_ptr(),
                           N, torch.get_num_threads()) != 0:
        return None
    CALLS['matmul_bcast'] += 1
    return y


def _expert_layer_applies(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, first: torch.Tensor,
                          down: torch.Tensor) -> bool:
    """Whether a native expert layer runs: 1 to :data:`NATIVE_EXPERT_TOKENS` tokens, every tensor
    float32 on CPU outside autograd (the index int64 on CPU), and the library built."""
    return (1 <= x.shape[0] <= NATIVE_EXPERT_TOKENS and all(is_plain(t) for t in (x, weights, first, down))
            and index.dtype == torch.int64 and index.device.type == 'cpu' and native_library() is not None)


def _call_expert_layer(kernel: str, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                       first: torch.Tensor, down: torch.Tensor, inter: int, *act) -> torch.Tensor:
    """``lm_<kernel>`` over checked inputs (x ``[T, H]``, index and weights ``[T, k]``, ``first``
    ``[E, F, H]`` the experts' first product, ``down`` ``[E, H, inter]``, then the kernel's
    activation arguments ``act`` if any) with its scratch: the sorted positions, the sorted rows
    ``[T * k, H]``, the hidden rows ``[T * k, F]`` and the expert outputs ``[T * k, H]``; returns
    float32 ``[T, H]``.

    Raises:
        ValueError: an expert id out of range.
    """
    (T, H), topk, E, S = x.shape, index.shape[1], first.shape[0], index.numel()
    x, index, weights, first, down = (t.contiguous() for t in (x, index, weights, first, down))
    pos = torch.empty(S, dtype=torch.int64)
    xs = torch.empty(S, H, dtype=torch.float32)
    h = torch.empty(S, first.shape[1], dtype=torch.float32)
    ys = torch.empty(S, H, dtype=torch.float32)
    out = torch.empty(T, H, dtype=torch.float32)
    CALLS[kernel] += 1
    if getattr(native_library(), 'lm_' + kernel)(
            x.data_ptr(), T, H, inter, topk, index.data_ptr(), weights.data_ptr(), first.data_ptr(), down.data_ptr(),
            E, *act, pos.data_ptr(), xs.data_ptr(), h.data_ptr(), ys.data_ptr(), out.data_ptr(),
            torch.get_num_threads()) != 0:
        raise ValueError(f'expert index out of range [0, {E})')
    return out


def _swiglu_inter(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor) -> int:
    """The experts' intermediate width ``I`` of a SwiGLU expert layer's checked shapes.

    Raises:
        ValueError: shapes other than x ``[T, H]``, index and weights ``[T, k]`` (k >= 1),
            gate_up ``[E, 2I, H]``, down ``[E, H, I]``.
    """
    T, (E, two_i, H) = x.shape[0], gate_up.shape
    topk = index.shape[1] if index.dim() == 2 else 0
    if (x.shape != (T, H) or index.shape != (T, topk) or weights.shape != (T, topk) or not topk or two_i % 2
            or down.shape != (E, H, two_i // 2)):
        raise ValueError(f'expected x [T, H], index and weights [T, k], gate_up [E, 2I, H], down [E, H, I]; got '
                         f'{tuple(x.shape)}, {tuple(index.shape)}, {tuple(weights.shape)}, {tuple(gate_up.shape)}, '
                         f'{tuple(down.shape)}')
    return two_i // 2


def swiglu_experts_native(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                          down: torch.Tensor) -> torch.Tensor | None:
    """A whole MoE expert layer in one native call, or ``None`` when it does not apply.

    ``out[t] = sum_j weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t]))`` with
    ``e = index[t, j]``, summed over ``j`` in order (the order of the torch path).

    Args:
        x: ``[T, H]``.
        index: int64 ``[T, k]`` expert ids in ``[0, E)``.
        weights: ``[T, k]`` routing weights.
        gate_up: ``[E, 2I, H]`` gate rows first, then up rows.
        down: ``[E, H, I]``.

    Returns:
        float32 ``[T, H]``; ``None`` unless every tensor is float32 on CPU outside autograd,
        ``1 <= T <= NATIVE_EXPERT_TOKENS``, and the library is available.

    Raises:
        ValueError: an expert id out of range, or inconsistent shapes.
    """
    if not _expert_layer_applies(x, index, weights, gate_up, down):
        return None
    return _call_expert_layer('swiglu_experts', x, index, weights, gate_up, down,
                              _swiglu_inter(x, index, weights, gate_up, down))


#: ``act`` codes of :func:`limited_swiglu_experts_native` (the C enum's values)
LIMITED_SWIGLU_ACTS = {'clipped': 1, 'clamped': 2}


def limited_swiglu_experts_native(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                                  gate_up: torch.Tensor, down: torch.Tensor, act: str,
                                  limit: float) -> torch.Tensor | None:
    """A whole MoE layer of limited-SwiGLU experts (Ling 3, GLM-5.3-Flash) in one native call, or
    ``None`` when it does not apply.

    ``out[t] = sum_j weights[t, j] * down_e(a(gate_e(x[t]), up_e(x[t])))`` with ``e = index[t, j]``,
    summed over ``j`` in order with each product rounded first, where ``a`` is
    ``min(silu(g), limit) * clamp(u, -limit, limit)`` for ``act='clipped'`` (``limit = 0``: plain
    ``silu(g) * u``) and ``silu(min(g, limit)) * clamp(u, -limit, limit)`` for ``'clamped'``; a
    NaN stays NaN through the clamps, as in torch. The products sum as
    :func:`~.moe.limited_swiglu_experts_loop`'s do while no expert has more than
    :data:`NATIVE_ROWS` rows; ``silu`` is ``g / (1 + expf(-g))`` with the C library's ``expf``,
    which differs from torch's ``silu`` in the last bit for a few percent of inputs, so the layer
    equals the loop to float32 rounding (bit for bit given the same ``silu``).

    Args:
        x: ``[T, H]``.
        index: int64 ``[T, k]`` expert ids in ``[0, E)``.
        weights: ``[T, k]`` routing weights.
        gate_up: ``[E, 2I, H]`` gate rows first, then up rows.
        down: ``[E, H, I]``.
        act: ``'clipped'`` or ``'clamped'``.
        limit: the activation's limit.

    Returns:
        float32 ``[T, H]``; ``None`` unless every tensor is float32 on CPU outside autograd (the
        index int64 on CPU), ``1 <= T <= NATIVE_EXPERT_TOKENS``, and the library is available.

    Raises:
        ValueError: an unknown ``act``, an expert id out of range, or inconsistent shapes.
    """
    if act not in LIMITED_SWIGLU_ACTS:
        raise ValueError(f'act must be one of {sorted(LIMITED_SWIGLU_ACTS)}, got {act!r}')
    if not _expert_layer_applies(x, index, weights, gate_up, down):
        return None
    code = 0 if act == 'clipped' and not limit else LIMITED_SWIGLU_ACTS[act]
    return _call_expert_layer('limited_swiglu_experts', x, index, weights, gate_up, down,
                              _swiglu_inter(x, index, weights, gate_up, down), code, float(limit))


def relu2_experts_native(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, up: torch.Tensor,
                         down: torch.Tensor) -> torch.Tensor | None:
    """A whole MoE layer of non-gated relu^2 experts in one native call, or ``None`` when it does
    not apply.

    ``out[t] = sum_j weights[t, j] * down_e(relu(up_e(x[t]))^2)`` with ``e = index[t, j]``, summed
    over ``j`` in order. Each expert's rows are one run of a stable counting sort on the expert,
    as in :func:`swiglu_experts_native`; with at most 24 rows per expert (:data:`NATIVE_ROWS`)
    every product sums as :func:`~.linear.linear` does, so the result equals the per-expert
    torch loop (:func:`~.moe.relu2_experts_loop`) bit for bit; with more (a prompt of up to
    :data:`NATIVE_EXPERT_TOKENS` tokens) it equals it to float32 rounding (MKL sums those).

    Args:
        x: ``[T, H]``.
        index: int64 ``[T, k]`` expert ids in ``[0, E)``.
        weights: ``[T, k]`` routing weights.
        up: ``[E, I, H]``; down: ``[E, H, I]`` (no biases).

    Returns:
        float32 ``[T, H]``; ``None`` unless every tensor is float32 on CPU outside autograd (the
        index int64 on CPU), ``1 <= T <= NATIVE_EXPERT_TOKENS``, and the library is available.

    Raises:
        ValueError: an expert id out of range, or inconsistent shapes.
    """
    if not _expert_layer_applies(x, index, weights, up, down):
        return None
    T, (E, inter, H) = x.shape[0], up.shape
    topk = index.shape[1] if index.dim() == 2 else 0
    if (x.shape != (T, H) or index.shape != (T, topk) or weights.shape != (T, topk) or not topk
            or down.shape != (E, H, inter)):
        raise ValueError(f'expected x [T, H], index and weights [T, k], up [E, I, H], down [E, H, I]; got '
                         f'{tuple(x.shape)}, {tuple(index.shape)}, {tuple(weights.shape)}, {tuple(up.shape)}, '
                         f'{tuple(down.shape)}')
    return _call_expert_layer('relu2_experts', x, index, weights, up, down, inter)


def delta_step_native(kq: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor,
                      state: torch.Tensor) -> torch.Tensor | None:
    """One decode token of the gated delta rule (a decay per head) or of Kimi Delta Attention (a
    decay per key channel) for ``N`` sequences, the state updated in place, or ``None`` when the
    native kernel does not apply (the caller runs torch).

    ``S <- diag(a) S + k delta^T`` with ``delta = beta (v - (diag(a) S)^T k)``; the output
    ``(diag(a) S)^T q + (q . k) delta`` equals ``q`` read against the updated state (gated delta
    rule: Yang, Kautz, Hatamizadeh, "Gated Delta Networks", ICLR 2025, eq. 10; its per-channel
    form: Kimi Team, "Kimi Linear", 2025).

    Args:
        kq: float32 ``[N, H, 2, dk]``: L2-normalised key, then the scaled query.
        v: ``[N, H, dv]``.
        decay: state multipliers ``a = exp(g)``: ``[N, H]`` (per head) or ``[N, H, dk]`` (per key
            channel).
        beta: ``[N, H]`` write strengths.
        state: float32 ``[N, H, dk, dv]`` with unit stride along ``dv`` (a view of the cache's
            rows is fine); updated in place.

    Returns:
        float32 ``o [N, H, dv]``, or ``None`` (dtype, device, shapes, strides, autograd, or no
        library).
    """
    if state.dim() != 4:
        return None
    N, H, dk, dv = state.shape
    per_channel = decay.dim() == 3
    lib = state_step_library((kq, v, decay, beta), state, kq.shape == (N, H, 2, dk) and v.shape == (N, H, dv)
                             and beta.shape == (N, H) and decay.shape == ((N, H, dk) if per_channel else (N, H)))
    if lib is None:
        return None
    kq, v, decay, beta = (t.contiguous() for t in (kq, v, decay, beta))
    out = torch.empty(N, H, dv, dtype=torch.float32)
    if N and H:
        CALLS['kda_step' if per_channel else 'gated_delta_step'] += 1
        lib.lm_delta_step(kq.data_ptr(), v.data_ptr(), decay.data_ptr(), int(per_channel), beta.data_ptr(),
                          state.data_ptr(), N, H, dk, dv, state.stride(0), state.stride(1), state.stride(2),
                          out.data_ptr(), torch.get_num_threads())
    return out


def conv_decode_step_native(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                            silu: bool) -> torch.Tensor | None:
    """One decode token of a depthwise causal convolution for ``N`` sequences, the window
    state updated in place, or ``None`` when the native kernel does not apply.

    Args:
        x: float32 ``[N, C]`` (unit stride along C).
        state: float32 ``[N, C, K - 1]``, the last ``K - 1`` inputs per channel, unit stride
            along the window (a view of the cache's rows is fine); becomes the window shifted
            by ``x``.
        weight: float32 ``[C, K]``; bias: float32 ``[C]`` or ``None``.
        silu: apply ``y * sigmoid(y)``.

    Returns:
        float32 ``y [N, C]``, or ``None`` (dtype, device, strides, autograd, or no library).
    """
    N, C = x.shape
    K = weight.shape[1]
    tensors = (x, state, weight) + (() if bias is None else (bias,))
    if not (all(is_plain(t) for t in tensors) and x.stride(1) == 1 and state.shape == (N, C, K - 1)
            and (K == 1 or state.stride(2) == 1) and weight.shape == (C, K) and (bias is None or bias.shape == (C,))):
        return None
    lib = native_library()
    if lib is None:
        return None
    weight = weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    y = torch.empty(N, C, dtype=torch.float32)
    if N and C:
        CALLS['conv_decode_step'] += 1
        lib.lm_conv_decode_step(x.data_ptr(), x.stride(0), state.data_ptr(), state.stride(0), state.stride(1),
                                weight.data_ptr(), None if bias is None else bias.data_ptr(), N, C, K, int(silu),
                                y.data_ptr(), torch.get_num_threads())
    return y


def rms_norm_native(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool,
                    gate: torch.Tensor | None = None) -> torch.Tensor | None:
    """Root-mean-square norm (Zhang & Sennrich, 2019) over the last dim in one native pass, or
    ``None`` when it does not apply.

    ``h = x / sqrt(mean(x^2) + eps)``; the result is ``h * (1 + weight)`` when ``zero_centered``
    (Qwen3-Next's stored ``w - 1``), else ``weight * h``; times ``silu(gate)`` when a gate is given
    (the gated norm of Gated DeltaNet's output).

    Args:
        x: float32 ``[..., D]``.
        weight: float32 ``[D]``.
        eps: added to the mean square.
        zero_centered: the weight convention above.
        gate: float32, the shape of ``x``, or ``None``.

    Returns:
        float32 tensor of ``x``'s shape (contiguous), or ``None`` (dtype, device, autograd, shape,
        or no library).
    """
    D = x.shape[-1]
    if not (x.dim() >= 1 and D and weight.shape == (D,) and is_plain(x) and is_plain(weight)
            and (gate is None or (gate.shape == x.shape and is_plain(gate)))):
        return None
    lib = native_library()
    if lib is None:
        return None
    x2 = x.reshape(-1, D)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    g2 = None
    if gate is not None:
        g2 = gate.reshape(-1, D)
        if g2.stride(1) != 1:
            g2 = g2.contiguous()
    weight = weight.contiguous()
    out = torch.empty(x.shape, dtype=torch.float32)
    if x2.shape[0]:
        CALLS['rms_norm'] += 1
        lib.lm_rms_norm(x2.data_ptr(), x2.shape[0], D, x2.stride(0), weight.data_ptr(), eps, int(zero_centered),
                        None if g2 is None else g2.data_ptr(), 0 if g2 is None else g2.stride(0), out.data_ptr(),
                        torch.get_num_threads())
    return out


def paged_decode_attention_native(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  block_table: torch.Tensor, kv_seqlens: torch.Tensor,
                                  scale: float) -> torch.Tensor | None:
    """One query token per sequence against its paged keys (softmax attention with an online
    softmax, Milakov & Gimelshein, "Online normalizer calculation for softmax", 2018), or
    ``None`` when the native kernel does not apply.

    Args:
        q: float32 ``[N, H, D]``.
        k_cache, v_cache: float32 ``[num_blocks, block_size, Hkv, D]`` with unit stride along D
            and equal strides (views into the cache's byte rows are fine).
        block_table: int64 ``[N, W]``; kv_seqlens: int64 ``[N]``, each in ``[1, W * block_size]``.
        scale: softmax scale.

    Returns:
        float32 ``[N, H, D]``, or ``None`` (dtype, device, strides, shapes, or no library).

    Raises:
        ValueError: a ``kv_seqlens`` entry outside ``[1, W * block_size]``, or a block id outside
            ``[0, num_blocks)`` among the blocks the lengths reach.
    """
    N, H, D = q.shape
    nb, bs, Hkv, Dk = k_cache.shape
    if not (all(is_plain(t) for t in (q, k_cache, v_cache)) and Dk == D and v_cache.shape == k_cache.shape
            and k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1 and Hkv and H % Hkv == 0
            and block_table.dtype == kv_seqlens.dtype == torch.int64 and block_table.dim() == 2
            and block_table.shape[0] == N and kv_seqlens.shape == (N,) and block_table.device.type == 'cpu'
            and kv_seqlens.device.type == 'cpu'):
        return None
    lib = native_library()
    if lib is None:
        return None
    q, block_table, kv_seqlens = q.contiguous(), block_table.contiguous(), kv_seqlens.contiguous()
    out = torch.empty(N, H, D, dtype=torch.float32)
    CALLS['paged_decode_attention'] += bool(N)
    status = N and lib.lm_paged_decode_attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                                 k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                                                 block_table.data_ptr(), block_table.stride(0), kv_seqlens.data_ptr(),
                                                 N, H, Hkv, D, bs, block_table.shape[1], nb, scale, out.data_ptr(),
                                                 torch.get_num_threads())
    if status == -1:
        raise ValueError(f'kv_seqlens must be in [1, {block_table.shape[1] * bs}]; got {kv_seqlens.tolist()}')
    if status == -2:
        raise ValueError(f'block_table holds a block id outside [0, {nb}) within kv_seqlens')
    return out
