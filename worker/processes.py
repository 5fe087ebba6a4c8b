"""The worker's child processes: how they die with their supervisor, how they are stopped, and how
their end is told."""

import ctypes
import os
import signal
import subprocess
import sys


def die_with_parent() -> None:
    """In a child, before exec: be killed when the supervisor that started it dies (Linux)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def without_torch() -> None:
    """At the start of a JAX process (training, a merge): ``import torch`` fails from here on. Where torch
    is installed, tensorboardX (under Tunix's metrics logger) imports it only to recognise torch tensors,
    which Tunedeck never hands it: about 3 s of CPU and 180 MB of memory per process."""
    sys.modules.setdefault("torch", None)  # type: ignore[assignment] - None is how a blocked import is spelled


def stop(child: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM, then SIGKILL if it is still there after ``grace_s``. A child that leads a process group
    of its own (``start_new_session``) is signalled with its group, so its own children go too."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if child.poll() is not None:
            return
        try:
            if os.getpgid(child.pid) == child.pid:
                os.killpg(child.pid, sig)
            else:
                child.send_signal(sig)
        except ProcessLookupError:
            return
        try:
            child.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


def exit_reason(code: int) -> str:
    """``killed by SIGKILL`` or ``exited with code 3``, from a Popen return code."""
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"
