"""A policy's Python code in a process of its own (the built-in ``python`` tool, or any tool, environment or
reward calling :func:`run_python`), against what a hostile program does: endless loops, fork bombs, memory hogs in
many processes, huge prints, reading the job's secrets or files (a prompt file's answers), writes that outlive
the call, killing the job or another rank's call, reaching the job's store or any server.

Where the machine makes namespaces (as root, or as any user in an unprivileged user namespace), each call gets a
root of its own (``pivot_root``: ``/usr``, ``/etc`` and the job's Python read-only, private ``/tmp`` and
``/dev/shm`` tmpfs, a few devices, its own ``/proc``; nothing of the job's folders; the root read-only), no network,
its own PIDs and IPC, no privilege (as root a uid no other call of the machine holds at once; otherwise root of its
namespace without capabilities), and one memory budget for all its processes (a cgroup of its own where the job
may make one, else :data:`FALLBACK_PROCESSES` processes of ``memory_bytes / FALLBACK_PROCESSES`` each). Always
``python -I``, a clean environment, no stdin, rlimits (``prlimit``, set inside its user namespace, where the process
count is its own), its output read from files it cannot reach, and a wall clock after which all it started dies.
Where no namespace can be made it is refused (:class:`SandboxRefused`) unless the job opts in
(``rl.sandbox_unsafe_no_isolation=true``, :data:`UNSAFE_ENV`). Standard library only: the module runs alone.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

FALLBACK_PROCESSES = 8  # without a cgroup: at most this many processes, each budget / this of address space
UNSAFE_ENV = "SYNCWISE_SANDBOX_UNSAFE_NO_ISOLATION"  # "1": run unprotected where no namespace can be made
UIDS = range(61000, 62000)  # a call's own user, as root


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 5.0  # the call's whole time
    cpu_s: int = 5  # CPU seconds of each process
    memory_bytes: int = 1 << 30  # the call's processes together (see the module's text)
    file_bytes: int = 16 << 20  # the largest file it writes (its output included)
    processes: int = 32  # the call's processes at once
    output_chars: int = 4000  # of stdout, and of stderr, in the answer
    scratch_bytes: int = 64 << 20  # each of its private /tmp and /dev/shm (memory, within the budget)


class SandboxFailure(Exception):
    """The code did not run to a normal end (a limit, an error of its own): the message says which, with the
    output it gave before."""


class SandboxRefused(RuntimeError):
    """No namespace can be made here and the job did not opt in to running policy code unprotected: the job's
    error, not the tool's answer."""


REFUSAL = ("the sandbox for policy code needs namespaces (unshare: as root, or in an unprivileged user namespace), "
           "and this machine makes none: the code would share the job's network, /tmp and files; run where "
           "namespaces are allowed, or set rl.sandbox_unsafe_no_isolation=true to run it unprotected")


@dataclass(frozen=True)
class Isolation:
    """What this machine lets the sandbox use (asked once, :func:`isolation`)."""

    own_user: bool  # runs as an unprivileged uid of its own (the job runs as root, setpriv is there)
    namespaces: tuple[str, ...]  # unshare's options ("" none: the probe failed)
    cgroup: bool  # a memory and pids cgroup per call

    @property
    def own_network(self) -> bool:
        return bool(self.namespaces)

    @property
    def own_pids(self) -> bool:
        return bool(self.namespaces)


# Keyrings are no namespace: the program would keep the job's session keyring and, as its possessor, read every key
# in it (Kerberos KEYRING: caches, host tooling's tokens). Its first program joins a fresh anonymous session keyring,
# then execs the code's Python; where keyctl cannot be called (seccomp, another machine), it goes on only if the
# job's keyring is out of reach anyway.
_KEYCTL = {"x86_64": 250, "aarch64": 219, "arm64": 219, "riscv64": 219, "ppc64le": 311, "s390x": 280, "i686": 288}
LEAVE_KEYRING = f"""import ctypes, os, platform, sys
number = {_KEYCTL!r}.get(platform.machine())
keyctl = (lambda *a: ctypes.CDLL(None, use_errno=True).syscall(number, *a)) if number else (lambda *a: -1)
if keyctl(1, None) < 0 and keyctl(0, -3, 0) >= 0:  # JOIN_SESSION_KEYRING(NULL) failed, the session still reachable
    sys.exit("sandbox: could not leave the job's session keyring; the code was not run")
os.execv(sys.argv[1], sys.argv[1:])"""

_NAMESPACES = ("--pid", "--fork", "--kill-child", "--net", "--mount", "--ipc", "--uts", "--propagation", "private")
_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin"


