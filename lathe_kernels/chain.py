"""Lathe's own fixed-order products for a decode step's few rows and its attention (CPU, fp32): ``chain.c``, built
with the machine's C compiler on first use and loaded with ctypes.

    chain_matmul(x, w, block) -> y
      x: [M, K] fp32 (rows contiguous); w: [K, N] fp32 (any strides)
      y[i, j] = sum_k x[i, k] * w[k, j]: k cut into blocks of ``block``, each block one fused multiply-add
      chain from zero in k order, the block sums added in order                           -> y: [M, N] fp32

    chain_lora(x, a, b, scale, block) -> d             (a LoRA correction of a few rows in one call)
      x: [M, K]; a: [R, K]; b: [N, R]; all fp32
      d = chain_matmul(chain_matmul(x, a.T) * scale, b.T), the scaling rounded to fp32   -> d: [M, N] fp32
    chain_lora_segments(x, [(r0, rows, a, b, scale, block), ...], N) -> d   (a decode step's adapters in one call)
      d[r0:r0+rows] = chain_lora(x[r0:r0+rows], a, b, scale, block) per segment, 0 elsewhere  -> d: [T, N] fp32

    chain_linear(x, weight, block, segments) -> y   (a decode step's linear and its adapters' corrections in one call)
      weight: [N, K] (a linear's); y = chain_matmul(x, weight.T, block) + chain_lora_segments(x, segments, N), one
      rounding of the sum; no segments: the product alone                               -> y: [M, N] fp32
    chain_linears(x, [(weight, block, segments, panels), ...]) -> [y, ...]   (a decode layer's q, k, v in one call)
      each y the chain_linear of its job, with the bits of its own call                -> one [M, N_j] fp32 a job

    (and ``lathe_rope``, RoPE in one call, for ``lathe.kernels.rotary``)

    attention_scores(q, k, positions, scale, block, table=None) -> x   (invariant decode attention, before its exp)
      q: [S, Hq, D]; k: [S, N, Hkv, D]; positions: [S] int64; g = Hq // Hkv; C = N // KEY_CHUNK
      or k: a paged cache's blocks [B, 64, Hkv, D] and table: [S, C] int64 block ids (chunk c of s is block
      table[s, c], read in place)
      x[s, h, c, r, j] = chain(scale * q[s, h * g + r], k[s, c * 64 + j, h]) - max over the row's visible keys,
      -inf where c * 64 + j > positions[s]                                          -> x: [S, Hkv, C, g, 64] fp32
    attention_values(p, den, v, positions, block, table=None) -> o   (and after them; v laid out as k)
      p: [S, Hkv, C, g, 64] (exp(x)); den: [S, Hkv, C, g] (p summed over its 64 keys); v: [S, N, Hkv, D]
      o[s, h * g + r] = (sum over c in order of chain(p[s, h, c, r], v[s, chunk c, h])) / (sum over c of den)
                                                                                     -> o: [S, Hq, D] fp32
      Chunks wholly past positions[s] are not computed: they add exact zeros, as they do in the library's products.

Why: an invariant ``linear`` gives a row the bits of its reference tile, and the kernel library computes a row of
one or two rows with other bits, so a lone decode row was zero-padded to a tile of four, for which the library
packs the whole weight again (a third of a single-sequence decode step, measured under MKL's AVX2 path). Where the
library's tile computes each element in the order above (MKL's AVX2 sgemm does, with blocks of 192), this kernel
gives the lone row the same bits reading each weight once. Whether it does on a machine is never assumed: a pool's
trial admits a block only where every row of every weight it runs comes out bitwise equal to the reference tile
(``lathe.models.tiles.choose_chain``), and an unadmitted machine, or one without a C compiler, runs as before.

Decode attention's products are as small, and each library call of them woke the library's threads (a third of a
single-sequence decode token); the library computes them in the same order, so the attention calls run a layer's
products in two calls, reading a paged cache's blocks in place.

Who owns what: this module owns the build (a cache directory, one library per source, compiler flags and CPU) and
the calls; ``lathe.kernels.ops.direct_matmul`` decides which rows come here (``Ladder.chain``), and
``lathe.kernels.attention.decode_attention`` whether its products do (``Decoder.attn_chain``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("chain.c")

FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC")
"""How the library is built: vectorized for this CPU (fused multiply-adds are exact at any width), and no
contraction of the block sums' separate adds into fused ones."""

