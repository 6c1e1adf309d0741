"""Unit tests of the fedsched library (one test module per library module)."""
