"""Running a policy's Python code in a separate process, as the built-in ``python`` tool does
(``rl.tools=[python]``). What the model writes is hostile input: a loop that never ends, a fork bomb, a memory
hog, a 100 MB print, a look at the trainer's secrets, a write outside its folder, a kill of its parent, a
connection to the job's rendezvous store or to any server on the machine, files left in ``/dev/shm``.

Always: a separate process (``python -I``: no user site, no ``PYTHON*`` variables, not the job's folder on
the path) in a fresh folder it may write, with a clean environment (no inherited variables: no tokens, no keys,
not the job's secret), no stdin, a wall-clock limit, CPU-time, memory (address space), file-size, open-file and
core limits (``prlimit``), its output read from files no larger than the file-size limit and cut to
``output_chars``; the whole process group killed at the end. Where the machine lets it (``unshare``; as root, or
an unprivileged user namespace otherwise): namespaces of its own -- a **network** namespace (only a loopback of
its own, which is down: it reaches nothing, neither the job's store nor any other server, here or elsewhere), a
**mount** namespace whose ``/tmp`` and ``/dev/shm`` are private tmpfs of ``scratch_bytes`` each (its folder is
that ``/tmp``; whatever it writes there is memory, bounded, and gone when it ends) and a **PID** namespace whose
processes all die with it (its ``/proc`` shows only them: not the job's). Where the job runs as root, the code
also runs as an unprivileged user of its own (a uid per call, ``setpriv``): it cannot write the job's files,
signal or trace its processes, and a process-count limit holds. :func:`describe` says which was used. It is not
a container: the code sees the machine's file system (read-only where its user may not write) and the
installed Python packages.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 5.0  # the call's whole time
    cpu_s: int = 5  # CPU seconds of its process
    memory_bytes: int = 1 << 30  # address space of each process
    file_bytes: int = 16 << 20  # the largest file it writes (its output included)
    processes: int = 32  # processes of its user at once (where it has a user of its own)
    output_chars: int = 4000  # of stdout, and of stderr, in the answer
    scratch_bytes: int = 64 << 20  # each of its private /tmp and /dev/shm (memory; where it has namespaces)


class SandboxFailure(Exception):
    """The code did not run to a normal end (a limit, an error of its own): the message says which, with the
    output it gave before."""


@dataclass(frozen=True)
class Isolation:
    """What this machine lets the sandbox use (asked once, :func:`isolation`)."""

    own_user: bool  # runs as an unprivileged uid of its own (the job runs as root, setpriv is there)
    namespaces: tuple[str, ...]  # unshare's options: network, mount and PID namespaces of its own ("" none)

    @property
    def own_network(self) -> bool:
        return bool(self.namespaces)

    @property
    def own_pids(self) -> bool:
        return bool(self.namespaces)


_NAMESPACES = ("--pid", "--fork", "--kill-child", "--mount-proc", "--net", "--mount", "--propagation", "private")


@functools.cache
def isolation() -> Isolation:
    """Which isolation the sandbox can use here: as root, a user of its own and (with ``unshare``) namespaces;
    otherwise namespaces inside an unprivileged user namespace, where the kernel allows one."""
    own_user = os.geteuid() == 0 and shutil.which("setpriv") is not None
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return Isolation(own_user, ())
    options = _NAMESPACES if os.geteuid() == 0 else ("--user", "--map-root-user", *_NAMESPACES)
    # the probe does what a call does: a folder kept read-only in a private /tmp, a private /dev/shm, then the
    # network is unreachable
    script = (_private_scratch(1 << 20, ["/tmp/syncwise-probe"], "/etc") +
              " && ! (exec 3<>/dev/tcp/127.0.0.1/1) 2>/dev/null")
    try:
        probe = subprocess.run(["unshare", *options, "bash", "-c", script], capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return Isolation(own_user, ())
    return Isolation(own_user, options if probe.returncode == 0 else ())


def _interpreter_under_tmp() -> list[str]:
    """The folders of the job's Python that lie under /tmp (a checkout and its venv there, as CI clones): the private
    /tmp would hide them, so they are mounted there again, read-only."""
    folders = (sys.prefix, sys.base_prefix, sys.exec_prefix, Path(sys.executable).parent)
    found = {str(Path(p).resolve()) for p in folders}
    under = sorted(p for p in found if Path(p).is_relative_to("/tmp") and p != "/tmp")
    return [p for p in under if not any(Path(p).is_relative_to(q) and p != q for q in under)]


def _private_scratch(size: int, kept: list[str], source: str | None = None) -> str:
    """The shell commands (in a mount namespace of its own) that give a call private /tmp and /dev/shm tmpfs of
    ``size`` bytes each, with each folder of ``kept`` (under /tmp) mounted there again read-only -- parked on a
    transient /dev/shm while /tmp is replaced. ``source``: the probe's stand-in for what is kept."""
    parked = [f"mkdir /dev/shm/k{i} && mount --bind {shlex.quote(source or path)} /dev/shm/k{i}"
              for i, path in enumerate(kept)]
    moved = [f"mkdir -p {shlex.quote(path)} && mount --move /dev/shm/k{i} {shlex.quote(path)} && "
             f"mount -o remount,bind,ro {shlex.quote(path)}" for i, path in enumerate(kept)]
    steps = (["mount -t tmpfs -o size=1m tmpfs /dev/shm", *parked] if kept else [])
    steps += [f"mount -t tmpfs -o size={size},mode=1777 tmpfs /tmp", *moved]
    steps += ["umount /dev/shm"] if kept else []
    steps += [f"mount -t tmpfs -o size={size},mode=1777 tmpfs /dev/shm"]
    return " && ".join(steps)


