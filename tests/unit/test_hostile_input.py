"""Hostile input for every command-line entry point (issue 45, point 3): ``pretrain_gpt.py`` (every
numeric flag, the path flags, the launcher's variables), ``--rehearse``, every ``tools/*.py`` main
and the launchers' environment variables, each fed its hostile values: 0, negative, nan, inf, huge
(beyond 64 bits), the wrong type, a missing file, a directory, a damaged file.

One table (``CASES``, plus the generated sweep of pretrain_gpt.py's numeric flags): each case must end
with exit status 2 and one ``error:`` naming the argument (the case's pattern) and the fix (a
verb telling what to do), and no traceback. The entry points' importable mains run in this process
(``pretrain_gpt.run_cli`` with the process-group start replaced by a sentinel: a value that got
through would be a failed case, never a training run); the launchers, shell scripts, in a
subprocess with a fake torchrun that records what reached it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import traceback
import typing

import pytest
import torch

from megatron_ext.arguments import get_field_types
from tests.unit.test_launchers import REPO, launch_env, slurm_env

HUGE = str(2**63)  # one past int64: wraps or overflows in torch, numpy and bash arithmetic
# the fix: what to do, or the value wanted
FIX = re.compile(
    r"\b(give|use|set|unset|delete|drop|add|leave|pass|lower|raise|remove|download|measure|record|start|launch|"
    r"check|change|choose|rebuild|redo|copy|shorten|lengthen|export|install|must (be|lie)|needs?|expected)\b"
)
# the smallest valid job: mock data, a 4-layer model over 2 pipeline stages (world size 2)
PRETRAIN = (
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 127 --num-layers 4 --hidden-size 32 "
    "--num-attention-heads 4 --seq-length 32 --micro-batch-size 1 --global-batch-size 4 --train-iters 10 "
    "--pipeline-model-parallel-size 2 --device cpu"
).split()
REHEARSAL_ONLY = ("gpu_memory_gib",)
FP16_ONLY = ("loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis")
WORLD = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}


class Accepted(Exception):
    """pretrain_gpt.py got past its checks to the process group: the hostile value was accepted."""


@dataclasses.dataclass(frozen=True)
class Case:
    entry: str  # pretrain, rehearse, a tools/ module name, torchrun.sh or slurm.sbatch
    argv: tuple[str, ...]
    expect: str  # a regex the error must match: the argument's name
    env: tuple[tuple[str, str], ...] = ()

    def __str__(self) -> str:
        env = " ".join(f"{k}={v}" for k, v in self.env if (k, v) not in WORLD.items())
        argv = self.argv[len(PRETRAIN) :] if self.argv[: len(PRETRAIN)] == tuple(PRETRAIN) else self.argv
        return f"{env} {self.entry} {' '.join(a.replace(TMP + os.sep, '') for a in argv)}".strip()[:120]


def case(entry: str, argv: str | list[str], expect: str, **env: str) -> Case:
    args = argv.split() if isinstance(argv, str) else argv
    return Case(entry, tuple(args), expect, tuple(env.items()))


# ----------------------------------------------------------------------------- running an entry point


def run_in_process(main: typing.Callable[[], object]) -> tuple[object, str]:
    """(exit status, or the unexpected exception's traceback; stdout + stderr) of ``main()``."""
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            status = main()
    except SystemExit as exit_:
        status = exit_.code
    except BaseException:  # noqa: BLE001 - a traceback is the failure this test looks for
        status = "traceback:\n" + traceback.format_exc()
    return status, out.getvalue()


def run_case(c: Case, monkeypatch, tmp: pathlib.Path) -> tuple[object, str]:
    for name in (
        "WORLD_SIZE",
        "RANK",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "OMP_NUM_THREADS",
        "MEGATRON_EXT_EXIT_MARKER_DIR",
    ):
        monkeypatch.delenv(name, raising=False)
    if c.entry in ("torchrun.sh", "slurm.sbatch"):
        return run_launcher(c, tmp)
    for name, value in c.env:
        monkeypatch.setenv(name, value)
    if c.entry in ("pretrain", "rehearse"):
        import pretrain_gpt

        # every case a launch of its own (report_error_once prints an error once per launch and host,
        # marked in the temporary directory): the reporter itself runs, reading the case's variables
        monkeypatch.setattr(tempfile, "tempdir", tempfile.mkdtemp(dir=tmp))

        def refuse(*args, **kwargs):
            raise Accepted("the run would have started")

        monkeypatch.setattr(pretrain_gpt, "init_distributed", refuse)
        argv = list(c.argv) + (["--rehearse"] if c.entry == "rehearse" else [])
        return run_in_process(lambda: pretrain_gpt.run_cli(argv))
    module = __import__(f"tools.{c.entry}", fromlist=["main"])
    return run_in_process(lambda: module.main(list(c.argv)))


def run_launcher(c: Case, tmp: pathlib.Path) -> tuple[object, str]:
    """launch/torchrun.sh or launch/slurm.sbatch with a fake torchrun (and srun, scontrol)."""
    tmp = pathlib.Path(tempfile.mkdtemp(dir=tmp))  # (the fakes' bin/ is made afresh)
    env = slurm_env(tmp, 1) if c.entry == "slurm.sbatch" else launch_env(tmp)
    env.update(dict(c.env))
    done = subprocess.run(
        ["bash", os.path.join(REPO, "launch", c.entry), *c.argv],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done.returncode, done.stdout + done.stderr


def check_one_error(c: Case, status: object, output: str) -> None:
    """Exit 2, one ``error:`` naming the argument and the fix, no traceback."""
    assert "Traceback" not in output and not str(status).startswith("traceback"), f"{c}:\n{status}\n{output}"
    assert status == 2, f"{c}: exit status {status!r}, not 2:\n{output}"
    starts = [m.start() for m in re.finditer(r"(?m)^error: ", output)]
    assert len(starts) == 1, f"{c}: {len(starts)} error lines:\n{output}"
    error = output[starts[0] :]
    assert re.search(c.expect, error), f"{c}: the error does not name {c.expect!r}:\n{error}"
    assert FIX.search(error), f"{c}: the error says no fix:\n{error}"


# ----------------------------------------------------------------------------- the table


def _pretrain_number_cases() -> list[Case]:
    """Every numeric flag of pretrain_gpt.py with the values no setting can take: the wrong type,
    negative, beyond 64 bits, and (floats) nan and inf; each refused naming the flag."""
    out = []
    for name, (kind, _, _) in sorted(get_field_types().items()):
        if kind not in (int, float):
            continue
        flag = "--" + name.replace("_", "-")
        values = ["abc", "-1", "-5"] + (["nan", "inf", "-inf", "1e400"] if kind is float else [HUGE, "1.5"])
        used = ["--fp16"] if name in FP16_ONLY else []  # (ignored with a notice without --fp16, as Megatron-LM)
        entry = "rehearse" if name in REHEARSAL_ONLY else "pretrain"  # (ignored without --rehearse)
        out += [case(entry, PRETRAIN + used + [f"{flag}={v}"], re.escape(flag), **WORLD) for v in values]
    return out


def _pretrain_path_cases(tmp: str) -> list[Case]:
    garbage, folder = os.path.join(tmp, "garbage.yaml"), os.path.join(tmp, "folder")
    a_file = os.path.join(tmp, "a_file")
    nan_yaml = os.path.join(tmp, "nan.yaml")
    return [
        case("pretrain", ["--config", os.path.join(tmp, "missing.yaml")], "--config", **WORLD),
        case("pretrain", ["--config", folder], "--config", **WORLD),
        case("pretrain", ["--config", garbage], "--config", **WORLD),
        case("pretrain", ["--config", nan_yaml, *PRETRAIN], "--lr", **WORLD),
        case("pretrain", PRETRAIN[1:] + ["--data-path", os.path.join(tmp, "nope")], "--data-path", **WORLD),
        case("pretrain", PRETRAIN[1:] + ["--data-path", folder], "--data-path", **WORLD),
        case("pretrain", PRETRAIN[1:] + ["--data-path", os.path.join(tmp, "damaged")], "--data-path|damaged", **WORLD),
        case(
            "pretrain",
            PRETRAIN[:1] + ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", a_file] + PRETRAIN[5:],
            "--tokenizer-model",
            **WORLD,
        ),
        case("pretrain", PRETRAIN + ["--save", a_file], "--save", **WORLD),
        case("pretrain", PRETRAIN + ["--data-cache-path", a_file], "--data-cache-path", **WORLD),
        case("pretrain", PRETRAIN + ["--load", a_file], "--load", **WORLD),
    ]


def _environment_cases() -> list[Case]:
    """The launcher's variables as a worker reads them (set by hand for --rehearse or one process)."""
    out = [
        case("pretrain", PRETRAIN, "WORLD_SIZE", WORLD_SIZE="abc"),  # crashed the error reporter itself
        case("pretrain", PRETRAIN, "WORLD_SIZE", WORLD_SIZE=HUGE),
        case("pretrain", PRETRAIN, "RANK", **{**WORLD, "RANK": "2"}),
        case("pretrain", PRETRAIN, "LOCAL_RANK", **{**WORLD, "LOCAL_RANK": "-1"}),
        case("pretrain", PRETRAIN, "OMP_NUM_THREADS", **WORLD, OMP_NUM_THREADS="0"),
        case("pretrain", PRETRAIN, "OMP_NUM_THREADS", **WORLD, OMP_NUM_THREADS="four"),
        case("pretrain", PRETRAIN, "LOCAL_WORLD_SIZE", **{**WORLD, "LOCAL_WORLD_SIZE": "abc"}),
    ]
    out += [case("rehearse", PRETRAIN, "WORLD_SIZE", WORLD_SIZE=v) for v in ("abc", "0", "-8", HUGE, "²", "1e3")]
    out += [case("rehearse", PRETRAIN, "WORLD_SIZE")]  # unset
    out += [case("rehearse", PRETRAIN, "LOCAL_WORLD_SIZE", WORLD_SIZE="2", LOCAL_WORLD_SIZE=v) for v in ("0", "x")]
    out += [case("rehearse", PRETRAIN + ["--lr", "nan"], "--lr", WORLD_SIZE="2")]
    return out


def _launcher_cases() -> list[Case]:
    out = []
    for name, values in {
        "MAX_RESTARTS": (HUGE, str(2**64), "-1", "two"),  # 2^64 wrapped to 0: no restart, silently
        "STOPPED_EXIT_CODE": (str(2**64), "256", "-1"),  # 2^64 wrapped to 0 and passed the check
        "NNODES": ("0", "-1", "abc", HUGE),
        "NPROC_PER_NODE": ("0", "-1", "many", HUGE),
        "NODE_RANK": ("-1", "abc", HUGE),
        "OMP_NUM_THREADS": ("0", "x"),
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": ("abc", "-5"),
    }.items():
        out += [case("torchrun.sh", "--config x.yaml", f"^error: {name}=", **{name: v}) for v in values]
    out += [case("torchrun.sh", "--config x.yaml", "NODE_RANK", NNODES="2", NODE_RANK="2", MASTER_ADDR="10.0.0.1")]
    out += [
        case("torchrun.sh", "--config x.yaml", "MASTER_PORT", MASTER_PORT=v, MASTER_ADDR="h")
        for v in ("0", "70000", "x")
    ]
    out += [case("slurm.sbatch", "--config x.yaml", "MAX_REQUEUES", MAX_REQUEUES=v) for v in (str(2**64), "-1", "x")]
    return out


def _plan_layout_cases(tmp: str) -> list[Case]:
    """Issue 45's list for tools/plan_layout.py, and the rest of its numbers and paths."""
    base = ["--config", os.path.join(REPO, "configs", "llama3-8b.yaml"), "--gpus", "64"]
    out = [case("plan_layout", base + ["--gpus", v], "--gpus") for v in ("0", "-8", "abc", HUGE)]
    for flag, values in {
        "--peak-tflops": ("0", "-1", "nan", "inf"),
        "--seq-length": ("-1", "0", HUGE),
        "--achievable": ("nan", "5", "0", "-0.5"),
        "--gpu-memory-gib": ("-1", "0", "inf"),
        "--gpus-per-node": ("0", "-8"),
        "--global-batch-size": ("0", "-1"),  # 0 fell back to the config's, silently
        "--intra-node-gbps": ("0", "nan"),
        "--inter-node-gbps": ("-1",),
        "--top": ("0", "-1"),
    }.items():
        out += [case("plan_layout", base + [f"{flag}={v}"], re.escape(flag)) for v in values]
    out += [
        case("plan_layout", ["--gpus", "8", "--config", os.path.join(tmp, "missing.yaml")], "--config"),
        case("plan_layout", ["--gpus", "8", "--config", os.path.join(tmp, "folder")], "--config"),
        case("plan_layout", ["--gpus", "8", "--config", os.path.join(tmp, "garbage.yaml")], "--config"),
        case("plan_layout", base + ["--hf-config", os.path.join(tmp, "garbage.yaml")], "--hf-config"),
        case("plan_layout", base + ["--fix", "tp=abc"], "--fix tp=abc"),
        case("plan_layout", base + ["--fix", "pp=0"], "--fix pp=0"),
        case("plan_layout", base + ["--show", "schedule=Nope"], "--show schedule=Nope"),
        case("plan_layout", base + ["--fix", "bogus=1"], "--fix"),
        case("plan_layout", base + ["--gpus", "12"], "--gpus 12"),  # not whole nodes of 8
    ]
    return out


def _tool_cases(tmp: str) -> list[Case]:
    """The other tools' numbers and paths."""
    j = os.path.join
    missing, folder, a_file, garbage = j(tmp, "missing"), j(tmp, "folder"), j(tmp, "a_file"), j(tmp, "garbage.yaml")
    text = j(tmp, "text.jsonl")
    pre = ["--input", text, "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--output-prefix", j(tmp, "pp")]
    out = [
        case("build_default_corpus", ["--output", folder], "--output"),
        case("build_default_corpus", ["--output", j(a_file, "corpus.jsonl")], "--output"),
        *[
            case("build_default_corpus", ["--output", j(tmp, "c.jsonl"), f"--max-bytes={v}"], "--max-bytes")
            for v in ("0", "-1", HUGE, "1e6")
        ],
        case("build_default_corpus", ["--output", j(tmp, "c.jsonl"), "--min-chars=-1"], "--min-chars"),
        case("calibrate_memory", ["--from-rows", missing], "--from-rows"),
        case("calibrate_memory", ["--from-rows", folder], "--from-rows"),
        case("calibrate_memory", ["--from-rows", garbage, "--out", j(tmp, "o.json")], "--from-rows"),
        case("calibrate_memory", ["--from-rows", text, "--out", j(tmp, "o.json")], "--from-rows"),
        case("calibrate_memory", ["--out", folder], "--out"),
        case("gen_flags_doc", ["--output", folder], "--output"),
        case("gen_flags_doc", ["--output", folder, "--check"], "--output"),
        case("make_default_data", ["--output-dir", a_file], "--output-dir"),
        *[
            case("make_default_data", ["--output-dir", j(tmp, "md"), f"--vocab-size={v}"], "--vocab-size")
            for v in ("0", "-1", HUGE)
        ],
        *[
            case("make_default_data", ["--output-dir", j(tmp, "md"), f"--workers={v}"], "--workers")
            for v in ("0", "-2")
        ],
        case("make_default_data", ["--output-dir", j(tmp, "md"), "--max-bytes=-5"], "--max-bytes"),
        case("pp_timeline", [missing], "missing"),
        case("pp_timeline", [a_file], "a_file"),
        case("pp_timeline", [j(tmp, "damaged_trace")], r"rank0\.jsonl line 1"),
        case("pp_timeline", [j(tmp, "damaged_trace"), "--step=-1"], "--step"),
        case("pp_timeline", [j(tmp, "damaged_trace"), "--output", folder], "--output"),
        case("preprocess_data", pre[:1] + [missing] + pre[2:], "--input"),
        case("preprocess_data", pre[:1] + [folder] + pre[2:], "--input"),
        case("preprocess_data", pre[:1] + [garbage] + pre[2:], "--input"),
        *[
            case("preprocess_data", pre[:5] + [f"--vocab-size={v}"] + pre[6:], "--vocab-size")
            for v in ("0", "-1", HUGE)
        ],
        *[case("preprocess_data", pre + [f"--workers={v}"], "--workers") for v in ("0", "-2")],
        case("preprocess_data", pre + ["--log-interval=-2"], "--log-interval"),
        case("preprocess_data", pre + ["--tiktoken-num-special-tokens=-1"], "--tiktoken-num-special-tokens"),
        case(
            "print_topology",
            ["--tensor-model-parallel-size=0", "--output-dir", j(tmp, "topo")],
            "--tensor-model-parallel-size",
        ),
        case(
            "print_topology",
            ["--pipeline-model-parallel-size=-1", "--output-dir", j(tmp, "topo")],
            "--pipeline-model-parallel-size",
        ),
        case("print_topology", ["--output-dir", a_file], "--output-dir"),
        case("train_tokenizer", ["--input", missing, "--output-prefix", j(tmp, "tk")], "--input"),
        case("train_tokenizer", ["--input", folder, "--output-prefix", j(tmp, "tk")], "--input"),
        case("train_tokenizer", ["--input", garbage, "--output-prefix", j(tmp, "tk")], "--input"),
        *[
            case(
                "train_tokenizer",
                ["--input", text, "--output-prefix", j(tmp, "tk"), f"--vocab-size={v}"],
                "--vocab-size",
            )
            for v in ("0", "-1", HUGE, "abc")
        ],
    ]
    return out


def _convert_cases(tmp: str) -> list[Case]:
    j = os.path.join
    out = [
        case(
            "convert_checkpoint",
            ["hf-to-megatron", "--hf-dir", j(tmp, "hf_missing_tensor"), "--save", j(tmp, "c1")],
            r"--hf-dir .*no tensor model\.layers\.0\.mlp\.down_proj\.weight",
        ),
        case(
            "convert_checkpoint",
            ["hf-to-megatron", "--hf-dir", j(tmp, "hf_cut_tensor"), "--save", j(tmp, "c2")],
            r"--hf-dir .*model\.norm\.weight is \(3,\)",
        ),
        case(
            "convert_checkpoint", ["hf-to-megatron", "--hf-dir", j(tmp, "missing"), "--save", j(tmp, "c3")], "--hf-dir"
        ),
        case(
            "convert_checkpoint", ["hf-to-megatron", "--hf-dir", j(tmp, "a_file"), "--save", j(tmp, "c3")], "--hf-dir"
        ),
        case(
            "convert_checkpoint", ["hf-to-megatron", "--hf-dir", j(tmp, "folder"), "--save", j(tmp, "c3")], "--hf-dir"
        ),
        case(
            "convert_checkpoint",
            ["hf-to-megatron", "--hf-dir", j(tmp, "hf_missing_tensor"), "--save", j(tmp, "a_file")],
            "--save",
        ),
        case(
            "convert_checkpoint", ["megatron-to-hf", "--load", j(tmp, "missing"), "--hf-dir", j(tmp, "out")], "--load"
        ),
        case("convert_checkpoint", ["megatron-to-hf", "--load", j(tmp, "a_file"), "--hf-dir", j(tmp, "out")], "--load"),
        case(
            "convert_checkpoint",
            ["megatron-to-hf", "--load", j(tmp, "missing"), "--hf-dir", j(tmp, "a_file")],
            "--hf-dir",
        ),
    ]
    for flag in ("--tensor-model-parallel-size", "--make-vocab-size-divisible-by"):
        out += [
            case(
                "convert_checkpoint",
                ["hf-to-megatron", "--hf-dir", j(tmp, "hf_missing_tensor"), "--save", j(tmp, "c4"), f"{flag}={v}"],
                re.escape(flag),
            )
            for v in ("0", "-1", HUGE, "x")
        ]
    return out


def _generate_cases(tmp: str) -> list[Case]:
    """tools/generate.py: the prompt checked against the checkpoint's vocabulary (128 ids) and its
    model's positions (RoPE trained at --seq-length 16) before anything is generated."""
    j = os.path.join
    load = ["--load", j(tmp, "ckpt")]
    ids = ["--prompt-ids", "1,2,3"]
    out = [
        case("generate", load + ["--prompt-ids", "1,abc"], "--prompt-ids"),
        case("generate", load + ["--prompt-ids=-1"], "--prompt-ids"),
        case(
            "generate",
            load + ["--prompt-ids", "1,500"],
            r"--prompt-ids: ids 500 are outside the checkpoint's vocabulary",
        ),
        case("generate", load + ["--prompt-ids", ",".join(["5"] * 17)], r"--prompt-ids: .*--seq-length"),
        case("generate", load + ids + ["--max-new-tokens", "14"], r"--max-new-tokens 13 or less"),  # RoPE: not past 16
        case("generate", load + ["--prompt", ""], "--prompt"),
        *[
            case("generate", load + ids + [f"--max-new-tokens={v}"], "--max-new-tokens")
            for v in ("0", "-1", HUGE, "1000000")
        ],
        *[case("generate", load + ids + [f"--temperature={v}"], "--temperature") for v in ("nan", "-1", "inf")],
        *[case("generate", load + ids + [f"--top-p={v}"], "--top-p") for v in ("0", "nan", "1.5")],
        *[case("generate", load + ids + [f"--top-k={v}"], "--top-k") for v in ("-1", HUGE)],
        *[case("generate", load + ids + [f"--seed={v}"], "--seed") for v in ("-1", HUGE)],
        case("generate", ["--load", j(tmp, "missing")] + ids, "--load"),
        case("generate", ["--load", j(tmp, "a_file")] + ids, "--load"),
        case("generate", ["--load", j(tmp, "folder")] + ids, "--load"),
        case("generate", ["--load", j(tmp, "damaged_ckpt")] + ids, "--load"),
    ]
    return out


TMP = "{tmp}"
CASES = (
    _pretrain_number_cases()
    + _pretrain_path_cases(TMP)
    + _environment_cases()
    + _launcher_cases()
    + _plan_layout_cases(TMP)
    + _tool_cases(TMP)
    + _convert_cases(TMP)
    + _generate_cases(TMP)
)


def _save_tiny_checkpoint(rank: int, world_size: int, root: str) -> None:
    from megatron_ext.parallel import destroy_parallel_context
    from megatron_ext.testing import LLAMA_STYLE, MarkovDataset, build_tiny_run, tiny_values
    from megatron_ext.training.checkpointing import save_checkpoint

    values = tiny_values(**LLAMA_STYLE, seq_length=16, micro_batch_size=1, global_batch_size=1, train_iters=1)
    run = build_tiny_run(values, MarkovDataset(16))
    save_checkpoint(run, root)
    destroy_parallel_context()


# a 1-layer Llama of hidden 8, 2 heads of 4, MLP 16, 16 ids, as Hugging Face names and shapes its tensors
HF_CONFIG = dict(
    model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=16, hidden_size=8, intermediate_size=16,
    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
)  # fmt: skip
HF_SHAPES = {
    "model.embed_tokens.weight": (16, 8),
    "model.norm.weight": (8,),
    "lm_head.weight": (16, 8),
    **{f"model.layers.0.self_attn.{x}_proj.weight": (8, 8) for x in "qkvo"},
    "model.layers.0.input_layernorm.weight": (8,),
    "model.layers.0.post_attention_layernorm.weight": (8,),
    "model.layers.0.mlp.gate_proj.weight": (16, 8),
    "model.layers.0.mlp.up_proj.weight": (16, 8),
    "model.layers.0.mlp.down_proj.weight": (8, 16),
}


def _write_hf_model(path: pathlib.Path, drop: str | None = None, cut: str | None = None) -> None:
    """``HF_CONFIG``'s model as Hugging Face saves it, without ``drop`` or with ``cut`` of 3 values."""
    from safetensors.torch import save_file

    tensors = {k: torch.zeros(3 if k == cut else shape) for k, shape in HF_SHAPES.items() if k != drop}
    path.mkdir()
    (path / "config.json").write_text(json.dumps(HF_CONFIG))
    save_file(tensors, str(path / "model.safetensors"))


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> pathlib.Path:
    """The files the cases name: a directory, a file, damaged files of each kind, a text corpus,
    Hugging Face directories with a tensor missing or cut, an empty checkpoint directory."""
    tmp = tmp_path_factory.mktemp("hostile")
    (tmp / "folder").mkdir()
    (tmp / "a_file").write_text("not a directory\n")
    (tmp / "garbage.yaml").write_bytes(b"\x00\xff: [unclosed\n\t- {")
    (tmp / "nan.yaml").write_text("lr: .nan\n")
    for ext in (".bin", ".idx"):
        (tmp / f"damaged{ext}").write_bytes(b"\x00garbage" * 10)
    (tmp / "text.jsonl").write_text('{"text": "some words of text"}\n' * 20)
    (tmp / "damaged_trace").mkdir()
    (tmp / "damaged_trace" / "rank0.jsonl").write_bytes(b"\x00\xffnot json\n")
    (tmp / "damaged_ckpt" / "iter_0000001").mkdir(parents=True)
    (tmp / "damaged_ckpt" / "iter_0000001" / "complete.json").write_bytes(b"\xff{garbage")
    (tmp / "damaged_ckpt" / "latest_checkpointed_iteration.txt").write_text("1\n")
    pytest.importorskip("safetensors")
    _write_hf_model(tmp / "hf_missing_tensor", drop="model.layers.0.mlp.down_proj.weight")
    _write_hf_model(tmp / "hf_cut_tensor", cut="model.norm.weight")
    return tmp


@pytest.fixture(scope="module")
def tiny_checkpoint(workspace) -> str:
    """A RoPE model's checkpoint (seq 16, 128 ids) for tools/generate.py, saved by a forked rank."""
    from megatron_ext.testing import run_ranks

    root = str(workspace / "ckpt")
    run_ranks(_save_tiny_checkpoint, 1, root, timeout=300)
    return root


def _substitute(c: Case, tmp: pathlib.Path) -> Case:
    fill = lambda text: text.replace(TMP, str(tmp))  # noqa: E731
    return Case(c.entry, tuple(map(fill, c.argv)), c.expect, tuple((k, fill(v)) for k, v in c.env))


@pytest.mark.parametrize("c", CASES, ids=str)
def test_hostile_input_is_one_error_naming_the_argument_and_the_fix(c, workspace, request, monkeypatch):
    if c.entry == "generate":
        request.getfixturevalue("tiny_checkpoint")
    c = _substitute(c, workspace)
    status, output = run_case(c, monkeypatch, workspace)
    check_one_error(c, status, output)


# ----------------------------------------------------------------------------- beside the table


def test_plan_layout_says_why_nothing_fits(capsys):
    """ "0 fit" used to end the output with no reason: it names the pinned settings no layout has, or
    the layout closest to fitting, its largest term and the memory it needs."""
    from tools.plan_layout import main

    config = ["--config", os.path.join(REPO, "configs", "llama3-8b.yaml")]
    assert main([*config, "--gpus", "8", "--gpu-memory-gib", "1", "--fix", "tp=8", "--fix", "mbs=1"]) == 1
    out = capsys.readouterr().out
    found = re.search(r"0 fit: .*the closest, (TP \d+ x PP \d+.*?) \(DP \d+\), needs ([\d.]+) GiB .*the largest term "
                      r"(\w+) \(([\d.]+) GiB\); it fits GPUs of --gpu-memory-gib (\d+)", out)  # fmt: skip
    assert found, out
    need, largest, fits = float(found.group(2)), float(found.group(4)), int(found.group(5))
    assert 1 < largest <= need <= fits < need + 1, out
    assert main([*config, "--gpus", "64", "--fix", "pp=3"]) == 1  # PP 3 divides neither 32 layers nor 64 GPUs
    assert (
        "0 fit: no layout has pp=3: the planner tries TP dividing --gpus-per-node 8, the CP sizes the sequence allows, PP dividing the 32 layers"
        in (capsys.readouterr().out)
    )


class _RunsCommand:
    """A pickle that runs a command when loaded (and would then be an integer array's stand-in)."""

    def __init__(self, sentinel: str):
        self.sentinel = sentinel

    def __reduce__(self):
        return (os.system, (f"touch {self.sentinel}",))


def test_a_forged_dataset_index_cache_never_runs_its_command(tmp_path):
    """megatron-core loads its GPTDataset index caches (under --data-cache-path) with
    numpy.load(allow_pickle=True): a pickle put there ran its command at the next start. Refused
    by name now, nothing run; our packing caches (.npz, read without pickles) likewise."""
    import pickle

    import numpy as np

    from megatron_ext.config import ConfigError
    from megatron_ext.data.gpt_datasets import build_gpt_datasets
    from megatron_ext.data.packed_dataset import read_cached_arrays
    from megatron_ext.data.tokenizers import build_tokenizer

    tokenizer = build_tokenizer(
        tokenizer_type="SentencePieceTokenizer",
        tokenizer_model=os.path.join(REPO, "data", "default", "tokenizer.model"),
    )
    cache, sentinel = tmp_path / "cache", tmp_path / "ran"
    build = lambda: build_gpt_datasets(  # noqa: E731
        tokenizer,
        64,
        [16, 0, 0],
        [os.path.join(REPO, "data", "default", "corpus_text_document")],
        split="99,1,0",
        path_to_cache=str(cache),
        unused_splits=(1, 2),
    )
    build()  # writes the caches
    for index in ("document_index", "sample_index", "shuffle_index"):
        (path,) = cache.glob(f"*-GPTDataset-train-{index}.npy")
        real = path.read_bytes()
        path.write_bytes(pickle.dumps(_RunsCommand(str(sentinel))))
        try:
            build()
            error = "built"
        except ConfigError as err:
            error = str(err)
        assert not sentinel.exists(), f"the forged {index} ran its command"
        assert re.search(rf"{re.escape(str(path))} holds Python objects.*may have been tampered", error), error
        path.write_bytes(real)
    for name, forged in (
        ("pickle.npz", pickle.dumps(_RunsCommand(str(sentinel)))),
        ("objects.npz", None),
    ):
        path = tmp_path / name
        if forged is None:
            np.savez(path, a=np.array([_RunsCommand(str(sentinel))], dtype=object))
        else:
            path.write_bytes(forged)
        with pytest.raises(ConfigError, match="cannot be read"):
            read_cached_arrays(str(path))
        assert not sentinel.exists(), f"the forged packing cache {name} ran its command"


def test_convert_checkpoint_prints_its_error_and_no_import_warnings(tmp_path):
    """megatron-core's Transformer Engine/Apex warnings (four, with their source lines) came before the
    converter's one line: quieted before its imports, as the other tools do."""
    tool = os.path.join(REPO, "tools", "convert_checkpoint.py")
    argv = ["hf-to-megatron", "--hf-dir", str(tmp_path / "missing"), "--save", str(tmp_path / "out")]
    done = subprocess.run([sys.executable, tool, *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        f"error: argument --hf-dir: {tmp_path / 'missing'} does not exist: give an existing directory "
        "(--help lists the arguments)"
    ], done.stderr
