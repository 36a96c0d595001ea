"""Figures and texts the app reads, installed as the package `reprise_resources` (see pyproject)."""
