"""What a `profile_steps=` trace (trainer/profiling.py) spent the devices' time on: each operation's time and share,
the table XProf's "HLO op stats" gives, in a terminal: `python -m trainer.profile_report WORKDIR/profile`.
"""

from __future__ import annotations

from dataset_format import storage


def device_ops(directory: str) -> dict[str, dict[str, float]]:
    """The newest trace under `directory` (WORKDIR/profile): each operation the devices ran, {name: {"seconds":
    total time, "count": times run, "category": its kind, "?" where neither the trace nor its name says}}, summed
    over the devices' "XLA Ops" lines (one event per HLO operation: a fusion, a matrix multiply, a custom call such
    as cuDNN's attention) or, where a device plane has none, over its kernels. {} for a trace of a CPU run (XLA:CPU
    traces no device plane)."""
    return read(directory)[0]


def read(directory: str) -> tuple[dict[str, dict[str, float]], tuple[float, float]]:
    """(device_ops(directory), (busy, span)): the seconds in which some operation ran, and the seconds from each
    device's first operation to its last, both summed over the devices. span - busy is the time the devices
    idled between operations within the profiled steps (waiting for the host, or for a kernel's launch)."""
    from jax.profiler import ProfileData

    traces = sorted(storage.glob(storage.join(directory, "plugins/profile/*/*.xplane.pb")))
    if not traces:
        raise FileNotFoundError(f"no trace under {directory}: train with profile_steps=N (N > 0) to write one")
    profile = ProfileData.from_serialized_xspace(storage.read_bytes(traces[-1]))
    ops: dict[str, dict[str, float]] = {}
    busy = span = 0.0
    for plane in profile.planes:
        if not plane.name.startswith("/device:") or plane.name.startswith("/device:CUSTOM"):
            continue
        lines = list(plane.lines)
        chosen = [line for line in lines if line.name == "XLA Ops"] or \
                 [line for line in lines if line.name.startswith("Stream")]
        intervals = []
        for line in chosen:
            for event in line.events:
                op = ops.get(event.name)
                if op is None:
                    stats = dict(event.stats)
                    category = stats.get("hlo_category") or stats.get("category") or kernel_kind(event.name)
                    op = ops[event.name] = {"seconds": 0.0, "count": 0, "category": str(category) or "?"}
                op["seconds"] += event.duration_ns / 1e9
                op["count"] += 1
                intervals.append((event.start_ns / 1e9, (event.start_ns + event.duration_ns) / 1e9))
        plane_busy, plane_span = occupancy(intervals)
        busy, span = busy + plane_busy, span + plane_span
    return ops, (busy, span)


def occupancy(intervals: list[tuple[float, float]]) -> tuple[float, float]:
    """(the length of the union of these (start, end) intervals, last end - first start)."""
    busy, covered_to = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > covered_to:
            busy += end - max(start, covered_to)
            covered_to = end
    return busy, (max(end for _, end in intervals) - min(start for start, _ in intervals)) if intervals else 0.0


_KINDS = (("matrix multiply", ("gemm", "xmma", "cutlass", "cublas", "matmul")),
          ("attention (cuDNN)", ("cudnn", "fmha", "flash", "sdpa")),
          ("collective", ("nccl", "all-reduce", "all_reduce", "allreduce", "all-gather", "reduce-scatter")),
          ("copy", ("memcpy", "memset", "copy")))


def kernel_kind(name: str) -> str:
    """A GPU kernel's kind by its name, where the trace gives no XLA category ("" when the name says none)."""
    lowered = name.lower()
    return next((kind for kind, marks in _KINDS if any(mark in lowered for mark in marks)), "")


def report(ops: dict[str, dict[str, float]], top: int = 25, occupied: tuple[float, float] | None = None) -> str:
    """The `top` operations by device time, each with its share, as lines a person reads; with `occupied` (read's
    (busy, span)), the share of the profiled span in which the devices ran an operation."""
    total = sum(op["seconds"] for op in ops.values())
    if not total:
        return "no device operations in this trace (a CPU run traces none)"
    categories: dict[str, float] = {}
    for op in ops.values():
        categories[op["category"]] = categories.get(op["category"], 0.0) + op["seconds"]
    rows = [f"{'share':>6} {'seconds':>9} {'count':>6}  operation (category)",
            *(f"{op['seconds'] / total:6.1%} {op['seconds']:9.4f} {op['count']:6d}  {name} ({op['category']})"
              for name, op in sorted(ops.items(), key=lambda kv: -kv[1]["seconds"])[:top]),
            "", f"{'share':>6} {'seconds':>9}  category",
            *(f"{seconds / total:6.1%} {seconds:9.4f}  {name}"
              for name, seconds in sorted(categories.items(), key=lambda kv: -kv[1]))]
    rows.append(f"total device time {total:.4f} s over {len(ops)} operations")
    if occupied and occupied[1]:
        busy, span = occupied
        rows.append(f"the devices ran an operation {busy:.4f} s of the {span:.4f} s from their first operation to "
                    f"their last ({busy / span:.1%}); idle between operations: {span - busy:.4f} s")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m trainer.profile_report",
                                     description="The operations a profile_steps= trace spent its device time on.")
    parser.add_argument("directory", help="WORKDIR/profile of a run with profile_steps=N")
    parser.add_argument("--top", type=int, default=25, help="operations to list (default 25)")
    args = parser.parse_args(argv)
    try:
        ops, occupied = read(args.directory)
        print(report(ops, args.top, occupied))
    except FileNotFoundError as e:
        parser.exit(2, f"error: {e}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
