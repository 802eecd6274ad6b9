"""CPU weights in a huge-page arena (``lmdeploy.pytorch.host_memory``): the loader carves every
parameter from one 2 MiB-aligned mapping advised ``MADV_HUGEPAGE`` before the first write, with
values, shapes, strides and greedy output bit for bit those of the ordinary load.

``madvise`` is replaced by a recorder and the THP mode is fixed by the tests, so nothing here
depends on the host's transparent-huge-page setting (whether the kernel then grants huge pages
is measured in ``benchmark/ab_huge_pages.py``, not asserted).
"""
from __future__ import annotations

import mmap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmdeploy import GenerationConfig
from lmdeploy.pytorch import host_memory
from lmdeploy.pytorch.host_memory import HUGE_PAGE, HugePageArena, materialize, tensor_align
from lmdeploy.pytorch.models import get_model_class
from lmdeploy.pytorch.models.loader import load_model
from lmdeploy.tools.make_tiny_model import build_config
from lmdeploy.tools.tiny_args import ARCHS

from engine_utils import make_engine, random_prompt


class MadviseRecorder:
    """Stands in for ``host_memory._madvise``: records ``(address, advice, length)`` and whether the
    advised bytes were still all zero (nothing written yet) when advised; ``fail`` raises instead."""

    def __init__(self, fail: bool = False):
        self.calls: list[tuple[int, int, int, bool]] = []
        self.fail = fail

    def __call__(self, mapping, advice, offset, length):
        region = torch.frombuffer(mapping, dtype=torch.uint8)[offset:offset + length]
        self.calls.append((region.data_ptr(), advice, length, not bool(region.any())))
        if self.fail:
            raise OSError(22, 'Invalid argument')


@pytest.fixture
def huge(monkeypatch):
    """Huge pages switched on as on a THP ``madvise`` host, whatever this host says; the recorder."""
    rec = MadviseRecorder()
    monkeypatch.delenv('LMDEPLOY_HUGE_PAGES', raising=False)
    monkeypatch.setattr(host_memory, 'thp_mode', lambda path=None: 'madvise')
    monkeypatch.setattr(host_memory, '_madvise', rec)
    return rec


def _inside(t: torch.Tensor, base: int, size: int) -> bool:
    return base <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= base + size


# --- the switch -----------------------------------------------------------------------------
@pytest.mark.parametrize('text, mode', [('always [madvise] never\n', 'madvise'), ('[always] madvise never\n', 'always'),
                                        ('always madvise [never]\n', 'never'), ('garbage\n', None)])
def test_thp_mode_reads_the_bracketed_word(tmp_path, text, mode):
    path = tmp_path / 'enabled'
    path.write_text(text)
    assert host_memory.thp_mode(str(path)) == mode
    assert host_memory.thp_mode(str(tmp_path / 'missing')) is None


@pytest.mark.parametrize('env, mode, wanted', [(None, 'madvise', True), (None, 'always', True), ('1', 'madvise', True),
                                               (None, 'never', False), (None, None, False), ('0', 'madvise', False)])
def test_huge_pages_wanted_follows_the_env_var_and_the_thp_mode(monkeypatch, env, mode, wanted):
    if env is None:
        monkeypatch.delenv('LMDEPLOY_HUGE_PAGES', raising=False)
    else:
        monkeypatch.setenv('LMDEPLOY_HUGE_PAGES', env)
    monkeypatch.setattr(host_memory, 'thp_mode', lambda path=None: mode)
    assert host_memory.huge_pages_wanted() is wanted


# --- the arena ------------------------------------------------------------------------------
def test_arena_is_2mib_aligned_and_advised_before_any_write(huge):
    arena = HugePageArena(3 * HUGE_PAGE + 5)
    assert arena.base % HUGE_PAGE == 0 and arena.size == 4 * HUGE_PAGE and arena.advised
    assert huge.calls == [(arena.base, mmap.MADV_HUGEPAGE, arena.size, True)]
    t = arena.take((1024, 1024), torch.float32)
    assert t.data_ptr() == arena.base and t.is_contiguous() and not t.any()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 300), min_size=0, max_size=3),
                          st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.uint8])),
                min_size=1, max_size=12))
