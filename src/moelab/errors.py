"""The errors a user can cause: each is printed as one line that says what to change, exit code 2.

Every layer raises these (or a subclass named for its area) and `moelab` turns them into that line;
a bug raises anything else and shows its traceback.
"""

from __future__ import annotations


class UsageError(Exception):
    """Bad input the user can fix; printed as one line, exit code 2."""


class RecordError(UsageError):
    """A record that does not hold what it claims (a forecast changed after it was registered, say)."""
