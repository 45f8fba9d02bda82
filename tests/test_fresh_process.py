"""tests/fresh_process.py: a forked child behaves as ``python -c`` / ``python script`` would in a
fresh interpreter, for what the docs' blocks, the examples and the ranks can notice."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import fresh_process


def test_a_block_starts_with_nothing_of_its_own():
    run = fresh_process.run(code="torch.zeros(1)", timeout=60)
    assert run.returncode == 1
    assert "NameError: name 'torch' is not defined" in run.stderr
    assert 'File "<string>", line 1, in <module>' in run.stderr
    assert "fresh_process" not in run.stderr  # the server's own frame is not shown


def test_only_torch_is_imported_before_the_block_and_with_one_thread(tmp_path):
    code = textwrap.dedent("""
        import sys
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("headwise", "transformers", "pytest", "hypothesis")))
        print(__name__, sys.argv, repr(sys.path[0]))
        import torch
        print(torch.get_num_threads())
    """)
    run = fresh_process.run(code=code, cwd=tmp_path, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin"}, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["[]", "__main__ ['-c'] ''", "1"]


def test_the_request_sets_cwd_env_and_argv_of_a_script(tmp_path):
    script = tmp_path / "tool.py"
    script.write_text(textwrap.dedent("""
        import os, sys
        print(os.getcwd(), os.environ["HEADWISE_PROBE"], sys.argv[1:], sys.path[0], __file__)
        sys.exit(3)
    """))
    work = tmp_path / "work"
    work.mkdir()
    run = fresh_process.run(script=script, args=("--quick", "x"), cwd=work, env={"HEADWISE_PROBE": "yes"},
                            timeout=60)
    assert run.returncode == 3
    assert run.stdout.split() == [str(work), "yes", "['--quick',", "'x']", str(tmp_path), str(script)]


@pytest.mark.parametrize(("code", "exit_code", "stderr"), [
    ("import sys; sys.exit()", 0, ""),
    ("import sys; sys.exit('bad input')", 1, "bad input\n"),
    ("import os, signal; os.kill(os.getpid(), signal.SIGTERM)", -15, ""),
])
def test_exit_codes_as_the_interpreter_gives_them(code, exit_code, stderr):
    ours = fresh_process.run(code=code, timeout=60)
    theirs = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert (ours.returncode, ours.stderr) == (theirs.returncode, theirs.stderr) == (exit_code, stderr)


def test_atexit_and_threads_finish_before_the_exit():
    code = textwrap.dedent("""
        import atexit, threading, time
        atexit.register(print, "atexit ran")
        threading.Thread(target=lambda: (time.sleep(0.2), print("thread ran"))).start()
    """)
    run = fresh_process.run(code=code, timeout=60)
    assert (run.returncode, run.stdout) == (0, "thread ran\natexit ran\n")


def test_a_child_past_its_timeout_is_killed():
    with pytest.raises(subprocess.TimeoutExpired):
        fresh_process.run(code="import time; time.sleep(60)", timeout=0.5)
    assert fresh_process.run(code="print('next')", timeout=60).stdout == "next\n"  # the server serves on


def test_children_run_side_by_side_and_keep_their_own_output():
    children = [fresh_process.start(code=f"import time; time.sleep(0.3); print({i})", stderr_to_stdout=True)
                for i in range(3)]
    for i, child in reversed(list(enumerate(children))):  # waited for out of order
        assert child.wait(timeout=60) == 0
        assert child.output() == (f"{i}\n", "")


def test_state_does_not_leak_from_one_child_to_the_next():
    """Each child starts from the server's state, with seeds of its own as a new interpreter draws
    them: nothing one child sets reaches the next."""
    fresh_process.run(code="import torch, os; torch.manual_seed(5); os.environ['LEAK'] = '1'", timeout=60)
    code = "import os, random, torch; print(torch.initial_seed(), random.random(), os.environ.get('LEAK'))"
    first, second = (fresh_process.run(code=code, timeout=60).stdout.split() for _ in range(2))
    assert first[2] == second[2] == "None"
    assert first[0] != second[0] and "5" not in (first[0], second[0])
    assert first[1] != second[1]
