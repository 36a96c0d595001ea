"""The engine raises `UserError` (defined in `sessions`, the lowest layer) for user mistakes."""

from sessions.errors import UserError

__all__ = ["UserError"]