@functools.cache
def isolation() -> Isolation:
    """Which isolation the sandbox can use here: as root, a user of its own, namespaces (``unshare``) and a cgroup
    per call; otherwise namespaces inside an unprivileged user namespace, where the kernel allows one. The probe
    builds a call's root and runs the job's Python in it, as a call does."""
    root = os.geteuid() == 0
    own_user = root and shutil.which("setpriv") is not None
    cgroup = root and _CallCgroup.usable()
    if not all(shutil.which(tool) for tool in ("unshare", "mount", "setpriv", "prlimit")):
        return Isolation(own_user, (), cgroup)
    options = _NAMESPACES if root else ("--user", "--map-root-user", *_NAMESPACES)
    with tempfile.TemporaryDirectory(prefix="syncwise-sandbox-probe-") as folder:
        (Path(folder) / "root").mkdir()
        script = _enter_root(Path(folder) / "root", 1 << 20)
        try:
            probe = subprocess.run(["unshare", *options, "sh", "-c", script, "probe", sys.executable, "-I", "-c",
                                    "import os"],
                                   capture_output=True, timeout=30, env={"PATH": _PATH}, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.SubprocessError):
            return Isolation(own_user, (), cgroup)
    return Isolation(own_user, options if probe.returncode == 0 else (), cgroup)


def python_folders() -> list[str]:
    """The job's Python as a call needs it: its prefix, base prefix and the interpreter's folder, outermost only."""
    found = {str(Path(p).resolve()) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix,
                                              Path(sys.executable).resolve().parent)}
    return sorted(p for p in found if not any(Path(p).is_relative_to(q) and p != q for q in found))


_SYSTEM = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_DEVICES = ("null", "zero", "full", "random", "urandom")


def _enter_root(root: Path, scratch_bytes: int) -> str:
    """The shell commands (in the call's mount, PID and user namespaces) that make ``root`` the call's root -- see
    the module's text -- and then run ``"$@"`` in its ``/tmp``. ``-n``: no userspace mount table to update
    (refused inside a user namespace)."""
    q = shlex.quote
    steps = ["set -e", f"mount -n -t tmpfs -o size=4m,mode=0755 sandbox-root {q(str(root))}", f"cd {q(str(root))}",
             "mkdir -p dev/shm tmp proc .old",
             f"mount -n -t tmpfs -o size={scratch_bytes},mode=1777 sandbox-tmp tmp",  # before a Python under /tmp
             f"mount -n -t tmpfs -o size={scratch_bytes},mode=1777 sandbox-shm dev/shm"]
    for path in (*_SYSTEM, *(p for p in python_folders() if not p.startswith(("/usr/", "/etc/")))):
        if os.path.islink(path):  # a merged /usr's /bin -> usr/bin
            steps.append(f"ln -s {q(os.readlink(path))} .{q(path)}")
        elif os.path.isdir(path):
            steps += [f"mkdir -p .{q(path)}", f"mount -n --rbind {q(path)} .{q(path)}",
                      f"mount -n -o remount,bind,ro .{q(path)}"]
    steps += [f"touch dev/{d} && mount -n --bind /dev/{d} dev/{d}" for d in _DEVICES if os.path.exists(f"/dev/{d}")]
    steps += ["ln -s /proc/self/fd dev/fd", "mount -n -t proc proc proc",
              "pivot_root . .old", "cd /", "umount -n -l /.old", "rmdir /.old",
              "mount -n -o remount,bind,ro /", "cd /tmp", 'exec "$@"']
    return "\n".join(steps)


def describe() -> str:
    """Which isolation the sandbox uses here, in words (for the job's first line)."""
    found = isolation()
    user = ", as an unprivileged user of its own" if found.own_user else ", as the job's user without privileges"
    if not found.namespaces:
        return ("a process of its own" + user + ", UNPROTECTED: sharing the job's network, /tmp and files (no "
                "namespaces here; rl.sandbox_unsafe_no_isolation=true), with rlimits")
    memory = ("one memory budget for its processes (a cgroup)" if found.cgroup
              else f"at most {FALLBACK_PROCESSES} processes sharing one memory budget (rlimits)")
    return ("a process of its own" + user + ", in a root of its own (the system and the job's Python read-only, "
            "private /tmp and /dev/shm), with no network, its own PIDs and /proc (namespaces), " + memory)