def describe() -> str:
    """Which isolation the sandbox uses here, in words (for the job's first line)."""
    found = isolation()
    user = ", as an unprivileged user of its own" if found.own_user else ", as the job's user"
    spaces = (", with no network, private /tmp and /dev/shm and its own PIDs and /proc (namespaces)" if found.namespaces
              else ", sharing the job's network, /tmp and /dev/shm (no namespaces here)")
    return "a process of its own" + user + spaces + ", with rlimits; not a container"


_UIDS = itertools.cycle(range(61000, 62000))  # one per call at a time: a limit or a kill touches only its own
_UID_LOCK = threading.Lock()


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> str:
    """``code``'s stdout (and stderr, where it wrote some), each cut to ``limits.output_chars``; a
    :class:`SandboxFailure` naming the limit or the exit status where it did not end normally."""
    found = isolation()
    with _UID_LOCK:
        uid = next(_UIDS)
    with tempfile.TemporaryDirectory(prefix="syncwise-sandbox-") as folder:
        work, logs = Path(folder) / "work", Path(folder) / "logs"
        work.mkdir()
        logs.mkdir(mode=0o700)  # the code's output files, opened here: it cannot read or change them by path
        if found.own_user:
            os.chown(work, uid, uid)
        python = [sys.executable, "-I", "-c", code]
        if found.own_user:
            python = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all", *python]
        command, home = python, str(work)
        if found.namespaces:  # its folder is its private /tmp (the host's is out of sight there)
            size = max(limits.scratch_bytes, 1 << 20)
            mounts = _private_scratch(size, _interpreter_under_tmp()) + ' && cd /tmp && exec "$@"'
            command, home = ["unshare", *found.namespaces, "sh", "-c", mounts, "sandbox", *python], "/tmp"
        command = ["prlimit", f"--cpu={limits.cpu_s}", f"--as={limits.memory_bytes}", f"--fsize={limits.file_bytes}",
                   "--nofile=256", "--core=0", f"--nproc={limits.processes}", "--", *command]
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8"}
        with open(logs / "stdout", "wb") as out, open(logs / "stderr", "wb") as err:
            proc = subprocess.Popen(command, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    close_fds=True, start_new_session=True)
            try:
                status, why = proc.wait(timeout=limits.wall_s), None
            except subprocess.TimeoutExpired:
                status, why = None, f"did not finish within {limits.wall_s:g} s"
            _kill_all(proc, uid, found.own_user and not found.own_pids)
            status = proc.wait() if status is None else status
        stdout, stderr = (_read(logs / name, limits.output_chars) for name in ("stdout", "stderr"))
    why = why or _reason(status, limits)
    shown = stdout + (f"\n[stderr]\n{stderr}" if stderr else "")
    if why:
        raise SandboxFailure(f"the code {why}" + (f"; its output before:\n{shown}" if shown else ""))
    return shown


def _kill_all(proc: subprocess.Popen, uid: int, whole_user: bool) -> None:
    """Everything the call started: its process group (a PID namespace dies with its first process), and
    ``whole_user``: every process of the call's own user (what left the group)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    if whole_user:
        subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "kill", "-9", "-1"],
                       capture_output=True, timeout=10, check=False)
    if isolation().own_user:  # the kernel kills a namespace's processes asynchronously: return once they are gone
        deadline = time.monotonic() + 10
        while _alive(uid) and time.monotonic() < deadline:
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


def _reason(status: int | None, limits: SandboxLimits) -> str | None:
    """Why the code did not end normally, from its exit status (a signal is negative, or 128 + it through
    unshare), or None."""
    if status == 0:
        return None
    signum = -status if status < 0 else status - 128 if status > 128 else 0
    known = {signal.SIGXCPU: f"used its {limits.cpu_s} s of CPU time",
             signal.SIGXFSZ: f"wrote past the {limits.file_bytes // 2**20} MiB file-size limit (its output included)",
             signal.SIGKILL: "was killed (a limit: memory, processes, or time)",
             signal.SIGSEGV: "crashed (segmentation fault)"}
    if signum in known:
        return known[signum]
    return f"exited with status {status}"