def test_taken_tensors_are_aligned_disjoint_and_inside_the_planned_arena(specs):
    metas = [torch.empty(shape, dtype=dtype, device='meta') for shape, dtype in specs]
    arena = HugePageArena(HugePageArena.plan(metas))
    spans = []
    for m in metas:
        t = arena.take(m.shape, m.dtype)
        nbytes = t.numel() * t.element_size()
        assert t.shape == m.shape and t.dtype == m.dtype and t.stride() == m.stride()
        if nbytes:      # (an empty tensor's data_ptr is 0)
            assert (t.data_ptr() - arena.base) % tensor_align(nbytes) == 0
            assert _inside(t, arena.base, arena.size)
        spans.append((t.data_ptr(), t.data_ptr() + nbytes))
        t.fill_(1)           # writable, and no later tensor may overlap the bytes written
    spans = sorted(s for s in spans if s[1] > s[0])
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    with pytest.raises(MemoryError):
        arena.take((arena.size - arena.used + 1,), torch.uint8)


def test_huge_bytes_sums_anon_huge_pages_of_the_mappings_over_the_arena(tmp_path):
    arena = HugePageArena(HUGE_PAGE)
    lo, hi = arena.base, arena.base + arena.size
    smaps = tmp_path / 'smaps'
    smaps.write_text(f'{lo - 4096:x}-{lo:x} rw-p 00000000 00:00 0\nAnonHugePages:      9 kB\n'
                     f'{lo:x}-{hi:x} rw-p 00000000 00:00 0\nSize:     2048 kB\nAnonHugePages:   2048 kB\n'
                     'VmFlags: rd wr mr mw me ac hg\n'
                     f'{hi:x}-{hi + 4096:x} rw-p 00000000 00:00 0\nAnonHugePages:      7 kB\n')
    assert arena.huge_bytes(str(smaps)) == HUGE_PAGE
    assert arena.huge_bytes(str(tmp_path / 'missing')) is None


# --- materialize = to_empty().to(dtype), for every registered family --------------------------
@pytest.mark.parametrize('arch', ARCHS)
def test_materialize_builds_what_to_empty_builds(huge, arch):
    """Same parameter names, shapes, strides, dtypes (bfloat16: a family keeping some parameters
    float32 keeps them) and requires_grad as ``to_empty(device='cpu').to(dtype)``; every parameter
    inside the one advised arena."""
    config = build_config(arch, vocab_size=64, eos_token_id=2, pad_token_id=0)
    cls = get_model_class(config.model_type)
    with torch.device('meta'):
        plain, placed = cls(config), cls(config)
    plain = plain.to_empty(device='cpu').to(torch.bfloat16)
    placed, arena = materialize(placed, 'cpu', torch.bfloat16)
    want = [(n, p.shape, p.stride(), p.dtype, p.requires_grad) for n, p in plain.named_parameters()]
    assert [(n, p.shape, p.stride(), p.dtype, p.requires_grad) for n, p in placed.named_parameters()] == want
    assert all(_inside(p, arena.base, arena.size) for p in placed.parameters())
    assert [(c[0], c[1]) for c in huge.calls] == [(arena.base, mmap.MADV_HUGEPAGE)]


def test_a_parameter_shared_by_two_modules_stays_one_parameter(huge):
    with torch.device('meta'):
        a, b = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
        b.weight = a.weight
        model = torch.nn.Sequential(a, b)
    model, arena = materialize(model, 'cpu', torch.float32)
    assert model[0].weight is model[1].weight and _inside(model[1].weight, arena.base, arena.size)
    assert arena.used < 2 * 4 * 8 * 4     # carved once


