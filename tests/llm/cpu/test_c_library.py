"""The C kernels' build: every kernel compiles on any x86-64 Linux (a source that does not
compile fails here, whatever the CPU) and every kernel the CPU can run loads; where the machine
gets in the way (no compiler, an unwritable cache, a library that does not load) torch's
kernels run, with one warning; processes building at once take turns."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from rstar_pipelines.llm.cpu.kernels import c_library, decode_attention_cpu, quantized_cpu

LIBRARIES = (
    quantized_cpu.AMX,
    quantized_cpu.AVX512_BF16,
    quantized_cpu.AVX512,
    quantized_cpu.AVX2,
    quantized_cpu.INT8_AVX512_BF16,
    decode_attention_cpu.KERNEL,
)
# The CPU's own flags, before a test says it has every kernel's.
CPU_FLAGS = c_library.cpu_flags


@pytest.fixture
def fresh_libraries(monkeypatch):
    """Every library loads again in the test, each cause warns afresh, and every kernel's CPU
    features are there."""
    monkeypatch.setattr(c_library, "_warned", set())
    every = frozenset().union(*(library.needs for library in LIBRARIES))
    monkeypatch.setattr(c_library, "cpu_flags", lambda: every)
    for library in LIBRARIES:
        library.library.cache_clear()
    yield
    for library in LIBRARIES:
        library.library.cache_clear()


def _warnings(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == c_library.__name__ and r.levelno == logging.WARNING
    ]


@pytest.mark.skipif(not c_library.x86_64_linux(), reason="the kernels are built for x86-64 Linux")
@pytest.mark.parametrize("library", LIBRARIES, ids=lambda library: library.label)
def test_every_kernel_compiles_whatever_the_cpu(library):
    # Compiling for an instruction set needs only the compiler, so a source that does not
    # compile fails here on every x86-64 machine, with the compiler's messages.
    try:
        built = library.build()
    except subprocess.CalledProcessError as error:
        pytest.fail(f"{library.source.name} does not compile:\n{error.stderr}")
    assert built.is_file()


@pytest.mark.parametrize(
    "library",
    [
        pytest.param(
            library,
            id=library.label,
            marks=pytest.mark.skipif(
                not library.runs_here(),
                reason=f"the CPU lacks {sorted(library.needs - CPU_FLAGS())}",
            ),
        )
        for library in LIBRARIES
    ],
)
def test_every_kernel_the_cpu_can_run_loads(library):
    library.library.cache_clear()
    try:
        assert library.available()
    finally:
        library.library.cache_clear()


def test_without_a_compiler_every_kernel_is_off_with_one_warning(
    fresh_libraries, monkeypatch, tmp_path, caplog
):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.INFO, logger=c_library.__name__):
        assert not any(library.available() for library in LIBRARIES)
    assert _warnings(caplog) == ["C kernels off, torch's run: no C compiler (gcc or $CC)"]


def test_an_unwritable_cache_turns_the_kernels_off_with_one_warning(
    fresh_libraries, monkeypatch, tmp_path, caplog
):
    # A file where the cache directory would go: no process, root included, can make it.
    blocker = tmp_path / "cache"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    with caplog.at_level(logging.INFO, logger=c_library.__name__):
        assert not any(library.available() for library in LIBRARIES)
    [warning] = _warnings(caplog)
    assert "the kernel cache cannot be written" in warning
    # Torch's kernels answer instead.
    query, key = torch.randn(1, 1, 2, 64), torch.randn(1, 1, 5, 64)
    assert decode_attention_cpu.decode_attention(query, key, key, None, 1.0) is None


def test_a_library_that_does_not_load_turns_its_kernel_off_with_one_warning(
    fresh_libraries, monkeypatch, caplog
):
    runnable = [library for library in LIBRARIES if not library.needs - CPU_FLAGS()]
    if not runnable:
        pytest.skip("the CPU runs none of the kernels")

    def cannot_load(path, *args, **kwargs):
        raise OSError(f"{path}: wrong ELF class: ELFCLASS32")

    monkeypatch.setattr(c_library, "cpu_flags", CPU_FLAGS)
    monkeypatch.setattr(c_library.ctypes, "CDLL", cannot_load)
    with caplog.at_level(logging.INFO, logger=c_library.__name__):
        assert not any(library.available() for library in runnable)
    [warning] = _warnings(caplog)
    assert "wrong ELF class" in warning


def test_a_source_that_does_not_compile_turns_its_kernel_off_with_one_warning(
    fresh_libraries, monkeypatch, tmp_path, caplog
):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a compiler that fails on every source
    with caplog.at_level(logging.INFO, logger=c_library.__name__):
        assert not decode_attention_cpu.KERNEL.available()
    [warning] = _warnings(caplog)
    assert "failed to build it" in warning
    with pytest.raises(subprocess.CalledProcessError):
        decode_attention_cpu.KERNEL.build()
    assert not list(tmp_path.rglob("*.so"))


def test_processes_building_at_once_take_turns_and_build_once(tmp_path):
    runnable = [library for library in LIBRARIES if library.runs_here()]
    if not runnable:
        pytest.skip("the CPU runs none of the kernels")
    compiles = tmp_path / "compiles.log"
    compiler = tmp_path / "slow-gcc"
    # A compiler that takes its time, so that the second process asks while the first builds.
    compiler.write_text(f'#!/bin/sh\necho "$$" >> {compiles}\nsleep 2\nexec gcc "$@"\n')
    compiler.chmod(0o755)
    script = textwrap.dedent(
        """
        from rstar_pipelines.llm.cpu.kernels import decode_attention_cpu, quantized_cpu
        kernels = [quantized_cpu.AVX2, quantized_cpu.AVX512, decode_attention_cpu.KERNEL]
        print(next(kernel for kernel in kernels if kernel.runs_here()).available())
        """
    )
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "CC": str(compiler)}
    processes = [
        subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [process.communicate(timeout=600)[0] for process in processes]
    assert [process.returncode for process in processes] == [0, 0]
    assert [output.strip() for output in outputs] == ["True", "True"]
    assert len(compiles.read_text().splitlines()) == 1
