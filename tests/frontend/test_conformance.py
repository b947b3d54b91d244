"""onnx's backend test runner over the node tests of the listed op types: a floor on the pass rate
(the measured rate and every failure: ``python -m tests.frontend.conformance``)."""

from .conformance import run

FLOOR = 0.95  # measured 95.6 % (672 of 703) when this floor was set; raise it as coverage grows


def test_node_test_pass_rate_does_not_regress() -> None:
    total, failures = run()
    rate = (total - len(failures)) / total
    assert total > 600
    assert rate >= FLOOR, f"{rate:.1%} of {total} node tests pass; first failures: {failures[:5]}"
