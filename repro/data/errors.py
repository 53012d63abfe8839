"""The one error type of the data pipeline: it names the file at fault and the fix."""

from __future__ import annotations

from repro.cli import UserError


class DataError(UserError):
    """A missing, corrupt or malformed data file; the message names the file and how to fix it."""
