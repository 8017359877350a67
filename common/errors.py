"""User-facing errors.

`UserError` is a mistake the user can fix (bad path, mismatching shards, corrupt checkpoint). The CLI
prints its message without a traceback and exits 1. Flag/config problems are `ValueError` from a config's
`validate()`, which the CLI turns into a usage error (exit 2). Anything else is a bug and gets a traceback.
"""
from __future__ import annotations


class UserError(Exception):
    """A problem with the user's inputs or environment, with an actionable message."""

    exit_code = 1


class ConfigError(ValueError):
    """One or more invalid settings; the message lists all of them with the fix."""

    def __init__(self, problems: list[str], what: str = "configuration"):
        self.problems = list(problems)
        msg = f"invalid {what}:\n" + "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(msg)


def collect(problems: list[str], what: str) -> None:
    """Raise a ConfigError listing every problem, if there are any."""
    if problems:
        raise ConfigError(problems, what)
