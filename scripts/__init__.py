"""Tools run from the repository root as modules: python -m scripts.bench, python -m
scripts.gpu_check."""
