"""Workers: one sandbox server each, in a Docker container or a namespaced host process.

Both speak the server's JSON-lines protocol over a stream socket, so the pool drives
them the same way; they differ only in how the server is started and stopped.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rstar_sandbox.server import IPC_SYSCTLS, SCRATCH, TMPFS_INODES, WRITABLE

SERVER_FILE = Path(__file__).with_name("server.py")
CONTAINER_SERVER = "/opt/rstar/server.py"
CONTAINER_SOCKET_DIR = "/run/rstar"
OWNER_LABEL = "rstar-sandbox.owner"
# The uids jobs run as, one per worker on the host (the image's sandbox user is the first).
# RLIMIT_NPROC counts a user's processes over the whole kernel, containers included: workers
# sharing a uid share the limit, and one worker's jobs would fail to fork (EAGAIN) while
# another's run. Below 65536, which a user-namespaced Docker daemon maps.
JOB_UIDS = range(10001, 10001 + 4096)
UID_LOCKS = Path(tempfile.gettempdir()) / "rstar-sandbox-uids"
log = logging.getLogger("rstar_sandbox")


class JobUid:
    """A uid of JOB_UIDS no other worker on this host holds: a lock file per uid, taken
    without waiting, held while the worker lives (the kernel drops it if its holder dies)."""

    def __init__(self):
        UID_LOCKS.mkdir(mode=0o700, exist_ok=True)
        for uid in JOB_UIDS:
            fd = os.open(UID_LOCKS / f"{uid}.lock", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self.uid, self._fd = uid, fd
            return
        raise RuntimeError(
            f"every job uid of {JOB_UIDS.start}-{JOB_UIDS.stop - 1} is held by a sandbox "
            f"worker on this host (locks in {UID_LOCKS})"
        )

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class WorkerDied(RuntimeError):
    """The server stopped answering (crashed, killed, or hung past the job's timeout)."""


class Worker:
    """A started sandbox server reachable through `self._sock`."""

    name = "worker"
    _sock: socket.socket

    def execute(self, request: dict, timeout_s: float) -> dict:
        try:
            self._sock.settimeout(timeout_s)
            self._sock.sendall(json.dumps(request).encode("utf-8") + b"\n")
            line = self._reader.readline()
        except (OSError, ValueError) as err:  # timeouts are OSErrors too
            raise WorkerDied(f"{self.name}: {type(err).__name__}: {err}") from err
        if not line:
            raise WorkerDied(f"{self.name}: the server closed the connection")
        reply = json.loads(line)
        if reply.get("id") != request["id"]:
            raise WorkerDied(
                f"{self.name}: reply for job {reply.get('id')}, expected {request['id']}"
            )
        return reply

    def _connect(self, sock: socket.socket) -> None:
        self._sock = sock
        self._reader = sock.makefile("rb")

    def close(self) -> None:
        for closer in (getattr(self, "_reader", None), getattr(self, "_sock", None)):
            if closer is not None:
                try:
                    closer.close()
                except OSError:
                    pass
        job_uid = getattr(self, "job_uid", None)
        if job_uid is not None:
            job_uid.release()


def locked_down(tmpfs_mb: int) -> dict:
    """The containers.run options that lock a sandbox container down."""
    tmpfs = f"rw,nosuid,nodev,noexec,size={tmpfs_mb}m,nr_inodes={TMPFS_INODES},mode=1777"
    return {
        "network_mode": "none",
        "read_only": True,
        "tmpfs": dict.fromkeys(WRITABLE, tmpfs),
        "sysctls": IPC_SYSCTLS,
        "user": "0:0",
        "cap_drop": ["ALL"],
        "cap_add": ["SETUID", "SETGID"],
        "security_opt": ["no-new-privileges"],
    }


class DockerWorker(Worker):
    """A locked-down container: no network, read-only root, size- and inode-capped
    tmpfs mounts for /tmp and /dev/shm (the only places a job can write), SysV IPC and
    POSIX message queues off, no-new-privileges, caps on pids, memory and CPU, and
    Docker's default seccomp profile. The server runs as root with only the two
    capabilities it needs to start each job as this worker's own non-root user. The
    server file is mounted read-only, so the image never goes stale."""

    def __init__(
        self,
        client,
        image: str,
        index: int,
        *,
        preload: tuple[str, ...],
        memory_mb: int,
        pids: int,
        cpus: float,
        tmpfs_mb: int,
        start_timeout_s: float,
    ):
        self.name = f"docker-worker-{index}"
        self.job_uid = JobUid()
        self._socket_dir = tempfile.mkdtemp(prefix="rstar-sandbox-")
        os.chmod(self._socket_dir, 0o777)  # the container's root creates the socket here
        command = [
            "python3",
            "-I",
            CONTAINER_SERVER,
            "--job-uid",
            str(self.job_uid.uid),
            "--listen",
            f"{CONTAINER_SOCKET_DIR}/server.sock",
            "--preload",
            ",".join(preload),
        ]
        try:
            self.container = client.containers.run(
                image,
                command=command,
                detach=True,
                **locked_down(tmpfs_mb),
                pids_limit=pids,
                mem_limit=f"{memory_mb}m",
                memswap_limit=f"{memory_mb}m",
                nano_cpus=int(cpus * 1e9),
                working_dir=SCRATCH,
                volumes={
                    str(SERVER_FILE): {"bind": CONTAINER_SERVER, "mode": "ro"},
                    self._socket_dir: {"bind": CONTAINER_SOCKET_DIR, "mode": "rw"},
                },
                labels={OWNER_LABEL: owner_label()},
            )
            self._connect(self._wait_for_socket(start_timeout_s))
            # Connected: nothing in the container may write to this host directory again.
            os.unlink(os.path.join(self._socket_dir, "server.sock"))
            os.chmod(self._socket_dir, 0o555)
        except BaseException:
            self.close()
            raise

    def _wait_for_socket(self, timeout_s: float) -> socket.socket:
        path = os.path.join(self._socket_dir, "server.sock")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if os.path.exists(path):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    sock.connect(path)
                    return sock
                except OSError:
                    sock.close()
            self.container.reload()
            if self.container.status == "exited":
                logs = self.container.logs(tail=20).decode(errors="replace")
                raise RuntimeError(f"{self.name}: the sandbox server exited at start:\n{logs}")
            time.sleep(0.02)
        raise RuntimeError(f"{self.name}: the sandbox server did not start in {timeout_s:.0f} s")

    def kill(self) -> None:
        """Stop the container abruptly (used by tests and when it stops answering)."""
        self.container.kill()

    def close(self) -> None:
        super().close()
        container = getattr(self, "container", None)
        if container is not None:
            try:
                container.remove(force=True)
            except Exception as err:  # already gone, or the engine went away: nothing to keep
                log.debug("%s: remove failed: %s", self.name, err)
        shutil.rmtree(self._socket_dir, ignore_errors=True)


_warned_process_backend = False


def default_interpreter() -> str:
    """Debian's python3 when there is one: jobs run as a user of their own, who may not be
    able to read an interpreter installed under a private home (pyenv under /root, say)."""
    return "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable


def _namespace_command(python: str, server_args: list[str]) -> list[str]:
    """Fresh PID, network, IPC, UTS and mount namespaces, the server as their PID 1."""
    user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    return [
        "unshare",
        *user,
        "--fork",
        "--pid",
        "--mount-proc",
        "--net",
        "--ipc",
        "--uts",
        "--mount",
        "--propagation",
        "private",
        "--",
        python,
        "-I",
        # The source, not its path: the path may lie under /tmp, which the new tmpfs hides.
        "-c",
        SERVER_FILE.read_text(),
        *server_args,
    ]


class ProcessWorker(Worker):
    """The same server as a host process in fresh namespaces: no network, its own PID
    namespace, the host's file system read-only, one size-capped tmpfs of its own for
    /tmp and /dev/shm paid from each job's memory, the same rlimits, and a syscall
    filter against keyrings and user namespaces. Started as root, jobs run as a uid of
    this worker's own (JobUid); otherwise as the caller inside a user namespace, with
    every capability dropped.
    Weaker than a container: the host's files are readable where "others" may read
    them, and there is no memory or pids cgroup."""

    def __init__(
        self,
        index: int,
        *,
        preload: tuple[str, ...],
        tmpfs_mb: int,
        start_timeout_s: float,
        python: str | None = None,
    ):
        global _warned_process_backend
        if not _warned_process_backend:
            log.warning(
                "rstar_sandbox: process backend: jobs run as host processes in fresh "
                "namespaces with rlimits; isolation is weaker than the Docker backend"
            )
            _warned_process_backend = True
        if shutil.which("unshare") is None:
            raise RuntimeError("the process backend needs `unshare` (util-linux)")
        self.name = f"process-worker-{index}"
        server_args = ["--own-mounts", str(tmpfs_mb), "--syscall-filter"]
        if os.geteuid() == 0:
            self.job_uid = JobUid()
            server_args += ["--job-uid", str(self.job_uid.uid)]
        server_args += ["--preload", ",".join(preload)]
        host_end, server_end = socket.socketpair()
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}
        try:
            self.process = subprocess.Popen(
                _namespace_command(python or default_interpreter(), server_args),
                stdin=server_end,
                stdout=server_end,
                stderr=subprocess.PIPE,
                env=env,
                start_new_session=True,
            )
        except BaseException:
            Worker.close(self)  # the uid goes back
            raise
        finally:
            server_end.close()
        self._connect(host_end)
        # A first no-op job proves the server (and its namespaces) came up.
        try:
            self.execute({"id": -1, "code": "pass", "timeout_s": 5.0}, start_timeout_s)
        except WorkerDied as err:
            self.kill()
            stderr = self.process.stderr.read().decode(errors="replace")[-2000:]
            self.close()
            raise RuntimeError(
                f"{self.name}: the sandbox server did not start: {err}\n{stderr}"
            ) from err

    def kill(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def close(self) -> None:
        super().close()
        self.kill()
        self.process.wait()
        self.process.stderr.close()


def owner_label() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def remove_orphaned_containers(client) -> int:
    """Remove sandbox containers left by processes of this host that no longer exist
    (a pool killed by SIGKILL cannot clean up after itself)."""
    removed = 0
    host = socket.gethostname()
    for container in client.containers.list(all=True, filters={"label": OWNER_LABEL}):
        owner_host, _, pid = container.labels.get(OWNER_LABEL, "").rpartition(":")
        if owner_host == host and pid.isdigit() and not _pid_alive(int(pid)):
            container.remove(force=True)
            removed += 1
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
