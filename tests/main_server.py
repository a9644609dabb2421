"""`python main.py ARGS` for the tests without importing the libraries each time: a server
process imports them once, then forks a copy per command, which runs `main.py` as the
interpreter would. Each copy starts as a fresh process would at that point (no backend, no
thread, nothing compiled), in its own working directory, with its own environment, argv and
standard streams.

    python tests/main_server.py SOCKET ROOT template   # ROOT's package imported as main.py does
    python tests/main_server.py SOCKET ROOT libraries  # the libraries only: a copied project
                                                       # that the test edits between commands

A request is one JSON line {"argv", "cwd", "env"} sent with three file descriptors (the
command's stdin, stdout and stderr). The server forks a handler per request, so that it keeps
no threads and never waits; the handler forks the command, sends its pid, waits for it, and
sends its exit status (as `subprocess` reports it: negative for a signal).
"""

from __future__ import annotations

import array
import importlib
import json
import os
import pathlib
import runpy
import signal
import socket
import sys
import time

# What the template's main.py imports before its flags, outside its own package.
LIBRARIES = ("jax", "flax.nnx", "optax", "orbax.checkpoint", "ml_collections", "absl.app")


def serve(path: str, root: str, preload: str) -> None:
    """Import what `main.py` imports before its flags (`preload`: all, or the libraries only),
    then answer requests until killed."""
    sys.path[0] = root  # as for `python main.py`: the script's directory first
    launch = None
    if preload == "template":
        from fmnist_flax import launch
        from fmnist_flax.runtime import startup

        with startup.without_ipython():
            from fmnist_flax import cli  # noqa: F401
    else:
        sys.modules["IPython"] = None  # as `startup.without_ipython` has them imported (the
        for name in LIBRARIES:  # project's own package stays unimported: the test edits it)
            importlib.import_module(name)
        sys.modules.pop("IPython")

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # handlers are reaped by the kernel
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    listener.settimeout(1.0)
    parent = os.getppid()
    print("ready", flush=True)
    while os.getppid() == parent:  # a test process that died leaves no server behind
        try:
            connection, _ = listener.accept()
        except TimeoutError:
            continue
        connection.settimeout(None)
        if os.fork() == 0:
            listener.close()
            handle(connection, pathlib.Path(root) / "main.py", launch)  # never returns
        connection.close()


def handle(connection: socket.socket, main: pathlib.Path, launch) -> None:
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
        run(request, main, launch)
    for fd in fds:
        os.close(fd)
    connection.sendall(f"{pid}\n".encode())
    _, status = os.waitpid(pid, 0)
    connection.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
    os._exit(0)


def run(request: dict, main: pathlib.Path, launch) -> None:
    """In the command's process: `python main.py ARGV` from here on."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [str(main), *request["argv"]]
    if launch is not None:  # imported by the server: its start is now
        launch.STARTED = time.perf_counter()
    code = 0
    try:
        runpy.run_path(str(main), run_name="__main__")
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
    serve(*sys.argv[1:4])
