"""User-facing errors: one line naming the field and the fix, exit code 2."""

from __future__ import annotations

EXIT_USER_ERROR = 2


class UserError(Exception):
    """A mistake in the user's input, caught before anything is launched or written."""

    def __init__(self, field: str, problem: str, fix: str = ""):
        self.field = field
        self.problem = problem
        self.fix = fix
        super().__init__(self.line())

    def line(self) -> str:
        """The single line shown to the user."""
        text = f"{self.field}: {self.problem}" if self.field else self.problem
        if self.fix:
            text += f" — {self.fix}"
        return text