BLOCKS = (64, 96, 128, 192, 256, 320, 384, 512)
"""K-blocks a pool's trial tries, in this order (``lathe.models.tiles.choose_chain``); the calls refuse a larger one
(no library measured blocks by more)."""

THREADED_FLOPS = 1 << 17
"""Fewest multiply-adds of a product that runs on torch's threads; a smaller one (a LoRA shrink) stays on one, as
an OpenMP region costs more than its arithmetic (the bits do not depend on the thread count)."""


def cache_dir() -> Path:
    """Where built libraries are kept: ``$LATHE_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/lathe/kernels`` (``~/.cache``
    when unset)."""
    if os.environ.get("LATHE_KERNEL_CACHE"):
        return Path(os.environ["LATHE_KERNEL_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lathe" / "kernels"


def _cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((line for line in text.splitlines() if line.startswith("flags")), "")


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The built library, compiled once per source, flags and CPU into ``cache_dir`` (written under a temporary
    name and renamed, so processes building at once never load a partial file); None where that fails."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.warning("lathe.kernels.chain: no C compiler (CC or cc); lone decode rows keep the padded tile")
        return None
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, " ".join(FLAGS).encode(), _cpu_flags().encode(),
                                     compiler.encode()])).hexdigest()[:16]
    built = cache_dir() / f"chain-{key}.so"
    try:
        if not built.exists():
            built.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=built.parent) as tmp:
                out = Path(tmp) / built.name
                subprocess.run([compiler, *FLAGS, "-o", str(out), str(SOURCE), "-lm"], check=True,
                               capture_output=True, timeout=120)
                os.replace(out, built)
        lib = ctypes.CDLL(str(built))
        ptr, stride, count = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
        for fn in (lib.lathe_chain_matmul, lib.lathe_chain_lora, lib.lathe_chain_lora_segments, lib.lathe_chain_linears,
                   lib.lathe_chain_attention_scores, lib.lathe_chain_attention_values, lib.lathe_rope):
            fn.restype = None
        lib.lathe_chain_has_panels.restype = ctypes.c_int
    except (OSError, subprocess.SubprocessError, AttributeError) as e:
        detail = getattr(e, "stderr", b"") or b""
        log.warning("lathe.kernels.chain: building %s failed (%s %s); lone decode rows keep the padded tile",
                    SOURCE.name, e, detail.decode(errors="replace")[-400:])
        return None
    lib.lathe_chain_matmul.argtypes = [ptr, stride, ptr, stride, stride, ptr, count, count, count, count, count]
    lib.lathe_chain_lora.argtypes = [ptr, stride, ptr, stride, stride, ptr, stride, stride, ctypes.c_float, ptr, ptr,
                                     count, count, count, count, count, count]
    longs, floats = ctypes.POINTER(ctypes.c_long), ctypes.POINTER(ctypes.c_float)
    lib.lathe_chain_lora_segments.argtypes = [ptr, stride, longs, floats, ptr, ptr, count, count, count, count, count]
    lib.lathe_chain_attention_scores.argtypes = [ptr, stride, stride, ptr, ptr, stride, stride, stride, ptr,
                                                 ctypes.c_float, ptr, *[count] * 7]
    lib.lathe_chain_attention_values.argtypes = [ptr, ptr, ptr, ptr, stride, stride, stride, ptr, ptr, stride, stride,
                                                 *[count] * 7]
    lib.lathe_chain_linears.argtypes = [ptr, stride, count, count, count, longs]
    lib.lathe_rope.argtypes = [ptr, stride, stride, ptr, ptr, ptr, count, count, count]
    return lib


