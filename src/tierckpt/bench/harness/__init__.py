"""What the benchmarks share: jobs, scratch space, measurement (REDESIGN §3.1 bench/harness/)."""
