"""An error printed once per launch and host, not once per rank, and named as torchrun's root cause.

Every rank of a launch usually finds the same configuration problem; printed by each, one line
becomes eight (or 64) identical blocks. Invariant: a launch's ranks on one host print each distinct
message once (the first to create its marker file in the temporary directory prints); a process
launched alone, and every new launch, always prints. Imports nothing of ours (the entry point uses
it before anything is built).

Under torchrun each rank also writes the message to its ``TORCHELASTIC_ERROR_FILE`` (torchelastic's
error-file contract, what its ``@record`` writes for an exception), so that torchrun's failure
summary, printed after it, shows the error as its root cause instead of "To enable traceback see
...": the rank that printed writes the whole message, the others a pointer to it, dated one second
later so that torchrun (which takes the failure with the smallest whole-second timestamp, ties to the
lowest local rank) picks the rank that printed as the root cause. The file's one-line "message"
(the error's first line) is what torchrun copies into its own error file, for a scheduler to read.
"""

from __future__ import annotations

import os


def get_launch_id() -> str | None:
    """What the ranks of one launch on one host share and no other launch does, or None for a
    process launched alone: the launcher process (torchrun's agent, Slurm's step daemon, ...) by
    pid and start time (a pid alone is reused), and Slurm's job and step where present. Not
    TORCHELASTIC_RUN_ID or MASTER_ADDR/PORT: every plain torchrun launch has run id "none"."""
    if read_process_count() <= 1:
        return None
    parent = os.getppid()
    try:
        with open(f"/proc/{parent}/stat") as f:
            started = f.read().rsplit(")", 1)[1].split()[19]  # field 22: start time in clock ticks
    except (OSError, IndexError):
        started = "?"
    slurm = f"{os.environ.get('SLURM_JOB_ID', '')}.{os.environ.get('SLURM_STEP_ID', '')}"
    return f"{parent}-{started}-{slurm}"


def read_process_count() -> int:
    """The processes of this launch on this host (LOCAL_WORLD_SIZE, else WORLD_SIZE), 1 when unset or
    not a number: the reporter must print whatever the environment holds (WORLD_SIZE=abc is the error
    it may be reporting)."""
    value = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("WORLD_SIZE") or "1"
    value = value.strip()
    return int(value) if value.isascii() and value.isdecimal() and len(value) < 10 else 1


def report_error_once(message: str) -> bool:
    """Print ``error: message`` to stderr unless another rank of this launch on this host already
    did (every rank usually finds the same problem); returns whether this rank printed it. A
    process launched alone always prints; so does every launch, the same command again included.
    Under torchrun the message (or, from a rank that did not print, a pointer to it) also goes to
    this rank's error file, for torchrun's summary (the module's docstring)."""
    import hashlib
    import sys
    import tempfile
    import time

    launch = get_launch_id()
    timestamp = int(time.time())
    printed = True
    if launch is not None:
        digest = hashlib.sha256(f"{launch}:{message}".encode()).hexdigest()[:20]
        marker = os.path.join(tempfile.gettempdir(), f"megatron_ext-error-{digest}")
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            printed = False
            # the printing rank read the clock before it created the marker, this one after: a
            # second later is strictly later in whole seconds
            timestamp = int(time.time()) + 1
        except OSError:
            pass  # no temporary directory: print rather than stay silent
    # before printing: torchrun SIGTERMs the other ranks as soon as one has exited
    text = f"error: {message}" if printed else "(the same error: as the root cause below, printed once above)"
    write_torchelastic_error_file(message.split("\n", 1)[0], text, timestamp)
    if printed:
        print(f"error: {message}", file=sys.stderr, flush=True)
    return printed


def write_torchelastic_error_file(summary: str, text: str, timestamp: int) -> None:
    """Under torchrun: write this rank's failure to ``TORCHELASTIC_ERROR_FILE`` in the format of
    torchelastic's ``ErrorHandler.record_exception``; its failure summary shows ``text`` (where an
    exception's traceback would be) and picks the root cause by ``timestamp`` (whole seconds)."""
    import json

    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": summary, "extraInfo": {"py_callstack": text, "timestamp": str(timestamp)}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass  # torchrun then reports the exit code alone, as without the file
