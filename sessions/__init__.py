"""Persistence for Reprise: paths, SQLite, cache files. No Qt, no model code."""
