"""Started by a worker process in place of a command job's program, run as
`python -S command_shim.py <parent pid> <uid:gid | -> <program> <args...>`: it becomes the
tenant's OS identity when one is given (no supplementary groups, then the group, then the
user: `ELASTRAIN_TENANT_USERS`), asks the kernel to kill it when its parent goes (after
the change of user, which clears that request), then becomes the program (exec keeps it).

Why a separate step: a worker process that dies (its node lost, Ray killing it) cannot
stop its script, and an orphaned rank would train on, and write checkpoints into the
job's folder beside the next attempt. `subprocess`'s `preexec_fn` could ask the same, but
it runs Python between fork and exec in a process with many threads, which can deadlock.
Standard library only, no site: this costs a few milliseconds per start.
"""

import ctypes
import os
import signal
import sys
import warnings  # noqa: F401 - os.execvp imports it; after a change of user it may not

PR_SET_PDEATHSIG = 1


def main() -> None:
    parent = int(sys.argv[1])
    run_as = sys.argv[2]
    argv = sys.argv[3:]
    if run_as != "-":
        uid, gid = (int(part) for part in run_as.split(":"))
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
        except OSError as exc:
            sys.stderr.write(f"elastrain: cannot run as {run_as}: {exc.strerror}\n")
            sys.exit(126)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        sys.stderr.write("elastrain: could not tie the script to its worker process\n")
    if os.getppid() != parent:  # the parent went before the request was made
        sys.exit(1)
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        sys.stderr.write(f"elastrain: cannot run {argv[0]!r}: {exc.strerror}\n")
        sys.exit(127)


if __name__ == "__main__":
    main()
