"""Unit tests of services/scheduler (the pure core and the tenancy gate)."""
