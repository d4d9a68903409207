"""Jobs as an attacker writes them: nothing a job writes or starts survives it, no job
reaches the host's shared memory, and no job can read another's input, on both backends.

Each hostile job reports what it found as JSON on stdout; a worker is told apart by the
PID namespace its job sees (one per worker on both backends)."""

import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
import uuid

import pytest

from rstar_sandbox import MEMORY_LIMIT, OK, RUNTIME_ERROR, Job, Sandbox
from tests.fakes.repo import host_processes_matching
from tests.fakes.sandbox import has_lean_zygote

WORKER_ID = "os.readlink('/proc/self/ns/pid')"

# Jobs that import only the standard library run in the lean zygote, the others in the
# one that preloaded numpy (server.needs_preloaded): hostile jobs try from both.
ZYGOTES = {"lean": "", "preloaded": "import numpy\n"}
from_each_zygote = pytest.mark.parametrize("first_line", ZYGOTES.values(), ids=ZYGOTES.keys())


def server_processes(backend: str) -> int:
    """PID 1 (the zygote that preloads numpy), the supervisor and the lean zygote."""
    return 3 if has_lean_zygote(backend) else 2


# Plants something in every place a job could keep state, or tries to; reports each try.
PLANT = """
import ctypes, json, os, platform, subprocess, sys, time
marker = sys.stdin.read().strip()
tried = {}
def attempt(name, action):
    try:
        result = action()
        tried[name] = "ok" if result is None or result >= 0 else f"errno {ctypes.get_errno()}"
    except Exception as exc:
        tried[name] = type(exc).__name__
def write(path):
    with open(path, "w") as fh:
        fh.write(marker)
def locked_deep_tree():
    os.makedirs(f"/tmp/{marker}-tree/" + "/".join(["d"] * 200))
    write(f"/tmp/{marker}-tree/d/file")
    os.chmod(f"/tmp/{marker}-tree/d", 0)
for place in ("/tmp", "/dev/shm", os.path.expanduser("~"), os.getcwd()):
    attempt(f"file in {place}", lambda: write(f"{place}/{marker}-{len(tried)}"))
attempt("deep tree, unreadable", locked_deep_tree)
attempt("symlink to a host file", lambda: os.symlink("/etc/passwd", f"/tmp/{marker}-link"))
for place in ("/var/tmp", "/run/lock", "/usr/local", "/etc", "/", "/run/rstar"):
    attempt(f"file in {place}", lambda: write(f"{place}/{marker}"))
libc = ctypes.CDLL(None, use_errno=True)
attempt("sysv shm", lambda: libc.shmget(0x5EC, 4096, 0o1666))
attempt("sysv sem", lambda: libc.semget(0x5EC, 1, 0o1666))
attempt("sysv msg", lambda: libc.msgget(0x5EC, 0o1666))
librt = ctypes.CDLL("librt.so.1", use_errno=True)
queue = b"/" + marker.encode()
attempt("posix mq", lambda: librt.mq_open(queue, os.O_CREAT | os.O_RDWR, 0o600, None))
add_key = {"x86_64": 248, "aarch64": 217}[platform.machine()]
attempt("user keyring", lambda: libc.syscall(add_key, b"user", marker.encode(), b"x", 1, -4))
attempt("user namespace", lambda: libc.unshare(0x10000000))
attempt("ptrace the server", lambda: libc.ptrace(16, 1, 0, 0))
subprocess.Popen(["sleep", "1000", marker], start_new_session=True)
if os.fork() == 0:  # a daemon that keeps writing, in its own session
    os.setsid()
    for i in range(100000):
        try:
            write(f"/dev/shm/{marker}-late-{i}")
        except OSError:
            pass
    os._exit(0)
time.sleep(0.3)  # long enough that both workers take some of these jobs
print(json.dumps({"worker": WORKER_ID_EXPR, "tried": tried}))
""".replace("WORKER_ID_EXPR", WORKER_ID)

