"""The verify command's report: the check of a candidate model against the original."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar

from onnx_conv2matmul.errors import ExitCode
from onnx_conv2matmul.report import Command, CommandReport

if TYPE_CHECKING:
    from onnx_conv2matmul.verify.check import VerifyReport


@dataclasses.dataclass
class VerifyCommandReport(CommandReport):
    """The verify command's report: one comparison of two models (``verification``)."""

    COMMAND: ClassVar[Command] = Command.VERIFY

    verification: VerifyReport

    @property
    def return_code(self) -> int:
        return int(ExitCode.OK if self.verification.passed else ExitCode.FAILED)

    @property
    def failure(self) -> str | None:
        return None if self.verification.passed else "verification failed: the models differ"

    @property
    def inputs(self) -> list[str]:
        return [self.verification.original, self.verification.candidate]

    def body(self) -> dict[str, Any]:
        return {"verification": self.verification.to_dict()}
