"""Capture the argv that Megatron-LM's example scripts hand to ``pretrain_gpt.py``, as bash really
passes them, into this directory's ``*.json`` (the test data of tests/unit/test_megatron_lm_scripts.py).

    python tests/data/megatron_lm_argv/capture.py MEGATRON_LM_GIT_DIR

Each script is read from the Megatron-LM repository at the commit named below (``git show``: nothing
is checked out) and run with bash in an empty directory, with a stand-in ``torchrun`` first on PATH
that writes its own argv as JSON and exits: the words after ``pretrain_gpt.py`` are the argv our
``pretrain_gpt.py`` would get. bash's word splitting stays as it is: an unquoted ``${ARGS[@]}``
splits an element such as ``"--split '99,1,0'"`` into ``--split`` and ``'99,1,0'``, quotes included.
The scripts' path arguments are placeholders (``<CHECKPOINT_PATH>``, ...), and the run directory,
where a script puts paths under ``$PWD``, is written as ``<PWD>``.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
CORE_V0_16_1 = "55ac7082517c3878ae653c07c09c534b8aed49f6"  # tag core_v0.16.1
MAIN_D98E8A64 = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"  # main, 2026-08-22 (issue 43's)
LLAMA3_8B = "examples/llama/train_llama3_8b_h100_fp8.sh"
GPT3_175B = "examples/gpt3/train_gpt3_175b_distributed.sh"
MIXTRAL = "examples/mixtral/train_mixtral_8x7b_distributed.sh"

REFS = (("core_v0.16.1", CORE_V0_16_1), ("d98e8a64", MAIN_D98E8A64))
# (output name without the ref, script, its arguments, which branch of it they take)
SCRIPTS = (
    (
        "llama3_8b_mock",
        LLAMA3_8B,
        ["<CHECKPOINT_PATH>", "<TENSORBOARD_LOGS_PATH>"],
        "mock-data branch (TOKENIZER_ARG and DATA_ARG default to MOCK)",
    ),
    (
        "llama3_8b_data",
        LLAMA3_8B,
        ["<CHECKPOINT_PATH>", "<TENSORBOARD_LOGS_PATH>", "<TOKENIZER_MODEL>", "<DATA_PATH>"],
        "real-data branch (a Hugging Face tokenizer directory and a data prefix)",
    ),
    (
        "gpt3_175b",
        GPT3_175B,
        ["<CHECKPOINT_PATH>", "<TENSORBOARD_LOGS_PATH>", "<VOCAB_FILE>", "<MERGE_FILE>", "<DATA_PATH>"],
        "the only branch",
    ),
    (
        "mixtral_8x7b",
        MIXTRAL,
        ["<CHECKPOINT_PATH>", "<TOKENIZER_MODEL>", "<DATA_PATH>"],
        "without WANDB_API_KEY (no --wandb-* flags)",
    ),
)
# (output name, commit, ref, script, script arguments, branch)
CASES = [
    (f"{name}_{ref}", commit, ref, script, args, branch)
    for name, script, args, branch in SCRIPTS
    for ref, commit in REFS
]

STAND_IN_TORCHRUN = f"""#!{sys.executable}
import json, os, sys
with open(os.environ["ARGV_OUT"], "w") as f:
    json.dump(sys.argv[1:], f)
"""


def capture(git_dir: str, commit: str, script: str, args: list[str]) -> list[str]:
    """torchrun's argv when bash runs ``script`` (at ``commit``) with ``args``."""
    text = subprocess.run(
        ["git", "--git-dir", git_dir, "show", f"{commit}:{script}"], check=True, capture_output=True, text=True
    ).stdout
    with tempfile.TemporaryDirectory() as run_dir:
        bin_dir, work = os.path.join(run_dir, "bin"), os.path.join(run_dir, "work")
        os.makedirs(bin_dir)
        os.makedirs(work)
        torchrun = os.path.join(bin_dir, "torchrun")
        with open(torchrun, "w") as f:
            f.write(STAND_IN_TORCHRUN)
        os.chmod(torchrun, os.stat(torchrun).st_mode | stat.S_IEXEC)
        open(os.path.join(work, "pretrain_gpt.py"), "w").close()  # the 8B script checks that it exists
        out = os.path.join(run_dir, "argv.json")
        env = {
            "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": run_dir,
            "ARGV_OUT": out,
        }  # nothing else: no MASTER_ADDR, SLURM_NNODES or WANDB_API_KEY from this machine
        subprocess.run(["bash", "-c", text, script, *args], cwd=work, env=env, check=True)
        with open(out) as f:
            argv = json.load(f)
    return [word.replace(work, "<PWD>") for word in argv]


def main(argv: list[str] | None = None) -> None:
    (git_dir,) = argv if argv is not None else sys.argv[1:]
    for name, commit, ref, script, args, branch in CASES:
        torchrun_argv = capture(git_dir, commit, script, args)
        entry = torchrun_argv.index("pretrain_gpt.py")
        record = {
            "megatron_lm_commit": commit,
            "megatron_lm_ref": ref,
            "script": script,
            "script_arguments": args,
            "branch": branch,
            "captured_by": "tests/data/megatron_lm_argv/capture.py (a stand-in torchrun that dumps its argv)",
            "torchrun_arguments": torchrun_argv[:entry],
            "argv": torchrun_argv[entry + 1 :],
        }
        with open(os.path.join(HERE, name + ".json"), "w") as f:
            json.dump(record, f, indent=1)
            f.write("\n")
        print(f"{name}.json: {len(record['argv'])} words, {sum(w.startswith('--') for w in record['argv'])} flags")


if __name__ == "__main__":
    main()
