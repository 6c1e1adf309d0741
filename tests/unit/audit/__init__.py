"""Unit tests of services/audit."""