# Lists what a later job can find of earlier ones.
PROBE = """
import json, os, time
found = {}
for place in ("/tmp", "/dev/shm", os.path.expanduser("~"), os.getcwd()):
    found[place] = sorted(os.listdir(place))
for kind in ("shm", "sem", "msg"):
    found["sysv " + kind] = open(f"/proc/sysvipc/{kind}").read().splitlines()[1:]
if os.path.isdir("/dev/mqueue"):
    found["/dev/mqueue"] = sorted(os.listdir("/dev/mqueue"))
# Left: the server's processes and this job.
found["processes"] = len([p for p in os.listdir("/proc") if p.isdigit()])
time.sleep(0.1)
print(json.dumps({"worker": WORKER_ID_EXPR, "found": found}))
""".replace("WORKER_ID_EXPR", WORKER_ID)

PLACES_JOBS_MAY_WRITE = {"/tmp", "/dev/shm"}  # home and working directory are /tmp


def _reports(results) -> list[dict]:
    for result in results:
        assert result.status == OK, result
    return [json.loads(result.stdout) for result in results]


@from_each_zygote
def test_nothing_a_job_writes_or_starts_survives_it_on_any_worker(sandbox, first_line):
    marker = f"rstar-plant-{uuid.uuid4().hex[:12]}"
    plant = Job(code=first_line + PLANT, stdin=marker, timeout_s=20)
    plants = _reports(sandbox.run([plant] * 4))
    probes = _reports(sandbox.run([Job(code=PROBE)] * 8))

    assert len({p["worker"] for p in plants}) == sandbox.workers
    assert len({p["worker"] for p in probes}) == sandbox.workers
    for plant in plants:
        for name, outcome in plant["tried"].items():
            place = name.removeprefix("file in ")
            if place in PLACES_JOBS_MAY_WRITE or name.startswith(("deep tree", "symlink")):
                assert outcome == "ok", (name, outcome)
            else:
                assert outcome != "ok", (name, outcome)  # refused: nothing to clean up
    for probe in probes:
        found = probe["found"]
        # No leftover process of any job.
        assert found.pop("processes") == server_processes(sandbox.backend) + 1, probe
        assert all(entries == [] for entries in found.values()), probe
    # On the host: no leftover process, and (process backend) nothing in its /dev/shm.
    assert host_processes_matching(marker) == []
    assert not [name for name in os.listdir("/dev/shm") if marker in name]


def test_the_process_backend_keeps_off_the_hosts_shared_memory(backend):
    if backend != "process":
        pytest.skip("the Docker backend never sees the host's file systems")
    name = f"rstar-shm-{uuid.uuid4().hex[:12]}"
    code = f"import os\nopen('/dev/shm/{name}', 'w').write('x')\nprint(os.stat('/dev/shm').st_dev)"
    with Sandbox(backend="process", workers=1) as sb:
        [result] = sb.run([Job(code=code)])
    assert result.status == OK
    assert int(result.stdout) != os.stat("/dev/shm").st_dev  # a tmpfs of its own
    assert not os.path.exists(f"/dev/shm/{name}")


FILL = """
import errno, os, sys
place = sys.stdin.read().strip()
written = 0
try:
    for part in range(1000):  # files of 8 MB: under the per-file limit
        with open(f"{place}/fill-{part}", "wb") as fh:
            for _ in range(8):
                fh.write(b"x" * (1 << 20))
                written += 1
except OSError as err:
    print(written, errno.errorcode[err.errno])
"""


@pytest.mark.parametrize("place", ["/tmp", "/dev/shm"])
def test_a_job_filling_its_tmpfs_gets_a_write_error_and_the_next_job_is_fine(backend, place):
    with Sandbox(backend=backend, workers=1) as sb:  # one worker: the next job runs there
        full, after = sb.run(
            [
                Job(code=FILL, stdin=place, timeout_s=30),
                Job(code=f"import os\nprint(os.listdir({place!r}))\n" + FILL, stdin=place),
            ]
        )
    written_mb, error = full.stdout.split()
    assert full.status == OK and error == "ENOSPC"
    assert int(written_mb) <= 64  # the tmpfs cap (tmpfs_mb)
    assert after.status == OK and after.stdout.startswith("[]\n")
    assert after.stdout.split()[-2:] == [written_mb, "ENOSPC"]  # all of it free again


