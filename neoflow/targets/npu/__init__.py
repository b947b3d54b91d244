"""The NPU target (an Ascend-like AI core, as a model): the machine as data so far (``machine``);
the compiler, static schedule, simulator and counters follow (issue 37)."""
