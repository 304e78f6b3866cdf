"""Offload benchmarks: each prints JSON and measures its baseline in the same run (raw memcpy, raw disk
I/O, the alternative scheme), because these machines are shared and only ratios travel."""
