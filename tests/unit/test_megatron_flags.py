"""A Megatron-LM-style Llama-3 8B launch script parses: its flags are ours, or Megatron-LM flags
accepted because they change nothing here (one warning each), or refused by name because they
would change the model or the training and we lack them (megatron_flags.py)."""

from __future__ import annotations

import shlex

import pytest

from megatron_ext.arguments import build_parser, parse_args_with_notes
from megatron_ext.config import ConfigError
from megatron_ext.validation import validate

# The argument arrays of a Megatron-LM-style Llama-3 8B pretraining script (mock data branch),
# as its torchrun line passes them to pretrain_gpt.py.
SCRIPT = r"""
MODEL_ARGS=(
    --use-mcore-models --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336
    --num-attention-heads 32 --group-query-attention --num-query-groups 8 --kv-channels 128
    --seq-length 8192 --max-position-embeddings 8192 --position-embedding-type rope
    --rotary-base 1000000 --rotary-percent 1.0 --attention-dropout 0.0 --hidden-dropout 0.0
    --swiglu --init-method-std 0.0134 --attention-backend fused --apply-layernorm-1p
    --untie-embeddings-and-output-weights --disable-bias-linear
)
TRAINING_ARGS=(
    --micro-batch-size 1 --global-batch-size 128 --train-samples 1953125000
    --lr-decay-samples 1949218748 --lr-warmup-samples 3906252 --lr 0.00015 --min-lr 0.00001
    --decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5 --lr-decay-style cosine --clip-grad 1.0
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16 --grad-reduce-in-bf16
    --cross-entropy-loss-fusion --calculate-per-token-loss --manual-gc --empty-unused-memory-level 1
    --exit-duration-in-mins 235
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
)
DTYPE_ARGS=(--fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max --fp8-param-gather)
MODEL_PARALLEL_ARGS=(--tensor-model-parallel-size 1 --context-parallel-size 1 --sequence-parallel)
DATA_ARGS=(
    --mock-data --tokenizer-type NullTokenizer --vocab-size 128256 --data-cache-path /tmp/cache
    --tiktoken-pattern v2 --split 99,1,0 --no-create-attention-mask-in-dataloader --no-mmap-bin-files
    --num-workers 0
)
EVAL_AND_LOGGING_ARGS=(
    --log-interval 1 --eval-iters 32 --eval-interval 100 --save-interval 1000 --log-throughput
    --profile --profile-step-start 4 --profile-step-end 6 --ckpt-format torch_dist
    --distributed-timeout-minutes 60 --save /tmp/ckpt --load /tmp/ckpt --tensorboard-dir /tmp/tb
)
"""
REFUSED = [
    "--fp8-format",
    "--fp8-amax-history-len",
    "--fp8-amax-compute-algo",
    "--fp8-param-gather",
]
WARNED = [
    "--use-mcore-models",
    "--attention-backend fused",
    "--cross-entropy-loss-fusion",
    "--tiktoken-pattern v2",
    "--no-create-attention-mask-in-dataloader",
    "--no-mmap-bin-files",
    "--log-throughput",
]


def script_argv() -> list[str]:
    body = [line for line in SCRIPT.splitlines() if not line.endswith("=(") and line.strip() != ")"]
    return shlex.split(" ".join(line.split("=(", 1)[-1].rstrip(")") for line in body))


def _without(argv: list[str], flags: list[str]) -> list[str]:
    out, skip = [], False
    for token in argv:
        if skip and not token.startswith("--"):
            continue
        skip = token in flags
        if not skip:
            out.append(token)
    return out


def test_every_flag_of_the_script_is_known():
    known = {s for action in build_parser()._actions for s in action.option_strings}
    flags = [t for t in script_argv() if t.startswith("--")]
    assert len(flags) == 74 and [f for f in flags if f not in known] == []


def test_the_refused_flags_are_named_together():
    with pytest.raises(ConfigError) as err:
        parse_args_with_notes(script_argv())
    named = [next(f for f in REFUSED if p.startswith(f + " ") or p.startswith(f + ":")) for p in err.value.problems]
    assert named == REFUSED, err.value.problems