def available() -> bool:
    """Whether the library builds and loads on this machine."""
    return _library() is not None


def _lib(block: int, dims: int, *operands: torch.Tensor) -> ctypes.CDLL:
    """The library, after checking the block and that every operand is a ``dims``-d fp32 CPU tensor."""
    lib = library()
    if not 0 < block <= BLOCKS[-1]:
        raise ValueError(f"lathe.kernels.chain: block must be in [1, {BLOCKS[-1]}], got {block}")
    for t in operands:
        if t.dtype != torch.float32 or not t.is_cpu or t.dim() != dims:
            raise TypeError(f"lathe.kernels.chain takes {dims}-d fp32 CPU tensors, got {t.dtype} "
                            f"{list(t.shape)} on {t.device}")
    return lib


def library() -> ctypes.CDLL:
    """The built library (``lathe.kernels.rotary`` calls it too); RuntimeError where it does not build here."""
    lib = _library()
    if lib is None:
        raise RuntimeError("lathe.kernels.chain is not available on this machine (see the log for why)")
    return lib


def _checked(x: torch.Tensor, block: int, *weights: torch.Tensor) -> tuple[ctypes.CDLL, torch.Tensor]:
    """The library and ``x`` with contiguous rows, after ``_lib``'s checks of 2-d operands."""
    return _lib(block, 2, x, *weights), x if x.stride()[1] == 1 else x.contiguous()


def _threads(flops: int) -> int:
    return torch.get_num_threads() if flops >= THREADED_FLOPS else 1


def chain_matmul(x: torch.Tensor, w: torch.Tensor, block: int) -> torch.Tensor:
    """y = x @ w in the fixed order of the module docstring; x [M, K], w [K, N], both fp32 on the CPU -> [M, N].
    ``x``'s rows are made contiguous if they are not; ``w`` is read in place whatever its strides."""
    lib, x = _checked(x, block, w)
    (m, k), n = x.shape, w.shape[1]
    if w.shape[0] != k:
        raise ValueError(f"chain_matmul: x is [{m}, {k}] but w is {list(w.shape)}")
    y = torch.empty(m, n, dtype=torch.float32)
    lib.lathe_chain_matmul(x.data_ptr(), x.stride(0), w.data_ptr(), w.stride(0), w.stride(1), y.data_ptr(),
                           m, k, n, block, _threads(m * k * n))
    return y


def chain_lora(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, block: int) -> torch.Tensor:
    """d = ((x @ a.T) * scale) @ b.T in one call, each product in the fixed order of the module docstring; x [M, K],
    a [R, K], b [N, R], all fp32 on the CPU -> [M, N]."""
    lib, x = _checked(x, block, a, b)
    (m, k), (r, n) = x.shape, (a.shape[0], b.shape[0])
    if a.shape[1] != k or b.shape[1] != r:
        raise ValueError(f"chain_lora: x is [{m}, {k}], a {list(a.shape)}, b {list(b.shape)}")
    v, y = torch.empty(m, r, dtype=torch.float32), torch.empty(m, n, dtype=torch.float32)
    lib.lathe_chain_lora(x.data_ptr(), x.stride(0), a.data_ptr(), a.stride(1), a.stride(0), b.data_ptr(),
                         b.stride(1), b.stride(0), scale, v.data_ptr(), y.data_ptr(), m, k, r, n, block,
                         _threads(m * r * n))
    return y


Segment = tuple[int, int, torch.Tensor, torch.Tensor, float, int]
"""(first row, rows, a [R, K], b [N, R], scale, block): one adapter's rows of a ``chain_lora_segments`` call."""


