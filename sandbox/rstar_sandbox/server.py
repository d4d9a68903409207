"""The sandbox server: runs untrusted programs, one fresh process per job.

It runs as PID 1 of a PID namespace of its own: in each sandbox container, and for the
process backend as a host process under `unshare`. Standard library only: the
container's Python has nothing else we ship. Protocol: one JSON object per line in, one
per line out, in order, over stdin/stdout or over a Unix socket (`--listen PATH`).

Three kinds of process:
  * the zygote (PID 1) preloads modules once and forks one child per job. It never
    reads a job's code, input or output: they reach the child as file descriptors, so
    no job can find another job's data in the memory it inherits. As PID 1 it cannot be
    signalled from inside the namespace, and it reaps what jobs leave behind.
    With modules to preload and a job user, a second, lean zygote forked before
    preloading serves the jobs that import neither those modules nor anything outside
    the standard library (`needs_preloaded`): a smaller process is cheaper to fork and
    to tear down. It keeps root's powers (effective uid 0) under a real and saved uid of
    its own (`LEAN_ZYGOTE_UID`), so that neither a job nor the supervisor's `kill(-1)`
    as the job user can signal it.
  * the supervisor, forked by the zygote before preloading, talks to the host. Per job
    it hands the code and the input to a zygote as memfds, enforces the wall-clock
    timeout and the output cap, and afterwards kills every process the job left
    (`kill(-1)` as the job user reaches exactly those), waits until no process but the
    server's is left, and empties every place a job can write (`WRITABLE`).
  * the job child starts its own session, takes its stdin from a memfd and its
    stdout/stderr from pipes, closes every other descriptor, drops to the job user
    (`--job-uid`; where the server cannot change uid, it drops every capability),
    sets rlimits (address space, CPU seconds, processes, file size, open files), and
    executes the code as `__main__` in the clean environment the zygote set up.

SysV IPC and POSIX message queues are switched off (their namespace limits are 0), so
nothing a job leaves can live there. With `--own-mounts` (the process backend) the
zygote first makes the whole host file system read-only in its mount namespace and
mounts one tmpfs for /tmp and /dev/shm, whose size each job pays out of its memory
budget; `--syscall-filter` denies jobs the kernel keyrings and new user namespaces
(what Docker's default seccomp profile does for the Docker backend).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import importlib
import json
import os
import re
import resource
import select
import signal
import socket
import stat
import struct
import sys
import time
import traceback

OK = "ok"
RUNTIME_ERROR = "runtime_error"
TIMEOUT = "timeout"
MEMORY_LIMIT = "memory_limit"
OUTPUT_LIMIT = "output_limit"
SANDBOX_ERROR = "sandbox_error"

SCRATCH = "/tmp"  # the job's working, home and temporary directory
WRITABLE = (SCRATCH, "/dev/shm")  # every place a job can write; emptied after each job
STATUS_FD = 3  # the child reports "out of memory" on this descriptor
JOB_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "PYTHONIOENCODING": "utf-8",
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "HOME": SCRATCH,
    "TMPDIR": SCRATCH,
}
# Namespace limits of 0: no job can create SysV shared memory, semaphores or message
# queues, or POSIX message queues (Python reaches them only through ctypes).
IPC_SYSCTLS = {
    "kernel.shmmni": "0",
    "kernel.msgmni": "0",
    "kernel.sem": "0 0 0 0",
    "fs.mqueue.queues_max": "0",
}
TMPFS_INODES = 4096  # caps the files a job can leave, so a sweep is always short
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
# Zygote -> supervisor: b"X" + the job child's wait status, user and system CPU seconds,
# peak RSS in KiB; b"E" + why the fork failed; b"r" once zombies are reaped.
EXIT_REPORT = struct.Struct("=iddq")
# Supervisor -> job child, in a memfd: CPU seconds, address space, processes, file size,
# open files, then the code (UTF-8). Unpacking it costs the child next to nothing.
JOB_SPEC = struct.Struct("=qqqqq")
LEFTOVER_GRACE_S = 5.0
# The lean zygote's real and saved uid: not root's and no job's (workers run jobs as a uid
# of their own from 10001 up: workers.JOB_UIDS). Signals need the sender's real
# or effective uid to match the target's real or saved one.
LEAN_ZYGOTE_UID = 10000
# An import statement at the start of a line: `import a.b as c, d` or `from a.b import c`.
IMPORT_STATEMENT = re.compile(r"^[ \t]*(?:from[ \t]+(\w+)|import[ \t]+([\w. \t,]+))", re.M)

_libc = ctypes.CDLL(None, use_errno=True)


def _syscall_check(result: int, what: str) -> None:
    if result < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


# -- kernel interfaces Python's os module lacks ------------------------------------------

PR_SET_DUMPABLE = 4
PR_SET_SECCOMP = 22
PR_SET_NO_NEW_PRIVS = 38
SECCOMP_MODE_FILTER = 2


def _prctl(option: int, value: int, pointer=None) -> None:
    # Plain ints (widened to the registers' size by libffi): building ctypes objects
    # would cost each job child tens of microseconds more.
    result = _libc.prctl(option, value, pointer if pointer is not None else 0, 0, 0)
    _syscall_check(result, f"prctl({option})")


MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 0x2, 0x4, 0x8, 0x20, 0x1000
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV, MOUNT_ATTR_NOEXEC = 0x1, 0x2, 0x4, 0x8
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
SYS_MOUNT_SETATTR = 442  # the same number on every architecture (new system calls are)


class _MountAttr(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in ("set", "clr", "propagation", "userns_fd")]


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None):
    def c(text):
        return text.encode() if text is not None else None

    result = _libc.mount(c(source), c(target), c(fstype), ctypes.c_ulong(flags), c(data))
    _syscall_check(result, f"mount {target}")


def _mount_setattr(path: str, set_flags: int = 0, clear_flags: int = 0, recursive=False) -> None:
    attr = _MountAttr(set_flags, clear_flags, 0, 0)
    result = _libc.syscall(
        ctypes.c_long(SYS_MOUNT_SETATTR),
        ctypes.c_long(AT_FDCWD),
        ctypes.c_char_p(path.encode()),
        ctypes.c_long(AT_RECURSIVE if recursive else 0),
        ctypes.byref(attr),
        ctypes.c_long(ctypes.sizeof(attr)),
    )
    _syscall_check(result, f"mount_setattr {path} (needs Linux 5.12)")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint32) for name in ("effective", "permitted", "inheritable")]


def _drop_capabilities() -> None:
    """Clear every capability set (with no-new-privs, no exec can bring one back)."""
    header = _CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3: two data structs
    data = (_CapData * 2)()
    _syscall_check(_libc.capset(ctypes.byref(header), data), "capset")


# seccomp: (audit arch, {name: number}) per machine. The filter denies the kernel
# keyrings (per-user, they outlive every process) and new user namespaces (in one a job
# could mount a tmpfs of any size, outside its memory budget).
SECCOMP_ARCHES = {
    "x86_64": (
        0xC000003E,
        {"add_key": 248, "request_key": 249, "keyctl": 250, "unshare": 272, "clone": 56},
    ),
    "aarch64": (
        0xC00000B7,
        {"add_key": 217, "request_key": 218, "keyctl": 219, "unshare": 97, "clone": 220},
    ),
}
SYS_CLONE3 = 435  # its flags are behind a pointer the filter cannot read: ENOSYS sends
# glibc back to clone, whose flags it can
CLONE_NEWUSER = 0x10000000
X32_SYSCALL_BIT = 0x40000000


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _seccomp_program() -> tuple[_SockFprog, ctypes.Array]:
    machine = os.uname().machine
    if machine not in SECCOMP_ARCHES:
        raise RuntimeError(f"the syscall filter knows {sorted(SECCOMP_ARCHES)}, not {machine}")
    audit_arch, nr = SECCOMP_ARCHES[machine]
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|...|K
    allow, eperm, enosys = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38

    def deny_if(op: int, k: int, action: int = eperm) -> list[tuple]:
        return [(op, 0, 1, k), (ret, 0, 0, action)]  # match: fall through to the return

    code = [(ld, 0, 0, 4), (jeq, 1, 0, audit_arch), (ret, 0, 0, eperm), (ld, 0, 0, 0)]
    if machine == "x86_64":
        code += deny_if(jge, X32_SYSCALL_BIT)
    for name in ("add_key", "request_key", "keyctl"):
        code += deny_if(jeq, nr[name])
    code += deny_if(jeq, SYS_CLONE3, enosys)
    code += [
        (jeq, 2, 0, nr["unshare"]),
        (jeq, 1, 0, nr["clone"]),
        (ret, 0, 0, allow),
        (ld, 0, 0, 16),  # the low half of the first argument: the flags of both
        *deny_if(jset, CLONE_NEWUSER),
        (ret, 0, 0, allow),
    ]
    buffer = ctypes.create_string_buffer(b"".join(struct.pack("=HBBI", *i) for i in code))
    return _SockFprog(len(code), ctypes.addressof(buffer)), buffer


def _fork_function():
    """`os.fork` runs Python's at-fork machinery in every child: with numpy preloaded
    (it imports threading) that is about 200 page faults, some 0.4 ms, per job. In a
    single-threaded CPython 3.11 process all of it repairs what other threads might have
    left mid-way (the GIL, locks, the thread registry), except reseeding `random`, which
    the child does itself (`_reseed`). So there the zygote calls fork(2) directly, with
    the GIL held; anywhere else it uses `os.fork`."""
    threads = len(os.listdir("/proc/self/task"))
    if sys.implementation.name == "cpython" and sys.version_info[:2] == (3, 11) and threads == 1:
        fork = ctypes.PyDLL(None, use_errno=True).fork
        fork.restype = ctypes.c_int
        return fork
    return os.fork


def _reseed() -> None:
    random = sys.modules.get("random")
    if random is not None:
        random.seed()


def _job_streams():
    """The job's sys.stdin, stdout and stderr, built once in the zygote over descriptors
    of the kinds the job's will be (a memfd, then pipes: a stream remembers whether it
    can seek), so that a child only installs them; building them costs ~60 page faults."""
    memfd, (pipe_r, pipe_w) = os.memfd_create("stdin"), os.pipe()
    saved = [os.dup(fd) for fd in (0, 1, 2)]
    try:
        for fd, kind in ((0, memfd), (1, pipe_w), (2, pipe_w)):
            os.dup2(kind, fd)
        return (
            open(0, encoding="utf-8", errors="replace", closefd=False),
            open(1, "w", encoding="utf-8", closefd=False),
            open(2, "w", encoding="utf-8", closefd=False, buffering=1),
        )
    finally:
        for fd, original in enumerate(saved):
            os.dup2(original, fd)
            os.close(original)
        for fd in (memfd, pipe_r, pipe_w):
            os.close(fd)


def needs_preloaded(source: str, preloaded: frozenset[str]) -> bool:
    """Whether a job goes to the zygote that preloaded modules: its source imports one of
    them, or a module outside the standard library (which may import them in turn).
    A textual scan of import statements: an import it misses (`__import__`, importlib,
    one after a `;`) still works in the lean zygote, only slower."""
    for match in IMPORT_STATEMENT.finditer(source):
        if match[1] is not None:
            names = [match[1]]
        else:
            names = [part.split(".")[0].split()[0] for part in match[2].split(",") if part.strip()]
        for name in names:
            if name in preloaded or name not in sys.stdlib_module_names:
                return True
    return False


def _vm_size_bytes() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


# -- the process backend's own mounts ---------------------------------------------------


def own_mounts(tmpfs_mb: int) -> None:
    """Make the host's file system read-only in this mount namespace and put one
    size-capped tmpfs under both /tmp and /dev/shm (two directories of it, its root
    hidden), so that a job can write nowhere else and cannot reach the host's."""
    _mount_setattr("/", set_flags=MOUNT_ATTR_RDONLY, recursive=True)
    _mount_setattr("/proc", clear_flags=MOUNT_ATTR_RDONLY)  # ours, for this PID namespace
    _mount("tmpfs", SCRATCH, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, _tmpfs_options(tmpfs_mb))
    for name in ("tmp", "shm"):
        os.mkdir(f"{SCRATCH}/{name}")
        os.chmod(f"{SCRATCH}/{name}", 0o1777)
    _mount(f"{SCRATCH}/shm", "/dev/shm", None, MS_BIND, None)
    _mount(f"{SCRATCH}/tmp", SCRATCH, None, MS_BIND, None)
    for place in WRITABLE:
        _mount_setattr(place, set_flags=MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC)
    for name, value in IPC_SYSCTLS.items():
        with open("/proc/sys/" + name.replace(".", "/"), "w") as fh:
            fh.write(value)