def test_process_backend_tmpfs_and_address_space_share_the_jobs_memory(backend):
    if backend != "process":
        pytest.skip("Docker counts tmpfs pages in the container's memory cgroup instead")

    def hold(mb: int) -> str:
        return FILL + f"x = bytearray({mb} << 20)\nprint('holds', {mb})"

    with Sandbox(backend="process", workers=1) as sb:
        within, beyond = sb.run(
            [
                Job(code=hold(40), stdin="/dev/shm", memory_mb=64),
                Job(code=hold(56), stdin="/dev/shm", memory_mb=64),
            ]
        )
    # A quarter of the 64 MB budget is tmpfs, the rest address space: 16 MB of files and
    # 40 MB of memory fit, 16 and 56 do not.
    assert within.status == OK and within.stdout.split() == ["16", "ENOSPC", "holds", "40"]
    assert beyond.status == MEMORY_LIMIT and beyond.stdout.split() == ["16", "ENOSPC"]


HOLD_SECRET = """
import json, os, subprocess, sys, time
secret = sys.stdin.readline().strip()
started = time.monotonic()
open(f"/tmp/{secret}", "w").write(secret)
child = subprocess.Popen(
    [sys.executable, "-c", "import time; time.sleep(2)", secret], env={"SECRET": secret}
)
time.sleep(2)
child.wait()
print(json.dumps({"start": started, "end": time.monotonic()}))
"""

# Looks for anything that starts like a secret in every other process it can see.
SNOOP = """
import json, os, time
prefix = bytes([114, 115, 116, 97, 114, 45, 115, 101, 99, 114, 101, 116, 45])
seen = time.monotonic()
found = []
def look(path, read):
    try:
        data = read(path)
    except OSError:  # not ours to read: what this test wants
        return
    if prefix in data:
        found.append(path)
def read_without_blocking(path):  # a pipe with no writer must not stall the search
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        return os.read(fd, 1 << 16)
    finally:
        os.close(fd)
for pid in filter(str.isdigit, os.listdir("/proc")):
    if int(pid) == os.getpid():
        continue
    for name in ("cmdline", "environ"):
        look(f"/proc/{pid}/{name}", lambda p: open(p, "rb").read())
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        fds = []
    for fd in fds:
        look(f"/proc/{pid}/fd/{fd}", read_without_blocking)
for place in ("/tmp", "/dev/shm"):
    for name in os.listdir(place):
        look(f"{place}/{name}", lambda p: p.encode() + open(p, "rb").read())
print(json.dumps({"seen": seen, "found": found}))
"""


def _secret() -> str:
    return f"rstar-secret-{uuid.uuid4().hex}"


def test_concurrent_jobs_on_two_workers_cannot_see_each_other(backend):
    secret = _secret()
    with Sandbox(backend=backend, workers=2) as sb:
        holder: list = []
        thread = threading.Thread(
            target=lambda: holder.extend(sb.run([Job(code=HOLD_SECRET, stdin=secret)]))
        )
        thread.start()
        time.sleep(1.0)  # the holder is running, its input and child alive
        [snoop] = sb.run([Job(code=SNOOP)])
        thread.join()
    held, seen = json.loads(holder[0].stdout), json.loads(snoop.stdout)
    assert held["start"] < seen["seen"] < held["end"]  # they ran at the same time
    assert seen["found"] == []


def test_two_jobs_at_once_in_one_worker_cannot_read_each_others_input(backend):
    """One worker runs one job at a time: the second starts only once the first and
    everything it started (here a process holding its stdin open) are gone."""
    secret = _secret()
    leaves_a_reader = (
        "import subprocess, sys\n"
        "subprocess.Popen(['sleep', '30'], stdin=0, start_new_session=True)\n"
        "print(sys.stdin.read())\n"
    )
    with Sandbox(backend=backend, workers=1) as sb:
        outcomes: dict = {}
        runs = {
            "first": Job(code=leaves_a_reader, stdin=secret),
            "second": Job(code=SNOOP),
        }
        threads = [
            threading.Thread(target=lambda k=k, j=j: outcomes.update({k: sb.run([j])[0]}))
            for k, j in runs.items()
        ]
        for thread in threads:
            thread.start()
            time.sleep(0.05)
        for thread in threads:
            thread.join()
    assert outcomes["first"].stdout.strip() == secret
    assert json.loads(outcomes["second"].stdout)["found"] == []