def unsafe_allowed() -> bool:
    return os.environ.get(UNSAFE_ENV) == "1"


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> str:
    """``code``'s stdout (and stderr, where it wrote some), each cut to ``limits.output_chars``; a
    :class:`SandboxFailure` naming the limit or the exit status where it did not end normally; a
    :class:`SandboxRefused` where nothing isolates it and the job did not opt in."""
    found = isolation()
    if not found.namespaces and not unsafe_allowed():
        raise SandboxRefused(REFUSAL)
    with contextlib.ExitStack() as stack:
        uid = stack.enter_context(_claimed_uid()) if found.own_user else None
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="syncwise-sandbox-")))
        cgroup = stack.enter_context(_CallCgroup(limits)) if found.cgroup else None
        (folder / "root").mkdir()
        logs = folder / "logs"
        logs.mkdir(mode=0o700)  # the code's output files, opened here: it cannot read or change them by path
        command, cwd = _command(code, limits, found, uid, folder, cgroup)
        env = {"PATH": _PATH, "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8"}
        with open(logs / "stdout", "wb") as out, open(logs / "stderr", "wb") as err:
            proc = subprocess.Popen(command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    close_fds=True, start_new_session=True)
            try:
                status, why = proc.wait(timeout=limits.wall_s), None
            except subprocess.TimeoutExpired:
                status, why = None, f"did not finish within {limits.wall_s:g} s"
            _kill_all(proc, uid, cgroup, found)
            status = proc.wait() if status is None else status
        stdout, stderr = (_read(logs / name, limits.output_chars) for name in ("stdout", "stderr"))
        why = why or _reason(status, limits, cgroup)
    shown = stdout + (f"\n[stderr]\n{stderr}" if stderr else "")
    if why:
        raise SandboxFailure(f"the code {why}" + (f"; its output before:\n{shown}" if shown else ""))
    return shown


def _command(code: str, limits: SandboxLimits, found: Isolation, uid: int | None, folder: Path,
             cgroup: _CallCgroup | None) -> tuple[list[str], str]:
    """The call's command line, outermost first: into its cgroup, into its namespaces and root, its privileges
    dropped, its limits set (inside its user namespace, where the process count is the call's own), the code."""
    per_process = limits.memory_bytes if cgroup is not None else limits.memory_bytes // FALLBACK_PROCESSES
    processes = limits.processes if cgroup is not None else min(limits.processes, FALLBACK_PROCESSES)
    command = ["prlimit", f"--cpu={limits.cpu_s}", f"--as={per_process}", f"--fsize={limits.file_bytes}",
               "--nofile=256", "--core=0", f"--nproc={processes}", "--",
               sys.executable, "-I", "-c", LEAVE_KEYRING, sys.executable, "-I", "-c", code]
    drop = ["--inh-caps=-all", "--bounding-set=-all", "--no-new-privs"]
    if uid is not None:
        command = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *drop, *command]
    elif found.namespaces:
        command = ["setpriv", *drop, *command]
    cwd = str(folder / "root")
    if found.namespaces:
        scratch = max(limits.scratch_bytes, 1 << 20)
        command = ["unshare", *found.namespaces, "sh", "-c", _enter_root(folder / "root", scratch), "sandbox",
                   *command]
        cwd = "/"
    elif uid is not None:
        os.chown(cwd, uid, uid)
    if cgroup is not None:
        command = ["sh", "-c", cgroup.join_script() + ' && exec "$@"', "cgroup", *command]
    return command, cwd