def test_without_the_refused_flags_the_script_runs_with_one_warning_per_no_op_flag():
    cfg, notes = parse_args_with_notes(_without(script_argv(), REFUSED))
    # the script passes --sequence-parallel at TP 1: turned off, as Megatron-LM does, with a notice
    adjusted = [n for n in notes if n.startswith("--sequence-parallel is off")]
    assert len(adjusted) == 1 and not cfg.parallel.sequence_parallel, notes
    notes = [n for n in notes if n not in adjusted]
    assert sorted(next(w for w in WARNED if n.startswith(w)) for n in notes) == sorted(WARNED), notes
    assert all("changes nothing" in n for n in notes)
    t = cfg.training
    assert (t.train_samples, t.lr_decay_samples, t.lr_warmup_samples, t.empty_unused_memory_level) == (
        1953125000,
        1949218748,
        3906252,
        1,
    )
    assert cfg.model.num_query_groups == 8 and cfg.parallel.overlap_param_gather
    # real fields now (issue 31): the embedding/output layer's own LR, bf16 gradient buffers
    assert (t.decoupled_lr, t.decoupled_min_lr, cfg.parallel.grad_reduce_in_bf16) == (5.0e-4, 4.5e-5, True)
    assert cfg.model.apply_layernorm_1p  # our (1 + gamma) norms
    validate(cfg, 8, cuda=True)  # the rest of the script is a valid job for us


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--ckpt-format", "torch"], "--ckpt-format torch: only torch_dist"),
        (["--use-rotary-position-embeddings"], "add --position-embedding-type rope"),
        (["--lr-warmup-init", "1e-5"], "--lr-warmup-init 1e-5: the warm-up starts from learning rate 0"),
        (
            ["--attention-backend", "fused", "--transformer-impl", "transformer_engine"],
            "choosing Transformer Engine's attention backend is not supported yet",
        ),
    ],
)
def test_accepted_flags_with_other_values_are_refused(argv, needle):
    base = [
        "--hidden-size",
        "4096",
        "--num-attention-heads",
        "32",
        "--mock-data",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "128",
    ]
    with pytest.raises(ConfigError) as err:
        parse_args_with_notes(base + argv)
    assert any(needle in p for p in err.value.problems), err.value.problems


def test_accepted_flags_stating_our_behaviour_are_silent():
    cfg, notes = parse_args_with_notes(
        [
            "--ckpt-format",
            "torch_dist",
            "--kv-channels",
            "16",
            "--hidden-size",
            "64",
            "--num-attention-heads",
            "4",
            "--position-embedding-type",
            "rope",
            "--use-rotary-position-embeddings",
            "--no-position-embedding",
            "--lr-warmup-init",  # Megatron-LM's flag (default 0.0): it was refused as an unknown flag
            "0.0",
        ]
    )
    assert notes == [] and cfg.model.position_embedding_type == "rope"


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--decoupled-min-lr", "1e-5"], "--decoupled-min-lr 1e-05 needs --decoupled-lr"),
        (
            ["--decoupled-lr", "1e-5", "--lr", "1e-4", "--min-lr", "2e-5"],
            "--min-lr 2e-05 (the default of --decoupled-min-lr) is larger than --decoupled-lr 1e-05",
        ),
        (
            ["--decoupled-lr", "1e-4", "--decoupled-min-lr", "2e-4"],
            "--decoupled-min-lr 0.0002 is larger than --decoupled-lr",
        ),
        (["--decoupled-lr", "-1"], "--decoupled-lr must be a number >= 0"),
        (["--grad-reduce-in-bf16"], "--grad-reduce-in-bf16 needs --bf16"),
        (
            ["--grad-reduce-in-bf16", "--fp16"],
            "--grad-reduce-in-bf16 needs --bf16: the gradient buffers take the parameters' dtype (fp16 here)",
        ),
    ],
)
def test_decoupled_lr_and_bf16_grad_buffers_are_checked_before_any_work(argv, needle):
    cfg, _ = parse_args_with_notes(["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"] + argv)
    with pytest.raises(ConfigError) as err:
        validate(cfg, 1)
    assert any(needle in p for p in err.value.problems), err.value.problems
    assert len(err.value.problems) == 1, err.value.problems


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--check-for-spiky-loss"], "--check-for-spiky-loss: Megatron-LM's spike check re-runs the step"),
        (["--check-for-large-grads"], "--check-for-large-grads: Megatron-LM's large-gradient check"),
        (["--rerun-mode", "validate_results"], "--rerun-mode validate_results: Megatron-LM's rerun state machine"),
        (["--rerun-mode", "report_stats"], "--rerun-mode report_stats: Megatron-LM's rerun state machine"),
    ],
)
def test_the_rerun_state_machines_flags_are_refused_by_name(argv, needle):
    """Issue 31: Megatron-LM's loss-spike and large-gradient checks re-run steps; without that machine each
    flag is one error naming it (a silent no-op would drop a check the script asked for)."""
    with pytest.raises(ConfigError) as err:
        parse_args_with_notes(["--mock-data", *argv])
    assert [p for p in err.value.problems if p.startswith(needle)], err.value.problems


