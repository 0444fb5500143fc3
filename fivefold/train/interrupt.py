"""Stopping a run on SIGINT / SIGTERM without losing it.

The first signal is remembered: the trainer finishes the step it is in, saves a checkpoint and returns,
and `fivefold train` exits 128 + the signal number (130, 143) after printing how to resume. A second
signal ends the process at once, without saving. Under torch.distributed the ranks agree after every
step (a max over their flags), so all of them stop after the same step and save one checkpoint together,
even when the signal reached them at different moments.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class GracefulStop:
    """Context manager that turns SIGINT / SIGTERM into a request to stop after the current step."""

    def __init__(self, device: torch.device, distributed: bool, announce: bool = True):
        self.device, self.distributed, self.announce = device, distributed, announce
        self.signum = 0
        self._previous: dict = {}

    def __enter__(self) -> "GracefulStop":
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
            self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.signum:
            sys.stderr.write(f"\n{name} again: stopping now, without saving\n")
            sys.stderr.flush()
            os._exit(128 + signum)
        self.signum = signum
        if self.announce:
            sys.stderr.write(f"\n{name}: finishing this step, saving a checkpoint, then stopping "
                             f"({name} again stops at once, without saving)\n")
            sys.stderr.flush()

    def requested(self) -> int:
        """The signal every rank stops for after this step, or 0 to go on (collective when distributed)."""
        if not self.distributed:
            return self.signum
        flag = torch.tensor([self.signum], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())
