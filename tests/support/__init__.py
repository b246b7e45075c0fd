"""Builders and helpers the test tiers and the benchmark share; no tests here."""
