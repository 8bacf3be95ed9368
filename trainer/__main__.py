"""`python -m trainer [--config FILE] key=value ...`: see trainer/config.py for the keys.

Exit status: 0 when the run finished its steps; 2 for a bad setting or bad data (one line on stderr); 1 for any
other failure (its traceback, then its cause as the last line); PREEMPTED (143,
128 + SIGTERM, the convention for a process ended by SIGTERM) when a SIGTERM stopped it after saving a checkpoint, so
a scheduler that restarts failed jobs (Kubernetes `restartPolicy: OnFailure`, JobSet, Slurm `--requeue`) restarts it
and it resumes from that checkpoint; INTERRUPTED (130) when a Ctrl-C did (a second Ctrl-C stops it at once)."""

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import warnings

PREEMPTED = 128 + signal.SIGTERM
INTERRUPTED = 128 + signal.SIGINT  # Ctrl-C: a checkpoint saved, then stopped


def registered() -> dict[str, str]:
    """The values of the keys that name a registered thing (every model, task and strategy), for --help: read from
    the registries themselves, so a new one is listed without editing any help text."""
    from trainer import config, models, tasks

    return {"model": "built in: " + ", ".join(models.MODELS), "task": "built in: " + ", ".join(tasks.TASKS),
            "strategy": "one of: " + ", ".join(config.STRATEGIES)}


def user_frame(tb):
    """The innermost frame of `tb` in a user's own code (a model or task given as package.module:attr): not this
    project's packages, not an installed package, not the standard library. None when there is none."""
    import os
    import sysconfig
    import traceback

    ours = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    packages = tuple(os.path.join(ours, name) + os.sep for name in ("trainer", "loader", "dataset_format", "pipelines"))
    installed = tuple(os.path.abspath(sysconfig.get_paths()[k]) + os.sep for k in ("stdlib", "purelib", "platlib"))
    for frame in reversed(traceback.extract_tb(tb)):
        path = os.path.abspath(frame.filename)
        if frame.filename.startswith("<") or path.startswith(packages + installed) or "-packages" + os.sep in path:
            continue
        return frame
    return None


@contextlib.contextmanager
def _summary_alone_on_stdout():
    """While the run runs, what is written to file descriptor 1 goes to 2: stdout then holds the summary's JSON alone
    (gloo, under jax.distributed, prints "[Gloo] Rank 0 is connected to 1 peer ranks" there from C++)."""
    sys.stdout.flush()
    kept = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(kept, 1)
        os.close(kept)


def _leaving_the_job(code: int, process: bool) -> int:
    """`code`, for a run that failed, its cause said as the last line. In a process of its own (`process`), what the
    interpreter's end still has to say is the same failure again and is not said: orbax's other futures of a failed
    write, and its event loop, log "exception was never retrieved", "exception calling callback" or "Exception
    ignored in ... RuntimeError: Event loop is closed" from background threads and finalisers, at random. A process
    of a multi-process job leaves at once: at exit, jax.distributed's shutdown waits at a barrier for every process,
    and when another has died it waits minutes, then aborts with a C++ stack printed after the error."""
    sys.stdout.flush()
    sys.stderr.flush()
    if process:  # (not in a caller's process: its logging and hooks are its own)
        import threading

        logging.disable(logging.CRITICAL)  # every logger, absl's included, from any thread
        sys.unraisablehook = lambda unraisable: None  # what finalisers raise
        threading.excepthook = lambda args: None  # what a background thread's end raises
    jax = sys.modules.get("jax")
    if jax is not None and jax.distributed.is_initialized() and jax.process_count() > 1:
        import time

        logging.shutdown()
        if jax.process_index() == 0:  # its coordination service going first aborts the others (a C++ stack), maybe
            time.sleep(1.0)  # before their own error is out: they leave first, as they learnt it too
        os._exit(code)
    return code


# A collective's error when a process of the job is gone (killed, out of memory, its host lost): gloo's on CPU, NCCL's
# on GPUs. The message names a socket, not the process: the last line says which to look at.
LOST_PEER = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "remote process exited",
             "NCCL communicator was aborted", "stopped sending heartbeats")


def _cause(e: BaseException) -> str:
    """The last line of a failed run: the exception's type and first line, and, for a collective that lost another
    process of a multi-process job, where the cause is."""
    first = str(e).splitlines()[0] if str(e) else ""
    line = f"error: {type(e).__name__}: {first}"
    jax = sys.modules.get("jax")
    if (jax is not None and jax.distributed.is_initialized() and jax.process_count() > 1
            and any(s in str(e) for s in LOST_PEER)):
        line += (f" (process {jax.process_index()} lost another process of the job in a collective: that process's "
                 "own log has the cause; restart every process and they resume from the last checkpoint)")
    return line


