"""async_grpo.rewards.sandbox.run_python against hostile programs: each attack is contained (the outcome says which
limit stopped it, nothing escapes) and the run ends within its deadline plus a generous slack.

The kernel-layer tests run with the Python audit hook off (python_guards=False), so they show the
kernel layer alone; the hook tests show the Python layer alone on attacks the kernel lets through.
"""

from __future__ import annotations

import os
import socket
import threading
import uuid
from pathlib import Path

import pytest

from async_grpo.rewards import sandbox
from async_grpo.rewards.sandbox import SandboxConfig, run_python

# Interpreter start and the kill/reap path on a loaded 2-core machine; a contained attack ends
# within deadline + this, an uncontained one (a stalled read, a leaked tree) would not end at all.
SLACK_S = 10.0
DEADLINE_S = 2.0
LAYERS = sandbox.isolation()
needs_namespaces = pytest.mark.skipif(not LAYERS.namespaces, reason="unshare --net --pid unavailable here")
needs_own_uid = pytest.mark.skipif(not LAYERS.own_uid, reason="not root: no uid of the sandbox's own")


def _config(**overrides) -> SandboxConfig:
    return SandboxConfig(timeout_s=DEADLINE_S, **overrides)


def _processes_of_uid_range() -> list[int]:
    """Pids of live processes whose effective uid is in the sandbox's range. A zombie is not live
    (it runs nothing and holds nothing; the machine's pid 1 reaps it a second or two later), and
    is read here from its state letter independently of sandbox._is_dead."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid >= sandbox._UID_BASE and any(
                        _thread_state(name, task) not in ("Z", "X", None) for task in os.listdir(f"/proc/{name}/task")):
                    found.append(int(name))
            except OSError:
                continue
    return found


def _thread_state(pid: str, task: str) -> str | None:
    """The state letter of one thread from its status file; None when it is gone."""
    try:
        with open(f"/proc/{pid}/task/{task}/status") as status:
            return next(line for line in status if line.startswith("State:")).split()[1]
    except OSError:
        return None


@pytest.mark.system
def test_a_plain_program_reads_stdin_and_its_files():
    program = "data = open('table.txt').read()\nprint(int(input()) * 2, data.strip())"
    result = run_python(program, stdin="21\n", config=_config(), files={"table.txt": "hello\n"})
    assert (result.outcome, result.exit_code, result.stdout) == ("ok", 0, "42 hello\n")


@pytest.mark.system
def test_a_crashing_program_is_an_error_with_its_traceback():
    result = run_python("raise ValueError('nope')", config=_config())
    assert (result.outcome, result.exit_code) == ("error", 1)
    assert "ValueError: nope" in result.stderr


@pytest.mark.system
def test_an_infinite_loop_is_killed_at_the_deadline():
    result = run_python("while True:\n    pass", config=_config(cpu_time_s=60))
    assert result.outcome == "timeout" and result.exit_code is None
    assert DEADLINE_S <= result.wall_s < DEADLINE_S + SLACK_S


@pytest.mark.system
def test_a_cpu_burner_hits_the_cpu_limit_before_a_longer_deadline():
    result = run_python("while True:\n    pass", config=SandboxConfig(timeout_s=30.0, cpu_time_s=1))
    assert result.outcome == "cpu_limit", result
    assert result.wall_s < 30.0


@pytest.mark.system
@needs_own_uid
def test_a_fork_bomb_is_capped_and_leaves_no_process_behind():
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    result = run_python(bomb, config=_config(max_processes=8))
    assert result.outcome == "timeout"
    assert result.wall_s < DEADLINE_S + SLACK_S
    assert _processes_of_uid_range() == []


@pytest.mark.system
@needs_namespaces
def test_children_that_leave_the_session_die_with_the_run():
    # setsid() escapes a process-group kill; the PID namespace's teardown still reaches it.
    marker = f"sandbox-orphan-{uuid.uuid4().hex}"
    program = ("import os, time\n"
               "if os.fork() == 0:\n"
               "    os.setsid()\n"
               f"    os.execvp('sleep', ['sleep', '600', '{marker}'])\n"
               "print('parent done')")
    result = run_python(program, config=_config(python_guards=False))
    assert result.outcome == "ok" and result.wall_s < DEADLINE_S + SLACK_S
    survivors = [p for p in Path("/proc").iterdir() if p.name.isdigit() and marker in _cmdline(p)]
    assert survivors == []


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


@pytest.mark.system
def test_a_memory_hog_gets_memory_error_not_the_machine():
    result = run_python("x = bytearray(8 * 1024 ** 3)\nprint('allocated')", config=_config(memory_bytes=256 * 2**20))
    assert result.outcome == "memory_limit"
    assert "allocated" not in result.stdout


@pytest.mark.system
def test_a_gradual_memory_hog_is_stopped_too():
    program = "chunks = []\nwhile True:\n    chunks.append(bytearray(16 * 1024 ** 2))"
    result = run_python(program, config=_config(memory_bytes=256 * 2**20))
    assert result.outcome == "memory_limit"
    assert result.wall_s < DEADLINE_S + SLACK_S


@pytest.mark.system
def test_100_mb_of_output_is_cut_at_the_cap_and_killed():
    program = "import sys\nfor _ in range(100):\n    sys.stdout.write('x' * 1_000_000)"
    result = run_python(program, config=_config(max_output_bytes=65536))
    assert result.outcome == "output_limit"
    assert len(result.stdout) + len(result.stderr) <= 65536
    assert result.wall_s < DEADLINE_S + SLACK_S


@pytest.mark.system
def test_a_file_larger_than_the_file_limit_cannot_be_written():
    program = "with open('big.bin', 'wb') as f:\n    f.write(b'x' * 4_000_000)"
    result = run_python(program, config=_config(max_file_bytes=1_000_000))
    assert result.outcome in ("file_limit", "error"), result  # SIGXFSZ, or EFBIG where the signal is ignored
    assert result.outcome != "ok"


@pytest.mark.system
@needs_own_uid
def test_the_kernel_refuses_writes_to_root_owned_paths(tmp_path):
    target = tmp_path / "pwned.txt"
    tmp_path.chmod(0o755)
    result = run_python(f"open({str(target)!r}, 'w').write('x')", config=_config(python_guards=False))
    assert result.outcome == "error" and "Permission denied" in result.stderr
    assert not target.exists()


@pytest.mark.system
def test_the_audit_hook_refuses_writes_outside_the_directory():
    # /tmp is world-writable, so only the Python layer stops this one.
    target = Path("/tmp") / f"sandbox-escape-{uuid.uuid4().hex}"
    for program in (f"open({str(target)!r}, 'w').write('x')",
                    f"import os\nos.close(os.open({str(target)!r}, os.O_WRONLY | os.O_CREAT))",
                    f"import os\nos.mkdir({str(target)!r})",
                    f"import shutil\nshutil.copy('main.py', {str(target)!r})"):
        result = run_python(program, config=_config())
        assert result.outcome == "error" and "sandbox:" in result.stderr, (program, result)
        assert not target.exists(), program


@pytest.mark.system
def test_writes_inside_the_directory_work_and_the_directory_is_removed():
    program = "import os\nopen('out.txt', 'w').write('hi')\nos.mkdir('sub')\nprint(os.getcwd())"
    result = run_python(program, config=_config())
    assert result.outcome == "ok", result
    workdir = Path(result.stdout.strip())
    assert workdir.name.startswith("sandbox-") and not workdir.exists()


def _listener() -> tuple[socket.socket, list[socket.socket]]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.2)
    accepted: list[socket.socket] = []

    def accept() -> None:
        for _ in range(30):
            try:
                accepted.append(server.accept()[0])
            except OSError:
                continue

    threading.Thread(target=accept, daemon=True).start()
    return server, accepted


@pytest.mark.system
@pytest.mark.parametrize("guards", [True, False], ids=["audit_hook", "kernel_only"])
def test_a_socket_reaches_nothing(guards):
    if not guards and not LAYERS.namespaces:
        pytest.skip("no network namespace here: the audit hook is the only network guard")
    server, accepted = _listener()
    port = server.getsockname()[1]
    program = f"import socket\ns = socket.socket()\ns.connect(('127.0.0.1', {port}))\nprint('connected')"
    result = run_python(program, config=_config(python_guards=guards))
    server.close()
    assert result.outcome == "error" and "connected" not in result.stdout
    assert ("sandbox: socket" in result.stderr) if guards else ("Network is unreachable" in result.stderr)
    assert accepted == []


@pytest.mark.system
def test_the_environment_is_not_inherited(monkeypatch):
    monkeypatch.setenv("SECRET_TOKEN", "do-not-leak")
    result = run_python("import os\nprint(os.environ.get('SECRET_TOKEN'), os.environ['HOME'] == os.getcwd())",
                        config=_config())
    assert result.stdout == "None True\n"


def test_files_must_stay_inside_the_directory():
    with pytest.raises(ValueError, match="relative path inside"):
        run_python("pass", files={"../escape.txt": "x"})


@pytest.mark.parametrize("field, value", [("timeout_s", 0), ("timeout_s", float("nan")), ("memory_bytes", 0),
                                          ("max_output_bytes", -1), ("cpu_time_s", 1.5)])
def test_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=f"SandboxConfig.{field}"):
        SandboxConfig(**{field: value})


def test_no_sandbox_process_outlives_the_tests():
    assert _processes_of_uid_range() == []
    assert os.geteuid() != sandbox._UID_BASE


@pytest.mark.system
def test_installed_packages_only_with_site_packages():
    program = "import numpy\nprint(numpy.__name__)"
    assert run_python(program, config=_config()).outcome == "error"
    assert run_python(program, config=_config(site_packages=True)).stdout == "numpy\n"
