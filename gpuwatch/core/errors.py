"""The one exception type that the CLI turns into a one-line message instead of a traceback."""


class UserError(Exception):
    """Bad input or an unreachable dependency: the message names the input and the problem."""


class NotFound(UserError):
    """The thing asked for (a job, a node, a GPU) is not known; the server answers NOT_FOUND."""


class AgentIdConflict(Exception):
    """A batch whose (agent id, sequence) was stored before with other content: two agents share one id."""

    def __init__(self, agent_id: str, sequence: int) -> None:
        super().__init__(f"batch {sequence} of agent {agent_id} was stored before with different content")
        self.agent_id = agent_id
        self.sequence = sequence