def main(argv=None, *, process: bool = False) -> int:
    """python -m trainer's exit status; `process`: main is the whole process (see _leaving_the_job)."""
    from dataset_format.config_help import keys_help
    from trainer.config import TrainConfig

    class Help(argparse.Action):  # the keys' help imports the registries (JAX, Flax): only when asked for
        def __call__(self, parser, namespace, values, option_string=None):
            parser.epilog = f"keys (key=value, or in the --config file):\n{keys_help(TrainConfig, choices=registered())}"
            parser.print_help()
            parser.exit()

    p = argparse.ArgumentParser(prog="python -m trainer", description="Train a JAX model on converted data.",
                                formatter_class=argparse.RawDescriptionHelpFormatter, add_help=False)
    p.add_argument("-h", "--help", action=Help, nargs=0, help="show this help, every key and its values, and exit")
    p.add_argument("--config", action="append", help="a JSON or YAML (.yml, .yaml) file of config keys "
                                                       "(command-line key=value pairs override it)")
    p.add_argument("overrides", nargs="*", help="key=value, e.g. data=out/train steps=500 strategy=mirrored")
    argv = sys.argv[1:] if argv is None else list(argv)
    options = ("h", "help", "config", "")
    dashed = [a for a in argv if a.startswith("-") and a.lstrip("-").partition("=")[0] not in options]
    if dashed:  # `--steps=5` or `-steps=5` for `steps=5`: say the form, not argparse's "unrecognized arguments"
        key, _, value = dashed[0].lstrip("-").partition("=")
        print(f"error: {dashed[0]}: keys are written key=value without dashes: {key}={value or 'VALUE'} "
              "(python -m trainer --help lists every key)", file=sys.stderr)
        return 2
    args = p.parse_intermixed_args(argv)  # --config may come anywhere among the key=value pairs
    from dataset_format import logs
    from trainer import preemption

    if process:  # (a caller's process keeps its own SIGTERM handling)
        preemption.stop_on_sigterm_before_the_steps()

    logs.setup()
    # JAX warns at every fork that it "will likely lead to a deadlock"; subprocess (Ray's processes, `ray start`)
    # execs at once after its fork, which is safe
    warnings.filterwarnings("ignore", r"os\.fork\(\) was called", RuntimeWarning, "subprocess")
    if args.config is not None and len(args.config) > 1:  # (argparse kept the last, and the others went unread)
        print(f"error: --config is given {len(args.config)} times ({', '.join(args.config)}): give one file; "
              "key=value pairs on the command line override it", file=sys.stderr)
        return 2
    try:
        config = TrainConfig.from_args(args.overrides, args.config[0] if args.config else None)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from trainer.checkpoints import UnreadableCheckpoint
    from trainer.launch import run

    try:
        with _summary_alone_on_stdout():
            summary = run(config)
    except (ValueError, FileNotFoundError) as e:  # bad data, strategy or hardware: say what, not where
        where = user_frame(e.__traceback__)  # ... unless the user's own code (a model, a task) raised it
        print(f"error: {e}" + (f" (in {where.filename}:{where.lineno}, {where.name})" if where else ""),
              file=sys.stderr)
        return _leaving_the_job(2, process)
    except UnreadableCheckpoint as e:  # (what to do is in it: orbax's pages of detail are not)
        print(f"error: {e}", file=sys.stderr)
        return _leaving_the_job(1, process)
    except preemption.Terminated as e:  # before the steps: what ran has been cleaned up, as for a Ctrl-C
        print(str(e) or "stopped by SIGTERM before a step of this run ran (nothing saved; the same command resumes "
              "from the latest checkpoint, if any)", file=sys.stderr)
        return _leaving_the_job(PREEMPTED, process)
    except KeyboardInterrupt:  # a Ctrl-C before the loop, or a second one in it: what ran has been cleaned up
        print("stopped by Ctrl-C (no checkpoint saved; the latest one, if any, is where the same command resumes)",
              file=sys.stderr)
        return _leaving_the_job(INTERRUPTED, process)
    except Exception as e:  # noqa: BLE001 - the traceback for the record, then the cause as the last line (a
        # traceback through grain ends in its note on the frames it removed, not in the error)
        import traceback

        from dataset_format import extras

        if isinstance(e, ModuleNotFoundError) and extras.missing_extra(e, "train") is not None:
            raise  # an install without its extra: extras.run_main says which, in one line

        traceback.print_exc()
        print(_cause(e), file=sys.stderr)
        return _leaving_the_job(1, process)
    print(json.dumps({"summary": summary, "workdir": config.workdir}, indent=1))
    if summary.get("stopped_by") == "Ctrl-C":
        return INTERRUPTED
    return PREEMPTED if summary.get("preempted") else 0


if __name__ == "__main__":
    from dataset_format import extras

    sys.exit(extras.run_main(lambda: main(process=True), "python -m trainer", "train"))
