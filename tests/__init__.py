"""The test suite in three tiers (unit, http, e2e), its shared support, and the benchmark."""