def test_rerun_mode_disabled_is_accepted_silently():
    _, notes = parse_args_with_notes(["--mock-data", "--rerun-mode", "disabled"])
    assert not [n for n in notes if "rerun" in n], notes


@pytest.mark.parametrize("field", ["override_opt_param_scheduler", "use_checkpoint_opt_param_scheduler"])
def test_megatron_lms_own_spelling_of_the_scheduler_flags_is_accepted(field):
    # Megatron-LM's arguments.py defines --override-opt_param-scheduler and
    # --use-checkpoint-opt_param-scheduler (an underscore inside): its scripts' spelling was refused
    megatron_spelling = "--" + field.replace("_", "-").replace("opt-param", "opt_param")
    cfg, _ = parse_args_with_notes(
        ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", megatron_spelling]
    )
    assert getattr(cfg.checkpoint, field) is True


# Flags of Megatron-LM launch scripts refused as unknown before (user review): each now parses, with
# one warning line where it changes nothing here, or is one error naming it where we lack it.
NO_OP_FLAGS = [
    ["--timing-log-option", "max"],
    ["--timing-log-option", "minmax"],
    ["--timing-log-option", "all"],
    ["--ckpt-fully-parallel-save"],
    ["--ckpt-assume-constant-structure"],
    ["--auto-detect-ckpt-format"],
    ["--use-cpu-initialization"],
    ["--no-persist-layer-norm"],
]


@pytest.mark.parametrize("argv", NO_OP_FLAGS, ids=lambda a: " ".join(a))
def test_a_checkpoint_or_kernel_flag_that_changes_nothing_is_accepted_with_one_warning(argv):
    base = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]
    _, plain = parse_args_with_notes(base)
    _, notes = parse_args_with_notes(base + argv)
    added = [n for n in notes if n not in plain]
    assert len(added) == 1 and added[0].startswith(f"{argv[0]} ") and "changes nothing" in added[0], added


@pytest.mark.parametrize(
    "argv", [["--dist-ckpt-strictness", "assume_ok_unexpected"], ["--no-ckpt-fully-parallel-save"]], ids=" ".join
)
def test_a_flag_stating_what_we_do_is_accepted_silently(argv):
    base = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]
    _, plain = parse_args_with_notes(base)
    _, notes = parse_args_with_notes(base + argv)
    assert notes == plain


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--tp-comm-overlap"], "--tp-comm-overlap: overlapping tensor-parallel communication"),
        (["--dist-ckpt-strictness", "log_all"], "--dist-ckpt-strictness log_all: loads here are assume_ok_unexpected"),
        (["--dist-ckpt-strictness", "raise_all"], "--dist-ckpt-strictness raise_all: loads here are"),
        (["--timing-log-option", "median"], "--timing-log-option median: Megatron-LM's values are max, minmax and all"),
    ],
)
def test_a_flag_we_lack_is_one_error_naming_it(argv, needle):
    with pytest.raises(ConfigError) as err:
        parse_args_with_notes(["--mock-data", *argv])
    assert len(err.value.problems) == 1 and err.value.problems[0].startswith(needle), err.value.problems
