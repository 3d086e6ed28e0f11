"""Benchmarks and measurement scripts, run from the repo root as `python -m bench.<name>`
(`python -m bench.throughput --help`); they import the repo's packages as users do. Their results
go to bench/RESULTS.md.
"""
