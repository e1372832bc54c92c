"""The torch profiler of one scheduler rank, for SGLang's ``/start_profile`` and ``/stop_profile``.

Why in the scheduler: the profile should show what serving does (scheduling, the forwards, the
kernels), and every TP rank runs its own forwards, so every rank profiles itself and writes a
Chrome trace of its own (``{profile_id}-TP-{rank}[-DP-{replica}].trace.json``, SGLang's names). The
start and stop reach every rank with the broadcast inputs, so all ranks profile the same steps; a
start with ``num_steps`` stops by itself after that many forward steps, counted by every rank alike.

A profile that has not started cannot stop, and one that runs cannot start again: both are refused
with a reason (``ProfileError``), and the rank's state stays as it was.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch.profiler import ProfilerActivity

from runtime.engine.distributed import get_tp_group
from runtime.protocol.messages import ProfileOptions

logger = logging.getLogger(__name__)

ACTIVITIES = ("CPU", "GPU")
NOT_STARTED = "profile_not_started"
ALREADY_STARTED = "profile_already_started"
INVALID = "invalid_request"


class ProfileError(Exception):
    """A refused start or stop: ``code`` says which (the HTTP reply's error code), the message why."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class _Running:
    options: ProfileOptions
    profile: Any  # torch.profiler.profile
    activities: list[str]
    steps: int = 0


@dataclass
class _Stopped:
    """The last profile's end (what a stop after an automatic stop says)."""

    output_dir: str
    trace_files: list[str]
    steps: int
    by_itself: bool


@dataclass
class StepProfiler:
    """One rank's profiler. ``agree(failed)``: how many ranks of the TP group failed (a collective,
    so it is also a barrier: the traces are all written before rank 0 answers the stop); the ranks
    agree on each start and stop, so their states never part (a folder one node cannot make)."""

    device: torch.device
    tp_rank: int
    tp_size: int
    dp_rank: int = 0
    dp_size: int = 1
    agree: Callable[[bool], int] = int
    running: _Running | None = None
    last: _Stopped | None = field(default=None)

    @property
    def active(self) -> bool:
        return self.running is not None

    def start(self, options: ProfileOptions) -> dict[str, Any]:
        """Start profiling (ProfileError when it runs already or nothing could be recorded)."""
        if self.running is not None:
            raise ProfileError(
                ALREADY_STARTED,
                f"profiling is already running (profile {self.running.options.profile_id}); call /stop_profile first",
            )
        activities, note = self._activities(options.activities)
        error: ProfileError | None = None
        try:
            Path(options.output_dir).expanduser().mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            error = ProfileError(INVALID, f"output_dir {options.output_dir}: {exc}")
        failed = self.agree(error is not None)
        if failed:
            raise error or ProfileError(
                INVALID, f"output_dir {options.output_dir}: {failed} other TP rank(s) cannot write there"
            )
        profile = torch.profiler.profile(
            activities=[ProfilerActivity.CPU if a == "CPU" else ProfilerActivity.CUDA for a in activities],
            with_stack=options.with_stack,
            record_shapes=options.record_shapes,
            experimental_config=_all_threads(),
        )
        profile.start()
        self.running = _Running(options, profile, activities)
        logger.info(
            "profiling %s (%s) to %s%s",
            options.profile_id,
            ", ".join(activities),
            options.output_dir,
            f" for {options.num_steps} forward steps" if options.num_steps else "",
        )
        until = f" for {options.num_steps} forward steps" if options.num_steps else " until /stop_profile"
        return {
            "success": True,
            "message": f"Start profiling{until} ({', '.join(activities)}).{note}",
            "output_dir": options.output_dir,
            "profile_id": options.profile_id,
            "activities": activities,
            "trace_files": self.trace_files(options),
        }

    def stop(self) -> dict[str, Any]:
        """Stop profiling and write the traces (ProfileError when no profile runs)."""
        if self.running is None:
            message = "profiling is not running; call /start_profile first"
            if self.last is not None and self.last.by_itself:
                message += (
                    f" (the last profile stopped by itself after {self.last.steps} forward steps; "
                    f"its traces: {', '.join(self.last.trace_files)})"
                )
            raise ProfileError(NOT_STARTED, message)
        return self._finish(by_itself=False)

    def forward_step(self) -> None:
        """A forward step was launched: count it (after ``num_steps`` of them the profile is ``due``)."""
        if self.running is not None:
            self.running.steps += 1

    @property
    def due(self) -> bool:
        """The profile has seen its ``num_steps`` forward steps: the scheduler stops it (``stop_due``)
        at the start of its next step, once that last forward has completed."""
        running = self.running
        return (
            running is not None and running.options.num_steps is not None and running.steps >= running.options.num_steps
        )

    def stop_due(self) -> None:
        """Stop the profile that is ``due`` (nobody waits for a reply: a failure is logged)."""
        try:
            self._finish(by_itself=True)
        except ProfileError as exc:
            logger.error("profile stopped after its steps: %s", exc.message)

    def trace_files(self, options: ProfileOptions) -> list[str]:
        """The trace of every TP rank of this replica (each rank writes its own)."""
        return [str(Path(options.output_dir).expanduser() / self._name(options, r)) for r in range(self.tp_size)]

    def _finish(self, by_itself: bool) -> dict[str, Any]:
        running = self.running
        assert running is not None
        self.running = None
        options = running.options
        running.profile.stop()
        path = Path(options.output_dir).expanduser() / self._name(options, self.tp_rank)
        error: OSError | None = None
        try:
            running.profile.export_chrome_trace(str(path))
        except OSError as exc:  # every rank still meets the others below
            error = exc
        failed = self.agree(error is not None)
        files = self.trace_files(options)
        self.last = _Stopped(options.output_dir, files, running.steps, by_itself)
        if error is not None:
            logger.error("profile %s: writing %s failed: %s", options.profile_id, path, error)
            raise ProfileError(INVALID, f"writing the trace {path} failed: {error}")
        if failed:
            raise ProfileError(INVALID, f"{failed} other TP rank(s) could not write their traces (see their log)")
        logger.info("profile %s: %d forward steps, trace %s", options.profile_id, running.steps, path)
        return {
            "success": True,
            "message": f"Stop profiling: {running.steps} forward steps, traces in {options.output_dir}.",
            "output_dir": options.output_dir,
            "profile_id": options.profile_id,
            "num_steps": running.steps,
            "trace_files": files,
        }

    def _name(self, options: ProfileOptions, tp_rank: int) -> str:
        replica = f"-DP-{self.dp_rank}" if self.dp_size > 1 else ""
        return f"{options.profile_id}-TP-{tp_rank}{replica}.trace.json"

    def _activities(self, asked: list[str] | None) -> tuple[list[str], str]:
        """The activities to record, and a note on those this device lacks (dropped)."""
        has_gpu = self.device.type == "cuda"
        if asked is None:
            return (["CPU", "GPU"] if has_gpu else ["CPU"]), ""
        unknown = [a for a in asked if a not in ACTIVITIES]
        if unknown:
            raise ProfileError(
                INVALID, f"activities: {unknown[0]!r} is not supported here; choose from {', '.join(ACTIVITIES)}"
            )
        kept = [a for a in ACTIVITIES if a in asked and (a != "GPU" or has_gpu)]
        if not kept:
            raise ProfileError(
                INVALID, f"activities: this server runs on {self.device.type}, which has no GPU activity"
            )
        return kept, "" if len(kept) == len(set(asked)) else f" GPU skipped: this server runs on {self.device.type}."


def _all_threads() -> Any:
    """Kineto's option to record every thread's ops: with overlap scheduling the forwards run on the
    model worker's thread, not the scheduler's (None where this torch lacks it)."""
    try:
        from torch._C._profiler import _ExperimentalConfig

        return _ExperimentalConfig(profile_all_threads=True)
    except (ImportError, TypeError):
        return None


def tp_agreement(tp_size: int, device: torch.device) -> Callable[[bool], int]:
    """``agree(failed)``: how many ranks of the TP group failed (a one-element all-reduce, called by
    every rank with no forward in flight, so it cannot interleave with a forward's collectives)."""

    def agree(failed: bool) -> int:
        if tp_size == 1:
            return int(failed)
        flag = torch.tensor([1 if failed else 0], dtype=torch.int32, device=device)
        return int(get_tp_group().all_reduce(flag).item())

    return agree
