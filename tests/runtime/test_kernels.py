"""Kernels on the transfer path: both backends against plain torch, bit for bit.

The Triton backend runs here in Triton's interpreter (CPU tensors). rpcompile picks the
interpreter per call for CPU tensors, so these tests need no TRITON_INTERPRET setting and do not
depend on test order; one test checks that setting it anyway (before triton's first import, in
a fresh process) changes nothing. The reference is always torch itself (`Tensor.to`,
`acc += g.float()`, `torch.isfinite`), never the module's own torch backend.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rpcompile.runtime import kernels
from rpcompile.runtime.kernels import programs, tables

# The interpreter costs ~1 ms per program plus numpy work per block: few, small examples.
PROPERTY = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LOW = (torch.bfloat16, torch.float16)
GRAD_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# --------------------------------------------------------------------------------------------
# Values that exercise rounding
# --------------------------------------------------------------------------------------------


def _f32(bits: list[int]) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


SPECIALS = torch.cat(
    [
        torch.tensor(
            [
                0.0,
                -0.0,
                math.inf,
                -math.inf,
                math.nan,
                -math.nan,
                1.0,
                -1.0,
                65504.0,  # fp16 max finite
                65519.99,  # just below the fp16 overflow tie: rounds to 65504
                65520.0,  # the tie at fp16 max: rounds (to even) to inf
                -65520.0,
                2.0**-24,  # fp16 smallest subnormal
                2.0**-25,  # tie between 0 and the smallest subnormal: rounds to 0
                3 * 2.0**-26,  # above that tie: rounds to 2**-24
                2.0**-14,  # fp16 smallest normal
                2.0**-14 - 2.0**-25,  # largest-subnormal/smallest-normal boundary tie
                1.0 + 2.0**-8,  # bf16 tie, even below: rounds down to 1.0
                1.0 + 3 * 2.0**-8,  # bf16 tie, odd below: rounds up
                1.0 + 2.0**-11,  # fp16 tie: rounds to 1.0
            ],
            dtype=torch.float32,
        ),
        _f32(
            [
                0x7F7FFFFF,  # fp32 max: rounds up across the exponent to bf16 inf
                0x7F7F7FFF,  # just below bf16's rounding edge: stays bf16 max finite
                0x7F7F8000,  # tie at bf16 max finite, odd below: rounds to inf
                0x3FFFFFFF,  # mantissa all ones: rounds up to the next power of two
                0x00000001,  # fp32 smallest subnormal
                0x007FFFFF,  # fp32 largest subnormal: rounds up to bf16's smallest normal
                0x00008000,  # a bf16 subnormal tie
                0x80018000,  # negative subnormal tie, odd below
                0x7F800001,  # signalling-NaN pattern that rounding would turn into inf
                0xFF800001,
                0x7FFFFFFF,  # NaN whose rounding carry would wrap the sign
                0xFFFFFFFF,
            ]
        ),
    ]
)


def interesting_fp32(count: int, seed: int) -> torch.Tensor:
    """``count`` fp32 values: random bits, fp16-range values, rounding ties and specials."""
    gen = torch.Generator().manual_seed(seed)
    kind = torch.randint(0, 5, (count,), generator=gen)
    sign = torch.randint(0, 2, (count,), generator=gen) << 31
    mantissa = torch.randint(0, 1 << 23, (count,), generator=gen)
    # Exponents around fp16's range: its subnormals, normals and overflow.
    exponent = torch.randint(127 - 27, 127 + 17, (count,), generator=gen) << 23
    bf16_tie = (mantissa & ~0xFFFF) | 0x8000
    fp16_tie = (mantissa & ~0x1FFF) | 0x1000
    tie = torch.where(torch.rand(count, generator=gen) < 0.5, bf16_tie, fp16_tie)
    bits = torch.randint(0, 1 << 32, (count,), generator=gen)
    bits = torch.where(kind == 1, sign | exponent | mantissa, bits)
    bits = torch.where(kind == 2, sign | exponent | tie, bits)
    bits = torch.where(kind == 3, sign | exponent | 0x7FFFFF, bits)
    values = bits.to(torch.int32).view(torch.float32).clone()
    special = kind == 4
    pick = torch.randint(0, SPECIALS.numel(), (int(special.sum()),), generator=gen)
    values[special] = SPECIALS[pick]
    return values


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal bit for bit, except that any NaN may stand for any NaN (torch's own casts do not
    fix NaN bits: its vectorised CPU bf16 cast writes 0xFFFF, its scalar cast 0x7FC0)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    nan = expected.isnan()
    assert torch.equal(actual.isnan(), nan), "NaN positions differ"
    as_int = {2: torch.int16, 4: torch.int32}[actual.element_size()]
    bad = (actual.view(as_int) != expected.view(as_int)) & ~nan
    if bad.any():
        index = int(bad.nonzero()[0])
        raise AssertionError(
            f"{int(bad.sum())} mismatches; first at {index}: "
            f"got {actual[index].item()!r}, expected {expected[index].item()!r}"
        )


# --------------------------------------------------------------------------------------------
# Layouts: sizes, offsets with gaps
# --------------------------------------------------------------------------------------------

SIZES = st.lists(st.one_of(st.integers(0, 40), st.integers(41, 700)), min_size=0, max_size=12)


@st.composite
def layouts(draw, sizes=SIZES):
    """Sizes and non-overlapping offsets (gaps, possibly unaligned, possibly shuffled order)."""
    sizes = draw(sizes)
    gaps = draw(st.lists(st.integers(0, 9), min_size=len(sizes), max_size=len(sizes)))
    offsets, at = [], 0
    for size, gap in zip(sizes, gaps):
        at += gap
        offsets.append(at)
        at += size
    order = draw(st.permutations(range(len(sizes))))
    return [sizes[i] for i in order], [offsets[i] for i in order], at + draw(st.integers(0, 5))


BACKENDS = ("torch", "triton")


# --------------------------------------------------------------------------------------------
# cast_pack / cast_flat
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [*LOW, torch.float32])
def test_cast_of_special_and_random_values_matches_tensor_to(backend, dtype):
    values = torch.cat([SPECIALS, interesting_fp32(1 << 15, seed=7)])
    out = torch.empty(values.numel(), dtype=dtype)
    kernels.cast_pack(values, out, backend=backend)
    assert_bits_equal(out, values.to(dtype))


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_bf16_and_fp16_rounding_edge(backend):
    # For every exponent and sign: the dropped bits just below, at and above the half, with an
    # even and an odd kept part, and the all-ones mantissa that carries into the exponent.
    lows = [0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x0FFF, 0x1000, 0x1001, 0x1FFF]
    kept = [0x000000, 0x010000, 0x7E0000, 0x7F0000, 0x002000, 0x7FC000]
    bits = [
        (sign << 31) | (exponent << 23) | (high & 0x7FFFFF) | low
        for sign in (0, 1)
        for exponent in range(256)
        for high in kept
        for low in lows
    ]
    values = _f32(bits)
    for dtype in LOW:
        out = torch.empty(values.numel(), dtype=dtype)
        kernels.cast_pack([values], out, backend=backend)
        assert_bits_equal(out, values.to(dtype))


@PROPERTY
@given(layout=layouts(), dtype=st.sampled_from(LOW), seed=st.integers(0, 2**31))
@pytest.mark.parametrize("backend", BACKENDS)
def test_cast_pack_writes_each_tensor_at_its_offset(backend, layout, dtype, seed):
    sizes, offsets, total = layout
    sources = [interesting_fp32(n, seed + i) for i, n in enumerate(sizes)]
    sentinel = torch.full((total,), 1234.0, dtype=dtype)
    out = sentinel.clone()
    kernels.cast_pack(sources, out, offsets, backend=backend)
    expected = sentinel.clone()
    for source, offset in zip(sources, offsets):
        expected[offset : offset + source.numel()] = source.to(dtype)
    assert_bits_equal(out, expected)  # also: the gaps between tensors are untouched


@PROPERTY
@given(size=st.integers(0, 3000), dtype=st.sampled_from(LOW), seed=st.integers(0, 2**31))
@pytest.mark.parametrize("backend", BACKENDS)
def test_cast_flat_is_the_reverse_cast(backend, size, dtype, seed):
    accumulator = interesting_fp32(size, seed)
    out = kernels.cast_flat(accumulator, dtype=dtype, backend=backend)
    assert_bits_equal(out, accumulator.to(dtype))
    into = torch.zeros(size + 3, dtype=dtype)
    kernels.cast_flat(accumulator, into, backend=backend)
    assert_bits_equal(into[:size], accumulator.to(dtype))
    assert not into[size:].any()


def test_cast_pack_accepts_shaped_sources_and_views():
    flat = interesting_fp32(600, seed=3)
    shaped = [flat[:60].view(6, 10), flat[100:400].view(3, 10, 10), flat[500:501].view(())]
    out = torch.zeros(361, dtype=torch.bfloat16)
    kernels.cast_pack(shaped, out, backend="triton")
    assert_bits_equal(out, torch.cat([t.reshape(-1) for t in shaped]).to(torch.bfloat16))


# --------------------------------------------------------------------------------------------
# accumulate_grads
# --------------------------------------------------------------------------------------------


def _grad(size: int, dtype: torch.dtype, seed: int, special_share: float) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(size, generator=gen) * 10.0 ** torch.randint(-6, 6, (size,), generator=gen)
    special = torch.rand(size, generator=gen) < special_share
    values[special] = interesting_fp32(int(special.sum()), seed)
    return values.to(dtype)


def _reference_accumulate(grads, accumulator, offsets):
    """The plain-torch meaning, written out: acc[off:off+n] += g.float(), then the flag."""
    expected = accumulator.clone()
    found = False
    for grad, offset in zip(grads, offsets):
        region = expected[offset : offset + grad.numel()]
        region += grad.reshape(-1).float()
        found |= bool((~torch.isfinite(region)).any())
    return expected, found


@PROPERTY
@given(
    layout=layouts(),
    dtypes=st.one_of(
        st.sampled_from(GRAD_DTYPES).map(lambda d: [d]),  # one dtype: the fast path
        st.lists(st.sampled_from(GRAD_DTYPES), min_size=2, max_size=3),  # mixed in one launch
    ),
    special_share=st.sampled_from([0.0, 0.0, 0.01, 0.3]),
    seed=st.integers(0, 2**31),
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_accumulate_matches_torch_and_sets_the_flag(backend, layout, dtypes, special_share, seed):
    sizes, offsets, total = layout
    grads = [
        _grad(n, dtypes[i % len(dtypes)], seed + i, special_share) for i, n in enumerate(sizes)
    ]
    accumulator = torch.randn(total, generator=torch.Generator().manual_seed(seed))
    expected, found = _reference_accumulate(grads, accumulator, offsets)
    flag = kernels.nonfinite_flag()
    kernels.accumulate_grads(grads, accumulator, offsets, found_nonfinite=flag, backend=backend)
    assert_bits_equal(accumulator, expected)
    assert flag.item() == int(found)


@pytest.mark.parametrize("backend", BACKENDS)
def test_accumulate_over_microbatches_and_flag_only_rises(backend):
    sizes = [17, 0, 300, 1]
    accumulator = torch.zeros(sum(sizes))
    expected = accumulator.clone()
    flag = kernels.nonfinite_flag()
    for microbatch in range(3):
        grads = [_grad(n, torch.bfloat16, 10 * microbatch + i, 0.0) for i, n in enumerate(sizes)]
        kernels.accumulate_grads(grads, accumulator, found_nonfinite=flag, backend=backend)
        expected, _ = _reference_accumulate(grads, expected, kernels.packed_offsets(grads))
        assert_bits_equal(accumulator, expected)
    assert flag.item() == 0
    # A finite gradient whose sum overflows raises the flag too: the check is on the result.
    big = torch.full((4,), 3.0e38)
    kernels.accumulate_grads([big], accumulator, found_nonfinite=flag, backend=backend)
    kernels.accumulate_grads([big], accumulator, found_nonfinite=flag, backend=backend)
    assert flag.item() == 1
    # A later clean call does not lower it.
    kernels.accumulate_grads(
        [torch.ones(2)], accumulator, [20], found_nonfinite=flag, backend=backend
    )
    assert flag.item() == 1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mixed", [False, True])
def test_signed_zeros_add_like_torch(backend, mixed):
    # -0 + -0 is -0 but -0 + +0 is +0: a kernel that adds a stray +0 (e.g. from a masked load)
    # gets this wrong while every other value still matches.
    accumulator = torch.tensor([-0.0, -0.0, 0.0, 0.0] * 3)
    zeros = torch.tensor([-0.0, 0.0, -0.0, 0.0])
    grads = [zeros.to(d) for d in (GRAD_DTYPES if mixed else (torch.bfloat16,) * 3)]
    expected, _ = _reference_accumulate(grads, accumulator, [0, 4, 8])
    kernels.accumulate_grads(grads, accumulator, backend=backend)
    assert_bits_equal(accumulator, expected)
    assert torch.equal(accumulator.signbit(), torch.tensor([True, False, False, False] * 3))


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_gradient_sets_flag_and_stays_nan(backend):
    grad = torch.tensor([1.0, math.nan, -math.inf], dtype=torch.float16)
    accumulator = torch.zeros(3)
    flag = kernels.nonfinite_flag()
    kernels.accumulate_grads([grad], accumulator, found_nonfinite=flag, backend=backend)
    assert accumulator[0] == 1 and accumulator[1].isnan() and accumulator[2] == -math.inf
    assert flag.item() == 1


# --------------------------------------------------------------------------------------------
# One launch, block tables, the paths of the kernel
# --------------------------------------------------------------------------------------------


class _CountingKernels:
    """Wraps the interpreter kernels and counts grid launches."""

    def __init__(self, real):
        self.real, self.launches = real, []
        self.dtypes = real.dtypes

    def __getattr__(self, name):
        kernel = getattr(self.real, name)
        launches = self.launches

        class Launcher:
            def __getitem__(self, grid):
                launches.append((name, grid))
                return kernel[grid]

        return Launcher()


@pytest.fixture
def launch_counter(monkeypatch):
    counter = _CountingKernels(programs._triton_kernels(interpret=True))
    monkeypatch.setattr(tables, "_triton_kernels", lambda interpret: counter)
    return counter


def test_many_small_tensors_are_one_launch(launch_counter):
    sizes = [i % 7 for i in range(240)]  # includes empty tensors
    dtypes = [GRAD_DTYPES[i % 3] for i in range(240)]
    grads = [_grad(n, d, i, 0.05) for i, (n, d) in enumerate(zip(sizes, dtypes))]
    accumulator = torch.randn(sum(sizes))
    expected, found = _reference_accumulate(grads, accumulator, kernels.packed_offsets(grads))
    flag = kernels.nonfinite_flag()
    kernels.accumulate_grads(grads, accumulator, found_nonfinite=flag, backend="triton")
    sources = [torch.randn(n) for n in sizes]
    out = torch.empty(sum(sizes), dtype=torch.float16)
    kernels.cast_pack(sources, out, backend="triton")
    assert [name for name, _ in launch_counter.launches] == ["accumulate", "cast"]
    assert_bits_equal(accumulator, expected)
    assert flag.item() == int(found)
    assert_bits_equal(out, torch.cat(sources).to(torch.float16))


def test_nothing_to_move_launches_nothing(launch_counter):
    accumulator = torch.ones(4)
    flag = kernels.nonfinite_flag()
    kernels.accumulate_grads([], accumulator, found_nonfinite=flag, backend="triton")
    kernels.accumulate_grads([torch.empty(0)], accumulator, [4], backend="triton")
    kernels.cast_pack([torch.empty(0, 3)], torch.empty(0, dtype=torch.bfloat16), backend="triton")
    assert launch_counter.launches == []
    assert torch.equal(accumulator, torch.ones(4)) and flag.item() == 0


@pytest.mark.parametrize("dtype", GRAD_DTYPES)
def test_multi_block_tensors_take_full_and_partial_block_paths(monkeypatch, dtype):
    # Force 256-element blocks so tensors span several blocks: full blocks take the unmasked
    # path, the tails the masked one; aligned and unaligned layouts take both hint branches.
    monkeypatch.setattr(tables, "_INTERPRETER_BLOCK_RANGE", (256, 256))
    sizes = [1024, 1000, 256, 3]
    for align in (8, 1):
        grads = [_grad(n, dtype, n, 0.0) for n in sizes]
        offsets = kernels.packed_offsets(grads, align=align)
        if align == 1:
            offsets = [o + 1 for o in offsets]  # unaligned destinations
        total = offsets[-1] + sizes[-1]
        table = tables._table(grads, offsets, torch.empty(total))
        assert table.block == 256 and table.rows.shape[0] == 4 + 4 + 1 + 1
        assert table.aligned == (align == 8)
        accumulator = torch.randn(total)
        expected, _ = _reference_accumulate(grads, accumulator, offsets)
        kernels.accumulate_grads(grads, accumulator, offsets, backend="triton")
        assert_bits_equal(accumulator, expected)
        sources = [_grad(n, torch.float32, n + 1, 0.1) for n in sizes]
        out = torch.zeros(total, dtype=torch.bfloat16)
        kernels.cast_pack(sources, out, offsets, backend="triton")
        for source, offset in zip(sources, offsets):
            assert_bits_equal(out[offset : offset + source.numel()], source.to(torch.bfloat16))


def test_block_table_rows():
    grads = [
        torch.zeros(300),
        torch.zeros(0, dtype=torch.bfloat16),
        torch.zeros(5, dtype=torch.float16),
    ]
    table = tables._table(grads, [10, 310, 400], torch.empty(405))
    assert table.block == 512 and table.mixed
    rows = table.rows.tolist()
    assert rows == [
        [grads[0].data_ptr(), 10, 300, 2],
        [grads[2].data_ptr(), 400, 5, 1],
    ]


def test_block_tables_are_reused_and_evicted_by_size(monkeypatch):
    monkeypatch.setattr(tables, "_TABLES", tables.OrderedDict())
    monkeypatch.setattr(tables, "_TABLE_CACHE_BYTES", 3 * 32)  # three one-row tables
    tensors = [torch.zeros(5) for _ in range(5)]
    out = torch.empty(5)
    first = tables._table([tensors[0]], [0], out)
    assert tables._table([tensors[0]], [0], out) is first  # same layout: a hit
    for tensor in tensors[1:]:
        tables._table([tensor], [0], out)
    assert len(tables._TABLES) == 3
    assert tables._table([tensors[0]], [0], out) is not first  # evicted, rebuilt equal
    assert torch.equal(tables._table([tensors[0]], [0], out).rows, first.rows)
    # Still correct through evictions.
    accumulator = torch.zeros(5)
    for tensor in tensors:
        kernels.accumulate_grads([tensor + 1], accumulator, backend="triton")
    assert torch.equal(accumulator, torch.full((5,), 5.0))


def test_packed_offsets_align():
    tensors = [torch.empty(3), torch.empty(0), torch.empty(9), torch.empty(1)]
    assert kernels.packed_offsets(tensors) == [0, 3, 3, 12]
    assert kernels.packed_offsets(tensors, align=8) == [0, 8, 8, 24]


# --------------------------------------------------------------------------------------------
# Errors that say what to change
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: kernels.accumulate_grads([torch.ones(4)], torch.zeros(6), [0], backend="cuda"),
            "backend must be one of",
        ),
        (
            lambda: kernels.accumulate_grads(
                [torch.ones(4), torch.ones(4)], torch.zeros(6), [0, 2]
            ),
            "overlap",
        ),
        (lambda: kernels.accumulate_grads([torch.ones(4)], torch.zeros(6), [3]), "does not fit"),
        (lambda: kernels.accumulate_grads([torch.ones(4)], torch.zeros(6), [0, 1]), "offsets"),
        (lambda: kernels.accumulate_grads([torch.ones(4, 2).t()], torch.zeros(8)), "contiguous"),
        (
            lambda: kernels.accumulate_grads([torch.ones(4, dtype=torch.int32)], torch.zeros(8)),
            "dtype",
        ),
        (
            lambda: kernels.accumulate_grads([torch.ones(4)], torch.zeros(8, dtype=torch.bfloat16)),
            "accumulator must be",
        ),
        (
            lambda: kernels.accumulate_grads(
                [torch.ones(4)], torch.zeros(8), found_nonfinite=torch.zeros(1)
            ),
            "found_nonfinite",
        ),
        (
            lambda: kernels.cast_pack(
                [torch.ones(4, dtype=torch.bfloat16)], torch.zeros(8, dtype=torch.bfloat16)
            ),
            "sources[0] has dtype",
        ),
        (
            lambda: kernels.cast_pack([torch.ones(4)], torch.zeros(2, 4, dtype=torch.bfloat16)),
            "out must be",
        ),
        (lambda: kernels.cast_flat(torch.ones(4)), "needs `out` or `dtype`"),
    ],
)
def test_errors_name_the_fix(call, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        call()


def test_auto_backend_is_torch_on_cpu_and_triton_on_cuda():
    assert kernels.resolve_backend("auto", torch.device("cpu")) == "torch"
    assert kernels.resolve_backend("auto", torch.device("cuda", 0)) == "triton"
    assert kernels.resolve_backend("triton", torch.device("cpu")) == "triton"


def test_same_results_when_triton_interpret_is_set_before_import():
    # Some callers (transformers, torch.compile tests) import triton with TRITON_INTERPRET=1;
    # the kernels must behave the same whichever way triton was first imported.
    script = textwrap.dedent(
        """
        import os
        os.environ["TRITON_INTERPRET"] = "1"
        import triton, torch
        from rpcompile.runtime import kernels
        values = torch.tensor([1.0 + 3 * 2.0**-8, 65520.0, 3.0e38, -2.0**-25])
        out = torch.empty(4, dtype=torch.bfloat16)
        kernels.cast_pack(values, out, backend="triton")
        assert torch.equal(out.view(torch.int16), values.to(torch.bfloat16).view(torch.int16))
        acc, flag = torch.zeros(4), kernels.nonfinite_flag()
        kernels.accumulate_grads([values.half()], acc, found_nonfinite=flag, backend="triton")
        assert torch.equal(acc, values.half().float()) and flag.item() == 1
        print("ok")
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", LOW)
def test_compiled_kernels_on_cuda_match_torch(dtype):
    device = torch.device("cuda")
    sizes = [1, 4096, 4097, 100_000, 0, 33]
    sources = [interesting_fp32(n, n).to(device) for n in sizes]
    out = torch.empty(sum(sizes), dtype=dtype, device=device)
    kernels.cast_pack(sources, out, backend="triton")
    assert_bits_equal(out.cpu(), torch.cat(sources).cpu().to(dtype))
    grads = [_grad(n, d, n, 0.001).to(device) for n, d in zip(sizes, [dtype] * 5 + [torch.float32])]
    accumulator = torch.randn(sum(sizes), device=device)
    expected, found = _reference_accumulate(grads, accumulator, kernels.packed_offsets(grads))
    flag = kernels.nonfinite_flag(device)
    kernels.accumulate_grads(grads, accumulator, found_nonfinite=flag, backend="triton")
    assert_bits_equal(accumulator.cpu(), expected.cpu())
    assert flag.item() == int(found)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_kernels_launched_from_several_threads_at_once():
    # Worker compute threads reach a specialization none has compiled yet at the same time:
    # it compiles once and every thread's sums are right.
    import threading
    from concurrent.futures import ThreadPoolExecutor

    device = torch.device("cuda")
    gate = threading.Barrier(4)

    def job(seed):
        sizes = [4097 + seed, 3, 10_000]  # unaligned offsets: a specialization of its own
        grads = [_grad(n, torch.float16, seed * 10 + n, 0.0).to(device) for n in sizes]
        accumulator = torch.randn(sum(sizes), generator=torch.Generator().manual_seed(seed))
        expected, _ = _reference_accumulate([g.cpu() for g in grads], accumulator,
                                            kernels.packed_offsets(grads))
        accumulator = accumulator.to(device)
        gate.wait()
        kernels.accumulate_grads(grads, accumulator, backend="triton")
        torch.cuda.synchronize()
        assert_bits_equal(accumulator.cpu(), expected)
        return True

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(job, range(4)))