def _segment_table(segments: list[Segment], t: int, k: int, n: int, where: str
                   ) -> tuple[ctypes.Array, ctypes.Array, int, int]:
    """The C table of ``segments`` over ``t`` rows of ``k`` inputs and ``n`` outputs (10 longs a segment, as
    ``chain.c`` reads them), their scales, the rows they cover and the widest rank; refused, naming ``where``, when
    a segment does not fit or they are not in row order and disjoint."""
    table: list[int] = []
    end = covered = widest = 0
    for r0, rows, a, b, _, block in segments:
        if r0 < end:
            raise ValueError(f"{where}: the segment at row {r0} starts before row {end}, where the one before it "
                             "ends (segments go in row order, disjoint)")
        end = r0 + rows
        (rank, ka), (nb, rb) = a.shape, b.shape
        if r0 < 0 or rows < 1 or end > t or ka != k or nb != n or rb != rank or block < 1:
            raise ValueError(f"{where}: segment at row {r0} of {rows} rows with a {list(a.shape)}, b "
                             f"{list(b.shape)} does not fit x [{t}, {k}] -> [{t}, {n}]")
        sa, sb = a.stride(), b.stride()
        table += (r0, rows, rank, block, a.data_ptr(), sa[1], sa[0], b.data_ptr(), sb[1], sb[0])
        covered, widest = covered + rows, max(widest, rank)
    scales = (ctypes.c_float * len(segments))(*[segment[4] for segment in segments])
    return (ctypes.c_long * len(table))(*table), scales, covered, widest


def chain_lora_segments(x: torch.Tensor, segments: list[Segment], n: int) -> torch.Tensor:
    """Every segment's ``chain_lora`` in one call: y[r0:r0 + rows] = chain_lora(x[r0:r0 + rows], a, b, scale, block)
    for each segment (the segments disjoint, in row order), zeros in rows of no segment; x [T, K] -> y [T, n]. A
    segment's bits are ``chain_lora``'s for it alone (several segments run one a thread; a lone one shares its
    expand's columns over the threads, as ``chain_lora`` does)."""
    lib, x = _checked(x, max(blk for *_, blk in segments), *(t for s in segments for t in s[2:4]))
    t, k = x.shape
    table, scales, covered, widest = _segment_table(segments, t, k, n, "chain_lora_segments")
    v = torch.empty(t, widest, dtype=torch.float32)
    y = torch.empty(t, n, dtype=torch.float32) if covered == t else torch.zeros(t, n, dtype=torch.float32)
    lib.lathe_chain_lora_segments(x.data_ptr(), x.stride(0), table, scales, v.data_ptr(), y.data_ptr(), len(segments),
                                  k, n, widest, _threads(covered * widest * n))
    return y


PANEL = 16
"""Columns of a weight panel (``pack_panels``; ``chain.c``'s register panels)."""


def has_panels() -> bool:
    """Whether the library runs products over ``pack_panels`` copies here (built with AVX2 and FMA)."""
    lib = _library()
    return lib is not None and bool(lib.lathe_chain_has_panels())


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """A linear's weight [N, K] (fp32) as panels [ceil(N / PANEL), K, PANEL]: panel q holds columns q * PANEL onwards
    of x @ weight.T, each of its K rows contiguous, zeros past N (``chain_linear``'s ``panels``)."""
    n, k = weight.shape
    padded = torch.nn.functional.pad(weight.float(), (0, 0, 0, -n % PANEL))
    return padded.view(-1, PANEL, k).transpose(1, 2).contiguous()


Job = tuple[torch.Tensor, int, list[Segment], torch.Tensor | None]
"""(weight, block, segments, panels): one linear of a ``chain_linears`` call, as ``chain_linear`` takes them."""


