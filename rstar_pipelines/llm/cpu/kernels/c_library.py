"""Kernels of our own in C, built with the machine's C compiler on first use and loaded with
ctypes (the quantized matmuls of `quantized_cpu`, the decode attention of
`decode_attention_cpu`).

A library is compiled with gcc (or `$CC`) into the cache (`$XDG_CACHE_HOME/rstar-pipelines/
kernels`, named by a hash of the source and the command), so a changed source or flag gets a
library of its own; processes building one at once take turns on a file lock, and the later
ones load what the first built. OpenMP comes from the libgomp torch has loaded, so a kernel's
threads are torch's.

`library()` is None, and callers keep torch's kernels, where the CPU lacks the instructions the
flags compile for (logged), and, with one warning a cause a process, where there is no
compiler, where the cache directory cannot be written, where the compiler fails on a source,
where the built library does not load, or where an `init` function refuses (Linux not granting
AMX's tile state). `build()` raises instead: the tests build every kernel the CPU can run with
it, so that a source that does not compile fails them.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rstar_kernels.cpu_features import cpu_flags

log = logging.getLogger(__name__)

BUILD_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC")
# Where Linux's name of a CPU feature is not gcc's flag for it.
LINUX_NAMES = {"avx512bf16": "avx512_bf16"}


# The causes already warned of in this process (a missing compiler is one warning, not one a
# kernel).
_warned: set[str] = set()


def _warn_once(cause: str, message: str, *args: Any) -> None:
    if cause not in _warned:
        _warned.add(cause)
        log.warning(message, *args)


class NoCompiler(RuntimeError):
    """Neither gcc nor `$CC` is on the PATH."""


def _cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "rstar-pipelines" / "kernels"


def x86_64_linux() -> bool:
    """Whether this machine is what the kernels' sources are written and compiled for."""
    return platform.system() == "Linux" and platform.machine() == "x86_64"


class CLibrary:
    """One C source built with `flags` (and `defines`), whose function `entry` returns an int
    status and takes `argtypes`."""

    def __init__(
        self,
        label: str,
        source: str,
        flags: tuple[str, ...],
        entry: str,
        argtypes: Sequence[Any],
        defines: tuple[str, ...] = (),
        init: str | None = None,
    ):
        self.label, self.flags, self.defines, self.init = label, flags, defines, init
        self.entry, self.argtypes = entry, list(argtypes)
        self.source = Path(__file__).with_name(source)
        # The CPU features the flags compile for, as Linux names them ("-mamx-bf16": amx_bf16).
        self.needs = frozenset(
            LINUX_NAMES.get(feature, feature)
            for feature in (flag.removeprefix("-m").replace("-", "_") for flag in flags)
        )

    def runs_here(self) -> bool:
        """Whether this machine's CPU has the instructions the flags compile for (x86-64 Linux,
        from /proc/cpuinfo)."""
        return x86_64_linux() and not self.needs - cpu_flags()

    def build(self) -> Path:
        """The library, compiled into the cache unless it is there; NoCompiler, OSError (the
        cache directory) or CalledProcessError (the compiler's, with its messages) where it
        cannot be."""
        compiler = shutil.which(os.environ.get("CC", "gcc"))
        if compiler is None:
            raise NoCompiler("no C compiler (gcc or $CC) on the PATH")
        command = (compiler, *self.flags, *self.defines, *BUILD_FLAGS)
        digest = hashlib.sha256(self.source.read_bytes() + " ".join(command).encode())
        target = _cache_dir() / f"{self.source.stem}-{digest.hexdigest()[:16]}.so"
        if target.exists():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        # One process builds; the others wait for it and load what it built.
        with open(target.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not target.exists():
                # Compiled beside the target and renamed onto it: a present library is whole.
                with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
                    built = Path(scratch) / target.name
                    subprocess.run(
                        [*command, str(self.source), "-o", str(built)],
                        check=True,
                        capture_output=True,
                        text=True,
                    )
                    built.replace(target)
        return target

    @functools.cache  # noqa: B019 - one per kernel, module-level objects that live as long
    def library(self) -> ctypes.CDLL | None:
        """The loaded library, built on the first call; None where it cannot run (logged)."""
        if not self.runs_here():
            missing = ", ".join(sorted(self.needs - cpu_flags())) or "x86-64 Linux"
            log.info("%s kernel off: the CPU lacks %s", self.label, missing)
            return None
        try:
            path = self.build()
        except NoCompiler:
            _warn_once("compiler", "C kernels off, torch's run: no C compiler (gcc or $CC)")
            return None
        except subprocess.CalledProcessError as error:
            _warn_once(
                f"build {self.source.name}",
                "%s kernel off, torch's runs: %s failed to build it:\n%s",
                self.label,
                error.cmd[0],
                error.stderr,
            )
            return None
        except OSError as error:
            _warn_once(
                "cache",
                "C kernels off, torch's run: the kernel cache cannot be written (%s)",
                error,
            )
            return None
        try:
            library = ctypes.CDLL(str(path))
        except OSError as error:
            _warn_once("load", "%s kernel off, torch's runs: %s", self.label, error)
            return None
        if self.init is not None and getattr(library, self.init)() != 0:
            _warn_once(
                f"init {self.label}",
                "%s kernel off: Linux did not grant the process AMX's tile state",
                self.label,
            )
            return None
        function = getattr(library, self.entry)
        function.restype = ctypes.c_int
        function.argtypes = self.argtypes
        return library

    def available(self) -> bool:
        """Whether the kernel runs here (built and loaded on the first call)."""
        return self.library() is not None

    def call(self, *args: Any) -> int:
        """The entry's status for `args`; RuntimeError where the kernel cannot run here."""
        library = self.library()
        if library is None:
            raise RuntimeError(f"the {self.label} kernel is not available on this machine")
        return getattr(library, self.entry)(*args)
