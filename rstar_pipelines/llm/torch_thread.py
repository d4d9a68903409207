"""One thread for the torch work of the models this process loads (the transformers backend's
models and the PPM): loading them and every forward.

Torch's CPU kernels run their parallel loops on OpenMP (libgomp), which keeps a team of threads
per thread that starts parallel loops. While the process has more such threads than CPUs,
libgomp throttles the spinning with which a team's threads wait for the next loop to almost
nothing, and every parallel loop then waits for a sleeping thread to be woken. A model loaded on
a Dagster step's thread and generating on the LLM batcher's worker thread
(`types.GenerateBatcher`) makes two teams, and on a machine with few CPUs every small matmul of
a decode step then waits for a woken thread, which can cost as much as the matmul itself
(docs/benchmarks.md). Work handed to `run` goes to one long-lived thread, whoever asks, so
whatever thread calls `generate` the process has one team doing the models' work.

A model being trained (`TransformersLLM.wrap`) generates on its trainer's thread instead: the
training loop's own team is the one it should share.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None
_thread: threading.Thread | None = None


def _started() -> None:
    global _thread
    import torch

    _thread = threading.current_thread()
    # The process's torch thread count, as this thread's OpenMP setting too.
    torch.set_num_threads(torch.get_num_threads())


def _pool() -> ThreadPoolExecutor:
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="rstar-torch", initializer=_started
            )
        return _executor


def run(function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`function(*args, **kwargs)` on the torch thread (here, when called from it), its result
    or its exception."""
    if threading.current_thread() is _thread:
        return function(*args, **kwargs)
    return _pool().submit(function, *args, **kwargs).result()


def _forget() -> None:
    # A forked child has none of its parent's threads: its first `run` starts its own.
    global _executor, _thread, _lock
    _executor, _thread, _lock = None, None, threading.Lock()


os.register_at_fork(after_in_child=_forget)
