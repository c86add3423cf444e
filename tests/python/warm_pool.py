"""A warm interpreter for the test jobs' ranks: one server process imports torch, transformers and smp once, and each
rank is a fork of it instead of a new interpreter that imports them again (3 to 4 s of CPU a rank, on a 2-core
machine the larger part of a short job). A rank still runs as `python SCRIPT ARGS` runs: its own environment,
working directory, argv, standard streams and exit status, __main__ its script, interpreter exit as usual (atexit,
thread joins); a rank killed by a signal reports that signal.

  warm_pool.py start NAME [--preload M,..] [--idle-exit S]  starts a server (after stopping any of that name)
  warm_pool.py stop NAME
  warm_pool.py run [-u] (SCRIPT | -c CODE | -m MODULE) ARGS    what a rank runs in place of python; SMP_WARM_POOL
                                                               names the server. Without one, or where the request's
                                                               environment differs from what the server imported
                                                               under, it execs the real interpreter: the same job.

The client is the rank as its launcher sees it: signals sent to it are passed on to the fork, and if the client
dies (SIGKILL), the server kills the fork's process group.
"""

import gc
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time

# What a fork cannot change after the server's imports: where modules come from, and what torch read at import.
IMPORT_TIME_ENVIRONMENT = ("PYTHONPATH", "PYTHONHOME", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "LD_PRELOAD",
                           "LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES")
# What the test jobs import: the Hugging Face model families they build (transformers imports each on first use),
# torchvision's models, and what capturing a model loads on its first export.
PRELOAD = ",".join(["torch", "smp", "torch.export", "torch._dynamo", "sympy", "torchvision.models", "transformers"] + [
    f"transformers.models.{family}.modeling_{family}" for family in (
        "gpt2", "llama", "bert", "t5", "opt", "mistral", "qwen2", "phi", "gpt_neox", "bloom", "falcon", "roberta",
        "distilbert", "bart", "mixtral", "olmoe", "qwen3_moe", "deepseek_v3", "qwen2_moe")])
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def address(name):
    """An abstract socket: no file to leave behind, no path length limit."""
    return "\0smp-warm-pool:" + name


def import_time_environment(environment):
    return {key: value for key, value in environment.items()
            if key in IMPORT_TIME_ENVIRONMENT or key.startswith(("TORCH_", "PYTORCH_"))}


def send_message(connection, payload, fds=()):
    data = json.dumps(payload).encode()
    socket.send_fds(connection, [struct.pack("!I", len(data)) + data], list(fds))


def receive_message(connection):
    """(payload, fds) of one message, or (None, []) at end of stream."""
    head, fds, _, _ = socket.recv_fds(connection, 4, 8)
    if len(head) < 4:
        for fd in fds:
            os.close(fd)
        return None, []
    (size,) = struct.unpack("!I", head)
    data = b""
    while len(data) < size:
        chunk = connection.recv(size - len(data))
        if not chunk:
            return None, fds
        data += chunk
    return json.loads(data), fds


# ---------------------------------------------------------------------------------------------------------------
# Client


def parse_interpreter_arguments(arguments):
    """(unbuffered, kind, target, argv) for the command lines a job uses, None for any other (then the real python)."""
    unbuffered = False
    while arguments and arguments[0] == "-u":
        unbuffered, arguments = True, arguments[1:]
    if not arguments:
        return None
    if arguments[0] in ("-c", "-m"):
        if len(arguments) < 2:
            return None
        kind, target = arguments[0][1], arguments[1]
        return unbuffered, kind, target, [("-c" if kind == "c" else target)] + arguments[2:]
    if arguments[0].startswith("-"):
        return None
    return unbuffered, "script", arguments[0], arguments


def exec_interpreter(arguments):
    os.execv(sys.executable, [sys.executable] + arguments)


