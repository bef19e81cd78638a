"""The errors meant for the user: each ends the run with one paragraph on stderr and exit code 2, no
traceback (train.main prints it). A run that stops on one saves what it learned first
(checkpoint.save_interrupted), except where saving is what failed.
"""


class UserError(Exception):
    """Bad input, or a run that cannot go on: one paragraph on stderr and exit code 2."""


class RewardFailedSomewhere(UserError):
    """A reward error on one rank (under torchrun), raised on every rank at the same point, so that
    they all save the step's start together instead of waiting for one another. own: this rank's
    error (its message is the reward function's), not another's."""

    everywhere = True

    def __init__(self, message, own=True):
        super().__init__(message)
        self.own = own


class WriteFailed(UserError):
    """Writing a run's files failed (a full disk, a quota, a read-only or vanished directory).
    Nothing more is written on the way out: the last checkpoint stands, and --resume continues
    from it with metrics.jsonl cut back to its step."""


class SaveFailed(WriteFailed):
    """A checkpoint could not be written; the last whole one stands."""


class NonFiniteWeights(SaveFailed):
    """The weights hold NaN or inf: nothing is saved over the last checkpoint."""


def failure(e):
    """An exception from a write in a few words: OSError's own text ("No space left on device"),
    else its type and message (torch.save raises RuntimeError, safetensors SafetensorError, both
    without an errno)."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return f"{type(e).__name__}: {str(e)[:300]}"
