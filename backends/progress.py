"""A progress line while a long step runs (an export, a measurement, planning), on a terminal only.

`with progress("measuring gpt.onnx"):` writes `remat: measuring gpt.onnx... 12 s` to stdout,
updated every half second and erased when the step ends, so the step's own output follows on a
clean line. When stdout is not a terminal (a pipe, a file, a CI log) it writes nothing.
"""
from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

ERASE = "\r\033[K"


@contextmanager
def progress(what: str, stream: TextIO | None = None) -> Iterator[None]:
    stream = stream if stream is not None else sys.stdout
    if not stream.isatty():
        yield
        return
    start = time.monotonic()
    finished = threading.Event()

    def show() -> None:
        while True:
            stream.write(f"{ERASE}remat: {what}... {time.monotonic() - start:.0f} s")
            stream.flush()
            if finished.wait(0.5):
                return

    ticker = threading.Thread(target=show, daemon=True)
    ticker.start()
    try:
        yield
    finally:
        finished.set()
        ticker.join()
        stream.write(ERASE)
        stream.flush()
