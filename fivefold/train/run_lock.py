"""One run per run directory: an advisory lock held for the life of the training process.

The lock is `fcntl.flock` on `<run dir>/.lock`, so the kernel releases it when its holder dies, however
it dies: a lock left by a killed run is simply taken over. The file records the holder's pid, host and
command, so a second run is told who holds the directory.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from fivefold.errors import RunLockedError

LOCK_NAME = ".lock"
HELD_ENV = "FIVEFOLD_RUN_LOCK_HELD"  # set for workers whose launcher holds the lock


class RunLock:
    """`with RunLock(out_dir):` raises RunLockedError if another live process holds `out_dir`."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / LOCK_NAME
        self._fd: int | None = None
        self._made_dir = False

    def acquire(self) -> "RunLock":
        self._made_dir = not self.path.parent.exists()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(os.pread(fd, 4096, 0))
            os.close(fd)
            raise RunLockedError(f"{self.path.parent} is in use by {holder}; wait for it to finish, stop it, "
                                 f"or choose another --out") from None
        previous = os.pread(fd, 4096, 0)
        if previous:
            print(f"fivefold: taking over the lock on {self.path.parent} left by {_describe(previous)}, which is "
                  f"no longer running", file=sys.stderr)
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(),
                             "command": " ".join(["fivefold", *sys.argv[1:]])}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, record, 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)  # a clean exit leaves no "taking over" message for the next run
            # A run refused before it wrote anything (a bad config, a missing init_from) leaves no directory
            # behind it, if the lock made it.
            if self._made_dir and [p.name for p in self.path.parent.iterdir()] == [LOCK_NAME]:
                self.path.unlink()
                self.path.parent.rmdir()
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _describe(raw: bytes) -> str:
    try:
        info = json.loads(raw.decode())
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["since"]))
        return f"PID {info['pid']} on {info['host']} (since {started}: {info['command']})"
    except (ValueError, KeyError, TypeError):
        return "another process"
