"""Errors a user sees: each says what is wrong, where, and what to do about it."""


class StageError(RuntimeError):
    """A stage cannot produce a trustworthy output (empty output, failed gate, bad inputs)."""


class ContractError(StageError):
    """A stage output broke its contract; `report` holds the failing checks and sample rows."""

    def __init__(self, message: str, report: dict | None = None) -> None:
        super().__init__(message)
        self.report = report or {}
