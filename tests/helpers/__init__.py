"""Helpers shared by tierckpt's test suites (real processes, real files; no mocks)."""
