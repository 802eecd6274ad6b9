"""The dense projection kernel equals ``F.linear`` for every row count (skinny batches take the
transposed GEMM on CPU), with and without bias, for 2-D and 3-D inputs and other dtypes."""
import pytest
import torch
import torch.nn.functional as F

from lmdeploy.pytorch.kernels import cpu_native
from lmdeploy.pytorch.kernels import linear as linear_mod
from lmdeploy.pytorch.kernels.linear import SKINNY_ROWS, SKINNY_ROWS_NARROW, linear, transposed_rows
from lmdeploy.pytorch.models.layers import Linear


@pytest.mark.parametrize('rows', [0, 1, 4, 7, 8, 9, 16, 32, 33, 47, 48, 63, 64, 100])
@pytest.mark.parametrize('with_bias', [False, True])
def test_linear_equals_f_linear(rows, with_bias):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen)
    w = torch.randn(130, 96, generator=gen)
    b = torch.randn(130, generator=gen) if with_bias else None
    y = linear(x, w, b)
    assert y.shape == (rows, 130) and y.is_contiguous() and y.dtype == torch.float32
    # same dot products, MKL's summation order may differ: float32 rounding of sums of 96 terms
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_linear_3d_input_and_other_dtypes_pass_through():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, 64, generator=gen)
    w = torch.randn(48, 64, generator=gen)
    torch.testing.assert_close(linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    xh, wh = x.half(), w.half()
    assert torch.equal(linear(xh, wh), F.linear(xh, wh))   # float16: F.linear itself


@pytest.mark.parametrize('rows', [1, 2, 5, 16, 64, 65, 200])
@pytest.mark.parametrize('with_bias', [False, True])
def test_bf16_linear_equals_f_linear_and_takes_the_measured_form(rows, with_bias, monkeypatch):
    """bfloat16 on CPU: one row is ``torch.mv``, 2-64 rows ``weight @ x^T``, more rows
    ``F.linear``; all equal ``F.linear`` to bf16 rounding (both accumulate in float32 and
    round once; 2 bf16 ulps allowed for a different summation order)."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 256, generator=gen).bfloat16()
    w = torch.randn(96, 256, generator=gen).bfloat16()
    b = torch.randn(96, generator=gen).bfloat16() if with_bias else None
    calls = []

    class Spy:
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def mm(a, b_):
            calls.append('mm')
            return torch.mm(a, b_)

        @staticmethod
        def mv(a, b_):
            calls.append('mv')
            return torch.mv(a, b_)

    monkeypatch.setattr(linear_mod, 'torch', Spy())
    y = linear(x[None], w, b)[0]
    assert y.shape == (rows, 96) and y.dtype == torch.bfloat16
    assert calls == (['mv'] if rows == 1 else ['mm'] if rows <= 64 else [])
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    torch.testing.assert_close(y.float(), ref, rtol=2 * 2 ** -8, atol=2 * 2 ** -8 * float(ref.abs().max()))


@pytest.mark.parametrize('in_features, window', [(1024, SKINNY_ROWS), (2048, SKINNY_ROWS), (512, SKINNY_ROWS_NARROW),
                                                 (32, SKINNY_ROWS_NARROW)])
def test_skinny_rows_take_the_transposed_product(monkeypatch, in_features, window):
    """Inside the window for the weight's inner size the product is ``weight @ x^T`` (an ``mm``
    with the weight first); outside it, ``F.linear``. The module form calls the same kernel."""
    assert transposed_rows(in_features) is window
    calls = []
    real_mm = torch.mm

    class Spy:
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def mm(a, b):
            calls.append(tuple(a.shape))
            return real_mm(a, b)

    monkeypatch.setattr(linear_mod, 'torch', Spy())
    layer = Linear(in_features, 40, bias=False)
    for rows in (window.start, window.stop - 1):
        layer(torch.randn(rows, in_features))
    assert calls == [(40, in_features)] * 2
    layer(torch.randn(window.start - 1, in_features))
    layer(torch.randn(window.stop, in_features))
    assert calls == [(40, in_features)] * 2


@pytest.mark.parametrize('rows', [1, 2, 3, 24])
def test_few_float32_rows_take_the_native_product_when_built_else_mkl(rows, monkeypatch):
    """1-24 float32 rows go to the native product whenever its library is built: a fixed rule, so
    two processes on one host round a product the same way (no per-process timing). Without the
    library (or switched off) ``linear`` is MKL's product, bit for bit."""
    assert cpu_native.NATIVE_ROWS == range(1, 25)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 1000, generator=gen)        # inner size not a multiple of 16
    w, b = torch.randn(33, 1000, generator=gen), torch.randn(33, generator=gen)
    calls = []
    real = cpu_native.matmul_rows

    def spy(x_, w_):
        calls.append(x_.shape[0])
        return real(x_, w_)

    monkeypatch.setattr(linear_mod, 'matmul_rows', spy)
    with torch.inference_mode():
        y = linear(x, w, b)
        if cpu_native.native_library() is not None:
            assert calls == [rows]
            assert torch.equal(y, real(x, w) + b)          # the native sums, then the bias
        # another summation order than MKL's: float32 rounding of 1000-term sums, bounded by the
        # sum of |terms| (about K * 2^-24 of it at worst; 1e-5 of it here)
        scale = float((x.abs() @ w.abs().t()).max())
        assert (y - F.linear(x, w, b)).abs().max().item() <= 1e-5 * scale
        monkeypatch.setattr(cpu_native, 'native_library', lambda: None)
        # without the library 1-3 rows are MKL's direct product; 24 its transposed form
        ref = F.linear(x, w, b) if rows <= 3 else torch.mm(w, x.t()).t() + b
        assert torch.equal(linear(x, w, b), ref)