@contextlib.contextmanager
def _claimed_uid():
    """A uid no other call on this machine holds now (a lock file per uid in a root-only folder, held for the
    call: every rank of every job of the machine draws from the same locks)."""
    folder = Path("/run/syncwise-sandbox" if os.access("/run", os.W_OK) else "/tmp/syncwise-sandbox-uids")
    folder.mkdir(mode=0o700, exist_ok=True)
    if folder.stat().st_uid != 0 or folder.stat().st_mode & 0o077:
        raise RuntimeError(f"{folder} is not root's own folder (0700): the sandbox's uid locks cannot be trusted")
    start = random.randrange(len(UIDS))
    for i in range(len(UIDS)):
        uid = UIDS[(start + i) % len(UIDS)]
        fd = os.open(folder / str(uid), os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            yield uid
        finally:
            os.close(fd)
        return
    raise RuntimeError(f"all {len(UIDS)} sandbox uids are in use on this machine")


class _CallCgroup:
    """A memory and a pids cgroup of the call's own, below the job's (cgroup v1 controllers, or v2 where the job's
    cgroup delegates them): the budget for all the call's processes together; its peak read at the end."""

    def __init__(self, limits: SandboxLimits):
        self.limits = limits
        self.name = f"syncwise-sandbox-{os.getpid()}-{time.monotonic_ns()}"
        self.dirs: dict[str, Path] = {}

    @staticmethod
    def _parents() -> dict[str, Path] | None:
        """Where the job's own memory and pids cgroups are, writable: v1 per controller, else v2's one."""
        mine = {}
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for name in controllers.split(",") if controllers else ["v2"]:
                mine[name] = path.lstrip("/")
        found = {c: Path("/sys/fs/cgroup", c, mine[c]) for c in ("memory", "pids") if c in mine}
        if all(p.is_dir() and os.access(p, os.W_OK) for p in found.values()) and len(found) == 2:
            return found
        v2 = Path("/sys/fs/cgroup", mine.get("v2", ""))
        try:
            delegated = set((v2 / "cgroup.subtree_control").read_text().split())
        except OSError:
            return None
        return {"memory": v2, "pids": v2} if {"memory", "pids"} <= delegated and os.access(v2, os.W_OK) else None

    @classmethod
    def usable(cls) -> bool:
        try:
            with cls(SandboxLimits()):
                return True
        except OSError:
            return False

    def __enter__(self) -> _CallCgroup:
        parents = self._parents()
        if parents is None:
            raise OSError("no writable memory and pids cgroup")
        for controller, parent in parents.items():
            folder = parent / self.name
            if folder not in self.dirs.values():
                folder.mkdir()
            self.dirs[controller] = folder
        try:
            memory, pids = self.dirs["memory"], self.dirs["pids"]
            if (memory / "memory.max").exists():  # v2
                (memory / "memory.max").write_text(str(self.limits.memory_bytes))
                with contextlib.suppress(OSError):
                    (memory / "memory.swap.max").write_text("0")
            else:
                (memory / "memory.limit_in_bytes").write_text(str(self.limits.memory_bytes))
                with contextlib.suppress(OSError):  # no swap accounting: swap is then outside the budget
                    (memory / "memory.memsw.limit_in_bytes").write_text(str(self.limits.memory_bytes))
            (pids / "pids.max").write_text(str(self.limits.processes + 2))  # + the namespaces' two starters
        except OSError:
            self.__exit__(None, None, None)
            raise
        return self

    def join_script(self) -> str:
        return " && ".join(f"echo $$ > {shlex.quote(str(d / 'cgroup.procs'))}" for d in set(self.dirs.values()))

    def empty(self) -> bool:
        return all(not (d / "cgroup.procs").read_text().strip() for d in set(self.dirs.values()))

    def oom_killed(self) -> bool:
        memory = self.dirs["memory"]
        with contextlib.suppress(OSError, ValueError):
            if (memory / "memory.events").exists():
                return int(dict(line.split() for line in (memory / "memory.events").read_text().splitlines())
                           .get("oom_kill", 0)) > 0
            return int((memory / "memory.failcnt").read_text()) > 0
        return False

    def __exit__(self, *exc) -> None:
        for folder in set(self.dirs.values()):
            deadline = time.monotonic() + 10
            while folder.exists() and time.monotonic() < deadline:
                with contextlib.suppress(OSError):  # its last processes may still be being torn down
                    folder.rmdir()
                    break
                time.sleep(0.01)


def _kill_all(proc: subprocess.Popen, uid: int | None, cgroup: _CallCgroup | None, found: Isolation) -> None:
    """Everything the call started: its process group (a PID namespace dies with its first process); without one,
    every process of the call's own uid (what left the group); then wait until they are gone (the kernel kills a
    namespace's processes asynchronously)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    if uid is not None and not found.own_pids:
        subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "kill", "-9", "-1"],
                       capture_output=True, timeout=10, check=False)
    if cgroup is None and uid is None:
        return
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if cgroup.empty() if cgroup is not None else not _alive(uid):
            return
        time.sleep(0.01)


def _alive(uid: int) -> bool:
    """Whether a process of ``uid`` still runs (a zombie, left for its reaper, does not)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            status = dict(line.split(":", 1) for line in (proc / "status").read_text().splitlines() if ":" in line)
        except OSError:
            continue
        if int(status.get("Uid", "-1").split()[0]) == uid and not status.get("State", "").strip().startswith("Z"):
            return True
    return False


def _read(path: Path, limit: int) -> str:
    with open(path, "rb") as file:
        data = file.read(limit * 4 + 4)  # enough bytes for limit characters of UTF-8
    text = data.decode("utf-8", errors="replace")
    size = path.stat().st_size
    if len(text) > limit or size > len(data):
        return text[:limit] + f"\n[cut: the first {limit} characters of {size} bytes]"
    return text


def _reason(status: int | None, limits: SandboxLimits, cgroup: _CallCgroup | None) -> str | None:
    """Why the code did not end normally, from its exit status (a signal is negative, or 128 + it through
    unshare), or None."""
    if status == 0:
        return None
    signum = -status if status < 0 else status - 128 if status > 128 else 0
    if signum == signal.SIGKILL and cgroup is not None and cgroup.oom_killed():
        return f"was killed: its processes together passed the {limits.memory_bytes / 2**20:g} MiB memory budget"
    known = {signal.SIGXCPU: f"used its {limits.cpu_s} s of CPU time",
             signal.SIGXFSZ: f"wrote past the {limits.file_bytes // 2**20} MiB file-size limit (its output included)",
             signal.SIGKILL: "was killed (a limit: memory, processes, or time)",
             signal.SIGSEGV: "crashed (segmentation fault)"}
    if signum in known:
        return known[signum]
    return f"exited with status {status}"
