"""The built-in ``python`` tool's sandbox (issue 49) against what a policy may write: an endless loop, a fork
bomb, a memory hog, a 100 MB print, a look at the trainer's secrets, a write into the trainer's folder, a kill
of its parent, a child that leaves its process group, a connection to a loopback server and to the job's store,
files filling /dev/shm (issue 62); memory hogs in several processes, every writable folder, the job's files,
another rank's concurrent call, as root and as an unprivileged user (issue 67). Each is the tool's error, counted,
the caller goes on, nothing of the caller's is touched, and nothing the code started runs on. Short limits here
(the tool's defaults are 5 s)."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from pathlib import Path

import pytest

from job_output import failed
from syncwise.rl.env.tools import Tool, ToolLimits, ToolRunner
from syncwise.runtime import sandbox
from syncwise.runtime.sandbox import SandboxLimits, SandboxRefused, describe, isolation, python_folders, run_python
from syncwise.tools import BUILTIN_TOOLS

LIMITS = SandboxLimits(wall_s=2.0, cpu_s=2)
OWN_USER, NAMESPACES = isolation().own_user, isolation().own_network


def _tool(code: str):
    """Run ``code`` as the tool runner runs a call (its answer and kind, as the metrics count them)."""

    def python(code: str) -> str:
        """Run code.

        Args:
            code: The program.
        """
        return run_python(code, LIMITS)

    tools = {"python": Tool("python", python, {})}
    return ToolRunner(ToolLimits(timeout_s=30)).run([(tools, "python", {"code": code})])[0]


def _running(marker: str) -> list[int]:
    """Processes whose command line holds ``marker`` (what the code started, if any runs on)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if marker.encode() in (proc / "cmdline").read_bytes():
                    found.append(int(proc.name))
            except OSError:
                pass
    return found


def test_the_tool_prints_what_the_program_prints_and_says_how_it_is_isolated():
    assert BUILTIN_TOOLS["python"]("print(6 * 7)") == "42\n"
    assert _tool("import sys; print('out'); print('err', file=sys.stderr)").content == "out\n\n[stderr]\nerr\n"
    broken = _tool("1 / 0")
    assert broken.error == "exception" and "ZeroDivisionError" in broken.content  # the traceback is the answer
    assert "a process of its own" in describe() and ("in a root of its own" in describe()) == NAMESPACES


@pytest.mark.parametrize("name", ["loop", "fork_bomb", "setsid_child"])
def test_what_never_ends_is_cut_at_the_wall_clock_and_nothing_runs_on(name):
    marker = f"syncwise_marker_{name}"
    code = {"loop": f"# {marker}\nwhile True: pass",
            "fork_bomb": f"# {marker}\nimport os\nwhile True:\n    try: os.fork()\n    except OSError: pass",
            # a child that leaves the process group and outlives the program
            "setsid_child": f"# {marker}\nimport os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(600)\n"
                            f"time.sleep(600)"}[name]
    result = _tool(code)
    assert result.error == "exception" and "did not finish within 2 s" in result.content, result.content
    if name == "setsid_child" and not (OWN_USER or NAMESPACES):
        pytest.skip("not root: a child that leaves its process group outlives the call (said in the README)")
    assert _running(marker) == []


def test_a_memory_hog_and_a_huge_print_are_stopped_and_cut():
    hog = _tool("x = bytearray(8 << 30)")
    assert hog.error == "exception" and "MemoryError" in hog.content
    flood = _tool("import sys\nsys.stdout.write('x' * (100 << 20))")
    assert flood.error == "exception" and len(flood.content) < 20_000  # the first 4000 characters, said so
    printed = run_python("print('y' * 10_000)", LIMITS)
    assert printed.startswith("y" * 4000) and "[cut: the first 4000 characters of 10001 bytes]" in printed


