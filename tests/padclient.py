"""``python tests/padclient.py SOCKET MODULE ARGS...``: ``python -m MODULE ARGS`` forked from the
test suite's launch server (``launchpad``) into this process's namespaces, with this process's
environment, working directory, input and output.

The command of an emulated pod's container in the tests: the pod's process starts in a few
milliseconds (this file imports no torch) and the module runs in the pod's network, hostname,
PID and mount namespaces as a process of the pod would, without an interpreter start and a
torch import of its own. The signals this process gets are passed on to the module; its exit
status is this process's (a signal's death by the same signal). When this process is killed,
the launch server kills the module's session; a pod's PID namespace kills it with the pod.

``python tests/padclient.py --python SOCKET ARGS...`` stands in for ``python ARGS...``
(``procs.python_shim``): the same for what the server runs, else this Python, exec'd.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys

from launchpad import recv, send, served_argv

_RELAYED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def _open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def main(path: str, module: str, args: list[str]) -> int:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    req = {"module": module, "args": args, "env": dict(os.environ), "cwd": os.getcwd()}
    std = [n for n in (0, 1, 2) if _open(n)]
    send(sock, {**req, "join": True, "std": std}, std)
    if recv(sock)[0] is None:
        print(f"padclient: the launch server did not start {module}", file=sys.stderr)
        return 1
    for s in _RELAYED:
        signal.signal(s, lambda n, _frame: send(sock, {"signal": n}))
    ended = recv(sock)[0]
    if ended is None:
        print(f"padclient: the launch server lost {module}", file=sys.stderr)
        return 1
    code = ended["returncode"]
    if code < 0:  # its death by a signal: ours too (SIGKILL and SIGSTOP take no handler)
        with contextlib.suppress(OSError, ValueError):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


if __name__ == "__main__":
    if sys.argv[1] == "--python":  # standing in for this Python (``procs.python_shim``)
        served = served_argv([sys.executable, *sys.argv[3:]])
        if served is None:
            os.execv(sys.executable, [sys.executable, *sys.argv[3:]])
        sys.exit(main(sys.argv[2], served[0], served[1:]))
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3:]))
