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
    from jax.profiler import ProfileData

    traces = sorted(storage.glob(storage.join(directory, "plugins/profile/*/*.xplane.pb")))
    if not traces:
        raise FileNotFoundError(f"no trace under {directory}: train with profile_steps=N (N > 0) to write one")
    profile = ProfileData.from_serialized_xspace(storage.read_bytes(traces[-1]))
    ops: dict[str, dict[str, float]] = {}
    for plane in profile.planes:
        if not plane.name.startswith("/device:") or plane.name.startswith("/device:CUSTOM"):
            continue
        lines = list(plane.lines)
        chosen = [line for line in lines if line.name == "XLA Ops"] or \
                 [line for line in lines if line.name.startswith("Stream")]
        for line in chosen:
            for event in line.events:
                op = ops.get(event.name)
                if op is None:
                    stats = dict(event.stats)
                    category = stats.get("hlo_category") or stats.get("category") or kernel_kind(event.name)
                    op = ops[event.name] = {"seconds": 0.0, "count": 0, "category": str(category) or "?"}
                op["seconds"] += event.duration_ns / 1e9
                op["count"] += 1
    return ops


_KINDS = (("matrix multiply", ("gemm", "xmma", "cutlass", "cublas", "matmul")),
          ("attention (cuDNN)", ("cudnn", "fmha", "flash", "sdpa")),
          ("collective", ("nccl", "all-reduce", "all_reduce", "allreduce", "all-gather", "reduce-scatter")),
          ("copy", ("memcpy", "memset", "copy")))


def kernel_kind(name: str) -> str:
    """A GPU kernel's kind by its name, where the trace gives no XLA category ("" when the name says none)."""
    lowered = name.lower()
    return next((kind for kind, marks in _KINDS if any(mark in lowered for mark in marks)), "")


def report(ops: dict[str, dict[str, float]], top: int = 25) -> str:
    """The `top` operations by device time, each with its share, as lines a person reads."""
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
    return "\n".join([*rows, f"total device time {total:.4f} s over {len(ops)} operations"])


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m trainer.profile_report",
                                     description="The operations a profile_steps= trace spent its device time on.")
    parser.add_argument("directory", help="WORKDIR/profile of a run with profile_steps=N")
    parser.add_argument("--top", type=int, default=25, help="operations to list (default 25)")
    args = parser.parse_args(argv)
    try:
        print(report(device_ops(args.directory), args.top))
    except FileNotFoundError as e:
        parser.exit(2, f"error: {e}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
