"""Benchmarks: print tables of medians and ratios; never part of the test run."""
