"""gb10d's benchmarks: each claim measured against what people use today, in the same run.

Run `python -m bench` (or `bench/run`) from the repository root; `--quick`
is the CI version. See docs/BENCHMARKS.md for what each item measures.
"""
