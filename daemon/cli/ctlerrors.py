"""ultractl's exit codes and the error that carries one (printed as one line)."""

from __future__ import annotations

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3
EXIT_TIMEOUT = 4  # `ultractl wait`: the job did not reach the state in --timeout


class CtlError(Exception):
    def __init__(self, message: str, code: int = EXIT_FAILURE) -> None:
        super().__init__(message)
        self.code = code
