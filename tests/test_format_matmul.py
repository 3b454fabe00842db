"""The product API of every native GGUF format (kernels/cpu/format_matmul.h) against gguf's dequantizer.

Packed tiles dequantize to gguf's float32 weights rounded to bf16; both kernels (the dispatched
one, SIMD where the build has it, and the portable C twin) are within float32 accumulation's
error of a float64 product of those weights; a row's bits do not depend on its batch, the rows
beside it or the thread split; and bad formats or shapes are refused with nothing written."""

from __future__ import annotations

import ctypes

import gguf
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixrt.benchmarks.gguf_models import _random_blocks
from radixrt.kernels import cpu
from radixrt.kernels.cpu.format_matmul import FORMATS, FormatMatmul, FormatWeight, format_matmul
from radixrt.kernels.cpu.formats import BLOCKS

K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
NATIVE = ("Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1")  # format_layout.h's own kernels
DELEGATED = ("Q4_0", "Q4_1", "Q8_0")  # quantized_matmul.c's


@pytest.fixture(scope="module")
def kernels() -> FormatMatmul:
    built = format_matmul()
    if built is None:
        pytest.skip("no C compiler: the CPU kernels cannot be built")
    return built


def random_blocks(name: str, num_rows: int, num_cols: int, rng: np.random.Generator) -> np.ndarray:
    """Valid file rows: K-quants as random codes and sub-block scales with small finite fp16
    scales; the 32-element formats quantized from normal values by gguf."""
    qtype = gguf.GGMLQuantizationType[name]
    if name in K_QUANTS:
        return np.ascontiguousarray(_random_blocks(qtype, (num_rows, num_cols), rng))
    values = rng.standard_normal((num_rows, num_cols)).astype(np.float32)
    return np.ascontiguousarray(gguf.quants.quantize(values, qtype))


def dense_weight(name: str, blocks: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[name]))


def bf16_bits(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).view(torch.int16)


def error_bound(name: str, x: torch.Tensor, dense: torch.Tensor, file_rows: np.ndarray,
                integer_inputs: bool = False) -> torch.Tensor:
    """4 K 2^-24 sum |w x| per output (float32 accumulation over K terms). The delegated formats'
    kernel may round each input to an integer of its group's step max|x| / 32639 or finer first
    (tests/test_quantized_matmul.py): that moves a product by half a step times |d q| per term,
    |d q| <= 15 |d| (4-bit) or 128 |d| (8-bit), d the fp16 scale each of their blocks begins with.
    With `integer_inputs` (kquant_matmul_avx2.c) each input is rounded to an integer of step
    max|x| / 32767, within 0.51 step, and the product moves by that times |w| per term."""
    xd = x.double()
    bound = 4 * x.shape[1] * 2.0**-24 * (xd.abs() @ dense.double().abs().t())
    if name in DELEGATED:
        d = np.abs(file_rows.reshape(file_rows.shape[0], -1, BLOCKS[FORMATS[name]][1])[..., :2].copy().view(np.float16))
        codes = torch.from_numpy(d[..., 0].astype(np.float64) * (128 if name == "Q8_0" else 15)).repeat_interleave(32, 1)
        step = xd.abs().reshape(xd.shape[0], -1, 32).amax(-1) / 32639
        bound += 1e-5 * (xd.abs() @ dense.double().abs().t()) + (0.5001 * step).repeat_interleave(32, 1) @ codes.t()
    elif integer_inputs:
        moves = 0.51 * xd.abs().reshape(xd.shape[0], -1, 32).amax(-1) / 32767
        bound += moves.repeat_interleave(32, 1) @ dense.double().abs().t()
    return bound


def integer_inputs(name: str, portable: bool) -> bool:
    """True where the kernel run rounds inputs to 16-bit integers: the dispatched K-quant kernel
    of an AVX2 or AVX-512 build (kquant_matmul_avx2.c, kquant_matmul_avx512.c)."""
    library = cpu.load_library()
    return name in NATIVE and not portable and library is not None and cpu.isa() in ("avx2", "avx512")


def kernel_variants(name: str) -> list[bool]:
    """portable flags to test: the delegated formats' kernels are tests/test_quantized_matmul.py's
    to compare (their dispatched one runs here, where the library has one)."""
    if name in DELEGATED:
        return [False] if cpu.quantized_matmul() is not None else []
    return [False, True]


formats = st.sampled_from(NATIVE + DELEGATED)


@settings(max_examples=40, deadline=None)
@given(name=formats, tiles=st.integers(1, 4), blocks=st.integers(1, 3), seed=st.integers(0, 2**16),
       first=st.integers(0, 63), count=st.integers(1, 64))
