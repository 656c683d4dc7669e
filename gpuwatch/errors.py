"""The one exception type that the CLI turns into a one-line message instead of a traceback."""


class UserError(Exception):
    """Bad input or an unreachable dependency: the message names the input and the problem."""