def test_the_callers_secrets_files_and_process_are_out_of_reach(tmp_path, monkeypatch):
    monkeypatch.setenv("SYNCWISE_TEST_SECRET", "hunter2")
    looked = _tool("import os\nprint(dict(os.environ))")
    assert "hunter2" not in looked.content and "PATH" in looked.content  # a clean environment
    if not NAMESPACES:
        pytest.skip("no namespaces here: the sandbox refuses to run (tested below)")
    # the real parent's (this process's) environment, by its pid: a /proc of the call's own, where the job's
    # processes do not exist
    peek = _tool(f"print(open('/proc/{os.getpid()}/environ').read())")
    assert "hunter2" not in peek.content and peek.error == "exception"
    killed = _tool(f"import os, signal\nos.kill({os.getpid()}, signal.SIGKILL)")
    assert killed.error == "exception" and ("PermissionError" in killed.content
                                            or "ProcessLookupError" in killed.content)
    os.kill(os.getpid(), 0)  # still here
    assert signal.getsignal(signal.SIGINT) is not None


# A policy's attack, as JSON: whom it reaches on loopback, which folders it can write, whether it reads the job's
# files and any process's environment holding the secret, which processes it sees.
ATTACK = """
import json, os, socket
found = {"writable": [], "read": [], "environ_secret": False, "connected": False}
try:
    socket.create_connection(("127.0.0.1", PORT), timeout=2)
    found["connected"] = True
except OSError:
    pass
for folder in ["/", "/tmp", "/dev/shm", "/var/tmp", "/run/lock", "/run", "/var", "/home", "/root", "/etc", "/usr",
               "/usr/local", "/opt", "/srv", "/mnt", "/work", JOB_FOLDER]:
    try:
        with open(os.path.join(folder, "planted"), "w") as f:
            f.write("x")
        found["writable"].append(folder)
    except OSError:
        pass
for path in JOB_FILES:
    try:
        found["read"].append(open(path).read())
    except OSError:
        pass
pids = [p for p in os.listdir("/proc") if p.isdigit()]
for pid in pids:
    try:
        found["environ_secret"] |= "hunter2" in open(f"/proc/{pid}/environ").read()
    except OSError:
        pass
found["processes"] = len(pids)
print(json.dumps(found))
"""


