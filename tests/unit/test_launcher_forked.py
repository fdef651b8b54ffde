"""A forked child lives and ends as a fresh interpreter would: its exit code from ``sys.exit``
or an exception, ``atexit`` functions run, non-daemon threads joined, the given environment
and default signal handlers, and it never returns into its parent's code. Each case runs in a
child interpreter (forking pytest would copy its threads' state)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(60), pytest.mark.slow]  # child interpreters

_PARENT = textwrap.dedent(
    """
    import atexit, json, os, signal, sys, threading, time
    from pathlib import Path
    from unbroken.launcher import forked

    tmp = Path(sys.argv[1])
    case = sys.argv[2]
    signal.signal(signal.SIGTERM, lambda *a: None)  # the parent's, not the child's

    def child():
        seen = {
            "env": dict(os.environ),
            "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
            "stdin": os.readlink("/proc/self/fd/0"),
            "files": [os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
                      for fd in os.listdir("/proc/self/fd") if os.path.exists(f"/proc/self/fd/{fd}")],
        }
        (tmp / "seen.json").write_text(json.dumps(seen))
        atexit.register(lambda: (tmp / "atexit").write_text("ran"))
        def late():
            time.sleep(0.2)
            (tmp / "thread").write_text("joined")
        threading.Thread(target=late).start()
        if case == "exit":
            sys.exit(3)
        if case == "raise":
            raise ValueError("boom")

    held = open(tmp / "lock", "w")  # noqa: SIM115  # the parent's: closed in the child
    kept = os.open(tmp / "kept", os.O_WRONLY | os.O_CREAT)
    proc = forked.fork(child, env={"ONLY": "this"}, keep_fds=(kept,))
    code = proc.wait(30)
    with open(tmp / "after_fork", "a") as f:  # the parent's code only: the child never gets here
        f.write(f"{os.getpid()}\\n")
    print(json.dumps({"code": code, "pid": proc.pid}))
    """
)


@pytest.mark.parametrize(("case", "code"), [("return", 0), ("exit", 3), ("raise", 1)])
def test_a_forked_child_ends_as_an_interpreter_would(tmp_path: Path, case: str, code: int) -> None:
    script = tmp_path / "parent.py"
    script.write_text(_PARENT)
    res = subprocess.run(
        [sys.executable, str(script), str(tmp_path), case], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["code"] == code
    assert len((tmp_path / "after_fork").read_text().splitlines()) == 1  # the parent alone
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen["env"] == {"ONLY": "this"}
    assert seen["sigterm_default"] and seen["stdin"] == "/dev/null"
    assert "kept" in seen["files"] and "lock" not in seen["files"]  # the parent's other files
    assert (tmp_path / "atexit").read_text() == "ran"
    assert (tmp_path / "thread").read_text() == "joined"
    assert ("ValueError: boom" in res.stderr) == (case == "raise")


def test_forking_is_chosen_only_when_it_saves_imports_and_no_thread_runs() -> None:
    code = textwrap.dedent(
        """
        import threading, time
        from unbroken.launcher import forked
        assert forked.can_fork(["json", "os"]) is (forked.threads() == 1)
        assert not forked.can_fork([])
        assert not forked.can_fork(["json", "a_module_nobody_imported"])
        stop = threading.Event()
        t = threading.Thread(target=stop.wait)
        t.start()
        assert not forked.can_fork(["json"])
        stop.set()
        t.join()
        """
    )
    res = subprocess.run(
        [sys.executable, "-c", "import json\n" + code], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr
