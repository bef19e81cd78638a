"""The errors meant for the user. Every module may raise them; train.main prints the message and exits with code 2."""


class UserError(Exception):
    """Bad input, or a run that cannot go on: one paragraph on stderr and exit code 2, without a traceback."""
