"""User code in a worker process: functions loaded by import path (--reward-fn MODULE:FUNCTION,
--extract-answer MODULE:FUNCTION) run in one long-lived child process per run, so that whatever
they do cannot take the trainer down.

Worker      the child: started on the first load, fed each call's inputs, its results sent back
            (pickled, over two pipes of its own: the user's prints keep stdout and stderr). Its
            time limit is kept from outside: past it the child gets SIGTERM, then SIGKILL; a
            child that dies (os._exit, a segfault, the kernel's OOM killer) is said by name; its
            address space is capped (RLIMIT_AS, --reward-memory), so a runaway allocation is a
            MemoryError inside it. While the trainer waits on it, a signal stops the wait at once
            (signals.StopRequests.waiting) and the child is ended. After a kill the next call
            starts a fresh child and loads the same functions again.
Remote      a function in the worker, as the trainer holds it: callable, with the signature the
            worker read from the real one (inspect.signature works on it).

Why subprocess and pickle over pipes, not multiprocessing: the child runs `python -m
support.worker`, which imports nothing but the standard library and the user's module (no torch,
no trainer.py, as "spawn" would re-import the main module); the pipes are the child's own file
descriptors (a print in user code cannot corrupt the protocol); the child is a new session and
process group, so a Ctrl-C at the terminal reaches the trainer alone, which decides what happens
to the child, and ending the child ends the group: whatever a tool forked. A trainer killed
outright (SIGKILL) takes the child with it, even in the middle of a hung call (PR_SET_PDEATHSIG on
Linux, a watchdog thread elsewhere; the processes a tool forked then live on, as orphans of user
code). The trainer also watches that the child lives while it waits: a child that died while a
process it forked holds its pipe open is named at once, not waited on.

The mechanism is generic: `call` runs any loaded function, through an optional adapter (a
MODULE:FUNCTION run in the child around the call: sandbox.reward_in_worker for rewards), so tools
called mid-completion can use it as they are.
"""

import atexit
import importlib
import inspect
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import time
import weakref

# --reward-memory's default, in GiB of address space: generous for a checker that imports numpy or
# torch on the CPU (torch alone maps a few GiB), low enough that a runaway allocation fails in the
# worker, not in the machine. Never above the trainer's own hard limit (memory_limit).
DEFAULT_MEMORY_GB = 32.0

# How often the trainer, waiting on the worker, checks that the worker still lives: a tool that
# forked keeps the worker's pipe open in its child after the worker dies, so end-of-file alone
# cannot say so.
LIVENESS_POLL_S = 0.5

# The notes already said in this process (memory_limit's): once each, not once per worker.
SAID = set()

# After SIGTERM, how long the child has to exit before SIGKILL.
TERM_GRACE_S = 2.0

# How the child reports user code's errors: the message is built in the child, where the
# exception and its traceback are.
OK, RAISED, USER_ERROR = "ok", "raised", "user_error"


class WorkerFailed(Exception):
    """The worker timed out, died or could not start: `message` says so (the caller names the
    function and the flag)."""


class WorkerTimeout(WorkerFailed):
    """The worker did not answer within the time limit (and was killed)."""


class RemoteError(Exception):
    """User code raised in the worker: type_name, message and where (" (file.py:12)")."""

    def __init__(self, type_name, message, where=""):
        super().__init__(message)
        self.type_name, self.where = type_name, where


