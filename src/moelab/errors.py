"""The errors a user can cause, for every layer: each is printed by `moelab` as one line (or one
line per problem) that says what to change, with exit code 2; a run stopped by the NaN guard is
exit code 3. A bug raises anything else and shows its traceback.

Each area raises its own subclass (and keeps its name importable where it is raised), so a caller
can catch what it expects while `moelab` catches them all as UsageError.
"""

from __future__ import annotations

from collections.abc import Sequence


class UsageError(Exception):
    """Bad input the user can fix; printed as one line, exit code 2."""


class ConfigError(UsageError, ValueError):
    """A config the user wrote that cannot run. ``errors`` holds one line per problem."""

    def __init__(self, errors: Sequence[str]):
        self.errors = list(errors)
        super().__init__("\n".join(self.errors))


class DataError(UsageError, ValueError):
    """Input data the user can fix; the message is one line naming the file."""


class MeshError(UsageError, ValueError):
    """A mesh that does not fit the devices or the model; one line naming the field."""


class RunRefused(UsageError, ValueError):
    """A run the user asked for that cannot start as asked (exit code 2)."""


class RecordError(UsageError):
    """A record that does not hold what it claims (a forecast changed after it was registered, say)."""


class ForecastError(UsageError, ValueError):
    """Rungs that cannot be used for a forecast; one line naming the directory."""


class LawError(UsageError, ValueError):
    """A fit that cannot be made from what was given; one line saying what is missing."""


class ReplanError(UsageError, ValueError):
    """A re-plan that cannot be made; one line naming the field or file."""


class ExperimentError(UsageError, ValueError):
    """An experiment file that cannot be used; one line naming it."""


class RunError(Exception):
    """A run that cannot go on (exit code 3); the message says why and what was kept."""


class Interrupted(Exception):
    """A run the user stopped (Ctrl-C, SIGTERM) at a step boundary, its checkpoint saved: one line
    that says where, and exit code 130 (128 + SIGINT, as a shell reports an interrupted command)."""
