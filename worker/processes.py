"""The worker's child processes: how they die with their supervisor, how they are stopped, and how
their end is told."""

import ctypes
import importlib.util
import os
import signal
import socket
import subprocess
import sys


def die_with_parent() -> None:
    """In a child, before exec: be killed when the supervisor that started it dies (Linux)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def lean_jax_imports() -> None:
    """At the start of a JAX process (training, a merge, the built-in model server), before anything
    imports Tunix, leave out what Tunedeck never calls:

    - torch: ``import torch`` fails from here on. Where torch is installed, tensorboardX (under Tunix's
      metrics logger) imports it only to recognise torch tensors, which Tunedeck never hands it: about
      3 s of CPU and 180 MB of memory per process.
    - Tunix's package ``__init__``, which imports every trainer Tunix has (RL, agentic GRPO with pandas,
      PPO, distillation, DPO) to re-export their names. Tunedeck imports what it uses by module path
      (``tunix.models.gemma4``, ``tunix.sft.peft_trainer``, ...), which works the same from the bare
      package: about 5 s of CPU per process on a 2-core host."""
    sys.modules.setdefault("torch", None)  # type: ignore[assignment] - None is how a blocked import is spelled
    if "tunix" not in sys.modules:
        spec = importlib.util.find_spec("tunix")
        if spec is not None:  # the package with its search path, its __init__ not run
            sys.modules["tunix"] = importlib.util.module_from_spec(spec)


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


def free_port(host: str) -> int:
    """A TCP port free on ``host`` now (for a server this host starts)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