def test_dequantized_tiles_are_ggufs_weights_in_bf16(kernels, name, tiles, blocks, seed, first, count):
    num_rows, num_cols = 16 * tiles, BLOCKS[FORMATS[name]][0] * blocks
    file_rows = random_blocks(name, num_rows, num_cols, np.random.default_rng(seed))
    weight = kernels.pack_blocks(FORMATS[name], torch.from_numpy(file_rows))
    first = min(first, num_rows - 1)
    last = min(first + count, num_rows)
    expected = bf16_bits(dense_weight(name, file_rows)[first:last])
    for portable in (False, True):
        got = kernels.dequantize(weight, first, last, portable=portable)
        assert torch.equal(got.view(torch.int16), expected), portable


@settings(max_examples=40, deadline=None)
@given(name=formats, tiles=st.integers(1, 5), blocks=st.integers(1, 3), m=st.integers(1, 300),
       pad=st.integers(0, 40), seed=st.integers(0, 2**16))
def test_products_are_within_float32_accumulation_of_the_exact_one(kernels, name, tiles, blocks, m, pad, seed):
    """Both kernels, any M (blocks of 1-8 rows and their remainders), x with a row stride."""
    rng = np.random.default_rng(seed)
    num_rows, num_cols = 16 * tiles, BLOCKS[FORMATS[name]][0] * blocks
    m = min(m, 40) if seed % 4 else m  # a few large batches, most small: the examples stay fast
    file_rows = random_blocks(name, num_rows, num_cols, rng)
    weight = kernels.pack_blocks(FORMATS[name], torch.from_numpy(file_rows))
    dense = dense_weight(name, file_rows)
    x = torch.from_numpy(rng.standard_normal((m, num_cols + pad)).astype(np.float32)).to(torch.bfloat16)[:, :num_cols]
    exact = x.double() @ dense.double().t()
    for portable in kernel_variants(name):
        bound = error_bound(name, x, dense, file_rows, integer_inputs(name, portable))
        got = kernels(x, weight, torch.empty(m, num_rows), portable=portable)
        assert ((got.double() - exact).abs() <= bound).all(), (name, portable, (got.double() - exact).abs().max())
        as_bf16 = kernels(x, weight, portable=portable)
        assert torch.equal(as_bf16.view(torch.int16), bf16_bits(got))


@settings(max_examples=25, deadline=None)
@given(name=formats, tiles=st.integers(1, 6), m=st.integers(2, 40), seed=st.integers(0, 2**16),
       data=st.data())
def test_a_rows_result_does_not_depend_on_its_batch(kernels, name, tiles, m, seed, data):
    """Row j alone, in a sub-batch starting elsewhere, and on 1-3 threads: the same bits."""
    rng = np.random.default_rng(seed)
    num_rows, num_cols = 16 * tiles, BLOCKS[FORMATS[name]][0] * 2
    weight = kernels.pack_blocks(FORMATS[name], torch.from_numpy(random_blocks(name, num_rows, num_cols, rng)))
    x = torch.from_numpy(rng.standard_normal((m, num_cols)).astype(np.float32)).to(torch.bfloat16)
    j = data.draw(st.integers(0, m - 1))
    start = data.draw(st.integers(0, j))
    for portable in kernel_variants(name):
        with cpu.kernel_threads(1):
            whole = kernels(x, weight, torch.empty(m, num_rows), portable=portable)
        alone = kernels(x[j : j + 1], weight, torch.empty(1, num_rows), portable=portable)
        assert torch.equal(alone[0], whole[j])
        sub = kernels(x[start:], weight, torch.empty(m - start, num_rows), portable=portable)
        assert torch.equal(sub[j - start], whole[j])
        for threads in (2, 3):
            with cpu.kernel_threads(threads):
                split = kernels(x, weight, torch.empty(m, num_rows), portable=portable)
            assert torch.equal(split, whole)


def tiles_function(portable: bool) -> ctypes._CFuncPtr:
    library = cpu.load_library()
    assert library is not None
    function = getattr(library, "radixrt_format_matmul_tiles" + ("_portable" if portable else ""))
    i64, pointer = ctypes.c_int64, ctypes.c_void_p
    function.argtypes = [ctypes.c_int, pointer, i64, i64, pointer, i64, i64, pointer, pointer, pointer, i64, i64]
    function.restype = None
    return function