def _tmpfs_options(size_mb: int) -> str:
    return f"size={size_mb}m,nr_inodes={TMPFS_INODES},mode=755"


def resize_own_tmpfs(size_mb: int) -> None:
    # A remount without MS_BIND changes the shared superblock (so /dev/shm too); the
    # mount flags are repeated because a remount sets them anew.
    flags = MS_REMOUNT | MS_NOSUID | MS_NODEV | MS_NOEXEC
    _mount(None, SCRATCH, None, flags, f"size={size_mb}m")


# -- the job child ----------------------------------------------------------------------


class Zygote:
    """Forks one child per job from memory no job has touched; as PID 1 it also reaps."""

    def __init__(self, job_uid: int | None, syscall_filter: bool):
        self.job_uid = job_uid
        self.seccomp = _seccomp_program() if syscall_filter else None
        self.streams = _job_streams()
        # Resolve now the libc functions children call: the first lookup of a name
        # searches every loaded library (~0.2 ms with numpy's), and would in every child.
        for name in ("prctl", "capset"):
            getattr(_libc, name)
        # The first compile() in a process builds the ast module's ~120 node types (its
        # check whether the source is an AST): done here, not in every child, that is
        # ~130 page faults a job fewer where nothing preloaded has compiled before.
        compile("pass", "main.py", "exec")
        gc.collect()
        gc.freeze()  # children's collections then leave the shared pages alone
        self.base_vm = _vm_size_bytes()
        self.fork = _fork_function()

    def serve(self, ctl: socket.socket) -> None:
        while True:
            try:
                message, fds, _, _ = socket.recv_fds(ctl, 16, 5)
            except OSError:
                return
            if not message:
                return  # the supervisor is gone
            self._reap()  # before a fork too: zombies count against the pids limit
            reply = b"r" if message == b"R" else self._run(fds)
            try:
                ctl.send(reply)
            except OSError:
                return

    @staticmethod
    def _reap() -> None:
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            pass

    def _run(self, fds: list[int]) -> bytes:
        try:
            pid = self.fork()
            if pid < 0:
                errno = ctypes.get_errno()
                raise OSError(errno, os.strerror(errno))
        except OSError as err:
            pid, failure = -1, b"E" + f"cannot fork the job: {err}".encode()
        if pid == 0:
            self._child(*fds)
        for fd in fds:
            os.close(fd)
        if pid < 0:
            return failure
        _, wait_status, usage = os.wait4(pid, 0)
        return b"X" + EXIT_REPORT.pack(wait_status, usage.ru_utime, usage.ru_stime, usage.ru_maxrss)

    def _child(self, spec_fd: int, stdin_fd: int, out_w: int, err_w: int, status_w: int):
        """Runs in the forked child; never returns."""
        try:
            if self.fork is not os.fork:
                _reseed()
            size = os.lseek(spec_fd, 0, os.SEEK_END)  # fstat's result would cost ~9 page faults
            spec = os.pread(spec_fd, size, 0)
            os.setsid()
            for target, fd in ((0, stdin_fd), (1, out_w), (2, err_w), (STATUS_FD, status_w)):
                os.dup2(fd, target)
            os.closerange(STATUS_FD + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
            self._drop_privileges()
            _set_limits(JOB_SPEC.unpack_from(spec), self.base_vm)
            sys.stdin, sys.stdout, sys.stderr = self.streams
            sys.argv = ["main.py"]
            source = spec[JOB_SPEC.size :].decode("utf-8")
        except BaseException:
            os.write(2, traceback.format_exc().encode())
            os._exit(120)
        _exec_job(source)

    def _drop_privileges(self) -> None:
        # Jobs go first when a memory cgroup (the container's) runs out, not the server.
        fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY)
        os.write(fd, b"1000")
        os.close(fd)
        if self.job_uid is not None:  # no supplementary groups: main() dropped them
            os.setgid(self.job_uid)
            os.setuid(self.job_uid)
        else:  # root of a user namespace with no other uid mapped: keep uid 0, lose its powers
            _drop_capabilities()
        # The zygote's "not dumpable" protects the server; the job gets its own /proc
        # files back (its memory, environment, descriptors), as any process has them.
        _prctl(PR_SET_DUMPABLE, 1)
        if self.seccomp is not None:
            _prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(self.seccomp[0]))