class Worker:
    """One child process for a run's user code. `memory_gb`: its address-space limit (0: none)."""

    def __init__(self, memory_gb=DEFAULT_MEMORY_GB):
        self.memory_gb, self.process, self.loaded = memory_gb, None, []
        self.from_child = None

    # --- the trainer's side -----------------------------------------------------------------

    def load(self, spec, flag, cwd):
        """Import MODULE:FUNCTION in the worker (started now if it is not running), with `cwd`
        first on its import path, and return its Remote. Any problem (no module, an error at
        import, SystemExit or argparse at import, no such function) is a UserError with the
        message (import_function's)."""
        description = self.request(("load", spec, flag, cwd), timeout=0, what=f"importing {spec}")
        key = len(self.loaded)
        self.loaded.append((spec, flag, cwd))
        return Remote(self, key, spec, flag, description)

    def call(self, key, args, kwargs, timeout, what, adapter=None):
        """loaded[key](*args, **kwargs) in the worker, through `adapter` (MODULE:FUNCTION called as
        adapter(fn, *args, **kwargs)) if given; within `timeout` seconds (0: none). `what` names
        the function for the messages."""
        return self.request(("call", key, adapter, args, kwargs), timeout, what)

    def request(self, message, timeout, what):
        from support.signals import STOPS

        if self.process is None or self.process.poll() is not None:
            self.start()
        try:
            with STOPS.waiting():  # from the send: the child may begin the call at once
                self.send(message)
                status, *reply = self.receive(timeout, what)
        except BaseException:  # a timeout, a death, Ctrl-C or a signal: the child is ended
            self.close()
            raise
        if status == OK:
            return reply[0]
        if status == RAISED:
            raise RemoteError(*reply)
        from support.errors import UserError

        raise UserError(reply[0])

    def start(self):
        """A fresh child, with the functions the last one had loaded."""
        self.close()
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
        limit = memory_limit(self.memory_gb)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "support.worker", str(to_child_r), str(from_child_w)]
            + [str(limit), str(os.getpid())],
            pass_fds=(to_child_r, from_child_w),
            # its own session and process group: a Ctrl-C at the terminal is the trainer's to
            # handle, and close() ends the group, with whatever a tool forked
            start_new_session=True,
            env=env,
        )
        os.close(to_child_r), os.close(from_child_w)
        self.to_child, self.from_child = os.fdopen(to_child_w, "wb"), from_child_r
        atexit.register(close_at_exit, weakref.ref(self), os.getpid())
        for spec, flag, cwd in self.loaded:
            self.send(("load", spec, flag, cwd))
            status, *reply = self.receive(0, f"importing {spec}")
            if status != OK:  # it loaded before: the file changed since
                raise WorkerFailed(f"importing {spec} again in a fresh worker failed: {reply}")

    def send(self, message):
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self.to_child.write(struct.pack("<Q", len(data)) + data)
            self.to_child.flush()
        except (BrokenPipeError, OSError):
            raise WorkerFailed(self.death()) from None

    def receive(self, timeout, what):
        """The child's reply, or WorkerFailed when `timeout` passes or the child dies first."""
        deadline = time.monotonic() + timeout if timeout > 0 else None
        header = self.read(8, deadline, what, timeout)
        return pickle.loads(self.read(struct.unpack("<Q", header)[0], deadline, what, timeout))

    def read(self, n, deadline, what, timeout):
        chunks, left = [], n
        while left:
            wait = LIVENESS_POLL_S
            if deadline is not None:
                wait = min(wait, max(deadline - time.monotonic(), 0))
            ready, _, _ = select.select([self.from_child], [], [], wait)
            if not ready and self.process.poll() is not None:
                # dead, though its pipe is open (a process it forked holds it): what it wrote
                # before dying is read first
                ready, _, _ = select.select([self.from_child], [], [], 0)
                if not ready:
                    raise WorkerFailed(self.death())
            if not ready:
                if deadline is not None and time.monotonic() >= deadline:
                    raise WorkerTimeout(f"did not return within {timeout:g} s")
                continue
            chunk = os.read(self.from_child, min(left, 1 << 20))
            if not chunk:
                raise WorkerFailed(self.death())
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def death(self):
        """How the child ended, in words (it has, or is about to)."""
        try:
            code = self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return "closed its pipe and did not exit"
        if code < 0:
            name = signal.Signals(-code).name
            hint = (
                " (the kernel's out-of-memory killer sends it)" if -code == signal.SIGKILL else ""
            )
            return f"ended its worker process: killed by {name}{hint}"
        return f"ended its worker process: it exited with code {code} (os._exit or a crash)"

    def __del__(self):
        self.close()

    def close(self):
        """End the child and its process group (whatever a tool forked): SIGTERM, then SIGKILL
        if the child is still there after TERM_GRACE_S; the group gets SIGKILL last either way."""
        process, self.process = self.process, None
        if process is None:
            return
        for stream in (getattr(self, "to_child", None),):
            try:
                stream.close()
            except (OSError, AttributeError):
                pass
        try:
            os.close(self.from_child)
        except (OSError, TypeError):
            pass
        if process.poll() is None:
            signal_group(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=TERM_GRACE_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        # the child's group (its pid: it leads its own session) may outlive it: a tool's forks
        signal_group(process.pid, signal.SIGKILL)


def close_at_exit(ref, pid):
    """At the program's exit, end a worker it left open: atexit runs while os and signal still
    exist, where a Worker's __del__ may come after the interpreter has cleared them ("'NoneType'
    object has no attribute 'close'", printed at every exit of a program that kept one). Only in
    the process `pid` that started it: a fork of that process inherits the handler, not the
    worker."""
    worker = ref()
    if worker is not None and os.getpid() == pid:
        worker.close()


def signal_group(pgid, signum):
    """Send `signum` to process group `pgid`; nothing when it is gone (or not ours)."""
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def memory_limit(memory_gb):
    """The worker's address-space limit in bytes for --reward-memory `memory_gb` (0: none, 0
    returned): never above this process's own hard RLIMIT_AS, which the worker inherits and could
    not raise (a cluster's ulimit -v). Where that is lower than asked, the worker gets it, said
    once on stdout."""
    if memory_gb <= 0:
        return 0
    asked = int(memory_gb * 2**30)
    try:
        import resource

        hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    except (ImportError, OSError, ValueError):  # no resource module (not POSIX)
        return asked
    if hard == resource.RLIM_INFINITY or hard >= asked:
        return asked
    note = (
        f"--reward-memory {memory_gb:g} GiB is above this process's hard address-space limit "
        f"({hard / 2**30:.2f} GiB: ulimit -v, or the cluster's): the worker process gets "
        f"{hard / 2**30:.2f} GiB"
    )
    if note not in SAID and os.environ.get("RANK", "0") == "0":
        print(note, flush=True)
    SAID.add(note)
    return hard


class Remote:
    """A function loaded in a Worker, as the trainer calls it. inspect.signature reads the real
    function's (its defaults stand in as None)."""

    def __init__(self, worker, key, spec, flag, description):
        self.worker, self.key, self.spec, self.flag = worker, key, spec, flag
        self.__name__, params = description
        self.__signature__ = (
            inspect.Signature(
                [
                    inspect.Parameter(
                        name, kind, default=None if has_default else inspect.Parameter.empty
                    )
                    for name, kind, has_default in params
                ]
            )
            if params is not None
            else None
        )

    timeout = 0.0  # a plain call's time limit (--extract-answer's: --reward-timeout); 0: none

    def call(self, args, kwargs, timeout, adapter=None):
        """The function's value on these arguments, computed in the worker (through `adapter`)."""
        return self.worker.call(self.key, args, kwargs, timeout, self.spec, adapter)

    def __call__(self, *args, **kwargs):
        return self.call(args, kwargs, self.timeout)

    def __repr__(self):
        return f"<{self.spec} in a worker process>"


# --- the child's side -------------------------------------------------------------------------


def describe(fn):
    """(name, [(parameter, kind, has a default)] or None): what the trainer needs of fn's
    signature, in plain values that pickle."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return getattr(fn, "__name__", "function"), None
    return fn.__name__ if hasattr(fn, "__name__") else "function", [
        (p.name, p.kind, p.default is not p.empty) for p in params
    ]


def load(spec, flag, cwd):
    """The function MODULE:FUNCTION names, imported here; a UserError for what goes wrong."""
    return import_function(spec, flag, cwd)


def import_function(spec, flag, cwd):
    """The function MODULE:FUNCTION names, imported with `cwd` first on the import path (in the
    worker process), or a UserError saying why not: no such module, an error (SystemExit and
    argparse's exit too) while importing it, no such function."""
    from support.errors import UserError

    module_name, _, fn_name = spec.partition(":")
    if cwd not in sys.path[:1]:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name.split(".")[0] and e.name != module_name:
            raise UserError(
                f"{flag} {spec}: importing {module_name} for {flag} failed: {e}."
            ) from None
        raise UserError(
            f"{flag} {spec!r}: there is no module {module_name!r}: no {module_name.replace('.', '/')}"
            f".py in the working directory ({cwd}) or on the import path."
        ) from None
    except SystemExit as e:  # sys.exit, or argparse's parse_args reading the trainer's flags
        raise UserError(
            f"{flag} {spec}: importing {module_name} for {flag} raised SystemExit({e.code!r}): it "
            "exits when imported (argparse's parse_args at import time does, on flags that are not "
            'its own). Parse arguments under `if __name__ == "__main__":` only.'
        ) from None
    except (
        BaseException
    ) as e:  # a syntax error in the user's file, or an error it raises when imported
        raise UserError(
            f"{flag} {spec}: importing {module_name} for {flag} raised {type(e).__name__}: "
            f"{e}{raised_at(e)}."
        ) from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        found = sorted(
            n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_")
        )
        raise UserError(
            f"{flag} {spec!r}: {module_name} ({getattr(module, '__file__', '?')}) has no function "
            f"{fn_name!r}; its functions: {', '.join(found) or 'none'}."
        )
    return fn


def raised_at(e):
    """ " (file.py:12)": where an exception was raised, for a message; "" for a SyntaxError (it
    names its place itself) and for one raised in support/ (sandbox.py's checks: about the value,
    not user code)."""
    import traceback

    frames = traceback.extract_tb(e.__traceback__)
    if (
        isinstance(e, SyntaxError)
        or not frames
        or os.path.dirname(os.path.abspath(frames[-1].filename))
        == os.path.dirname(os.path.abspath(__file__))
    ):
        return ""
    return f" ({os.path.basename(frames[-1].filename)}:{frames[-1].lineno})"


def serve(inbox, outbox):
    """The child's loop: a request in, a reply out, until the trainer closes the pipe."""
    from support.errors import UserError

    functions = []

    def reply(message):
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        outbox.write(struct.pack("<Q", len(data)) + data)
        outbox.flush()

    while True:
        header = inbox.read(8)
        if len(header) < 8:
            return  # the trainer is gone or done
        kind, *request = pickle.loads(inbox.read(struct.unpack("<Q", header)[0]))
        try:
            if kind == "load":
                fn = load(*request)
                functions.append(fn)
                reply((OK, describe(fn)))
                continue
            key, adapter, args, kwargs = request
            fn = functions[key]
            if adapter is not None:
                module, _, name = adapter.partition(":")
                result = getattr(importlib.import_module(module), name)(fn, *args, **kwargs)
            else:
                result = fn(*args, **kwargs)
            reply((OK, result))
        except UserError as e:
            reply((USER_ERROR, str(e)))
        except BaseException as e:  # SystemExit too: user code does not end the worker
            try:
                reply((RAISED, type(e).__name__, str(e), raised_at(e)))
            except Exception as unpicklable:  # a result that does not pickle
                reply((RAISED, type(unpicklable).__name__, str(unpicklable), ""))


def die_with_parent(parent):
    """End this process when the trainer (pid `parent`) ends, however it ends (SIGKILL too), even
    while user code hangs and no end-of-file is read: Linux's PR_SET_PDEATHSIG (SIGKILL), and a
    parent that is gone already is checked after setting it (the kernel sends it when the thread
    that started this process ends: the trainer starts workers from its main thread). Elsewhere, a
    watchdog thread that checks the parent every LIVENESS_POLL_S and ends this process group."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            PR_SET_PDEATHSIG = 1
            if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0:
                if os.getppid() != parent:  # the trainer ended before prctl
                    os._exit(1)
                return
        except (OSError, AttributeError):
            pass
    import threading

    def watch():
        while os.getppid() == parent:
            time.sleep(LIVENESS_POLL_S)
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, daemon=True).start()


def main():
    inbox_fd, outbox_fd, limit = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    die_with_parent(int(sys.argv[4]))
    # a program a tool starts (with close_fds=False) does not inherit the protocol's pipes
    os.set_inheritable(inbox_fd, False), os.set_inheritable(outbox_fd, False)
    if limit > 0:
        import resource

        hard = resource.getrlimit(resource.RLIMIT_AS)[1]
        if hard != resource.RLIM_INFINITY:  # never above the inherited hard limit (memory_limit)
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer ends the worker
    with os.fdopen(inbox_fd, "rb") as inbox, os.fdopen(outbox_fd, "wb") as outbox:
        serve(inbox, outbox)


if __name__ == "__main__":
    main()
