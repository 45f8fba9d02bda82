"""Fresh processes for the docs' blocks, the examples and the distributed ranks, without paying
for ``import torch`` in each one.

A test that runs a README block in ``python -c`` spends most of its time starting Python and
importing torch (about 2 CPU-seconds on CI's machine), and the suite starts well over a hundred
such processes. Here one server per test process imports torch once, with one OpenMP thread,
and then forks a child for each request: the child gets its own ``__main__`` (so a block that
forgets ``import torch`` still fails with ``NameError``), its own ``sys.argv``, working
directory, environment and output files, and starts from the server's state, never from
another child's. Nothing of headwise is imported before the child's code imports it.

What a fork cannot give: a variable that torch reads at import time (``OMP_NUM_THREADS``,
``TORCH_*``) takes the server's value, not the request's. Code that needs that runs in
``subprocess`` as before.

Run as a script, this file is the server; imported, it is the client (:func:`start`,
:func:`run`). The two speak JSON lines: requests on the server's stdin, replies on its stdout.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_POLL_S = 0.02  # how often the server looks for children that have exited


# ----------------------------------------------------------------------------- the server

def _serve() -> None:
    import builtins
    import runpy
    import threading
    import types

    import torch  # the point of the server: imported once, before any fork

    replies = os.fdopen(os.dup(1), "w", buffering=1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 1)  # nothing but replies reaches the client's pipe
    children: dict[int, str] = {}  # pid -> request id
    pending = b""  # requests read but not yet served

    def child(request: dict) -> int:
        os.dup2(devnull, 0)
        out = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        err = out if request["stderr_to_stdout"] else os.open(request["errors"],
                                                               os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        sys.argv = list(request["argv"])
        # as python sets it: "" for -c, the script's folder for a script, then PYTHONPATH's folders
        extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
        sys.path[0:1] = [request["path0"], *extra]
        torch.seed()  # a seed of its own, as each new interpreter draws one (Python's random reseeds itself)
        main = types.ModuleType("__main__")
        main.__builtins__ = builtins
        sys.modules["__main__"] = main
        try:
            if "code" in request:
                exec(compile(request["code"], "<string>", "exec"), main.__dict__)  # noqa: S102
            else:
                runpy.run_path(request["script"], run_name="__main__")
            code = 0
        except SystemExit as stop:  # as the interpreter reads sys.exit()'s argument
            if stop.code is None:
                code = 0
            elif isinstance(stop.code, int):
                code = stop.code
            else:
                print(stop.code, file=sys.stderr)
                code = 1
        except BaseException:  # noqa: BLE001  (printed as the interpreter prints it, without this frame)
            kind, value, tb = sys.exc_info()
            tb = tb.tb_next if tb is not None else None
            sys.excepthook(kind, value.with_traceback(tb), tb)
            code = 1
        threading._shutdown()  # as at interpreter exit: wait for non-daemon threads, run atexit
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        return code

    while True:
        if b"\n" not in pending and select.select([0], [], [], _POLL_S)[0]:
            chunk = os.read(0, 65536)
            if not chunk:  # the client has gone: so do the children
                for pid in children:
                    os.kill(pid, signal.SIGKILL)
                return
            pending += chunk
        if b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                replies.close()
                os._exit(child(request))
            children[pid] = request["id"]
            replies.write(json.dumps({"id": request["id"], "pid": pid}) + "\n")
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            replies.write(json.dumps({"id": children.pop(pid), "exit": os.waitstatus_to_exitcode(status)}) + "\n")


# ----------------------------------------------------------------------------- the client

class _Server:
    """One server per test process, started on first use; it ends when this process does."""

    _current: _Server | None = None

    def __init__(self) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}  # libgomp reads it when torch loads it
        self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env)
        self.replies: dict[str, dict] = {}
        self.buffer = b""
        self.count = 0

    @classmethod
    def get(cls) -> _Server:
        if cls._current is None or cls._current.proc.poll() is not None:
            cls._current = cls()
            atexit.register(cls._current.close)
        return cls._current

    def close(self) -> None:
        """End the server (its children with it): it reads the closed pipe as the end."""
        self.proc.stdin.close()
        self.proc.wait(timeout=30)

    def send(self, request: dict) -> str:
        self.count += 1
        request["id"] = str(self.count)
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        return request["id"]

    def reply(self, key: str, field: str, deadline: float) -> dict | None:
        """The server's reply for request ``key`` holding ``field``; None when ``deadline`` passes."""
        while (key, field) not in self.replies:
            while b"\n" in self.buffer:
                line, self.buffer = self.buffer.split(b"\n", 1)
                message = json.loads(line)
                self.replies[(message["id"], "pid" if "pid" in message else "exit")] = message
            if (key, field) in self.replies:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self.proc.stdout], [], [], min(left, 3600.0))
            if ready:
                chunk = os.read(self.proc.stdout.fileno(), 65536)
                if not chunk:
                    raise RuntimeError(f"the fork server exited with {self.proc.wait()}; see its stderr above")
                self.buffer += chunk
        return self.replies.pop((key, field))