def chain_linear(x: torch.Tensor, weight: torch.Tensor, block: int, segments: list[Segment],
                 panels: torch.Tensor | None = None) -> torch.Tensor:
    """A linear and its LoRA corrections in one call: y = chain_matmul(x, weight.T, block) + chain_lora_segments(x,
    segments, N), the sum rounded once per element (as the decoder adds a correction); x [M, K], weight [N, K] (a
    linear's, any strides) -> [M, N]. With no segments, ``chain_matmul`` alone (nothing is added). ``panels``
    (``pack_panels(weight)``, where ``has_panels``): the product reads those instead, the same chains in an order of
    memory that streams (several rows of a decode step read each panel once)."""
    return chain_linears(x, [(weight, block, segments, panels)])[0]


def chain_linears(x: torch.Tensor, jobs: list[Job]) -> list[torch.Tensor]:
    """Several linears of the same rows in one call (a decode layer's q, k and v): [chain_linear(x, weight, block,
    segments, panels) for each job], each with the bits of its own call; x [M, K] -> one [M, N_j] per job."""
    lib, x = _checked(x, max(job[1] for job in jobs), *[job[0] for job in jobs])
    m, k = x.shape
    args: list[int] = []
    keep: list[object] = []  # the tables and buffers the call reads, alive until it returns
    ys = []
    for weight, block, segments, panels in jobs:
        n = weight.shape[0]
        if weight.shape[1] != k:
            raise ValueError(f"chain_linear: x is [{m}, {k}] but the weight is {list(weight.shape)}")
        if panels is not None and (panels.shape != (-(-n // PANEL), k, PANEL) or panels.dtype != torch.float32
                                   or not panels.is_contiguous()):
            raise ValueError(f"chain_linear: panels {list(panels.shape)} ({panels.dtype}) are not pack_panels of a "
                             f"weight {list(weight.shape)}")
        y = torch.empty(m, n, dtype=torch.float32)
        ys.append(y)
        table = scales = v = d = 0
        widest, lora_threads = 0, 1
        if segments:
            _lib(max(block, *[segment[5] for segment in segments]), 2, *[t for s in segments for t in s[2:4]])
            ctable, cscales, covered, widest = _segment_table(segments, m, k, n, "chain_linear")
            scratch = torch.empty(m * (widest + n), dtype=torch.float32)  # v [M, widest], then d [M, N]
            keep += (ctable, cscales, scratch)
            table, scales = ctypes.addressof(ctable), ctypes.addressof(cscales)
            v = scratch.data_ptr()
            d, lora_threads = v + 4 * m * widest, _threads(covered * widest * n)
        ws = weight.stride()
        args += (weight.data_ptr(), ws[1], ws[0], 0 if panels is None else panels.data_ptr(), y.data_ptr(), n, block,
                 _threads(m * k * n), table, scales, v, d, len(segments), widest, lora_threads)
    lib.lathe_chain_linears(x.data_ptr(), x.stride()[0], m, k, len(jobs), (ctypes.c_long * len(args))(*args))
    return ys


KEY_CHUNK = 64
"""Keys per chunk of the attention calls (``lathe.kernels.attention.KEY_CHUNK``, fixed in ``chain.c``)."""

MAX_HEAD = 512
"""Widest attention head the attention calls take (``chain.c``'s scratch)."""


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride()[-1] == 1 else t.contiguous()


def _long(name: str, t: torch.Tensor) -> torch.Tensor:
    if t.dtype != torch.long or not t.is_contiguous() or not t.is_cpu:
        raise ValueError(f"lathe.kernels.chain attention: {name} must be a contiguous int64 CPU tensor, got "
                         f"{t.dtype} on {t.device}")
    return t


def _layout(kv: torch.Tensor, positions: torch.Tensor, table: torch.Tensor | None) -> tuple[int, int, int, int]:
    """(S, Hkv, D, C) of keys or values ``kv``: [S, N, Hkv, D] without a table, [blocks, 64, Hkv, D] with
    ``table [S, C]``; and the checks that they fit ``positions [S]``."""
    rows, hkv, d = kv.shape[1:]
    s, chunks = (kv.shape[0], rows // KEY_CHUNK) if table is None else (table.shape[0], table.shape[-1])
    if (rows % KEY_CHUNK if table is None else rows != KEY_CHUNK or table.dim() != 2) or d > MAX_HEAD:
        raise ValueError(f"lathe.kernels.chain attention: keys/values {list(kv.shape)} must be [S, N, Hkv, D] with N "
                         f"whole chunks of {KEY_CHUNK}, or blocks [B, {KEY_CHUNK}, Hkv, D] with a table [S, C], and "
                         f"D <= {MAX_HEAD}")
    if positions.shape != (s,):
        raise ValueError(f"lathe.kernels.chain attention: positions {list(positions.shape)} for {s} sequences")
    _long("positions", positions)
    if table is not None:
        _long("table", table)
    return s, hkv, d, chunks


def _in_place(kv: torch.Tensor, table: torch.Tensor | None) -> tuple[int | None, int, int, int]:
    """The table pointer (None: one buffer per sequence) and the chunk, row and head strides of ``kv``."""
    return (None if table is None else table.data_ptr()), kv.stride(0), kv.stride(1), kv.stride(2)


def _attention_threads(s: int, hkv: int, g: int, d: int, chunks: int) -> int:
    return _threads(s * hkv * g * d * chunks * KEY_CHUNK)


def attention_scores(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, scale: float, block: int,
                     table: torch.Tensor | None = None) -> torch.Tensor:
    """Invariant decode attention's scores less each row's max (the module docstring); q [S, Hq, D], k [S, N, Hkv,
    D] (or a paged cache's blocks [B, 64, Hkv, D] with ``table [S, C]`` of block ids), positions [S] int64 ->
    x [S, Hkv, C, g, 64]."""
    lib = _lib(block, 3, q)
    _lib(block, 4, k)
    q, k = _rows(q), _rows(k)
    s, hkv, d, chunks = _layout(k, positions, table)
    g = q.shape[1] // hkv
    if q.shape != (s, g * hkv, d) or g == 0:
        raise ValueError(f"attention_scores: q {list(q.shape)} does not fit keys {list(k.shape)}")
    x = torch.empty(s, hkv, chunks, g, KEY_CHUNK, dtype=torch.float32)
    lib.lathe_chain_attention_scores(q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), *_in_place(k, table),
                                     positions.data_ptr(), scale, x.data_ptr(), s, hkv, g, d, chunks, block,
                                     _attention_threads(s, hkv, g, d, chunks))
    return x


def attention_values(p: torch.Tensor, den: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, block: int,
                     table: torch.Tensor | None = None) -> torch.Tensor:
    """Invariant decode attention's output from its probabilities (the module docstring); p [S, Hkv, C, g, 64],
    den [S, Hkv, C, g], v [S, N, Hkv, D] (or blocks and ``table`` as ``attention_scores``), positions [S] int64 ->
    o [S, Hq, D]."""
    lib = _lib(block, 4, v, den)
    _lib(block, 5, p)
    v = _rows(v)
    s, hkv, d, chunks = _layout(v, positions, table)
    g = p.shape[3]
    if p.shape != (s, hkv, chunks, g, KEY_CHUNK) or den.shape != p.shape[:4]:
        raise ValueError(f"attention_values: p {list(p.shape)} and den {list(den.shape)} do not fit values "
                         f"{list(v.shape)}")
    p, den = p.contiguous(), den.contiguous()
    o = torch.empty(s, hkv * g, d, dtype=torch.float32)
    lib.lathe_chain_attention_values(p.data_ptr(), den.data_ptr(), v.data_ptr(), *_in_place(v, table),
                                     positions.data_ptr(), o.data_ptr(), o.stride(0), o.stride(1), s, hkv, g, d,
                                     chunks, block, _attention_threads(s, hkv, g, d, chunks))
    return o
