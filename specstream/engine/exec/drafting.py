"""Where drafting runs in a step, one class per strategy, chosen by the mode's ``drafting``.

A step's draft job (for requests the step does not verify) starts before the target forward
pass (``begin``), may take the waits for history in flight (``gap``, handed to the round), and
is finished after the forward pass (``end``); drafts for the requests the step verifies run
after their verification (``run_now``).

- ``sequential``: everything after verification, on the one device (the baselines).
- ``gaps``: draft steps run while verification waits for history still crossing the link
  (``engine/exec/gap_filler.py`` decides which gaps are long enough); the rest after verification.
- ``parallel``: on a second worker standing for a second device, concurrently with verification.
- ``draft-stream`` (``gaps`` on CUDA): every draft step is enqueued at once on the backend's
  low-priority draft stream, as soon as the round's first copies are issued; the GPU's
  scheduler runs them in the gaps verification leaves, the host never polls a copy or times a
  gap. Draft steps do not read tensor values back (``spec/draft.py``), so enqueueing them costs
  no sync; the drafts come back with the round's one read-back (``backends.sync_point``).

Reading a job's drafts back (``result``) is a host sync, marked with ``sync_point``.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod

import torch

from specstream.backends.base import TransferBackend, sync_point
from specstream.engine.exec.gap_filler import GapFiller
from specstream.engine.exec.history import Gap
from specstream.engine.trace import Tracer
from specstream.options import Drafting as DraftingKind
from specstream.registry import Registry
from specstream.spec.proposer import ProposeJob


class Drafting(ABC):
    def __init__(self, tracer: Tracer, backend: TransferBackend | None = None) -> None:
        self.tracer, self.backend = tracer, backend
        # What the round may run while it waits for a piece of history still in flight.
        self.gap: Gap | None = None

    @abstractmethod
    def begin(self, job: ProposeJob | None) -> None:
        """Before the target forward pass: start ``job`` where the strategy runs it."""

    @abstractmethod
    def end(self) -> float:
        """After the forward pass: finish the job; returns the seconds spent drafting."""

    def copies_issued(self) -> None:  # noqa: B027
        """The round's first copies of cold history are in flight: work that needs the host
        for a while (enqueueing draft steps) may start without leaving the link idle."""

    def abort(self) -> None:  # noqa: B027
        """The forward pass failed: leave no draft work running into the next step."""

    def run_now(self, job: ProposeJob) -> None:
        """Run ``job`` to the end now, on the draft's device."""
        with self.tracer.span("draft", "draft (sequential)"), sync_point():
            job.result()


DRAFTING: Registry[type[Drafting]] = Registry("drafting strategy")


def drafting_for(mode_drafting: str, device: str) -> str:
    """The strategy that implements a mode's drafting on ``device``: on CUDA the link's gaps
    are filled by the GPU's stream scheduler, not by the host."""
    return "draft-stream" if mode_drafting is DraftingKind.GAPS and device.startswith("cuda") else (
        mode_drafting)


@DRAFTING.register("sequential")
class Sequential(Drafting):
    def begin(self, job: ProposeJob | None) -> None:
        self.job = job

    def end(self) -> float:
        if self.job is None:
            return 0.0
        t0 = time.perf_counter()
        self.run_now(self.job)
        return time.perf_counter() - t0


@DRAFTING.register("gaps")
class InGaps(Drafting):
    def begin(self, job: ProposeJob | None) -> None:
        self.filler = GapFiller(job, self.tracer) if job is not None else None
        self.gap = self.filler.fill if self.filler is not None else None

    def end(self) -> float:
        filler, self.filler, self.gap = self.filler, None, None
        return 0.0 if filler is None else filler.draft_s + filler.finish()

    def abort(self) -> None:
        self.filler, self.gap = None, None


@DRAFTING.register("draft-stream")
class OnDraftStream(Drafting):
    def begin(self, job: ProposeJob | None) -> None:
        # enqueued once the round's first copies are issued (copies_issued), so the link does
        # not wait for the host to enqueue the draft steps
        self.job, self.enqueue_s, self.queued = job, 0.0, False
        self.stream: object = None  # the backend's draft stream the steps are queued on

    def copies_issued(self) -> None:
        job = self.job
        if job is None or self.queued or self.backend is None:
            return
        t0 = time.perf_counter()
        with self.backend.draft_stream() as stream, torch.inference_mode():
            while job.step():  # enqueued, not run: nothing here waits for the device
                pass
        self.stream, self.queued = stream, True
        self.enqueue_s = time.perf_counter() - t0

    def end(self) -> float:
        self.copies_issued()  # a step without a forward pass: enqueue now
        if self.queued and self.backend is not None:
            self.backend.join(self.stream)
        return 0.0 if self.job is None else self.enqueue_s


@DRAFTING.register("parallel")
class OnSecondDevice(Drafting):
    def begin(self, job: ProposeJob | None) -> None:
        self.thread: _DraftThread | None = None
        if job is not None:
            self.thread = _DraftThread(job, self.tracer)

    def end(self) -> float:
        return 0.0 if self.thread is None else self.thread.join()

    def abort(self) -> None:
        if self.thread is not None:
            self.thread.thread.join()

    def run_now(self, job: ProposeJob) -> None:
        _DraftThread(job, self.tracer).join()


class _DraftThread:
    """Runs a draft job on its own thread: the second device of parallel-spec."""

    def __init__(self, job: ProposeJob, tracer: Tracer) -> None:
        self.job, self.tracer, self.draft_s = job, tracer, 0.0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="draft-device", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            torch.set_num_threads(1)
            t0 = time.perf_counter()
            # inference mode is per thread: the worker's round runs in it, and so must this
            with torch.inference_mode(), sync_point():
                self.job.result()
            self.draft_s = time.perf_counter() - t0
            self.tracer.add("draft", "draft (second device)", t0, t0 + self.draft_s)
        except BaseException as exc:  # surfaced in join()
            self.error = exc

    def join(self) -> float:
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.draft_s
