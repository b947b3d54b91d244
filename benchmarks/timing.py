"""The benchmarks' timing: ``neoflow.runtime.timing`` (interleaved rounds of blocks, medians, ratios)."""

from neoflow.runtime.timing import (
    SETTLE_SECONDS,
    interleaved_medians,
    interleaved_rounds,
    pooled_medians,
    round_ratios,
)

__all__ = ["SETTLE_SECONDS", "interleaved_medians", "interleaved_rounds", "pooled_medians", "round_ratios"]
