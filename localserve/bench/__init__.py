"""Benchmarks: the load generator, its report and the office workloads (clients of any server)."""