def _set_limits(spec: tuple[int, ...], base_vm: int) -> None:
    cpu_s, address_space_mb, processes, file_mb, open_files = spec
    limits = (
        # The child inherits the zygote's mappings; the job's budget comes on top.
        (resource.RLIMIT_AS, base_vm + (address_space_mb << 20)),
        (resource.RLIMIT_CPU, cpu_s),
        (resource.RLIMIT_NPROC, processes),
        (resource.RLIMIT_FSIZE, file_mb << 20),
        (resource.RLIMIT_NOFILE, open_files),
        (resource.RLIMIT_CORE, 0),
    )
    for kind, value in limits:
        resource.setrlimit(kind, (value, value))


def _exec_job(source: str) -> None:
    code = 0
    try:
        exec(
            compile(source, "main.py", "exec"),
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


# -- the supervisor ---------------------------------------------------------------------


def _empty(directory: str) -> None:
    """Remove everything under `directory`, however deep and whatever its modes (the
    job user owns all of it), never following a link. Nothing runs that could change
    it meanwhile: the job's processes are gone."""
    stack = [(os.open(directory, os.O_RDONLY | os.O_DIRECTORY), "")]
    names = [_names(stack[0][0])]  # what is left to remove in each open directory
    try:
        while stack:
            fd = stack[-1][0]
            if not names[-1]:
                os.close(fd)
                _, name = stack.pop()
                names.pop()
                if stack:
                    os.rmdir(name, dir_fd=stack[-1][0])
                continue
            name = names[-1].pop()
            if not stat.S_ISDIR(os.lstat(name, dir_fd=fd).st_mode):
                os.unlink(name, dir_fd=fd)
                continue
            os.chmod(name, 0o700, dir_fd=fd)  # a job may have left it unreadable
            child = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            stack.append((child, name))
            names.append(_names(child))
    finally:
        for fd, _ in stack:
            os.close(fd)


def _names(dir_fd: int) -> list[str]:
    with os.scandir(dir_fd) as entries:
        return [entry.name for entry in entries]


class Supervisor:
    def __init__(
        self,
        zygote: socket.socket,
        job_uid: int | None,
        own_tmpfs_mb: int | None,
        *,
        lean_zygote: socket.socket | None = None,
        preloaded: tuple[str, ...] = (),
        server_pids: tuple[int, ...] = (),
    ):
        self.zygote = zygote  # PID 1: it reaps what jobs leave
        self.lean_zygote = lean_zygote
        self.preloaded = frozenset(preloaded)
        self.server_pids = {1, os.getpid(), *server_pids}
        self.job_uid = job_uid
        self.own_tmpfs_mb = own_tmpfs_mb
        self.tmpfs_mb = own_tmpfs_mb

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

    def _job_spec(self, job: dict) -> bytes:
        memory_mb = int(job["memory_mb"])
        if self.own_tmpfs_mb is not None:
            # The job's tmpfs comes out of its memory budget: the files it may hold plus
            # its address space stay within memory_mb.
            tmpfs_mb = max(1, min(self.own_tmpfs_mb, memory_mb // 4))
            if tmpfs_mb != self.tmpfs_mb:
                resize_own_tmpfs(tmpfs_mb)
                self.tmpfs_mb = tmpfs_mb
            memory_mb = max(1, memory_mb - tmpfs_mb)
        limits = JOB_SPEC.pack(
            int(job["timeout_s"]) + 1,
            memory_mb,
            int(job["max_processes"]),
            int(job["max_file_mb"]),
            int(job["max_open_files"]),
        )
        return limits + job["code"].encode("utf-8")

    def _run(self, job: dict) -> dict:
        spec_fd = os.memfd_create("job")
        stdin_fd = os.memfd_create("stdin")
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        status_r, status_w = os.pipe()
        child_ends = [spec_fd, stdin_fd, out_w, err_w, status_w]
        try:
            os.write(spec_fd, self._job_spec(job))
            os.write(stdin_fd, job["stdin"].encode("utf-8"))
            os.lseek(stdin_fd, 0, os.SEEK_SET)
            zygote = self._zygote_for(job["code"])
            started = time.monotonic()
            _to_zygote(zygote, b"J", child_ends)
        finally:
            for fd in child_ends:
                os.close(fd)
        try:
            buffers, verdict, report = self._collect(job, zygote, started, out_r, err_r, status_r)
            wall = time.monotonic() - started
            if report is None:  # timeout or output cap: end it, then hear how it ended
                with self._as_job_user():
                    _kill_all()
                report = _reply_from_zygote(zygote)
        finally:
            for fd in (out_r, err_r, status_r):
                os.close(fd)
            self._reset()
        wait_status, user_s, system_s, maxrss_kib = EXIT_REPORT.unpack(report)
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
            "cpu_s": round(user_s + system_s, 6),
            "peak_memory_mb": round(maxrss_kib / 1024, 3),
        }

    def _zygote_for(self, code: str) -> socket.socket:
        if self.lean_zygote is not None and not needs_preloaded(code, self.preloaded):
            return self.lean_zygote
        return self.zygote

    def _collect(self, job: dict, zygote, started: float, out_r: int, err_r: int, status_r: int):
        """Read the child's output until it exits and its pipes drain, or until a
        verdict: TIMEOUT at the wall-clock deadline, OUTPUT_LIMIT past the cap.
        Returns (buffers, verdict, the zygote's exit report or None)."""
        limit = int(job["output_limit_bytes"])
        deadline = started + float(job["timeout_s"])
        buffers = {out_r: bytearray(), err_r: bytearray(), status_r: bytearray()}
        ctl = zygote.fileno()
        poller = select.poll()
        for fd in (*buffers, ctl):
            poller.register(fd, select.POLLIN)
        open_fds = len(buffers)
        report = None
        while report is None or open_fds:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return buffers, TIMEOUT, report
            wait_s = min(remaining, 0.05) if report is not None else remaining
            events = poller.poll(wait_s * 1000)
            if report is not None and not events:
                break  # a leftover descendant holds the pipes open: stop waiting
            for fd, _ in events:
                if fd == ctl:
                    report = _reply_from_zygote(zygote)
                    poller.unregister(ctl)
                    continue
                chunk = os.read(fd, READ_CHUNK)
                if not chunk:
                    poller.unregister(fd)
                    open_fds -= 1
                    continue
                buffer = buffers[fd]
                buffer += chunk
                if fd != status_r and len(buffer) > limit:
                    del buffer[limit:]
                    return buffers, OUTPUT_LIMIT, report
        return buffers, None, report

    @contextlib.contextmanager
    def _as_job_user(self):
        """Act as the job user: `kill(-1)` then reaches exactly the jobs' processes, and
        the files they made can be removed. Only the effective uid changes, so jobs
        still cannot signal the supervisor."""
        if self.job_uid is None:
            yield
            return
        os.seteuid(self.job_uid)
        try:
            yield
        finally:
            os.seteuid(0)

    def _reset(self) -> None:
        """Kill what the job left running, wait until it is gone (a process killed in
        the middle of a system call finishes that call first), empty the writable
        places."""
        with self._as_job_user():
            _kill_all()
            deadline = time.monotonic() + LEFTOVER_GRACE_S
            while self._leftovers():
                _to_zygote(self.zygote, b"R")  # leftovers are PID 1's orphans: it reaps them
                _reply_from_zygote(self.zygote)
                if not self._leftovers():
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError("processes left by the job would not die")
                time.sleep(0.001)
            for place in WRITABLE:
                _empty(place)

    def _leftovers(self) -> bool:
        """Whether any process but the server's is left, zombies included. (`kill(-1)`
        cannot tell: it counts the lean zygote, which it may not signal.)"""
        return any(
            name.isdigit() and int(name) not in self.server_pids for name in os.listdir("/proc")
        )


def _to_zygote(zygote: socket.socket, message: bytes, fds: list[int] | None = None) -> None:
    try:
        if fds:
            socket.send_fds(zygote, [message], fds)
        else:
            zygote.send(message)
    except OSError as err:
        sys.exit(f"rstar-sandbox: the zygote is gone: {err}")


def _reply_from_zygote(zygote: socket.socket, timeout_s: float = LEFTOVER_GRACE_S) -> bytes:
    zygote.settimeout(timeout_s)
    try:
        reply = zygote.recv(4096)
    except OSError as err:  # out of step with the zygote: this worker is done
        sys.exit(f"rstar-sandbox: no answer from the zygote: {err}")
    finally:
        zygote.settimeout(None)
    if not reply:
        sys.exit("rstar-sandbox: the zygote is gone")
    if reply[:1] == b"E":
        raise RuntimeError(reply[1:].decode())
    return reply[1:]


def _kill_all() -> None:
    """SIGKILL every process this one may signal but PID 1 and itself. In the kernel
    this is one pass that no fork can slip past."""
    try:
        os.kill(-1, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _serve(supervisor: Supervisor, rfile, wfile) -> None:
    for line in rfile:
        if not line.strip():
            continue
        try:
            request = json.loads(line)
        except ValueError as err:
            reply = {"id": None, "status": SANDBOX_ERROR, "stderr": f"bad request: {err}"}
        else:
            reply = supervisor.run_job(request)
        wfile.write(json.dumps(reply).encode("utf-8") + b"\n")
        wfile.flush()


def supervise(args, supervisor: Supervisor) -> int:
    if not args.listen:
        _serve(supervisor, sys.stdin.buffer, sys.stdout.buffer)
        return 0
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(args.listen)
    listener.listen(1)
    conn, _ = listener.accept()
    listener.close()  # one client only (the host removes the socket's path)
    with conn, conn.makefile("rb") as rfile, conn.makefile("wb") as wfile:
        try:
            _serve(supervisor, rfile, wfile)
        except (BrokenPipeError, ConnectionResetError):
            pass
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", help="serve one client on this Unix socket path")
    parser.add_argument("--preload", default="", help="comma-separated modules to import once")
    parser.add_argument("--job-uid", type=int, help="run jobs as this uid (the server is root)")
    parser.add_argument(
        "--own-mounts",
        type=int,
        metavar="TMPFS_MB",
        help="make the host file system read-only and mount /tmp and /dev/shm as one "
        "tmpfs of at most TMPFS_MB, paid from each job's memory (the process backend)",
    )
    parser.add_argument(
        "--syscall-filter", action="store_true", help="deny jobs keyrings and user namespaces"
    )
    args = parser.parse_args(argv)
    if os.getpid() != 1:
        parser.error("must run as PID 1 of its own PID namespace (a container, unshare --pid)")

    # Jobs inherit the zygote's dispositions: all default (Python ignores SIGPIPE and
    # SIGXFSZ and handles SIGINT; jobs keep SIGXFSZ ignored, so a write past the file
    # size limit raises instead of killing). As PID 1 the zygote still cannot be
    # signalled from inside: init only receives signals it has a handler for.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    _prctl(PR_SET_DUMPABLE, 0)  # no job may ptrace the server or read its /proc files
    _prctl(PR_SET_NO_NEW_PRIVS, 1)  # inherited: no setuid binary or file capability lifts a job
    if args.job_uid is not None:
        os.setgroups([])  # once here rather than in every job child
    if args.own_mounts is not None:
        own_mounts(args.own_mounts)
    os.environ.clear()  # before preloading, so numpy's BLAS starts single-threaded
    os.environ.update(JOB_ENV)
    os.chdir(SCRATCH)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))  # cheap closerange

    preload = tuple(filter(None, args.preload.split(",")))
    zygote_end, supervisor_end = _control_pair()
    lean_zygote, lean_pid = None, None
    if preload and args.job_uid is not None:
        if args.job_uid == LEAN_ZYGOTE_UID:
            parser.error(f"--job-uid {LEAN_ZYGOTE_UID} is the lean zygote's own")
        lean_zygote, lean_pid = _fork_lean_zygote(args, inherited=(zygote_end, supervisor_end))
    if os.fork() == 0:
        zygote_end.close()
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # jobs that share its uid cannot stop it
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # a closed host connection is an error
        supervisor = Supervisor(
            supervisor_end,
            args.job_uid,
            args.own_mounts,
            lean_zygote=lean_zygote,
            preloaded=preload,
            server_pids=(lean_pid,) if lean_pid else (),
        )
        return supervise(args, supervisor)
    for end in (supervisor_end, lean_zygote):
        if end is not None:
            end.close()
    _leave_the_host_connection()
    for name in preload:
        try:
            importlib.import_module(name)
        except ImportError as err:
            print(f"rstar-sandbox: cannot preload {name}: {err}", file=sys.stderr)
    Zygote(args.job_uid, args.syscall_filter).serve(zygote_end)
    return 0


def _fork_lean_zygote(args, inherited: tuple[socket.socket, ...]) -> tuple[socket.socket, int]:
    """Start the zygote for jobs that import only the standard library, before anything
    is preloaded. Returns the supervisor's end of its control socket, and its pid."""
    zygote_end, supervisor_end = _control_pair()
    pid = os.fork()
    if pid == 0:
        for end in (*inherited, supervisor_end):
            end.close()
        os.setresuid(LEAN_ZYGOTE_UID, 0, LEAN_ZYGOTE_UID)
        _prctl(PR_SET_DUMPABLE, 0)  # a change of uids resets it
        _leave_the_host_connection()
        Zygote(args.job_uid, args.syscall_filter).serve(zygote_end)
        os._exit(0)
    zygote_end.close()
    return supervisor_end, pid


def _control_pair() -> tuple[socket.socket, socket.socket]:
    """(zygote's end, supervisor's end): one message per job each way."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


def _leave_the_host_connection() -> None:
    """The host's connection (stdin/stdout for the process backend) is the supervisor's."""
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):
        os.dup2(devnull, fd)
    os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
