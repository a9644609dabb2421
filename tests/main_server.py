"""`python main.py ARGS` for the tests without importing the libraries each time: a server
process imports them once (as `main.py` does before it reads its flags), then forks a copy per
command, which runs `main.py` as the interpreter would. Each copy starts as a fresh process
would at that point (no backend, no thread, nothing compiled), in its own working directory,
with its own environment, argv and standard streams.

    python tests/main_server.py SOCKET   # conftest.run_main starts one per test worker

A request is one JSON line {"argv", "cwd", "env"} sent with three file descriptors (the
command's stdin, stdout and stderr). The server forks a handler per request, so that it keeps
no threads and never waits; the handler forks the command, sends its pid, waits for it, and
sends its exit status (as `subprocess` reports it: negative for a signal).
"""

from __future__ import annotations

import array
import json
import os
import pathlib
import runpy
import signal
import socket
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
MAIN = REPO / "main.py"


def serve(path: str) -> None:
    """Import what `main.py` imports before its flags, then answer requests until killed."""
    sys.path[0] = str(REPO)  # as for `python main.py`: the script's directory first
    from fmnist_flax import launch
    from fmnist_flax.runtime import startup

    with startup.without_ipython():
        from fmnist_flax import cli  # noqa: F401

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # handlers are reaped by the kernel
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    print("ready", flush=True)
    while True:
        connection, _ = listener.accept()
        if os.fork() == 0:
            listener.close()
            handle(connection, launch)  # never returns
        connection.close()


def handle(connection: socket.socket, launch) -> None:
    """Fork the command, tell the client its pid, then its exit status."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
    while not message.endswith(b"\n"):  # a stream: a long environment may come in parts
        message += connection.recv(1 << 20)
    request = json.loads(message)
    pid = os.fork()
    if pid == 0:
        connection.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        run(request, launch)
    for fd in fds:
        os.close(fd)
    connection.sendall(f"{pid}\n".encode())
    _, status = os.waitpid(pid, 0)
    connection.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
    os._exit(0)


def run(request: dict, launch) -> None:
    """In the command's process: `python main.py ARGV` from here on."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [str(MAIN), *request["argv"]]
    launch.STARTED = time.perf_counter()
    code = 0
    try:
        runpy.run_path(str(MAIN), run_name="__main__")
    except SystemExit as done:
        code = done.code
    sys.exit(code)  # the interpreter's exit, with its exit hooks, as main.py's would be


def request(path: str, argv: list[str], cwd: str, env: dict[str, str], fds: list[int]):
    """Send one command; returns the connection (its pid line, then its status line)."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.connect(path)
    message = json.dumps({"argv": argv, "cwd": cwd, "env": env}).encode() + b"\n"
    connection.sendmsg([message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    return connection


if __name__ == "__main__":
    serve(sys.argv[1])
