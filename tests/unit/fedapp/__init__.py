"""Unit tests of the composition layer (fedapp: CLI, replay workload, generated deploy files)."""
