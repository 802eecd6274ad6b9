"""Nemotron-H's routed relu^2 experts in one native call (``relu2_experts_native``, the CPU
implementation of the ``relu2_experts`` kernel): over expert counts, top-k, empty experts, widths
that are not a multiple of the vector length and row counts of a decode step or a short prompt,
it sums each output element in the torch loop's order (bit for bit), stays within float32
rounding of a float64 reference everywhere, refuses what it does not cover, and reads nothing into Python, so a decode graph
replays a Nemotron-3 MoE layer."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dispatch_log import one_native_call
from lmdeploy.pytorch.kernels import get_kernel
from lmdeploy.pytorch.kernels.cpu_native import NATIVE_EXPERT_TOKENS, native_library, relu2_experts_native
from lmdeploy.pytorch.kernels.linear import linear
from lmdeploy.pytorch.kernels.moe import relu2_experts_cpu, relu2_experts_cuda, relu2_experts_loop

pytestmark = pytest.mark.skipif(native_library() is None, reason='native CPU kernels could not be built here '
                                '(no C compiler with OpenMP, or LMDEPLOY_CPU_KERNELS=0)')


def _layer(T, E, k, hit, H, inter, seed):
    """A random layer and routing: ``T`` tokens each choosing ``k`` distinct experts among the
    first ``hit`` of ``E`` (the others stay empty), float32 weights in (0, 1]."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen)
    up = torch.randn(E, inter, H, generator=gen) * H ** -0.5
    down = torch.randn(E, H, inter, generator=gen) * inter ** -0.5
    index = torch.stack([torch.randperm(hit, generator=gen)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=gen) + 1e-3
    return x, index, weights, up, down


def _slot_order(x, index, weights, up, down):
    """The loop's products per (token, slot), weighted, then summed over the slots strictly in
    order: the sum order the native kernel promises."""
    rows = []
    for t in range(x.shape[0]):
        acc = None
        for e, w in zip(index[t].tolist(), weights[t]):
            y = linear(torch.square(F.relu(linear(x[t:t + 1], up[e]))), down[e]) * w
            acc = y if acc is None else acc + y
        rows.append(acc)
    return torch.cat(rows)


def _float64(x, index, weights, up, down):
    x, weights, up, down = (t.double() for t in (x, weights, up, down))
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for e, w in zip(index[t].tolist(), weights[t]):
            out[t] += w * (down[e] @ torch.square(F.relu(up[e] @ x[t])))
    return out


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 24), st.integers(2, 16), st.integers(1, 6), st.sampled_from([8, 16, 33, 64]),
       st.sampled_from([5, 16, 24, 40]), st.data())
@example(T=1, E=8, k=6, H=16, inter=24, data=None)          # torch's sum(1) over 6 choices is not sequential here
@example(T=24, E=2, k=1, H=33, inter=5, data=None)          # 24 rows per expert: still the native product
def test_sums_in_slot_order_and_within_float32_rounding_of_float64(T, E, k, H, inter, data):
    k = min(k, E)
    hit = E if data is None else data.draw(st.integers(k, E), label='experts hit')
    seed = 0 if data is None else data.draw(st.integers(0, 2 ** 31), label='seed')
    layer = _layer(T, E, k, hit, H, inter, seed)
    got = relu2_experts_native(*layer)
    assert got.shape == (T, H) and got.dtype == torch.float32
    assert torch.equal(got, _slot_order(*layer))
    loop = relu2_experts_loop(*layer)
    assert torch.equal(got, loop)       # the loop sums its choices in slot order too
    exact = _float64(*layer)
    own = (loop.double() - exact).abs().max().item()
    err = (got.double() - loop.double()).abs().max().item()
    assert err <= 4 * own + 1e-5 * (1.0 + exact.abs().max().item()), (err, own)


def test_a_prompt_of_128_tokens_matches_the_loop_to_float32_rounding():
    """Beyond 24 rows per expert the loop's products are MKL's (another sum order): equal to
    float32 rounding, as measured against float64."""
    layer = _layer(NATIVE_EXPERT_TOKENS, 4, 2, 4, 40, 24, seed=1)
    got, loop, exact = relu2_experts_native(*layer), relu2_experts_loop(*layer), _float64(*layer)
    own = (loop.double() - exact).abs().max().item()
    assert (got.double() - loop.double()).abs().max().item() <= 4 * own + 1e-5 * (1.0 + exact.abs().max().item())


def test_refuses_what_it_does_not_cover_and_the_cpu_kernel_falls_back_to_the_loop():
    x, index, weights, up, down = _layer(3, 4, 2, 4, 16, 8, seed=2)
    with pytest.raises(ValueError, match=r'expert index out of range \[0, 4\)'):
        relu2_experts_native(x, index.clamp(max=3) + 1, weights, up, down)
    with pytest.raises(ValueError, match='expected x'):
        relu2_experts_native(x, index, weights, up, down[:, :, :4])
    with pytest.raises(ValueError, match='expected x'):
        relu2_experts_native(x, index, weights[:, :1], up, down)
    many = _layer(NATIVE_EXPERT_TOKENS + 1, 4, 2, 4, 16, 8, seed=3)
    for args in (many, (x.bfloat16(), index, weights, up.bfloat16(), down.bfloat16()),
                 (x, index.int(), weights, up, down), (x[:0], index[:0], weights[:0], up, down)):
        assert relu2_experts_native(*args) is None
        assert torch.equal(relu2_experts_cpu(*args), relu2_experts_loop(*args))
    assert get_kernel('relu2_experts', 'cpu') is relu2_experts_cpu
    assert get_kernel('relu2_experts', 'cuda') is relu2_experts_cuda


def test_nemotron_moe_layer_is_one_native_call_and_reads_nothing_into_python():
    """A Nemotron-3 MoE layer (latent projections around the experts) on a float32 decode batch:
    one native experts call and no tensor value read into Python (what refused its decode
    graph: the loop's ``bincount(...).tolist()``), and the loop's result."""
    from types import SimpleNamespace

    from lmdeploy.pytorch.models.nemotron_h import NemotronHMoE
    config = SimpleNamespace(num_experts_per_tok=2, n_routed_experts=8, n_group=2, topk_group=1,
                             norm_topk_prob=True, routed_scaling_factor=2.5, hidden_size=24, moe_latent_size=16,
                             mlp_bias=False, moe_intermediate_size=20, moe_shared_expert_intermediate_size=12)
    moe = NemotronHMoE(config).eval()
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    x = torch.randn(3, 24, generator=gen)

    got, ops = one_native_call(lambda: moe(x), 'relu2_experts')
    assert not {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.bincount.default} & ops
    with torch.no_grad():
        weights, index = moe.route(x)
        h = moe.fc1_latent_proj(x)
        want = moe.fc2_latent_proj(relu2_experts_loop(h, index, weights, moe.experts.up_proj,
                                                      moe.experts.down_proj)) + moe.shared_experts(x)
    assert torch.equal(got, want)
