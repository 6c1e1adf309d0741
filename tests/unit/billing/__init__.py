"""Unit tests of services/billing."""
