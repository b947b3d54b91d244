"""The machine probes: the FMA peak loop must measure the FMA units' rate, not their latency."""

from __future__ import annotations

import re
import shlex
import subprocess

from neoflow.targets.cpu.compiler import FLAGS, compiler
from neoflow.targets.cpu.machine import PROBE_SOURCE
from tests.on_targets import NEEDS_CC


@NEEDS_CC
def test_the_fma_probe_keeps_twelve_independent_chains() -> None:
    # twelve chains with equal values were once merged by the compiler into one, which runs at
    # the FMA's latency: the "peak" then counted twelve FMAs for each one executed (1.5x too high)
    flags = [f for f in FLAGS if f not in ("-shared", "-fPIC")]
    assembly = subprocess.run(
        [*shlex.split(compiler()), *flags, "-S", "-o", "-", "-x", "c", "-"],
        input=PROBE_SOURCE,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    body = re.search(r"nf_fma_peak\._omp_fn\.0:(.*?)\.size\s+nf_fma_peak\._omp_fn\.0", assembly, re.S)
    assert body is not None, "the probe's parallel region was not found in the assembly"
    assert len(re.findall(r"\bvfmadd\w*", body.group(1))) >= 12