def _job_folder() -> Path:
    """A job's folder as users leave them: 0755, a prompt file with its answers and a checkpoint, 0644, outside
    /tmp (where the call's /tmp would hide it anyway)."""
    folder = Path(tempfile.mkdtemp(prefix="syncwise-job-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None))
    os.chmod(folder, 0o755)
    (folder / "prompts.jsonl").write_text('{"prompt": "2+2", "answer": "4"}\n')
    (folder / "checkpoint.pt").write_text("weights")
    for file in folder.iterdir():
        os.chmod(file, 0o644)
    return folder


def _attack_code(port: int, folder: Path) -> str:
    files = [str(folder / "prompts.jsonl"), str(folder / "checkpoint.pt"), str(Path.home() / ".bashrc")]
    return (ATTACK.replace("PORT", str(port)).replace("JOB_FOLDER", repr(str(folder)))
            .replace("JOB_FILES", repr(files)))


def _assert_held(found: dict, folder: Path) -> None:
    assert not found["connected"], found
    assert sorted(found["writable"]) == ["/dev/shm", "/tmp"], found  # nothing else, and both its own
    assert found["read"] == [] and not found["environ_secret"], found
    assert found["processes"] <= 3, found  # its own PID namespace: itself and the namespace's starter
    assert not (folder / "planted").exists() and not Path("/var/tmp/planted").exists()


@pytest.mark.skipif(not NAMESPACES, reason="no namespaces here: the sandbox refuses to run (tested below)")
def test_a_policy_reaches_no_server_writes_nothing_that_lasts_and_reads_none_of_the_jobs_files(monkeypatch):
    """Issue 67 (6, 8): as this job's user (root in CI) -- only its own /tmp and /dev/shm are writable (not
    /var/tmp or /run/lock on the real disk), none of the job's files is readable (the prompt file's answers, a
    checkpoint, the home folder), no process's environment shows the secret, no server is reached."""
    import json

    monkeypatch.setenv("SYNCWISE_TEST_SECRET", "hunter2")
    folder, server = _job_folder(), _loopback_server()
    try:
        found = json.loads(run_python(_attack_code(server.getsockname()[1], folder), LIMITS))
        _assert_held(found, folder)
    finally:
        server.close()
        shutil.rmtree(folder)


def _loopback_server():
    import socket

    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    return server


def _connect_code(port: int) -> str:
    return (f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            "    print('CONNECTED')\nexcept OSError as exc:\n    print('refused:', exc)")


@pytest.mark.skipif(not NAMESPACES, reason="no namespaces here: the sandbox shares the job's network (said in the "
                                           "first line; python beside rollout ranks is refused)")
def test_the_program_reaches_no_server_neither_on_loopback_nor_the_jobs_store():
    """Issue 62 (1): a loopback server of this process and the job's rendezvous store (hosted as the launcher hosts
    it, on loopback only) are out of the program's reach -- its network namespace has no route anywhere."""
    from syncwise.runtime.job_store import host_store

    server = _loopback_server()
    store = host_store()
    try:
        for port in (server.getsockname()[1], store.port):
            reached = _tool(_connect_code(port))
            assert "CONNECTED" not in reached.content and "refused:" in reached.content, reached.content
    finally:
        server.close()


def test_the_jobs_store_listens_on_loopback_only():
    """Issue 62 (1): the local launcher's store was on every interface (``*:<port>``), though it asked for
    127.0.0.1: any host reaching the machine could write to it. Read from the kernel's table of listening sockets."""
    from syncwise.runtime.job_store import host_store

    store = host_store()
    rows = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A" and int(local.split(":")[1], 16) == store.port:  # LISTEN
                rows.append(local.split(":")[0])
    assert rows == ["0100007F"], rows  # 127.0.0.1, and nothing else (no 0.0.0.0, no ::)


@pytest.mark.skipif(not NAMESPACES, reason="no namespaces here: the sandbox refuses to run (tested below)")
def test_dev_shm_and_tmp_are_private_bounded_and_gone_after_the_call():
    """Issue 62 (2): one call filling /dev/shm left 2.5 GiB of RAM behind, readable by later calls. Now each call's
    /tmp and /dev/shm are tmpfs of its own (scratch_bytes each): a fill stops there, nothing outlives the call, and
    the next call sees nothing of it."""
    limits = SandboxLimits(wall_s=10.0, cpu_s=10, scratch_bytes=8 << 20)
    before = set(os.listdir("/dev/shm"))
    fill = "\n".join([
        "import os",
        "for folder in ('/dev/shm', '/tmp'):",
        "    try:",
        "        with open(folder + '/fill', 'wb') as f:",
        "            for _ in range(64):",
        "                f.write(b'x' * (1 << 20))",
        "    except OSError as exc:",
        "        print(folder, 'full at', os.path.getsize(folder + '/fill') >> 20, 'MiB:', exc.strerror)"])
    out = run_python(fill, limits)
    assert "/dev/shm full at 8 MiB: No space left on device" in out and "/tmp full at 8 MiB" in out, out
    assert set(os.listdir("/dev/shm")) == before
    kept = sorted({Path(p).relative_to("/tmp").parts[0] for p in python_folders() if Path(p).is_relative_to("/tmp")})
    assert run_python("import os\nprint(os.listdir('/dev/shm'), sorted(os.listdir('/tmp')))", limits) == f"[] {kept}\n"


# Three children each holding 200 MiB for 2 s, against a budget of 512 MiB for the call
HOGS = """
import os, time
kids = []
for i in range(3):
    pid = os.fork()
    if pid == 0:
        try:
            block = bytearray(200 << 20)
            block[::4096] = b"x" * len(block[::4096])
            time.sleep(2)
        except MemoryError:
            os._exit(3)
        os._exit(0)
    kids.append(pid)
print([os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in kids])
"""


@pytest.mark.skipif(not NAMESPACES, reason="no namespaces here: the sandbox refuses to run (tested below)")
def test_memory_is_one_budget_for_all_the_calls_processes():
    """Issue 67 (7): 1 GiB of address space each, up to 32 processes, let three forked children hold 1.2-1.5 GiB.
    Now the call's processes share one budget (a cgroup; else limits whose product is the budget): three children
    of 200 MiB do not all hold theirs under 512 MiB."""
    limits = SandboxLimits(wall_s=20.0, cpu_s=10, memory_bytes=512 << 20)
    try:
        codes = run_python(HOGS, limits)
    except sandbox.SandboxFailure as failure:  # the budget's kill reached the parent too
        assert "memory budget" in str(failure) or "killed" in str(failure), str(failure)
        return
    assert codes.strip() != "[0, 0, 0]", codes
    assert run_python("print(len(bytearray(100 << 20)))", limits) == f"{100 << 20}\n"  # the budget is usable


@pytest.mark.skipif(not (OWN_USER and NAMESPACES), reason="a uid per call: the job runs as root")
def test_concurrent_calls_of_two_ranks_hold_different_uids_and_do_not_share_a_process_limit():
    """Issue 67 (10): every rank's first call ran as uid 61000, so one call holding its processes made another
    rank's call fail. Two processes (two ranks) call at once: different uids, and the second runs while the first
    holds every process it may."""
    import subprocess
    import sys

    hold = ("import os, time\nprint(os.getuid(), flush=True)\nfor _ in range(64):\n    try:\n"
            "        if os.fork() == 0:\n            time.sleep(5)\n            os._exit(0)\n"
            "    except OSError:\n        break\ntime.sleep(4)")
    probe = "import os\nprint(os.getuid())"
    script = ("import sys\nfrom syncwise.runtime.sandbox import SandboxLimits, run_python\n"
              "print(run_python(sys.argv[1], SandboxLimits(wall_s=float(sys.argv[2]), cpu_s=5)), end='')")
    first = subprocess.Popen([sys.executable, "-c", script, hold, "3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    import time

    time.sleep(1.0)  # the first call holds its processes now
    second = subprocess.run([sys.executable, "-c", script, probe, "10"], capture_output=True, text=True, timeout=60)
    out, err = first.communicate(timeout=60)
    assert second.returncode == 0, failed(second.stderr, 2000)
    assert "did not finish within 3 s" in err and out == "", err  # the first was cut at its wall clock
    held = err.split("its output before:\n")[1].split()[0]
    assert int(second.stdout) != int(held), (second.stdout, held)


def test_where_no_namespace_can_be_made_policy_code_is_refused_unless_the_job_opts_in(monkeypatch, folder_tools):
    """Issue 67 (5, 9): the code does not run unprotected by default -- run_python refuses, whoever calls it (the
    tool runner ends the job with it rather than answering the model), and the built-in python tool is one line
    before any rank; rl.sandbox_unsafe_no_isolation=true runs it, said in the first line."""
    monkeypatch.setattr(sandbox, "isolation", lambda: sandbox.Isolation(own_user=False, namespaces=(), cgroup=False))
    with pytest.raises(SandboxRefused, match="rl.sandbox_unsafe_no_isolation=true"):
        run_python("print(1)", LIMITS)
    with pytest.raises(SandboxRefused):
        _tool("print(1)")  # an environment's or user's tool calling run_python: the job's error
    assert "UNPROTECTED" in describe()
    monkeypatch.setenv(sandbox.UNSAFE_ENV, "1")
    assert run_python("print(6 * 7)", LIMITS) == "42\n"
    folder_tools(monkeypatch)


@pytest.fixture
def folder_tools(tmp_path):
    """The preflight's half of the refusal: ``rl.tools=[python]`` on a machine without namespaces."""

    def check(monkeypatch):
        from syncwise.config import load_config
        from syncwise.jobs.preflight import PreflightError, check_sandbox
        from syncwise.rl.env.tools import Tool
        from syncwise.tools import BUILTIN_TOOLS

        tools = {"python": Tool("python", BUILTIN_TOOLS["python"], {})}
        monkeypatch.delenv(sandbox.UNSAFE_ENV)
        with pytest.raises(PreflightError, match=r"^rl.tools: python: the sandbox for policy code needs namespaces"):
            check_sandbox(load_config(None, []), tools)
        check_sandbox(load_config(None, ["rl.sandbox_unsafe_no_isolation=true"]), tools)

    return check


@pytest.mark.skipif(not NAMESPACES, reason="no namespaces here: the call's /tmp is the machine's")
def test_a_job_whose_python_lies_under_tmp_runs_it_there_read_only():
    """A checkout and its venv under /tmp (as CI clones): the call's private /tmp would hide the interpreter (every
    call failed with 'setpriv: failed to execute .../.venv/bin/python'). Its folder is mounted there again,
    read-only, and nothing else of the host's /tmp is."""
    import subprocess
    import venv

    root = Path(tempfile.mkdtemp(prefix="syncwise-venv-", dir="/tmp"))
    try:
        venv.create(root / "venv", with_pip=False)
        (root / "secret.txt").write_text("the host's /tmp")
        code = ("import os, sys\nprint(sys.prefix)\nprint(os.listdir(os.path.dirname(sys.prefix)))\n"
                "try:\n    open(sys.prefix + '/planted', 'w')\nexcept OSError as exc:\n    print(exc.strerror)\n")
        script = (_load_module_alone() +
                  f"print(sandbox.run_python({code!r}, sandbox.SandboxLimits(wall_s=10, cpu_s=5)), end='')\n")
        proc = subprocess.run([str(root / "venv" / "bin" / "python"), "-I", "-c", script], capture_output=True,
                              text=True, timeout=60, cwd="/")
        assert proc.returncode == 0, failed(proc.stderr, 2000)
        assert proc.stdout.splitlines() == [str(root / "venv"), "['venv']", "Read-only file system"]
        assert not (root / "venv" / "planted").exists()
    finally:
        shutil.rmtree(root)


def _load_module_alone() -> str:
    """Python that loads the sandbox's module by its file (standard library only), as ``sandbox``."""
    module = Path(__file__).resolve().parents[1] / "src" / "syncwise" / "runtime" / "sandbox.py"
    return ("import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('sandbox', {str(module)!r})\n"
            "sandbox = sys.modules['sandbox'] = importlib.util.module_from_spec(spec)\n"
            "spec.loader.exec_module(sandbox)\n")


@pytest.mark.skipif(os.geteuid() != 0, reason="starts the sandbox as an unprivileged user, from root")
def test_run_by_a_user_without_root_the_call_holds_as_it_does_for_root():
    """Issue 67 (5): an unprivileged user got no isolation at all (the probe's mount --move was refused in its user
    namespace). Run as uid 65534 by a system Python: namespaces of its own, and the same attack as root's finds no
    server, no writable folder but its own, none of the job's files; forked hogs share one budget; a fork bomb
    ends with the call. (The module alone: this venv's Python may lie where only root reads.)"""
    import json
    import subprocess

    python = shutil.which("python3", path="/usr/bin:/usr/local/bin:/bin")
    if python is None:
        pytest.skip("no system python3 for an unprivileged user")
    folder, server = _job_folder(), _loopback_server()
    marker = "syncwise_marker_unprivileged_bomb"
    bomb = f"# {marker}\nimport os\nwhile True:\n    try: os.fork()\n    except OSError: pass"
    script = (_load_module_alone() +
              "import json\nfound = sandbox.isolation()\nprint(found.own_user, found.own_network)\n"
              "print(sandbox.describe())\n"
              f"print(sandbox.run_python({_attack_code(server.getsockname()[1], folder)!r}, "
              "sandbox.SandboxLimits(wall_s=10, cpu_s=5)), end='')\n"
              f"print(sandbox.run_python({HOGS!r}, sandbox.SandboxLimits(wall_s=20, cpu_s=10, "
              "memory_bytes=512 << 20)), end='')\n"
              f"try:\n    sandbox.run_python({bomb!r}, sandbox.SandboxLimits(wall_s=2, cpu_s=2))\n"
              "except sandbox.SandboxFailure as exc:\n    print(str(exc).splitlines()[0])\n"
              + KEY_SETUP + "print(KEY_ID >= 0)\nif KEY_ID >= 0:\n"
              f"    print(sandbox.run_python({KEYRING_PROBE!r}.replace('KEY_ID', str(KEY_ID))), end='')\n")
    try:
        proc = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", python, "-I", "-c",
                               script], capture_output=True, text=True, timeout=120, cwd="/",
                              env={"PATH": os.environ["PATH"], "SYNCWISE_TEST_SECRET": "hunter2"})
    finally:
        server.close()
    try:
        assert proc.returncode == 0, failed(proc.stderr, 2000)
        lines = proc.stdout.splitlines()
        own_user, network = lines[0].split()
        if network != "True":
            pytest.skip("the kernel allows no unprivileged user namespace here")
        assert own_user == "False" and "as the job's user without privileges" in lines[1]
        _assert_held(json.loads(lines[2]), folder)
        assert lines[3] != "[0, 0, 0]", lines[3]
        assert lines[4] == "the code did not finish within 2 s" and _running(marker) == []
        if lines[5] == "True":  # issue 77 (4): its keyring out of reach in a user namespace too (where keys exist)
            assert lines[6:] == ["read denied", "search denied", "list denied"], lines[6:]
    finally:
        shutil.rmtree(folder)


# Issue 77 (4): what the program tries against a key the job holds in its session keyring: read it by id, find it by
# search from its session keyring, list its session keyring -- each "denied" where the key is out of reach
KEYRING_PROBE = """
import ctypes, platform
number = {"x86_64": 250, "aarch64": 219}[platform.machine()]
libc = ctypes.CDLL(None, use_errno=True)
value, links = ctypes.create_string_buffer(256), ctypes.create_string_buffer(256)
read = libc.syscall(number, 11, KEY_ID, value, 256)  # KEYCTL_READ the key by id
found = libc.syscall(number, 10, -3, b"user", b"syncwise-test-secret", 0)  # KEYCTL_SEARCH the session keyring
listed = libc.syscall(number, 11, -3, links, 256)  # KEYCTL_READ the session keyring: the ids it links
ids = [int.from_bytes(links.raw[i:i + 4], "little") for i in range(0, max(listed, 0), 4)]
print("read", "denied" if read < 0 else value.raw[:read].decode(errors="replace"))
print("search", "denied" if found < 0 else found)
print("list", "denied" if KEY_ID not in ids else "holds the key")
"""
KEY_SETUP = """
import ctypes, platform
libc = ctypes.CDLL(None, use_errno=True)
add_key = {"x86_64": 248, "aarch64": 217}.get(platform.machine())
KEY_ID = libc.syscall(add_key, b"user", b"syncwise-test-secret", b"hunter2", 7, ctypes.c_int(-3)) if add_key else -1
"""


def _job_key() -> int:
    """A key added to this process's session keyring, as host tooling keeps a token there (skip: no keyrings)."""
    scope: dict = {}
    exec(KEY_SETUP, scope)
    if scope["KEY_ID"] < 0:
        pytest.skip("no key could be added (keyctl refused by a seccomp filter, or not x86_64 / aarch64)")
    return scope["KEY_ID"]


@pytest.mark.skipif(not NAMESPACES, reason="no namespaces here")
def test_the_program_cannot_read_a_key_of_the_jobs_keyring():
    """Issue 77 (4): the program kept the job's session keyring and read every key in it through keyctl(2), as
    root's sandbox uid. Each call now joins a fresh anonymous session keyring first: read, search and list all find
    nothing -- while this process still reads its own key (the job keeps its keyring)."""
    key = _job_key()
    out = run_python(KEYRING_PROBE.replace("KEY_ID", str(key)), LIMITS)
    assert out.splitlines() == ["read denied", "search denied", "list denied"], out
    mine = subprocess_free_probe(key)
    assert mine.splitlines()[0] == "read hunter2", mine  # the job still holds its own key


def subprocess_free_probe(key: int) -> str:
    """The probe run in this process (no sandbox): what the job itself reads."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(KEYRING_PROBE.replace("KEY_ID", str(key)), {})
    return out.getvalue()