def run_client(arguments):
    name = os.environ.get("SMP_WARM_POOL")
    parsed = parse_interpreter_arguments(arguments)
    if not name or parsed is None:
        exec_interpreter(arguments)
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(address(name))
    except OSError:
        exec_interpreter(arguments)
    unbuffered, kind, target, argv = parsed
    request = {"kind": kind, "target": os.path.abspath(target) if kind == "script" else target, "argv": argv,
               "unbuffered": unbuffered, "cwd": os.getcwd(), "environment": dict(os.environ)}
    send_message(connection, request, fds=(0, 1, 2))

    def forward(number, _frame):
        try:
            send_message(connection, {"signal": number})
        except OSError:
            pass

    for number in FORWARDED_SIGNALS:
        signal.signal(number, forward)
    reply, _ = receive_message(connection)
    if reply is None:
        sys.stderr.write("warm_pool: the server went away before the rank ended\n")
        os._exit(1)
    if reply.get("fallback"):
        connection.close()
        exec_interpreter(arguments)
    if "signal" in reply:
        number = reply["signal"]
        if number not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(number, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [number])
        os.kill(os.getpid(), number)
        os._exit(128 + number)
    os._exit(reply["exit"])


# ---------------------------------------------------------------------------------------------------------------
# Server


class Server:
    def __init__(self, name, idle_exit_s):
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(address(name))
        self.listener.listen(64)
        self.idle_exit_s = idle_exit_s
        self.environment = import_time_environment(os.environ)
        self.forks = {}  # fork pid -> client connection
        self.connections = {}  # client connection -> fork pid

    def serve(self):
        """Returns only in a fork, with the request it is to run; the server itself exits here."""
        import select
        idle_since = time.monotonic()
        while True:
            readable, _, _ = select.select([self.listener, *self.connections], [], [], 0.05)
            for connection in readable:
                if connection is self.listener:
                    request = self.accept()
                    if request is not None:
                        return request
                else:
                    self.client_spoke(connection)
            self.reap()
            if self.connections:
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since > self.idle_exit_s:
                sys.exit(0)

    def accept(self):
        connection, _ = self.listener.accept()
        request, fds = receive_message(connection)
        if request is None:
            connection.close()
            return None
        if request.get("stop"):
            for pid in self.forks:
                kill_group(pid, signal.SIGKILL)
            connection.close()
            sys.exit(0)
        if import_time_environment(request["environment"]) != self.environment:
            send_message(connection, {"fallback": True})
            connection.close()
            for fd in fds:
                os.close(fd)
            return None
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            self.become_fork(connection, fds)
            return request
        for fd in fds:
            os.close(fd)
        self.forks[pid] = connection
        self.connections[connection] = pid
        return None

    def become_fork(self, connection, fds):
        os.setsid()  # its own process group, killed whole if the client dies
        for number in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
                       signal.SIGUSR2):
            signal.signal(number, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for fd, target in zip(fds, (0, 1, 2)):
            os.dup2(fd, target)
            os.close(fd)
        self.listener.close()
        for other in self.connections:
            other.close()
        connection.close()

    def client_spoke(self, connection):
        pid = self.connections[connection]
        try:
            message, fds = receive_message(connection)
        except OSError:
            message, fds = None, []
        for fd in fds:
            os.close(fd)
        if message is None:  # the client died: its rank goes with it
            kill_group(pid, signal.SIGKILL)
            del self.connections[connection]
            self.forks[pid] = None
            connection.close()
        elif "signal" in message:
            try:
                os.kill(pid, message["signal"])
            except ProcessLookupError:
                pass

    def reap(self):
        while self.forks:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            connection = self.forks.pop(pid, None)
            if connection is None:
                continue
            del self.connections[connection]
            reply = ({"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status) else
                     {"exit": os.WEXITSTATUS(status)})
            try:
                send_message(connection, reply)
            except OSError:
                pass
            connection.close()


def kill_group(pid, number):
    for target in (-pid, pid):
        try:
            os.kill(target, number)
        except (ProcessLookupError, PermissionError):
            pass


def run_in_fork(request):
    """The request's program, as `python ARGS` would run it: returns into the interpreter's own exit."""
    import io
    import runpy
    import types

    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["environment"])
    unbuffered = request["unbuffered"] or bool(os.environ.get("PYTHONUNBUFFERED"))
    for fd, attribute in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        mode = "r" if fd == 0 else "w"
        raw = io.FileIO(fd, mode, closefd=False)
        interactive = os.isatty(fd)
        buffered = io.BufferedReader(raw) if fd == 0 else io.BufferedWriter(raw)
        stream = io.TextIOWrapper(buffered, encoding="utf-8", errors="backslashreplace" if fd == 2 else "strict",
                                  line_buffering=interactive or (fd == 2), write_through=unbuffered and fd != 0)
        setattr(sys, attribute, stream)
        setattr(sys, f"__{attribute}__", stream)
    sys.argv = request["argv"]
    kind, target = request["kind"], request["target"]
    if kind == "m":
        sys.path[0] = os.getcwd()
        runpy._run_module_as_main(target)  # what python -m does
        return
    # A script or -c code runs in the interpreter's __main__ module, which stays until the interpreter exits: its
    # globals die at finalization, after atexit, as under python itself.
    main = types.ModuleType("__main__")
    main.__builtins__ = __builtins__
    if kind == "script":
        sys.path[0] = os.path.dirname(target)
        main.__file__ = target
        with open(target, "rb") as file:
            code = compile(file.read(), target, "exec")
    else:
        sys.path[0] = ""
        code = compile(target, "<string>", "exec")
    sys.modules["__main__"] = main
    try:
        exec(code, main.__dict__)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as error:  # noqa: BLE001 - reported as python reports it, from the program's own frames
        sys.excepthook(type(error), error, error.with_traceback(error.__traceback__.tb_next).__traceback__)
        raise SystemExit(1) from None

def start(name, preload, idle_exit_s):
    stop(name)
    log = open(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"smp-warm-pool-{name}.log"), "w")
    server = subprocess.Popen([sys.executable, os.path.abspath(__file__), "serve", name, "--preload", preload,
                               "--idle-exit", str(idle_exit_s)], stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                              start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if server.poll() is not None:
            sys.exit(f"warm_pool: the server exited with status {server.returncode}; see {log.name}")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(address(name))
            probe.close()
            print(f"warm pool {name!r} up (pid {server.pid})")
            return
        except OSError:
            time.sleep(0.1)
    server.kill()
    sys.exit("warm_pool: the server did not come up within 120 s")


def stop(name):
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(address(name))
    except OSError:
        return
    send_message(connection, {"stop": True})
    connection.recv(1)  # the server closes it as it exits
    connection.close()


def serve(name, preload, idle_exit_s):
    import importlib
    for module in filter(None, preload.split(",")):
        try:
            importlib.import_module(module)
        except ImportError as error:  # a family this transformers lacks: its jobs import it (and fail) themselves
            print(f"warm_pool: not preloaded: {module}: {error}", flush=True)
    if len(os.listdir("/proc/self/task")) != 1:
        sys.exit("warm_pool: the imports started threads; forking would copy them half-way (set OMP_NUM_THREADS=1)")
    # What the imports made outlives every fork: frozen, no collection in a fork walks it (every object's header
    # written, every page of the server's heap copied into the fork).
    gc.collect()
    gc.freeze()
    server = Server(name, idle_exit_s)
    request = server.serve()
    del server
    run_in_fork(request)


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    command, rest = sys.argv[1], sys.argv[2:]
    if command == "run":
        run_client(rest)
        return
    import argparse
    parser = argparse.ArgumentParser()
    parser.add_argument("name")
    parser.add_argument("--preload", default=PRELOAD)
    parser.add_argument("--idle-exit", type=float, default=900)
    options = parser.parse_args(rest)
    if command == "start":
        start(options.name, options.preload, options.idle_exit)
    elif command == "stop":
        stop(options.name)
    elif command == "serve":
        serve(options.name, options.preload, options.idle_exit)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
