"""Throughput benchmarks (`eaglebatch bench`) and readable reports (`eaglebatch report`)."""
