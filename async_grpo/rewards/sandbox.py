"""Run an untrusted Python program in a sandbox process: no network, CPU time, memory, process
count, file size and output limits, a private temporary directory, killed on a wall deadline.

    result = run_python("print(int(input()) * 2)", stdin="21\\n", config=SandboxConfig(timeout_s=2.0))
    result.outcome, result.stdout   # ("ok", "42\\n")

Used by the code-execution reward (code_reward.py) and meant for the tools of multi-turn
environments, so it knows nothing about rewards. One call = one program run, in a fresh process
tree that is gone when the call returns, and whose directory is removed.

What contains a hostile program, layer by layer (`isolation()` says which layers this machine has;
tests/rewards/test_sandbox.py runs each attack against them):

    layer                          enforced by   contains
    network namespace              kernel        sockets: only a loopback that is down, so every
      (`unshare --net`)                          connect fails with "Network is unreachable"
    PID namespace                  kernel        fork bombs and stray children: killing the
      (`unshare --pid --kill-child`)             namespace's init kills every process in it,
                                                 including ones that called setsid()
    unprivileged uid               kernel        writes to anything owned by root (the repository,
      (`setpriv`, when run as root)              /etc, the venv); RLIMIT_NPROC counts this uid only;
                                                 after each run every process of the uid is killed
    rlimits (`prlimit`)            kernel        CPU seconds (RLIMIT_CPU), address space
                                                 (RLIMIT_AS: allocations fail with MemoryError),
                                                 processes (RLIMIT_NPROC), file size (RLIMIT_FSIZE),
                                                 no core dumps
    output cap                     this module   stdout+stderr read through pipes; past
                                                 max_output_bytes the tree is killed
    wall deadline                  this module   the whole tree is SIGKILLed at timeout_s
    audit hook (sys.addaudithook)  Python        in the program's own interpreter: opening for write,
                                                 creating, removing or renaming a path outside the
                                                 private directory, any socket, ctypes.dlopen
                                                 (unless site_packages) raise PermissionError

The kernel layers hold for any code the program runs (child processes, other binaries). The audit
hook is the only layer that stops writes into world-writable directories outside the private one
(/tmp, /dev/shm) and it covers Python code in the sandboxed interpreter only: a program that
starts another binary (`os.system("echo x > /tmp/f")`) can still write there as the unprivileged
uid. Without root (no uid change) the kernel does not stop writes the calling user may make, and
without `unshare` the audit hook is the only network guard; `isolation()` and the log say so.

Imports no Ray, vLLM or torch.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Literal

logger = logging.getLogger(__name__)

Outcome = Literal["ok", "error", "timeout", "output_limit", "cpu_limit", "memory_limit", "file_limit"]

# The sandboxed program's file inside its private directory.
PROGRAM_FILE = "main.py"
_STDIN_FILE = ".stdin"
# Sandboxed runs take uids far above any real account's: BASE + (pid << 8) + a per-process
# counter is unique among live processes (pid_max <= 2^22, so it stays below 2^32 - 1), so two
# concurrent sandboxes never share RLIMIT_NPROC's per-uid count or each other's files.
_UID_BASE = 3_000_000_000
_UID_SLOTS = 256
# Probing `unshare` starts two processes; past this the probe counts as failed.
_PROBE_TIMEOUT_S = 10.0
# RLIMIT_CPU's hard limit sits this far above the soft one: at the soft limit the kernel sends
# SIGXCPU (reported as "cpu_limit"), at the hard one SIGKILL, which would be indistinguishable
# from any other kill.
_CPU_HARD_GRACE_S = 1
# Reads from the program's pipes, in bytes.
_READ_CHUNK = 65536
# After a kill, how long to wait for the killed tree to be reaped before giving up on it.
_REAP_TIMEOUT_S = 5.0
# How often _sweep_uid looks again for processes that a SIGKILL has not removed yet.
_SWEEP_POLL_S = 0.01
# /proc/<pid>/stat states of a process that has exited: zombie, dead.
_DEAD_STATES = (b"Z", b"X")
# The init process exits 128 + N when the program died of signal N (the shell convention).
_SIGNAL_EXIT_BASE = 128
# Runs first in the sandboxed interpreter (python -I -c). In a PID namespace this interpreter is
# the namespace's init, and the kernel ignores signals such as SIGXCPU (RLIMIT_CPU) or SIGXFSZ
# that init has no handler for, so it forks: the program runs as pid 2 where the limits' signals
# kill it, and init reports its fate as an exit code (128 + signal). The audit hook comes next,
# then the program runs as __main__ from its file.
_BOOT = r'''
import os, sys
if os.getpid() == 1:
    child = os.fork()
    if child:
        _, status = os.waitpid(child, 0)
        os._exit(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
ROOT = os.path.realpath(os.getcwd())
GUARD = sys.argv[1] != "off"
BLOCKED_PREFIXES = ("socket.", "ctypes.dlopen") if sys.argv[1] == "strict" else ("socket.",)
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
PATH_EVENTS = {"os.remove": 1, "os.rename": 2, "os.mkdir": 1, "os.rmdir": 1, "os.symlink": 2, "os.link": 2,
               "os.chmod": 1, "os.chown": 1, "os.truncate": 1, "os.utime": 1, "shutil.rmtree": 1,
               }
def inside(path):
    if isinstance(path, int):
        return True
    real = os.path.realpath(os.fsdecode(path))
    return real == ROOT or real.startswith(ROOT + os.sep)
def hook(event, args):
    if event == "open":
        path, mode, flags = args
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool((flags or 0) & WRITE_FLAGS)
        if writing and not inside(path):
            raise PermissionError(f"sandbox: writing outside the sandbox directory is not allowed: {path!r}")
    elif event in PATH_EVENTS:
        for path in args[:PATH_EVENTS[event]]:
            if path is not None and not inside(path):
                raise PermissionError(f"sandbox: {event} outside the sandbox directory is not allowed: {path!r}")
    elif event.startswith(BLOCKED_PREFIXES):
        raise PermissionError(f"sandbox: {event} is not allowed")
if GUARD:
    sys.addaudithook(hook)
sys.argv = [sys.argv[2]]
import runpy
runpy.run_path(sys.argv[0], run_name="__main__")
'''
_uid_counter = itertools.count()
_uid_lock = threading.Lock()


@dataclass(kw_only=True, frozen=True)
class SandboxConfig:
    """Limits of one sandboxed run."""

    timeout_s: float = 5.0
    """Wall-clock deadline of the whole run (interpreter start included, ~30-60 ms); the process
    tree is SIGKILLed when it passes."""
    cpu_time_s: int = 5
    """RLIMIT_CPU of each process, in CPU seconds (SIGXCPU at the limit)."""
    memory_bytes: int = 512 * 1024 * 1024
    """RLIMIT_AS of each process: allocations beyond it fail (MemoryError in Python)."""
    max_processes: int = 16
    """RLIMIT_NPROC: processes (threads included) the sandbox uid may have at once. Only enforced
    with a uid of the sandbox's own (run as root); otherwise it would count the caller's processes."""
    max_file_bytes: int = 16 * 1024 * 1024
    """RLIMIT_FSIZE: largest file a process may write (SIGXFSZ beyond it)."""
    max_output_bytes: int = 1024 * 1024
    """stdout + stderr kept; a program that writes more is killed (outcome "output_limit")."""
    site_packages: bool = False
    """Let the program import the installed packages (the interpreter's site-packages). False runs
    it with `python -S`: the standard library only, and a faster start (site's import of a large
    environment's .pth files costs tens of ms per run). True also lets it load C libraries through
    ctypes (numpy does), which can bypass the audit hook: the kernel layers still hold."""
    python_guards: bool = True
    """Install the audit hook (writes outside the directory, sockets, ctypes) in the program's
    interpreter. False leaves only the kernel layers (tests use it to check those alone)."""

    def __post_init__(self) -> None:
        timeout = self.timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or timeout <= 0:
            raise ValueError(f"SandboxConfig.timeout_s must be a finite number > 0, got {timeout!r}")
        for name in ("cpu_time_s", "memory_bytes", "max_processes", "max_file_bytes", "max_output_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SandboxConfig.{name} must be an int >= 1, got {value!r}")


@dataclass(slots=True, frozen=True)
class SandboxResult:
    """What one sandboxed run did."""

    outcome: Outcome
    """"ok" (exit code 0), "error" (another exit code), "timeout" (killed at the deadline),
    "output_limit" (killed for writing more than max_output_bytes), "cpu_limit" (SIGXCPU),
    "memory_limit" (MemoryError or killed by the address-space limit), "file_limit" (SIGXFSZ)."""
    exit_code: int | None
    """The program's exit code; -N when signal N ended it; None when this module killed it."""
    stdout: str
    """What it wrote to stdout (UTF-8, undecodable bytes replaced), at most max_output_bytes."""
    stderr: str
    """What it wrote to stderr, likewise."""
    wall_s: float
    """Seconds from start to the last process reaped."""


@dataclass(slots=True, frozen=True)
class Isolation:
    """The kernel layers this machine gives a sandbox (see the module docstring)."""

    namespaces: bool
    """`unshare --net --pid --fork --kill-child` works: no network, whole-tree kill."""
    own_uid: bool
    """Running as root with `setpriv`: the program runs under a uid of its own."""
    prlimit: bool
    """The `prlimit` tool is present (rlimits are set without a preexec_fn)."""


@cache
def isolation() -> Isolation:
    """Probe (once per process) which kernel layers are available, and log the answer."""
    unshare, setpriv, prlimit = (shutil.which(tool) for tool in ("unshare", "setpriv", "prlimit"))
    namespaces = False
    if unshare is not None:
        try:
            probe = subprocess.run([unshare, "--net", "--pid", "--fork", "--kill-child", "true"],
                                   capture_output=True, timeout=_PROBE_TIMEOUT_S)
            namespaces = probe.returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            namespaces = False
    found = Isolation(namespaces=namespaces, own_uid=os.geteuid() == 0 and setpriv is not None,
                      prlimit=prlimit is not None)
    if not found.namespaces:
        logger.warning("sandbox: no network/PID namespaces (unshare unavailable or refused): sockets are blocked "
                       "by the Python audit hook only, and stray children are killed by process group")
    if not found.own_uid:
        logger.warning("sandbox: not root: programs run as the calling user (no uid of their own, no RLIMIT_NPROC)")
    return found


def _sandbox_uid() -> int:
    with _uid_lock:
        slot = next(_uid_counter) % _UID_SLOTS
    return _UID_BASE + (os.getpid() << 8) + slot


def _command(config: SandboxConfig, layers: Isolation, uid: int | None) -> list[str]:
    """prlimit -> unshare -> setpriv -> python, each exec'ing (or, unshare, forking) the next."""
    command: list[str] = []
    if layers.prlimit:
        command += ["prlimit", f"--cpu={config.cpu_time_s}:{config.cpu_time_s + _CPU_HARD_GRACE_S}", f"--as={config.memory_bytes}",
                    f"--fsize={config.max_file_bytes}", "--core=0"]
        if uid is not None:
            command.append(f"--nproc={config.max_processes}")
        command.append("--")
    if layers.namespaces:
        command += ["unshare", "--net", "--pid", "--fork", "--kill-child"]
    if uid is not None:
        command += ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
    flags = ["-I"] if config.site_packages else ["-I", "-S"]
    return command + [sys.executable, *flags, "-c", _BOOT, _guard_mode(config), PROGRAM_FILE]


def _guard_mode(config: SandboxConfig) -> str:
    """The boot code's audit-hook mode: off, strict (ctypes blocked too) or lenient (installed
    packages such as numpy load C libraries through ctypes, so site_packages allows it)."""
    if not config.python_guards:
        return "off"
    return "lenient" if config.site_packages else "strict"


def _rlimits_in_child(config: SandboxConfig) -> None:
    """preexec_fn when `prlimit` is missing (safe only from a single-threaded caller)."""
    import resource

    resource.setrlimit(resource.RLIMIT_CPU, (config.cpu_time_s, config.cpu_time_s + _CPU_HARD_GRACE_S))
    resource.setrlimit(resource.RLIMIT_AS, (config.memory_bytes, config.memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (config.max_file_bytes, config.max_file_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _prepare_directory(program: str, stdin: str, files: dict[str, str], uid: int | None) -> Path:
    """A fresh private directory holding the program, its stdin and extra files, owned by `uid`."""
    root = Path(tempfile.mkdtemp(prefix="sandbox-"))
    (root / PROGRAM_FILE).write_text(program, encoding="utf-8")
    (root / _STDIN_FILE).write_text(stdin, encoding="utf-8")
    for name, content in files.items():
        target = (root / name).resolve()
        if not target.is_relative_to(root.resolve()) or name in (PROGRAM_FILE, _STDIN_FILE):
            shutil.rmtree(root)
            raise ValueError(f"sandbox file name {name!r} must be a relative path inside the directory")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content, encoding="utf-8")
    if uid is not None:
        for path in (root, *root.rglob("*")):
            os.chown(path, uid, uid)
    return root


def run_python(program: str, stdin: str = "", config: SandboxConfig | None = None,
               files: dict[str, str] | None = None) -> SandboxResult:
    """Run `program` (Python source) in a sandbox with `stdin` as its standard input and `files`
    (relative name -> text) beside it; returns when every process of the run is gone and its
    directory removed. Never raises for anything the program does."""
    config = config or SandboxConfig()
    layers = isolation()
    uid = _sandbox_uid() if layers.own_uid else None
    root = _prepare_directory(program, stdin, files or {}, uid)
    try:
        return _run(config, layers, uid, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _run(config: SandboxConfig, layers: Isolation, uid: int | None, root: Path) -> SandboxResult:
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(root), "TMPDIR": str(root), "LANG": "C.UTF-8"}
    start = time.monotonic()
    with open(root / _STDIN_FILE, "rb") as stdin:
        process = subprocess.Popen(
            _command(config, layers, uid), stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=root,
            env=env, start_new_session=True, close_fds=True,
            preexec_fn=None if layers.prlimit else lambda: _rlimits_in_child(config),
        )
    out, err, killed_for = _collect(process, config, start + config.timeout_s)
    if killed_for is None:
        try:
            process.wait(max(start + config.timeout_s - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            killed_for = "timeout"
    if killed_for is not None:
        _kill_tree(process)
    if uid is not None:
        _sweep_uid(uid)
    wall = time.monotonic() - start
    stdout = out.decode("utf-8", "replace")
    stderr = err.decode("utf-8", "replace")
    exit_code = None if killed_for is not None else _exit_code(process.returncode, layers)
    outcome = killed_for or _outcome(exit_code, stderr)
    return SandboxResult(outcome=outcome, exit_code=exit_code, stdout=stdout, stderr=stderr, wall_s=wall)


def _collect(process: subprocess.Popen, config: SandboxConfig,
             deadline: float) -> tuple[bytes, bytes, Outcome | None]:
    """Read stdout and stderr until both close, the output cap or the deadline; returns what was
    read and why the tree must be killed (None: it closed its pipes in time)."""
    buffers = {process.stdout: bytearray(), process.stderr: bytearray()}
    total, killed_for = 0, None
    with selectors.DefaultSelector() as selector:
        for pipe in buffers:
            selector.register(pipe, selectors.EVENT_READ)
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                killed_for = "timeout"
                break
            for key, _ in selector.select(remaining):
                chunk = os.read(key.fileobj.fileno(), _READ_CHUNK)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                room = config.max_output_bytes - total
                buffers[key.fileobj] += chunk[:room]
                total += len(chunk)
            if total > config.max_output_bytes:
                killed_for = "output_limit"
                break
    for pipe in buffers:
        pipe.close()
    return bytes(buffers[process.stdout]), bytes(buffers[process.stderr]), killed_for


def _kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL the run's process group and reap its leader. With namespaces the leader is
    unshare, whose death kills the namespace's init, and the kernel then kills every process in
    the namespace (asynchronously: _sweep_uid waits for that)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        process.wait(_REAP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        logger.error("sandbox: process %d not reaped %.0f s after SIGKILL", process.pid, _REAP_TIMEOUT_S)


def processes_of_uid(uid: int) -> list[int]:
    """Pids of the live processes running as `uid` (the owner of /proc/<pid> is its effective
    uid). Zombies are not live: see _is_dead."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid and not _is_dead(int(name)):
                    found.append(int(name))
            except OSError:  # exited meanwhile
                continue
    return found


def _is_dead(pid: int) -> bool:
    """True for a zombie (or a process gone meanwhile). A killed run's processes, orphaned when
    the namespace's init dies, are reparented to the machine's pid 1 and stay zombies until it
    reaps them: it runs no code and holds no memory, CPU or files, but its /proc entry keeps
    the uid. On this project's machines pid 1 reaped them 1.4-1.9 s after the kill (measured),
    and waiting for that made every killed run cost that much more than its deadline. Every
    thread is checked, not the leader alone: a leader that exits by itself shows "Z" while the
    process's other threads still run."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # this thread exited meanwhile
            continue
        # The state letter follows the command name, in parentheses, which may contain any byte.
        if stat[stat.rfind(b")") + 2:][:1] not in _DEAD_STATES:
            return False
    return True


def _sweep_uid(uid: int) -> None:
    """SIGKILL every process of the sandbox's uid until none is left alive (children that left
    the process group with setsid(), or a namespace the kernel is still tearing down), so that a
    run never leaves a running process behind; zombies awaiting their reaper do not count
    (processes_of_uid); gives up with an error after _REAP_TIMEOUT_S."""
    give_up = time.monotonic() + _REAP_TIMEOUT_S
    while pids := processes_of_uid(uid):
        if time.monotonic() > give_up:
            logger.error("sandbox: %d processes of uid %d still alive %.0f s after SIGKILL", len(pids), uid,
                         _REAP_TIMEOUT_S)
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(_SWEEP_POLL_S)


def _exit_code(returncode: int, layers: Isolation) -> int:
    """The program's own exit code: the namespace init reports a death by signal N as 128 + N."""
    if layers.namespaces and returncode > _SIGNAL_EXIT_BASE:
        return -(returncode - _SIGNAL_EXIT_BASE)
    return returncode


def _outcome(exit_code: int | None, stderr: str) -> Outcome:
    if exit_code == 0:
        return "ok"
    if exit_code == -signal.SIGXCPU:
        return "cpu_limit"
    if exit_code == -signal.SIGXFSZ:
        return "file_limit"
    if "MemoryError" in stderr[-2000:]:
        return "memory_limit"
    return "error"
