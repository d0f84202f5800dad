"""The one exception type users see.

An ``HpcparError`` carries a message meant for the person at the terminal: one line that says
what is wrong and how to fix it. Everything else that escapes is a bug and is reported with its
traceback (see ``hpcpar.jobs.launch``).
"""


class HpcparError(Exception):
    """Bad input or an unusable environment, reported as a one-line message."""


class CommError(HpcparError):
    """A communication call failed; the message names the operation and the group."""


class CommTimeout(CommError):
    """A receive or collective waited longer than the job's timeout (the watchdog)."""


class PeerFailed(CommError):
    """Another rank of the group failed and said why; this one stops waiting for it."""

    def __init__(self, rank: int, message: str):
        super().__init__(f"rank {rank} failed: {message}")
        self.rank = rank


class HangElsewhere(CommTimeout):
    """Another node's rank found the job hung (the watchdog's alarm): stop waiting, report."""

    def __init__(self, rank: int):
        super().__init__(f"rank {rank} on another node found the job hung")
        self.rank = rank


class Stopped(Exception):
    """A stop request (SIGTERM, SIGUSR1, Ctrl-C) on ``rank``, ending a job phase that has no
    step to stop at (scoring): every rank of the node leaves what it is doing."""

    def __init__(self, signal_name: str, rank: int):
        super().__init__(f"{signal_name} to rank {rank}")
        self.signal_name, self.rank = signal_name, rank