@settings(max_examples=25, deadline=None)
@given(name=formats, tiles=st.integers(1, 9), m=st.integers(1, 12), seed=st.integers(0, 2**16), data=st.data())
def test_a_tile_range_writes_its_columns_only_with_the_whole_products_bits(kernels, name, tiles, m, seed, data):
    """radixrt_format_matmul_tiles over [first, last): those 16-column groups as the whole product
    has them, bit for bit; every other column untouched."""
    rng = np.random.default_rng(seed)
    number = FORMATS[name]
    num_rows, num_cols = 16 * tiles, BLOCKS[number][0] * 2
    weight = kernels.pack_blocks(number, torch.from_numpy(random_blocks(name, num_rows, num_cols, rng)))
    x = torch.from_numpy(rng.standard_normal((m, num_cols)).astype(np.float32)).to(torch.bfloat16)
    first = data.draw(st.integers(0, tiles - 1))
    last = data.draw(st.integers(first + 1, tiles))
    library = cpu.load_library()
    assert library is not None
    library.radixrt_format_matmul_scratch_bytes.restype = ctypes.c_int64
    scratch_bytes = library.radixrt_format_matmul_scratch_bytes(number, ctypes.c_int64(m), ctypes.c_int64(num_cols))
    scratch = torch.empty(scratch_bytes + 64, dtype=torch.uint8)
    for portable in kernel_variants(name):
        whole = kernels(x, weight, torch.empty(m, num_rows), portable=portable)
        out = torch.full((m, num_rows), 7.0)
        tiles_function(portable)(number, x.data_ptr(), x.stride(0), m, weight.data.data_ptr(), num_rows, num_cols,
                                 out.data_ptr(), None, scratch.data_ptr(), first, last)
        inside = slice(16 * first, 16 * last)
        assert torch.equal(out[:, inside], whole[:, inside])
        out[:, inside] = 7.0
        assert (out == 7.0).all()


def test_packed_bytes_stay_near_the_files(kernels):
    for name, number in FORMATS.items():
        elements, block_bytes = BLOCKS[number]
        file_bytes = 16 * 4096 // elements * block_bytes
        assert file_bytes <= kernels.tile_bytes(number, 4096) <= 1.1 * file_bytes or name == "Q4_0", name
    assert kernels.tile_bytes(FORMATS["Q4_K"], 256) == 2368


def test_bad_formats_and_shapes_are_refused_and_write_nothing(kernels):
    library = cpu.load_library()
    assert library is not None
    pack = library.radixrt_pack_format_rows
    pack.argtypes, pack.restype = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                   ctypes.c_int], ctypes.c_int
    rows = random_blocks("Q4_K", 16, 512, np.random.default_rng(0))
    addresses = (rows.ctypes.data + np.arange(16, dtype=np.int64) * rows.strides[0]).astype(np.int64)
    out = np.full(16 * 4096, 0xAB, dtype=np.uint8)
    for format, num_rows, num_cols in ((99, 16, 512), (FORMATS["Q4_K"], 8, 512), (FORMATS["Q4_K"], 16, 320),
                                       (FORMATS["Q5_0"], 16, 48), (FORMATS["Q4_0"], 16, 40), (1, 16, 512)):
        assert pack(format, addresses.ctypes.data, num_rows, num_cols, out.ctypes.data, 1) == -2
        assert (out == 0xAB).all()
        assert kernels.tile_bytes(format, num_cols) == 0 or num_rows != 16
    matmul = library.radixrt_format_matmul_tiles
    matmul.restype = None
    x = torch.ones(1, 512, dtype=torch.bfloat16)
    result = torch.full((1, 16), 7.0)
    scratch = torch.empty(1 << 16, dtype=torch.uint8)
    matmul(ctypes.c_int(99), ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(512), ctypes.c_int64(1),
           ctypes.c_void_p(out.ctypes.data), ctypes.c_int64(16), ctypes.c_int64(512), ctypes.c_void_p(result.data_ptr()),
           None, ctypes.c_void_p(scratch.data_ptr()), ctypes.c_int64(0), ctypes.c_int64(1))
    assert (result == 7.0).all()
    dequantize = library.radixrt_format_dequantize_tiles_bf16
    dequantize.restype = None
    values = torch.full((16, 512), 3.0, dtype=torch.bfloat16)
    for format, num_cols in ((99, 512), (FORMATS["Q6_K"], 320)):
        dequantize(format, ctypes.c_void_p(out.ctypes.data), ctypes.c_int64(num_cols), ctypes.c_int64(0),
                   ctypes.c_int64(16), ctypes.c_void_p(values.data_ptr()))
        assert (values == 3.0).all()
    with pytest.raises(ValueError, match="format"):
        kernels.pack(99, torch.from_numpy(addresses), 512)
    with pytest.raises(ValueError, match="multiple"):
        kernels.pack(FORMATS["Q6_K"], torch.from_numpy(addresses[:8]), 512)
    weight = kernels.pack(FORMATS["Q4_K"], torch.from_numpy(addresses), 512)
    with pytest.raises(ValueError, match="bf16"):
        kernels(torch.ones(1, 256, dtype=torch.bfloat16), weight)
    with pytest.raises(ValueError, match="rows"):
        kernels.dequantize(FormatWeight(weight.data, weight.format, 16, 512), 3, 3)


