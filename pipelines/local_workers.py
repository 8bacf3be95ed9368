"""Beam's worker processes on this machine (the DirectRunner's `multi_processing` mode) stop with the command.

Two things went wrong without this. A SIGTERM to the command (`kill PID`, a pod or VM stopping) could leave Beam's
runner waiting on its workers: its cleanup joins each worker's thread, which waits for the worker process to end, and
workers stopped in the middle of their bundles were seen not to (the command waited over ten minutes, until killed,
its lease held). A terminal's Ctrl-C reached the workers as well
(they share its process group): each printed its KeyboardInterrupt and grpc tracebacks, a hundred lines around the
command's last one.

So, while a pipeline runs with worker processes, a Ctrl-C or a SIGTERM kills the workers before the runner's cleanup
waits for them, and the runner's threads' reports of workers that died are not printed; and each worker, once it
converts, takes a Ctrl-C as the default action (its end, silent) rather than as Python's KeyboardInterrupt
(`take_ctrl_c_silently`, from the DoFn's setup: Beam gives the DirectRunner's workers no options, so no plugin of
Beam's can do it at their start). A Ctrl-C in a worker's first seconds, while it imports Beam, may still print a
traceback.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading

WORKER_MAIN = b"apache_beam.runners.worker.sdk_worker_main"
LAUNCHER = "PIPELINES_LAUNCHER_PID"  # set while the pipeline runs: the workers inherit it with the environment


@contextlib.contextmanager
def stopped_with_this_process(active: bool):
    """Runs the body with Beam's local worker processes tied to this one (above). `active`: the pipeline starts worker
    processes. Elsewhere than in the main thread (the only one that handles signals) or on a system without Linux's
    /proc, nothing changes."""
    if not (active and threading.current_thread() is threading.main_thread() and os.path.isdir("/proc/self")):
        yield
        return
    stopping = threading.Event()
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    previous = {sig: handler for sig, handler in previous.items() if callable(handler)}  # (not a background job's
    # ignored SIGINT, nor a default action, which ends the process and its workers' connections at once)

    def stop(signum, frame):
        stopping.set()
        kill_workers()
        previous[signum](signum, frame)

    hook = threading.excepthook

    def quiet(args):
        if not (stopping.is_set() and args.thread is not None and args.thread.name == "run_worker"):
            hook(args)

    for sig in previous:
        signal.signal(sig, stop)
    threading.excepthook = quiet
    os.environ[LAUNCHER] = str(os.getpid())
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        threading.excepthook = hook
        os.environ.pop(LAUNCHER, None)


def take_ctrl_c_silently() -> None:
    """In one of the command's local worker processes (nowhere else): a SIGINT ends it at once, without Python's
    KeyboardInterrupt and its tracebacks. Any thread may call it: it sets the action in C (Python's `signal.signal`
    works only in the main thread, and a worker runs its DoFns in others)."""
    launcher = os.environ.get(LAUNCHER)
    if launcher is None or launcher == str(os.getpid()) or not os.path.isdir("/proc/self"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.signal.argtypes, libc.signal.restype = (ctypes.c_int, ctypes.c_void_p), ctypes.c_void_p
    libc.signal(signal.SIGINT, None)  # SIG_DFL


def kill_workers() -> int:
    """SIGKILLs this process's Beam worker processes (and the shells that started them); how many."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    parent = int(f.read().rsplit(b")", 1)[1].split()[1])  # (after the name, which may hold anything)
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(parent, []).append(int(name))
    workers, todo = [], list(children.get(os.getpid(), ()))
    while todo:
        pid = todo.pop(0)
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read()
        except OSError:
            continue
        if WORKER_MAIN in command:
            workers.append(pid)
            todo.extend(children.get(pid, ()))
    killed = 0
    for pid in reversed(workers):  # the workers before their shells: a shell's end stops the runner's logging server,
        with contextlib.suppress(OSError):  # and a worker still alive then printed that its logging client failed
            os.kill(pid, signal.SIGKILL)
            killed += 1
    return killed
