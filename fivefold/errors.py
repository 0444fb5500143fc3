"""The errors a user can fix. Each subclass of `UserError` carries a message that says what went wrong
and what to change; the command line prints it as one line and exits 2 (`--debug` adds the traceback).
Anything else that escapes a command is a bug in fivefold, reported with its traceback."""

from __future__ import annotations


class UserError(Exception):
    """An anticipated failure caused by input, files or the machine; the message names the fix."""

    # Raised alike on every rank of a job (configs are validated everywhere, checkpoint checks and save
    # failures are agreed by collectives), so under torchrun rank 0 alone reports it.
    every_rank = True


class CheckpointError(UserError, ValueError):
    """A checkpoint that cannot be trusted or read (damaged, incomplete, or from another model)."""


class CheckpointSaveError(UserError, OSError):
    """A checkpoint could not be written (disk full, quota, permissions); earlier ones are untouched."""


class RunLockedError(UserError):
    """Another live process is using the run directory."""
