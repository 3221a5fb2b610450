"""Errors that are the user's to fix: the CLI prints them on one line and exits 2."""


class UserError(Exception):
    """Bad input or a missing precondition; the message says what and where."""
