"""Helpers shared by the test modules (no tests here): tiny checkpoints, workloads, clocks,
kernel comparisons, the frozen tree reference, the server thread and the training fixtures.
Test modules import from here (or from ``tests.helpers`` / ``tests.dflash_helpers``), never
from one another."""
