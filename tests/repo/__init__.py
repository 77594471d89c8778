"""Checks over the whole repository: lint, layering, docs links, results provenance, env variables, security."""
