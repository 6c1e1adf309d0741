"""Unit tests of services/inventory."""
