"""Speed, memory and data-preparation benchmarks, grouped by what they measure (README.md here); each script
runs from the repository's root as `python -m benchmarks.<group>.<name>` and has a `--smoke` mode."""
