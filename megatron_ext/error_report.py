"""An error printed once per launch and host, not once per rank.

Every rank of a launch usually finds the same configuration problem; printed by each, one line
becomes eight (or 64) identical blocks. Invariant: a launch's ranks on one host print each distinct
message once (the first to create its marker file in the temporary directory prints); a process
launched alone, and every new launch, always prints. Imports nothing of ours (the entry point uses
it before anything is built).
"""

from __future__ import annotations

import os


def get_launch_id() -> str | None:
    """What the ranks of one launch on one host share and no other launch does, or None for a
    process launched alone: the launcher process (torchrun's agent, Slurm's step daemon, ...) by
    pid and start time (a pid alone is reused), and Slurm's job and step where present. Not
    TORCHELASTIC_RUN_ID or MASTER_ADDR/PORT: every plain torchrun launch has run id "none"."""
    if int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")) or 1) <= 1:
        return None
    parent = os.getppid()
    try:
        with open(f"/proc/{parent}/stat") as f:
            started = f.read().rsplit(")", 1)[1].split()[19]  # field 22: start time in clock ticks
    except (OSError, IndexError):
        started = "?"
    slurm = f"{os.environ.get('SLURM_JOB_ID', '')}.{os.environ.get('SLURM_STEP_ID', '')}"
    return f"{parent}-{started}-{slurm}"


def report_error_once(message: str) -> bool:
    """Print ``error: message`` to stderr unless another rank of this launch on this host already
    did (every rank usually finds the same problem); returns whether this rank printed it. A
    process launched alone always prints; so does every launch, the same command again included."""
    import hashlib
    import sys
    import tempfile

    launch = get_launch_id()
    if launch is not None:
        digest = hashlib.sha256(f"{launch}:{message}".encode()).hexdigest()[:20]
        try:
            os.close(
                os.open(
                    os.path.join(tempfile.gettempdir(), f"megatron_ext-error-{digest}"),
                    os.O_CREAT | os.O_EXCL | os.O_WRONLY,
                )
            )
        except FileExistsError:
            return False
        except OSError:
            pass  # no temporary directory: print rather than stay silent
    print(f"error: {message}", file=sys.stderr, flush=True)
    return True