def test_off_device_or_switched_off_means_ordinary_allocations(huge, monkeypatch):
    with torch.device('meta'):
        model = torch.nn.Linear(8, 4)
    assert materialize(model, 'meta', torch.float32)[1] is None
    monkeypatch.setenv('LMDEPLOY_HUGE_PAGES', '0')
    model, arena = materialize(model, 'cpu', torch.float32)
    assert arena is None and model.weight.device.type == 'cpu' and huge.calls == []


# --- the loader -------------------------------------------------------------------------------
@pytest.fixture(scope='module')
def plain_qwen3_next(tiny_qwen3_next):
    """The tiny Qwen3-Next (MoE: stacked expert weights) loaded with huge pages off."""
    mp = pytest.MonkeyPatch()
    mp.setenv('LMDEPLOY_HUGE_PAGES', '0')
    try:
        return load_model(tiny_qwen3_next, progress=False).model
    finally:
        mp.undo()


def _assert_same_weights(model, ref):
    got, want = dict(model.named_parameters()), dict(ref.named_parameters())
    assert list(got) == list(want)
    for name, p in want.items():
        q = got[name]
        assert (q.shape, q.stride(), q.dtype, q.is_contiguous()) == (p.shape, p.stride(), p.dtype, p.is_contiguous())
        assert torch.equal(q, p), name


def test_loaded_weights_are_bit_identical_and_live_in_the_advised_arena(huge, tiny_qwen3_next, plain_qwen3_next):
    model = load_model(tiny_qwen3_next, progress=False).model
    _assert_same_weights(model, plain_qwen3_next)
    ((base, advice, size, untouched),) = huge.calls
    assert advice == mmap.MADV_HUGEPAGE and untouched and base % HUGE_PAGE == 0 and size % HUGE_PAGE == 0
    assert all(_inside(p, base, size) for p in model.parameters())
    assert any('experts' in n and p.dim() == 3 and _inside(p, base, size) for n, p in model.named_parameters())


@pytest.mark.parametrize('failure', ['madvise', 'mmap'])
def test_a_refused_advice_or_mapping_never_fails_the_load(monkeypatch, caplog, tiny_qwen3_next, plain_qwen3_next,
                                                          failure):
    rec = MadviseRecorder(fail=failure == 'madvise')
    monkeypatch.delenv('LMDEPLOY_HUGE_PAGES', raising=False)
    monkeypatch.setattr(host_memory, 'thp_mode', lambda path=None: 'madvise')
    monkeypatch.setattr(host_memory, '_madvise', rec)
    if failure == 'mmap':
        def no_map(self, nbytes):
            raise OSError(12, 'Cannot allocate memory')
        monkeypatch.setattr(HugePageArena, '__init__', no_map)
    with caplog.at_level('DEBUG', logger='lmdeploy'):
        model = load_model(tiny_qwen3_next, progress=False).model
    _assert_same_weights(model, plain_qwen3_next)
    words = 'madvise(MADV_HUGEPAGE) of a' if failure == 'madvise' else 'no huge-page host arena'
    assert any(words in r.getMessage() and r.levelname == 'DEBUG' for r in caplog.records)


def test_greedy_output_with_huge_pages_equals_the_plain_load(huge, monkeypatch, tiny_qwen3_next):
    prompts = [random_prompt(40, seed) for seed in (1, 2)]
    gen = GenerationConfig(max_new_tokens=12, ignore_eos=True)

    def generate():
        engine = make_engine(tiny_qwen3_next, max_batch_size=2, session_len=128)
        seqs = [engine.add_request(p, gen) for p in prompts]
        while not all(s.is_finished for s in seqs):
            engine.step()
        return [s.token_ids[len(p):] for s, p in zip(seqs, prompts)]

    on = generate()
    assert len(huge.calls) == 1
    monkeypatch.setenv('LMDEPLOY_HUGE_PAGES', '0')
    assert generate() == on and len(huge.calls) == 1
