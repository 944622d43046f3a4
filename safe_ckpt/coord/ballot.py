"""This rank's side of a save's votes.

One job: keep what went wrong on this rank since the last collective (its first failure,
and any `KeyboardInterrupt`/`SystemExit`) and hand it to the next vote, which every rank
takes part in; after a failed vote, clean up (the caller's ``on_failure``: rank 0 removes
the staging directory) and raise the same `CheckpointError` on every rank, or, on a rank
that was interrupted, the interrupt itself (once the commit vote has passed, an interrupt no
longer fails the save: it is raised on its rank when the save is over). Whatever a rank
meets between two collectives so reaches its peers at the next one, never a collective
later or not at all, and the group leaves every save in step.
Must not: decide what a failure means for the save, or talk to other ranks except
through `Coordinator.vote`.
"""

from __future__ import annotations

import logging
from typing import Callable

from .dist import Coordinator
from ..errors import INTERRUPTS, CheckpointError, RankFailure, failure_from_exception

log = logging.getLogger("safe_ckpt")


class Ballot:
    def __init__(self, coord: Coordinator, on_failure: Callable[[], None]) -> None:
        self.coord = coord
        self.failure: RankFailure | None = None  # this rank's, for the next vote
        self.interrupt: BaseException | None = None  # raised as itself once the vote is done
        self._on_failure = on_failure
        self._stops: list[Callable[[], None]] = []
        # The checkpoint is published: an interrupt from here on is raised once the save is over,
        # and no longer fails it on the other ranks.
        self.decided = False

    def on_note(self, stop: Callable[[], None]) -> None:
        """Call ``stop`` (e.g. cancel the writers) whenever a failure is noted."""
        self._stops.append(stop)

    def keep_interrupt(self, exc: BaseException | None) -> None:
        if isinstance(exc, INTERRUPTS) and self.interrupt is None:
            self.interrupt = exc

    def note(self, stage: str, exc: BaseException, key: str | None = None) -> None:
        """Keep this rank's first failure for the next vote."""
        self.keep_interrupt(exc)
        if self.decided and isinstance(exc, INTERRUPTS):
            return
        if self.failure is None:
            if not isinstance(exc, (CheckpointError, *INTERRUPTS)):
                log.debug("rank %d failed during %s", self.coord.rank, stage, exc_info=exc)
            self.failure = failure_from_exception(self.coord.rank, stage, exc, key)
        for stop in self._stops:
            stop()

    def raise_interrupt(self) -> None:
        if self.interrupt is not None:
            raise self.interrupt

    def take_held(self) -> BaseException | None:
        """A SIGINT the coordinator held during the last collective or hold (it fails the next step)."""
        held, self.coord.interrupted = self.coord.interrupted, None
        return held

    def vote(self, stage: str, report=None, decides: bool = False) -> list:
        """Every rank's ``report``; or, if any rank failed, the same error on every rank once
        ``on_failure`` has run (an interrupt is raised as itself instead). A vote that ``decides``
        the save (the commit vote), once passed, makes later interrupts wait for the save's end."""
        failure, self.failure = self.failure, None
        try:
            reports = self.coord.vote(stage, failure, report)
        except CheckpointError:
            self._on_failure()
            self.raise_interrupt()
            raise
        self.decided = self.decided or decides
        held = self.take_held()
        if held is not None:
            self.note(f"after {stage}", held)
        return reports