class Child:
    """A process forked by the server: ``wait()`` for it, as ``subprocess.Popen``'s."""

    def __init__(self, server: _Server, key: str, args: list[str], folder: Path, stderr_to_stdout: bool):
        self.server, self.key, self.args, self.folder = server, key, args, folder
        self.stderr_to_stdout = stderr_to_stdout
        self.pid = server.reply(key, "pid", float("inf"))["pid"]
        self.returncode: int | None = None

    def wait(self, timeout: float | None = None) -> int:
        """The exit code (negative: killed by that signal); ``subprocess.TimeoutExpired`` after ``timeout``."""
        if self.returncode is None:
            deadline = float("inf") if timeout is None else time.monotonic() + timeout
            message = self.server.reply(self.key, "exit", deadline)
            if message is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = message["exit"]
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            self.wait()

    def output(self) -> tuple[str, str]:
        """What the child wrote, once it has exited: (stdout, stderr) as text; stderr is "" when it
        went to stdout. The files are removed."""
        self.wait()
        out = (self.folder / "stdout").read_text(errors="replace")
        err = "" if self.stderr_to_stdout else (self.folder / "stderr").read_text(errors="replace")
        shutil.rmtree(self.folder, ignore_errors=True)
        return out, err


def start(*, code: str | None = None, script: str | Path | None = None, args: tuple[str, ...] = (),
          cwd: str | Path | None = None, env: dict[str, str] | None = None,
          stderr_to_stdout: bool = False) -> Child:
    """Fork a child that runs ``code`` as ``python -c`` would, or ``script`` with ``args`` as
    ``python script args`` would; it starts at once, ``wait()`` for it."""
    if (code is None) == (script is None):
        raise ValueError("give code or script, not both")
    folder = Path(tempfile.mkdtemp(prefix="headwise-fresh-"))
    request = {"output": str(folder / "stdout"), "errors": str(folder / "stderr"),
               "stderr_to_stdout": stderr_to_stdout, "cwd": str(cwd or os.getcwd()),
               "env": dict(os.environ if env is None else env)}
    if code is not None:
        request.update(code=code, argv=["-c"], path0="")
        shown = [sys.executable, "-c", code]
    else:
        script = Path(script).resolve()
        request.update(script=str(script), argv=[str(script), *args], path0=str(script.parent))
        shown = [sys.executable, str(script), *args]
    server = _Server.get()
    return Child(server, server.send(request), shown, folder, stderr_to_stdout)


def run(*, timeout: float, **options) -> subprocess.CompletedProcess:
    """:func:`start`, then wait: the finished process as ``subprocess.run(..., capture_output=True,
    text=True)`` gives it; killed and ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
    child = start(**options)
    try:
        code = child.wait(timeout)
    except subprocess.TimeoutExpired as late:
        child.kill()
        late.output, late.stderr = child.output()  # what it wrote before it was killed; its files removed
        raise
    out, err = child.output()
    return subprocess.CompletedProcess(child.args, code, out, err)


if __name__ == "__main__":
    _serve()
