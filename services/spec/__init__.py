"""Speculation service: draft proposals for the workers' verification steps (prompt lookup and
persistent domain n-gram tables)."""