# Searches everything it inherited: objects, frames, and its whole address space.
SEARCH_MEMORY = """
import gc, json, re, sys
prefix = bytes([114, 115, 116, 97, 114, 45, 115, 101, 99, 114, 101, 116, 45])
hits = set()
pattern = re.compile(re.escape(prefix) + rb"[0-9a-f]{32}")
for obj in gc.get_objects():
    for value in (obj.values() if isinstance(obj, dict) else [obj]):
        if isinstance(value, str):
            value = value.encode("utf-8", "replace")
        if isinstance(value, (bytes, bytearray)):
            hits.update(m.decode() for m in pattern.findall(value))
frame = sys._getframe()
while frame:
    hits.update(m.decode() for m in pattern.findall(repr(frame.f_locals).encode()))
    frame = frame.f_back
with open("/proc/self/maps") as maps, open("/proc/self/mem", "rb") as mem:
    for line in maps:
        fields = line.split()
        if "w" not in fields[1] or (len(fields) > 5 and fields[5] == "[vvar]"):
            continue
        start, end = (int(x, 16) for x in fields[0].split("-"))
        for chunk in range(start, end, 1 << 20):  # overlapping, so no match is cut in two
            try:
                mem.seek(chunk)
                data = mem.read(min((1 << 20) + 64, end - chunk))
            except (OSError, OverflowError, ValueError):
                break
            hits.update(m.decode() for m in pattern.findall(data))
print(json.dumps(sorted(hits)))
"""


@from_each_zygote
def test_a_job_finds_no_earlier_jobs_data_in_the_memory_it_inherits(backend, first_line):
    secrets = [_secret() for _ in range(3)]
    echo = "import sys\ndata = sys.stdin.read()\nprint(data)\nraise ValueError(data)"
    with Sandbox(backend=backend, workers=1) as sb:
        earlier = sb.run(
            [Job(code=code + echo, stdin=s) for s in secrets for code in ZYGOTES.values()]
        )
        [search] = sb.run([Job(code=first_line + SEARCH_MEMORY, timeout_s=30, memory_mb=512)])
    assert all(r.status == RUNTIME_ERROR and r.stdout.strip() in secrets for r in earlier)
    assert search.status == OK, search.stderr
    assert set(json.loads(search.stdout)).isdisjoint(secrets)


AS_NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def test_process_backend_without_root_drops_every_capability():
    """Started by an unprivileged user, the server is root of a user namespace: its jobs
    keep uid 0 there but lose every capability, so they cannot unmount their tmpfs to
    reach the host's /tmp or write anywhere else."""
    if os.geteuid() != 0:
        pytest.skip("run as root, so that the test can start the pool as nobody")
    probe = subprocess.run([*AS_NOBODY, "unshare", "--user", "--map-root-user", "true"], cwd="/")
    if probe.returncode != 0:
        pytest.skip("this kernel does not let unprivileged users create user namespaces")
    import rstar_sandbox

    readable = tempfile.mkdtemp(prefix="rstar-sandbox-copy-")  # nobody must read the package
    try:
        os.chmod(readable, 0o755)
        shutil.copytree(os.path.dirname(rstar_sandbox.__file__), f"{readable}/rstar_sandbox")
        pool = (
            "import json, sys\n"
            f"sys.path.insert(0, {readable!r})\n"
            "from rstar_sandbox import Job, Sandbox\n"
            "with Sandbox(backend='process', workers=1, preload=()) as sb:\n"
            "    [r] = sb.run([Job(code=sys.stdin.read())])\n"
            "print(json.dumps([r.status, r.stdout, r.stderr]))\n"
        )
        job = (
            "import ctypes, os\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "caps = open('/proc/self/status').read().split('CapEff:')[1].split()[0]\n"
            "unmounted = libc.umount2(b'/tmp', 2)\n"
            "try:\n"
            "    open('/var/tmp/rstar-escape', 'w')\n"
            "    wrote = True\n"
            "except OSError:\n"
            "    wrote = False\n"
            "print(os.getuid(), caps, unmounted, wrote)\n"
        )
        proc = subprocess.run(
            [*AS_NOBODY, "/usr/bin/python3", "-I", "-c", pool],
            input=job,
            capture_output=True,
            text=True,
            timeout=120,
            cwd="/",
        )
    finally:
        shutil.rmtree(readable)
    assert proc.returncode == 0, proc.stderr
    status, stdout, stderr = json.loads(proc.stdout)
    assert status == OK, stderr
    assert stdout.split() == ["0", "0000000000000000", "-1", "False"]


