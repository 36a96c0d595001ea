"""Errors a user can act on, kept apart from bugs.

A `UserError` carries a message meant for the person using the app (shown as
is in the terminal or a dialog); any other exception is a bug and is reported
with its traceback. It lives in the lowest layer so every layer can raise it.
"""


class UserError(Exception):
    """Something the user can fix: a bad file, a missing model, a full disk."""