def test_interpreter_launches_from_worker_threads():
    # Virtual workers are threads. Triton's interpreter patches triton.language for the length
    # of a launch, so concurrent launches must not trip over each other.
    from concurrent.futures import ThreadPoolExecutor

    def job(seed):
        grads = [_grad(n, GRAD_DTYPES[(seed + n) % 3], seed * 100 + n, 0.01) for n in (700, 3, 90)]
        accumulator = torch.randn(800, generator=torch.Generator().manual_seed(seed))
        expected, found = accumulator.clone(), False
        flag = kernels.nonfinite_flag()
        for _ in range(3):
            kernels.accumulate_grads(grads, accumulator, found_nonfinite=flag, backend="triton")
            expected, found_again = _reference_accumulate(
                grads, expected, kernels.packed_offsets(grads)
            )
            found |= found_again
        expected, _ = _reference_accumulate(
            [-g for g in grads], expected, kernels.packed_offsets(grads)
        )
        kernels.accumulate_grads([-g for g in grads], accumulator, backend="triton")
        assert_bits_equal(accumulator, expected)
        assert flag.item() == int(found)
        return True

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(job, range(8)))


def test_first_launch_of_a_specialization_runs_alone(monkeypatch):
    # On CUDA the first launch of each specialization compiles: compute threads of several
    # workers reaching it together must not each compile it. Later launches take no lock.
    import threading
    import time

    monkeypatch.setattr(tables, "_LAUNCHED", set())
    spans: list[tuple[str, float, float]] = []
    lock = threading.Lock()

    def launch(key):
        begin = time.perf_counter()
        time.sleep(0.02)
        with lock:
            spans.append((key, begin, time.perf_counter()))

    keys = ["a", "a", "a", "b", "b", "a", "b", "a"]
    threads = [threading.Thread(target=tables._first_launch_alone,
                                args=(k, lambda k=k: launch(k))) for k in keys]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(k for k, _, _ in spans) == sorted(keys)  # every launch ran, once
    spans.sort(key=lambda span: span[1])
    first = {}
    for span in spans:
        first.setdefault(span[0], span)
    for key, (_, begin, end) in first.items():
        # No other launch of the same key, and no other first launch, overlaps it.
        others = [s for s in spans if s[0] == key and s is not first[key]]
        others += [f for f in first.values() if f is not first[key]]
        assert all(e <= begin or b >= end for _, b, e in others), (key, spans)
    assert tables._LAUNCHED == {"a", "b"}