@from_each_zygote
def test_a_job_cannot_stop_the_server(backend, first_line):
    """Every signal a job can send to the zygotes, the supervisor or anything else: the
    worker keeps serving from both zygotes without a restart."""
    attack = first_line + (
        "import os, signal\n"
        "for pid in map(int, filter(str.isdigit, os.listdir('/proc'))):\n"
        "    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGSTOP, signal.SIGKILL):\n"
        "        if pid != os.getpid():\n"
        "            try:\n"
        "                os.kill(pid, sig)\n"
        "            except OSError:\n"
        "                pass\n"
        "os.kill(-1, signal.SIGKILL)\n"  # all it may signal but itself: nothing
        "print('done')\n"
    )
    with Sandbox(backend=backend, workers=1) as sb:
        attacked = sb.run([Job(code=attack)])[0]
        after = sb.run([Job(code=line + "print('still here')") for line in ZYGOTES.values()])
    assert (attacked.status, attacked.stdout, attacked.attempts) == (OK, "done\n", 1)
    for result in after:
        assert (result.status, result.stdout, result.attempts) == (OK, "still here\n", 1)


@from_each_zygote
def test_a_running_job_shares_its_worker_with_no_other_process(backend, first_line):
    """While a job runs, its worker holds the server's processes and the job: no
    earlier job's process and no child forked for a later job, which the job user
    could reach (or the reset's kill(-1) would find)."""
    census = first_line + (
        "import os\n"
        "pids = [p for p in os.listdir('/proc') if p.isdigit()]\n"
        "print(len(pids), sorted(os.stat(f'/proc/{p}').st_uid for p in pids))\n"
    )
    with Sandbox(backend=backend, workers=1) as sb:
        results = sb.run([Job(code=census)] * 5)
    servers = server_processes(backend)
    for result in results:
        count, uids = result.stdout.split(" ", 1)
        assert result.status == OK and int(count) == servers + 1, result.stdout
        assert json.loads(uids)[:servers] == [0] * servers, result.stdout  # root's


HOLD_PROCESSES = """
import subprocess, sys, time
count = int(sys.stdin.read())
held = [subprocess.Popen(["sleep", "30"]) for _ in range(count)]
print(len(held), flush=True)
time.sleep(3)
"""


def test_a_pool_at_its_process_limit_leaves_another_pools_jobs_their_own(backend):
    """RLIMIT_NPROC counts a user's processes over the whole kernel, containers included:
    while a job of one pool holds all the processes a job may have, a job of a second pool
    on the host still starts its own (each worker runs its jobs as a uid of its own)."""
    limit = Job(code="").max_processes
    fork = "import subprocess\nprint(subprocess.run(['true']).returncode)"
    with Sandbox(backend=backend, workers=1) as one, Sandbox(backend=backend, workers=1) as two:
        holder: list = []
        hold = Job(code=HOLD_PROCESSES, stdin=str(limit - 2), timeout_s=20)
        thread = threading.Thread(target=lambda: holder.extend(one.run([hold])))
        thread.start()
        time.sleep(1.5)  # the holder's processes are up
        [forked] = two.run([Job(code=fork)])
        thread.join()
    assert (holder[0].status, holder[0].stdout) == (OK, f"{limit - 2}\n"), holder[0]
    assert (forked.status, forked.stdout) == (OK, "0\n"), forked
