"""What a scenario reports: its figure (the number the scenario is about), pass or fail, details for the
report, and every failure in words."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Outcome:
    number: int
    scenario: str
    figure: str = ""
    passed: bool = False
    details: list[str] = dataclasses.field(default_factory=list)
    failures: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    def fail(self, message: str) -> None:
        self.failures.append(message)

    def finish(self, figure: str) -> Outcome:
        self.figure = figure
        self.passed = not self.failures
        return self

    def explain(self) -> str:
        """Everything that went wrong, for a pytest assertion message."""
        return f"{self.scenario}: {self.figure}\n" + "\n".join(f"  - {f}" for f in self.failures[:30])
