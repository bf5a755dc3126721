"""The built-in ``python`` tool's sandbox (issue 49) against what a policy may write: an endless loop, a fork
bomb, a memory hog, a 100 MB print, a look at the trainer's secrets, a write into the trainer's folder, a kill
of its parent, a child that leaves its process group, a connection to a loopback server and to the job's store,
files filling /dev/shm (issue 62). Each is the tool's error, counted, the caller goes on, nothing of the caller's
is touched, and nothing the code started runs on. Short limits here (the tool's defaults are 5 s)."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from pathlib import Path

import pytest

from job_output import failed
from syncwise.rl.env.tools import Tool, ToolLimits, ToolRunner
from syncwise.sandbox import SandboxLimits, _interpreter_under_tmp, describe, isolation, run_python
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
    assert "not a container" in describe() and "rlimits" in describe()


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
    if not OWN_USER:
        pytest.skip("the job does not run as root: the code runs as its user (said in the first line)")
    # the real parent's (this process's) environment, by its pid (in the PID namespace getppid() is 0): another
    # user's, unreadable -- or, with namespaces, a /proc of the call's own, where the job's processes do not exist
    peek = _tool(f"print(open('/proc/{os.getpid()}/environ').read())")
    assert "hunter2" not in peek.content
    assert peek.error == "exception" and ("PermissionError" in peek.content or "FileNotFoundError" in peek.content)
    # outside /tmp, which a call with namespaces does not even see (its /tmp is its own)
    with tempfile.TemporaryDirectory(dir="/var/tmp" if os.path.isdir("/var/tmp") else None) as folder:
        os.chmod(folder, 0o755)
        trainer_file = Path(folder) / "trainer_state.json"
        trainer_file.write_text("{}")
        wrote = _tool(f"open({str(trainer_file)!r}, 'w').write('pwned')\nopen({str(Path(folder) / 'new')!r}, 'w')")
        assert wrote.error == "exception" and "PermissionError" in wrote.content
        assert trainer_file.read_text() == "{}" and not (Path(folder) / "new").exists()
    killed = _tool(f"import os, signal\nos.kill({os.getpid()}, signal.SIGKILL)")
    assert killed.error == "exception" and ("PermissionError" in killed.content
                                            or "ProcessLookupError" in killed.content)
    os.kill(os.getpid(), 0)  # still here
    assert signal.getsignal(signal.SIGINT) is not None


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


@pytest.mark.skipif(not NAMESPACES, reason="no namespaces here: /tmp and /dev/shm are the machine's (said in the "
                                           "first line)")
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
    kept = sorted({Path(p).relative_to("/tmp").parts[0] for p in _interpreter_under_tmp()})  # a checkout in /tmp
    assert run_python("import os\nprint(os.listdir('/dev/shm'), sorted(os.listdir('/tmp')))", limits) == f"[] {kept}\n"


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
        module = Path(__file__).resolve().parents[1] / "src" / "syncwise" / "sandbox.py"
        code = ("import os, sys\nprint(sys.prefix)\nprint(os.listdir(os.path.dirname(sys.prefix)))\n"
                "try:\n    open(sys.prefix + '/planted', 'w')\nexcept OSError as exc:\n    print(exc.strerror)\n")
        script = ("import importlib.util, sys\n"
                  f"spec = importlib.util.spec_from_file_location('sandbox', {str(module)!r})\n"
                  "sandbox = sys.modules['sandbox'] = importlib.util.module_from_spec(spec)\n"
                  "spec.loader.exec_module(sandbox)\n"
                  f"print(sandbox.run_python({code!r}, sandbox.SandboxLimits(wall_s=10, cpu_s=5)), end='')\n")
        proc = subprocess.run([str(root / "venv" / "bin" / "python"), "-I", "-c", script], capture_output=True,
                              text=True, timeout=60, cwd="/")
        assert proc.returncode == 0, failed(proc.stderr, 2000)
        assert proc.stdout.splitlines() == [str(root / "venv"), "['venv']", "Read-only file system"]
        assert not (root / "venv" / "planted").exists()
    finally:
        shutil.rmtree(root)


@pytest.mark.skipif(os.geteuid() != 0, reason="starts the sandbox as an unprivileged user, from root")
def test_run_by_a_user_without_root_it_still_has_namespaces_of_its_own():
    """A job that does not run as root: the sandbox makes its namespaces in an unprivileged user namespace where
    the kernel allows one, so its network and /dev/shm are its own there too. (The module alone, by a system
    Python an unprivileged user can run: this venv's Python may lie where only root reads.)"""
    import subprocess

    python = shutil.which("python3", path="/usr/bin:/usr/local/bin:/bin")
    if python is None:
        pytest.skip("no system python3 for an unprivileged user")
    server = _loopback_server()
    module = Path(__file__).resolve().parents[1] / "src" / "syncwise" / "sandbox.py"
    script = ("import importlib.util\n"
              f"spec = importlib.util.spec_from_file_location('sandbox', {str(module)!r})\n"
              "import sys\nsandbox = sys.modules['sandbox'] = importlib.util.module_from_spec(spec)\n"
              "spec.loader.exec_module(sandbox)\n"
              "found = sandbox.isolation()\nprint(found.own_user, found.own_network)\nprint(sandbox.describe())\n"
              f"print(sandbox.run_python({_connect_code(server.getsockname()[1])!r}, "
              "sandbox.SandboxLimits(wall_s=10, cpu_s=5)))\n")
    try:
        proc = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", python, "-I", "-c",
                               script], capture_output=True, text=True, timeout=60, cwd="/",
                              env={"PATH": os.environ["PATH"]})
    finally:
        server.close()
    assert proc.returncode == 0, failed(proc.stderr, 2000)
    own_user, network = proc.stdout.splitlines()[0].split()
    if network != "True":
        pytest.skip("the kernel allows no unprivileged user namespace here")
    assert own_user == "False" and "as the job's user, with no network" in proc.stdout
    assert "refused:" in proc.stdout and "CONNECTED" not in proc.stdout
