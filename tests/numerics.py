"""Tolerances for comparing float32 computations that round differently, justified over a random
input class rather than fixed: shared by the fused-kernel tests."""


def close_to_measured_rounding(results, exact_out, exact_states):
    """Every way's output and states equal the unfused path's within float32 rounding *measured*
    on this input: the unfused path's own distance from a float64 run times 4, plus 1e-5 of the
    tensor's scale (its largest magnitude, plus 1).

    A fixed 1e-5 does not hold over a random input class: a head whose output is a
    near-cancellation of O(1) terms, which a gated RMS norm then scales up, moves every float32
    way 1e-4 or more from float64 (5.6e-5 between two of them seen on a Gated DeltaNet step),
    while a wrong gate, decay or norm moves them by O(1). The float64 run must compute in float64
    throughout: the torch delta-rule kernels compute in float32 whatever the dtype, and a run
    through them hides their own rounding (test_cpu_native_fused's ``_float64_path`` swaps in a
    float64 recurrence).

    Args:
        results: ``[(output, states tuple)]`` of float32 tensors, the unfused path's last (as
            ``_three_ways`` returns them); each way is compared with that last one.
        exact_out, exact_states: the float64 run's output and states, shaped as each way's.

    Raises:
        AssertionError: ``(distance, the unfused path's own distance)`` of the first tensor
            past its bound.
    """
    ref_out, ref_states = results[-1]
    for out, states in results[:-1]:
        for got, ref, exact in zip((out, *states), (ref_out, *ref_states), (exact_out, *exact_states)):
            own = (ref.double() - exact).abs().max().item()
            err = (got.double() - ref.double()).abs().max().item()
            assert err <= 4 * own + 1e-5 * (1.0 + exact.abs().max().item()), (err, own)
