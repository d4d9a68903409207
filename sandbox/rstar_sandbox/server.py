"""The sandbox server: runs untrusted programs, one fresh process per job.

It runs inside each sandbox container (and, for the process backend, as a host
process in fresh namespaces). Standard library only: the container's Python has
nothing else we ship. Protocol: one JSON object per line in, one per line out, in
order, over stdin/stdout or over a Unix socket (`--listen PATH`).

Each job is run by a child forked from this warm process (so preloaded modules cost
nothing per job and no state survives from one job to the next):
  * the child starts its own session, takes the job's stdin from a memfd and its
    stdout/stderr from pipes, closes every other descriptor, sets rlimits (address
    space, CPU seconds, processes, file size, open files) and a clean environment,
    then executes the code as `__main__`;
  * the server enforces the wall-clock timeout and the output cap, and afterwards
    kills every process the job left behind (as PID 1 of its namespace: all of
    them; elsewhere: the job's process group) and empties the scratch directory.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import selectors
import shutil
import signal
import socket
import sys
import time
import traceback

OK = "ok"
RUNTIME_ERROR = "runtime_error"
TIMEOUT = "timeout"
MEMORY_LIMIT = "memory_limit"
OUTPUT_LIMIT = "output_limit"
SANDBOX_ERROR = "sandbox_error"

STATUS_FD = 3  # the child reports "out of memory" on this descriptor
JOB_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "PYTHONIOENCODING": "utf-8",
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
NOBODY = 65534
READ_CHUNK = 1 << 16
DEFAULTS = {
    "stdin": "",
    "timeout_s": 10.0,
    "memory_mb": 256,
    "output_limit_bytes": 1 << 20,
    "max_processes": 64,
    "max_file_mb": 16,
    "max_open_files": 256,
}


def _vm_size_bytes() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _set_limits(job: dict, base_vm: int) -> None:
    cpu = int(job["timeout_s"]) + 1
    # The child inherits the warm parent's mappings; the job's budget comes on top.
    address_space = base_vm + (int(job["memory_mb"]) << 20)
    limits = {
        resource.RLIMIT_AS: address_space,
        resource.RLIMIT_CPU: cpu,
        resource.RLIMIT_NPROC: int(job["max_processes"]),
        resource.RLIMIT_FSIZE: int(job["max_file_mb"]) << 20,
        resource.RLIMIT_NOFILE: int(job["max_open_files"]),
        resource.RLIMIT_CORE: 0,
    }
    for kind, value in limits.items():
        resource.setrlimit(kind, (value, value))


def _child(
    job: dict, stdin_fd: int, out_w: int, err_w: int, status_w: int, scratch: str, base_vm: int
) -> None:
    """Runs in the forked child; never returns."""
    try:
        os.setsid()
        for target, fd in ((0, stdin_fd), (1, out_w), (2, err_w), (STATUS_FD, status_w)):
            os.dup2(fd, target)
        os.closerange(STATUS_FD + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        if os.getuid() == 0:  # process backend started as root: run jobs as nobody
            try:
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
            except OSError:
                pass  # root of a user namespace where nobody is unmapped: already unprivileged
        _set_limits(job, base_vm)
        os.environ.clear()
        os.environ.update(JOB_ENV, HOME=scratch, TMPDIR=scratch)
        os.chdir(scratch)
        sys.stdin = open(0, encoding="utf-8", errors="replace", closefd=False)
        sys.stdout = open(1, "w", encoding="utf-8", closefd=False)
        sys.stderr = open(2, "w", encoding="utf-8", closefd=False, buffering=1)
        sys.argv = ["main.py"]
    except BaseException:
        os.write(2, traceback.format_exc().encode())
        os._exit(120)
    code = 0
    try:
        exec(
            compile(job["code"], "main.py", "exec"),
            {"__name__": "__main__", "__builtins__": __builtins__},
        )
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except MemoryError as exc:
        os.write(STATUS_FD, b"M")
        code = 1
        try:
            _print_job_traceback(exc)
        except MemoryError:
            pass
    except BaseException as exc:
        code = 1
        _print_job_traceback(exc)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    os._exit(code & 0xFF)


def _print_job_traceback(exc: BaseException) -> None:
    # Skip this file's own frame: the job's traceback starts at its main.py.
    tb = exc.__traceback__.tb_next if exc.__traceback__ else None
    traceback.print_exception(type(exc), exc, tb)


def _kill_leftovers(pgid: int) -> None:
    """Kill what the job left running and reap it, including orphans re-parented here."""
    deadline = time.monotonic() + 5
    while True:
        if os.getpid() == 1:
            # PID 1 of a namespace: kill(-1) reaches every other process in it, even
            # ones that started their own session to escape the process group.
            try:
                os.kill(-1, signal.SIGKILL)
            except ProcessLookupError:
                pass
        else:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            return
        if time.monotonic() > deadline:
            return
        time.sleep(0.001)


def _wipe(directory: str) -> None:
    with os.scandir(directory) as entries:
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    os.unlink(entry.path)
            except OSError:
                pass


class Server:
    def __init__(self, scratch: str):
        self.scratch = scratch
        self.base_vm = _vm_size_bytes()

    def run_job(self, request: dict) -> dict:
        job = {**DEFAULTS, **request}
        try:
            return self._run(job)
        except Exception:  # the server itself failed: say so, keep serving
            return {
                "id": job.get("id"),
                "status": SANDBOX_ERROR,
                "exit_code": None,
                "stdout": "",
                "stderr": traceback.format_exc(),
                "wall_s": 0.0,
                "cpu_s": 0.0,
                "peak_memory_mb": 0.0,
            }

    def _run(self, job: dict) -> dict:
        stdin_fd = os.memfd_create("stdin")
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        status_r, status_w = os.pipe()
        child_ends = [stdin_fd, out_w, err_w, status_w]
        try:
            os.write(stdin_fd, job["stdin"].encode("utf-8"))
            os.lseek(stdin_fd, 0, os.SEEK_SET)
            started = time.monotonic()
            pid = os.fork()
            if pid == 0:
                _child(job, stdin_fd, out_w, err_w, status_w, self.scratch, self.base_vm)
        finally:
            for fd in child_ends:
                os.close(fd)
        try:
            buffers, verdict = self._collect(job, pid, started, out_r, err_r, status_r)
            wall = time.monotonic() - started
            if verdict is not None:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            _, wait_status, usage = os.wait4(pid, 0)
        finally:
            _kill_leftovers(pid)
            for fd in (out_r, err_r, status_r):
                os.close(fd)
            _wipe(self.scratch)

        exit_code = os.waitstatus_to_exitcode(wait_status)
        if verdict is None:
            if b"M" in buffers[status_r]:
                verdict = MEMORY_LIMIT
            elif exit_code == -signal.SIGXCPU:
                verdict = TIMEOUT
            elif exit_code == -signal.SIGKILL:
                verdict = MEMORY_LIMIT  # killed, and not by us: the memory cgroup's OOM killer
            else:
                verdict = OK if exit_code == 0 else RUNTIME_ERROR
        return {
            "id": job.get("id"),
            "status": verdict,
            "exit_code": exit_code,
            "stdout": buffers[out_r].decode("utf-8", errors="replace"),
            "stderr": buffers[err_r].decode("utf-8", errors="replace"),
            "wall_s": round(wall, 6),
            "cpu_s": round(usage.ru_utime + usage.ru_stime, 6),
            "peak_memory_mb": round(usage.ru_maxrss / 1024, 3),
        }

    @staticmethod
    def _collect(job: dict, pid: int, started: float, out_r: int, err_r: int, status_r: int):
        """Read the child's output until it exits and its pipes drain, or until a
        verdict: TIMEOUT at the wall-clock deadline, OUTPUT_LIMIT past the cap."""
        limit = int(job["output_limit_bytes"])
        deadline = started + float(job["timeout_s"])
        buffers = {out_r: bytearray(), err_r: bytearray(), status_r: bytearray()}
        pidfd = os.pidfd_open(pid)
        exited = False
        try:
            with selectors.DefaultSelector() as sel:
                for fd in (*buffers, pidfd):
                    sel.register(fd, selectors.EVENT_READ)
                while not exited or len(sel.get_map()) > 0:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return buffers, TIMEOUT
                    events = sel.select(min(remaining, 0.05) if exited else remaining)
                    if exited and not events:
                        break  # a leftover descendant holds the pipes open: stop waiting
                    for key, _ in events:
                        if key.fd == pidfd:
                            exited = True
                            sel.unregister(pidfd)
                            continue
                        chunk = os.read(key.fd, READ_CHUNK)
                        if not chunk:
                            sel.unregister(key.fd)
                            continue
                        buffer = buffers[key.fd]
                        buffer += chunk
                        if key.fd != status_r and len(buffer) > limit:
                            del buffer[limit:]
                            return buffers, OUTPUT_LIMIT
        finally:
            os.close(pidfd)
        return buffers, None


def _serve(server: Server, rfile, wfile) -> None:
    for line in rfile:
        if not line.strip():
            continue
        try:
            request = json.loads(line)
        except ValueError as err:
            reply = {"id": None, "status": SANDBOX_ERROR, "stderr": f"bad request: {err}"}
        else:
            reply = server.run_job(request)
        wfile.write(json.dumps(reply).encode("utf-8") + b"\n")
        wfile.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", help="serve one client on this Unix socket path")
    parser.add_argument(
        "--scratch", required=True, help="the jobs' working directory, emptied after every job"
    )
    parser.add_argument("--preload", default="", help="comma-separated modules to import once")
    args = parser.parse_args(argv)

    os.environ.update(JOB_ENV)  # before preloading, so numpy's BLAS starts single-threaded
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))  # cheap closerange
    for name in filter(None, args.preload.split(",")):
        try:
            importlib.import_module(name)
        except ImportError as err:
            print(f"rstar-sandbox: cannot preload {name}: {err}", file=sys.stderr)
    os.makedirs(args.scratch, exist_ok=True)
    server = Server(args.scratch)

    if not args.listen:
        _serve(server, sys.stdin.buffer, sys.stdout.buffer)
        return 0
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(args.listen)
    listener.listen(1)
    conn, _ = listener.accept()
    listener.close()
    os.unlink(args.listen)  # one client only: jobs cannot connect to it afterwards
    with conn, conn.makefile("rb") as rfile, conn.makefile("wb") as wfile:
        try:
            _serve(server, rfile, wfile)
        except (BrokenPipeError, ConnectionResetError):
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
