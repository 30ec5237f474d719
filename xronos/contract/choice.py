"""`LayoutChoice`: which layout mode xronos chose for a job, and what it was chosen over.

Mode xronos does not assume that spreading a job helps: its planner prices each
layout it may use (`JobOptions.layouts`) by the job's predicted time, start-up
included, and keeps the shortest (`xronos.planner.job_time`). The choice travels
in the job's report, so a user sees both the winner and the runner-up.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Layout = Literal["tp", "pp", "single"]
LAYOUTS: tuple[Layout, ...] = ("tp", "pp", "single")


class LayoutCandidate(BaseModel):
    """One layout the planner priced: on which devices, and what it predicts for the job."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    layout: Layout
    devices: list[str] = Field(description="The devices it uses (profile names), in rank order.")
    note: str | None = Field(None, description="Which variant: the partitioner's split, the even split.")
    step_seconds: float = Field(ge=0, description="Predicted seconds per optimizer step.")
    startup_seconds: float = Field(
        ge=0, description="Predicted one-off seconds: rendezvous, collective choice, first-step warm-up, re-shards."
    )
    steps: int = Field(ge=0, description="Steps the job has left to train.")

    @property
    def job_seconds(self) -> float:
        return self.startup_seconds + self.steps * self.step_seconds

    def describe(self) -> str:
        where = self.devices[0] if len(self.devices) == 1 else f"{len(self.devices)} devices"
        return f"{self.layout}{f' ({self.note})' if self.note else ''} on {where}"


class LayoutChoice(BaseModel):
    """The priced candidates, the chosen one first; why it won over the runner-up."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    candidates: list[LayoutCandidate] = Field(min_length=1, description="The chosen one first, the others by time.")
    reason: str | None = Field(None, description="Why the first was chosen when it is not the shortest.")

    @property
    def chosen(self) -> LayoutCandidate:
        return self.candidates[0]

    def describe(self) -> str:
        """`chose tp on 3 devices: 61.2 s predicted for 50 steps (1.9 s start-up, 1.186 s/step); 14% shorter
        than single on device-0 (71.3 s)`."""
        c = self.chosen
        line = (
            f"chose {c.describe()}: {c.job_seconds:.1f} s predicted for {c.steps} steps"
            f" ({c.startup_seconds:.1f} s start-up, {c.step_seconds:.3f} s/step)"
        )
        if len(self.candidates) > 1:
            r = self.candidates[1]
            gain = 1 - c.job_seconds / r.job_seconds if r.job_seconds > 0 else 0.0
            than = f"{gain:.0%} shorter" if gain >= 0 else f"{-gain:.0%} longer"
            line += f"; {than} than {r.describe()} ({r.job_seconds:.1f} s)"
        return line + (f"; {self.reason}" if self.reason else "")
