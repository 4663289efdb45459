"""The measuring processes of runtime.measure:
`python -m backends.onnx.measure_child MODEL FEEDS N THREADS peak|time`."""
from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} missing from /proc/self/status")


def main(model_path: str, feeds_path: str, repeats: int, threads: int, mode: str) -> None:
    from backends.onnx.runtime import make_session

    session = make_session(model_path, threads=threads, arena=mode == "time", cpu_only=True)
    wanted = {i.name for i in session.get_inputs()}
    with np.load(feeds_path) as data:
        feeds = {k: data[k] for k in data.files if k in wanted}
    session.run(None, feeds)
    if mode == "peak":
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        rest = _status_kib("VmRSS")
        session.run(None, feeds)
        peak = _status_kib("VmHWM")
        print(json.dumps({"peak_above_rest": (peak - rest) * 1024, "rest": rest * 1024,
                          "provider": session.get_providers()[0]}))
        return
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        session.run(None, feeds)
        times.append(time.perf_counter() - start)
    print(json.dumps({"seconds": statistics.median(times)}))


if __name__ == "__main__":
    from engine.errors import RematError

    # Any failure is one line on stderr (the parent reports the last line), exit status 1.
    try:
        model, feeds, n, threads, mode = sys.argv[1:6]
        if mode not in ("peak", "time") or int(n) < 1 or int(threads) < 1:
            raise ValueError(f"bad arguments {sys.argv[1:]}")
        main(model, feeds, int(n), int(threads), mode)
    except MemoryError:
        print("out of memory", file=sys.stderr)
        sys.exit(1)
    except Exception as err:  # the parent turns this line into a RematError
        text = " ".join(str(err).split())
        print(text if isinstance(err, RematError) else f"{type(err).__name__}: {text}", file=sys.stderr)
        sys.exit(1)