def _avx512_and_avx2() -> tuple[FormatMatmul, FormatMatmul]:
    from radixrt.kernels.cpu import build

    if build.cpu_level() != "avx512":
        pytest.skip("the CPU runs no AVX-512 build")
    levels = build.library("avx512"), build.library("avx2")
    if None in levels:
        pytest.skip("the kernels cannot be built")
    return FormatMatmul(levels[0]), FormatMatmul(levels[1])


@settings(max_examples=30, deadline=None)
@given(name=st.sampled_from(NATIVE), tiles=st.integers(1, 5), blocks=st.integers(1, 3), m=st.integers(1, 300),
       pad=st.integers(0, 40), seed=st.integers(0, 2**16), data=st.data())
def test_the_avx512_kernel_gives_the_avx2_kernels_bits_and_a_row_its_own_at_any_batch(name, tiles, blocks, m, pad,
                                                                                     seed, data):
    """kquant_matmul_avx512.c is the AVX2 kernel's arithmetic (integer sums are exact, the float32
    steps the same): equal bits at any M, x with a row stride; and row j's bits the same alone,
    in a sub-batch starting elsewhere, and on 1-3 threads, up to hundreds of rows a step."""
    avx512, avx2 = _avx512_and_avx2()
    rng = np.random.default_rng(seed)
    num_rows, num_cols = 16 * tiles, BLOCKS[FORMATS[name]][0] * blocks
    m = min(m, 40) if seed % 3 else m
    file_rows = torch.from_numpy(random_blocks(name, num_rows, num_cols, rng))
    wide = avx512.pack_blocks(FORMATS[name], file_rows)
    narrow = avx2.pack_blocks(FORMATS[name], file_rows)
    x = torch.from_numpy(rng.standard_normal((m, num_cols + pad)).astype(np.float32)).to(torch.bfloat16)[:, :num_cols]
    with cpu.kernel_threads(1):
        whole = avx512(x, wide, torch.empty(m, num_rows))
    assert torch.equal(whole, avx2(x, narrow, torch.empty(m, num_rows)))
    j = data.draw(st.integers(0, m - 1))
    start = data.draw(st.integers(0, j))
    assert torch.equal(avx512(x[j : j + 1], wide, torch.empty(1, num_rows))[0], whole[j])
    assert torch.equal(avx512(x[start:], wide, torch.empty(m - start, num_rows))[j - start], whole[j])
    for threads in (2, 3):
        with cpu.kernel_threads(threads):
            assert torch.equal(avx512(x, wide, torch.empty(m, num_rows)), whole)


@pytest.mark.parametrize("name", NATIVE)
def test_every_split_between_amx_tiles_and_vpdpwssd_blocks_gives_the_avx2_kernels_bits(name):
    """Where the CPU has AMX, kquant_avx512.h's amx_rows gives the tiles whole blocks of 16 rows
    and a last partial block of 8 rows or more, padded with zero rows; the rest go to the
    VPDPWSSD blocks. Every M up to 40 (each split of those) gives the AVX2 kernel's bits, and so
    every row its own bits whichever path took it."""
    avx512, avx2 = _avx512_and_avx2()
    rng = np.random.default_rng(7)
    num_rows, num_cols = 48, BLOCKS[FORMATS[name]][0] * 2
    file_rows = torch.from_numpy(random_blocks(name, num_rows, num_cols, rng))
    wide, narrow = avx512.pack_blocks(FORMATS[name], file_rows), avx2.pack_blocks(FORMATS[name], file_rows)
    x = torch.from_numpy(rng.standard_normal((40, num_cols)).astype(np.float32)).to(torch.bfloat16)
    alone = avx2(x, narrow, torch.empty(40, num_rows))
    for m in range(1, 41):
        for threads in (1, 2):
            with cpu.kernel_threads(threads):
                assert torch.equal(avx512(x[:m], wide, torch.empty(m, num_rows)), alone[:m]), (name, m, threads)
