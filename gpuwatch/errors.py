"""The one exception type that the CLI turns into a one-line message instead of a traceback."""


class UserError(Exception):
    """Bad input or an unreachable dependency: the message names the input and the problem."""


class NotFound(UserError):
    """The thing asked for (a job, a node, a GPU) is not known; the server answers NOT_FOUND."""
