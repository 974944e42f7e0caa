"""Exceptions of the client, carrying the daemon's gRPC status code and message."""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Optional

import grpc

if TYPE_CHECKING:
    from .results import Decision

__all__ = ["KvCacheError", "ScoreShapeError", "SequenceInFlightError", "StepError"]

_CODES: Dict[int, grpc.StatusCode] = {code.value[0]: code for code in grpc.StatusCode}


def status_code(value: int) -> grpc.StatusCode:
    """The grpc.StatusCode of a numeric google.rpc.Code (UNKNOWN for an unknown value)."""
    return _CODES.get(value, grpc.StatusCode.UNKNOWN)


class KvCacheError(Exception):
    """A call to kvcached failed. ``code`` is a grpc.StatusCode, ``message`` the daemon's text.

    Codes follow their retry meaning: INVALID_ARGUMENT (bad shape, budget or policy),
    NOT_FOUND (the sequence is not open), ALREADY_EXISTS, FAILED_PRECONDITION (a step out of
    order), RESOURCE_EXHAUSTED (--max_sequences, message size), UNAVAILABLE (no daemon).
    """

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(code, message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError, what: str) -> "KvCacheError":
        """Wraps a failed RPC; ``what`` names the call, e.g. "OpenSequence('req-1')"."""
        code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
        details = error.details() if hasattr(error, "details") else str(error)
        return cls(code or grpc.StatusCode.UNKNOWN, f"{what}: {details}")


class ScoreShapeError(ValueError):
    """Scores whose size or shape cannot be what the step needs.

    Raised on the client before anything is sent; here, beside the other errors, so that
    every module that checks a shape imports it without importing another checker.
    """


class SequenceInFlightError(ValueError):
    """A sequence was listed in a step while this batch has it in another step still in
    flight (``SequenceBatch.submit_step``): its next step's number, and whether it needs
    scores, are known only once that decision arrives. Raised before anything is sent."""


class StepError(KvCacheError):
    """One sequence's step was rejected; nothing changed for that sequence.

    ``decisions`` holds the whole batch's decisions when the error was raised by
    ``SequenceBatch.step(..., raise_on_error=True)``.
    """

    def __init__(self, sequence_id: str, step: int, code: grpc.StatusCode, message: str,
                 decisions: Optional[Dict[str, "Decision"]] = None) -> None:
        super().__init__(code, message)
        self.sequence_id = sequence_id
        self.step = step
        self.decisions = decisions

    def __str__(self) -> str:
        return (f"sequence {self.sequence_id!r} step {self.step} rejected "
                f"({self.code.name}): {self.message}")