@pytest.mark.parametrize(
    ("kernel", "constexprs", "signature"),
    [
        (
            "_cast_pack_kernel",
            {"OUT_DTYPE": "bfloat16", "OUT_IS_BF16": True, "ALIGNED": True},
            {"rows": "*i64", "out_ptr": "*bf16"},
        ),
        (
            "_accumulate_kernel",
            {"SRC_DTYPE": "float16", "MIXED": False, "CHECK": True, "ALIGNED": True},
            {"rows": "*i64", "acc_ptr": "*fp32", "flag_ptr": "*i32"},
        ),
        (
            "_accumulate_kernel",
            {"SRC_DTYPE": "float32", "MIXED": True, "CHECK": True, "ALIGNED": False},
            {"rows": "*i64", "acc_ptr": "*fp32", "flag_ptr": "*i32"},
        ),
    ],
)
def test_kernels_compile_for_sm90_without_a_gpu(kernel, constexprs, signature):
    # The interpreter never compiles, so this is the CPU suite's only check that the compiled
    # path builds (ahead of time, for an H100/H200 target) and that aligned layouts get
    # 16-byte vector loads.
    triton = pytest.importorskip("triton")
    pytest.importorskip("triton.backends.nvidia")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    programs._triton_kernels(interpret=True)  # binds the module's `tl`
    fn = triton.jit(getattr(programs, kernel))
    constants = {"BLOCK": 4096} | {
        k: getattr(triton.language, v) if isinstance(v, str) else v for k, v in constexprs.items()
    }
    source = ASTSource(
        fn,
        signature | dict.fromkeys(constants, "constexpr"),
        constexprs=constants,
        attrs={(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in signature},
    )
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    vector_loads = re.findall(r"ld\.global[\w:.]*\.v4", ptx)
    if constexprs["ALIGNED"] and not constexprs.get("MIXED", False):
        assert vector_loads, "aligned full blocks should load 16 bytes per access"
    else:
        assert ".entry" in ptx
