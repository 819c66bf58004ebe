"""`pagedserve bench`: benchmarks, their shipped workloads and length traces (see benchmarks/README.md)."""
