"""The terminal commands behind `reprise`."""
