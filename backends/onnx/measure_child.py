"""The measuring processes of runtime.measure:
`python -m backends.onnx.measure_child MODEL FEEDS N THREADS peak|time|timeline`."""
from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
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

    profile_dir = tempfile.mkdtemp(prefix="remat-profile-") if mode == "timeline" else None
    try:
        session = make_session(model_path, threads=threads, arena=mode == "time", cpu_only=True,
                               profile_prefix=None if profile_dir is None else os.path.join(profile_dir, "run"))
        wanted = {i.name for i in session.get_inputs()}
        with np.load(feeds_path) as data:
            feeds = {k: data[k] for k in data.files if k in wanted}
        session.run(None, feeds)
        if mode == "timeline":
            print(json.dumps(_timeline(session, feeds)))
            return
        _measure(session, feeds, repeats, mode)
    finally:
        if profile_dir is not None:
            shutil.rmtree(profile_dir, ignore_errors=True)


def _measure(session, feeds: dict, repeats: int, mode: str) -> None:
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


def _timeline(session, feeds: dict) -> dict:
    """The resident memory above rest while one step runs, sampled by a thread (ONNX Runtime
    releases the GIL while it runs) and placed on the nodes by ONNX Runtime's own profile of the
    step: each node gets the largest sample taken while it ran (or the last one before it). Nodes
    of a Loop's body run inside the Loop's span and are counted in the Loop's."""
    page = os.sysconf("SC_PAGE_SIZE")
    samples: list[tuple[int, int]] = []
    running = threading.Event()
    running.set()

    def sample() -> None:
        with open("/proc/self/statm") as statm:
            while running.is_set():
                statm.seek(0)
                samples.append((time.time_ns(), int(statm.read().split()[1]) * page))
                time.sleep(0.0002)

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    rest = _status_kib("VmRSS") * 1024
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    session.run(None, feeds)
    running.clear()
    sampler.join()
    peak = _status_kib("VmHWM") * 1024
    start = session.get_profiling_start_time_ns()
    with open(session.end_profiling()) as f:
        events = json.load(f)
    step = [e for e in events if e.get("name") == "model_run"][-1]
    kernels = sorted((e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")
                      and step["ts"] <= e["ts"] <= step["ts"] + step["dur"]), key=lambda e: e["ts"])
    names, live, end, k = [], [], -1, 0
    for e in kernels:
        if e["ts"] + e["dur"] <= end:
            continue                  # inside the span of a node already placed (a Loop's body)
        end = e["ts"] + e["dur"]
        t0, t1 = start + e["ts"] * 1000, start + end * 1000
        while k + 1 < len(samples) and samples[k + 1][0] < t0:
            k += 1
        during = [rss for t, rss in samples[k:] if t0 <= t <= t1] or ([samples[k][1]] if samples else [rest])
        names.append(e["name"][:-len("_kernel_time")])
        live.append(max(0, max(during) - rest))
    return {"steps": names, "live": live, "peak_above_rest": peak - rest, "rest": rest, "samples": len(samples)}


if __name__ == "__main__":
    from engine.errors import RematError

    # Any failure is one line on stderr (the parent reports the last line), exit status 1.
    try:
        model, feeds, n, threads, mode = sys.argv[1:6]
        if mode not in ("peak", "time", "timeline") or int(n) < 1 or int(threads) < 1:
            raise ValueError(f"bad arguments {sys.argv[1:]}")
        main(model, feeds, int(n), int(threads), mode)
    except MemoryError:
        print("out of memory", file=sys.stderr)
        sys.exit(1)
    except Exception as err:  # the parent turns this line into a RematError
        text = " ".join(str(err).split())
        print(text if isinstance(err, RematError) else f"{type(err).__name__}: {text}", file=sys.stderr)
        sys.exit(1)
