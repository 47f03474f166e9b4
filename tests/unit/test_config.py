"""Config: flags and files parse into typed sections; every layout rule has its own message;
all problems are reported at once; nothing is created while validating."""

from __future__ import annotations

import glob
import os

import pytest

from megatron_ext.arguments import load_config_file, parse_args
from megatron_ext.config import ConfigError, build_job_config
from megatron_ext.derived import (
    get_num_microbatches,
    get_padded_vocab_size,
    get_replica_size,
    get_virtual_pipeline_size,
)
from megatron_ext.validation import validate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MOCK = dict(mock_data=True, tokenizer_type="NullTokenizer", vocab_size=128)


def _problems(world_size: int, **values) -> list[str]:
    cfg = build_job_config({**MOCK, **values})
    with pytest.raises(ConfigError) as err:
        validate(cfg, world_size)
    return err.value.problems


def _accepted_or_problems(world_size: int, **values) -> list[str]:
    """[] when ``values`` validate, else their problems (so a test of an accepted setting asserts)."""
    try:
        validate(build_job_config({**MOCK, **values}), world_size)
    except ConfigError as err:
        return err.problems
    return []


def test_valid_layout_passes_and_derives_sizes():
    cfg = build_job_config(
        {
            **MOCK,
            "tensor_model_parallel_size": 2,
            "pipeline_model_parallel_size": 2,
            "num_layers": 8,
            "num_layers_per_virtual_pipeline_stage": 2,
            "micro_batch_size": 2,
            "global_batch_size": 16,
        }
    )
    validate(cfg, 8)
    assert get_virtual_pipeline_size(cfg) == 2
    assert get_num_microbatches(cfg, 8) == 16 // (2 * 2)


@pytest.mark.parametrize(
    "world, values, expected",
    [
        (6, dict(tensor_model_parallel_size=4), "world size 6 is not divisible by --tensor-model-parallel-size 4"),
        (
            4,
            dict(pipeline_model_parallel_size=4, num_layers=6),
            "--num-layers 6 is not divisible by --pipeline-model-parallel-size 4",
        ),
        (
            4,
            dict(pipeline_model_parallel_size=2, num_layers=6, num_layers_per_virtual_pipeline_stage=2),
            "--num-layers-per-virtual-pipeline-stage 2",
        ),
        (
            2,
            dict(tensor_model_parallel_size=2, num_attention_heads=3, hidden_size=96),
            "--num-attention-heads 3 is not divisible by --tensor-model-parallel-size 2",
        ),
        (
            4,
            dict(global_batch_size=6, micro_batch_size=2),
            "--global-batch-size 6 is not divisible by --micro-batch-size 2 x data-parallel size 4",
        ),
        (
            2,
            dict(
                pipeline_model_parallel_size=2,
                num_layers=4,
                num_layers_per_virtual_pipeline_stage=1,
                global_batch_size=1,
                micro_batch_size=1,
            ),
            "interleaved schedule: 1 micro-batch per step",
        ),
        (
            2,
            dict(
                pipeline_model_parallel_size=2,
                num_layers=8,
                num_layers_per_virtual_pipeline_stage=1,
                microbatch_group_size_per_vp_stage=4,
                global_batch_size=5,
                micro_batch_size=1,
            ),
            "leaves a last group of 1 < PP 2",
        ),
        (1, dict(num_layers=4, num_layers_per_virtual_pipeline_stage=2), "needs --pipeline-model-parallel-size > 1"),
        (
            2,
            dict(
                pipeline_model_parallel_size=2,
                num_layers=8,
                num_layers_per_virtual_pipeline_stage=2,
                num_virtual_stages_per_pipeline_rank=3,
            ),
            "disagree",
        ),
        (
            2,
            dict(tensor_model_parallel_size=2, group_query_attention=True, num_query_groups=1),
            "--num-query-groups 1 is not divisible by --tensor-model-parallel-size 2",
        ),
        (
            1,
            dict(seq_length=512, max_position_embeddings=256),
            "--seq-length 512 exceeds --max-position-embeddings 256",
        ),
        (
            2,
            dict(
                tensor_model_parallel_size=2,
                sequence_parallel=True,
                seq_length=63,
                max_position_embeddings=64,
                sequence_padding="static",
            ),
            "--seq-length 63 must be a multiple of --tensor-model-parallel-size 2 with --sequence-parallel",
        ),
    ],
)
def test_each_layout_rule_names_flags_and_values(world, values, expected):
    problems = _problems(world, **values)
    assert any(expected in p for p in problems), problems


def test_all_problems_are_reported_at_once():
    problems = _problems(6, tensor_model_parallel_size=4, num_attention_heads=3, hidden_size=96, min_lr=1.0, lr=0.1)
    assert len(problems) >= 3, problems


def test_data_rules():
    assert any("--mock-data and --data-path are exclusive" in p for p in _problems(1, data_path=["x"]))
    cfg = build_job_config({"tokenizer_type": "NullTokenizer", "vocab_size": 16, "data_path": ["/nope/prefix"]})
    with pytest.raises(ConfigError) as err:
        validate(cfg, 1)
    assert any("/nope/prefix: missing /nope/prefix.bin" in p for p in err.value.problems)
    cfg = build_job_config({"mock_data": True, "tokenizer_type": "NullTokenizer"})
    with pytest.raises(ConfigError, match="NullTokenizer needs a positive --vocab-size"):
        validate(cfg, 1)


def test_split_has_one_grammar_and_validation_applies_it():
    """--split is parsed by data/gpt_datasets.parse_split wherever it is read: a value the dataset
    builders would refuse (four parts, an empty part, words) is refused at validation, naming the flag
    (validation used to accept any number of parts, so --split 1,2,3,4 failed only when the data was built)."""
    for bad in ("1,2,3,4", "969,30,", "a,b", "0,0,0"):
        problems = _problems(1, split=bad)
        assert any(p.startswith(f"--split {bad!r}") for p in problems), problems
    for good in ("969,30,1", "98,2", "1", "3/1/0"):
        assert _accepted_or_problems(1, split=good) == []


def test_validation_creates_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = build_job_config(
        {
            **MOCK,
            "tensor_model_parallel_size": 3,
            "save": str(tmp_path / "ckpt"),
            "save_interval": 5,
            "tensorboard_dir": str(tmp_path / "tb"),
        }
    )
    with pytest.raises(ConfigError):
        validate(cfg, 4)
    assert os.listdir(tmp_path) == []
    import torch.distributed as dist

    assert not dist.is_initialized()


def test_unknown_keys_are_errors(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("tensor-model-parallel-size: 2\nno-such-flag: 1\n")
    with pytest.raises(ConfigError, match="unknown key 'no_such_flag'"):
        load_config_file(str(path))
    with pytest.raises(ConfigError, match="unknown setting"):
        build_job_config({"tensor_model_parallel_sizee": 2})


@pytest.mark.parametrize("value", ["direct", "megatron"])
def test_removed_ckpt_reader_is_one_error_naming_the_replacement(tmp_path, value):
    path = tmp_path / "old.yaml"
    path.write_text(f"ckpt-reader: {value}\n")
    for argv in (["--ckpt-reader", value], ["--config", str(path)]):
        with pytest.raises(ConfigError) as err:
            parse_args(argv)
        (problem,) = err.value.problems
        assert "--ckpt-reader was removed" in problem and "megatron-core's torch_dist reader" in problem, problem
        assert "--ckpt-verify" in problem and "unknown" not in problem


def test_flags_override_config_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('tensor-model-parallel-size = 2\nlr = 0.5\ndata-path = "a b"\nmock-data = false\n')
    cfg = parse_args(["--config", str(path), "--lr", "0.25", "--use-distributed-optimizer"])
    assert cfg.parallel.tensor_model_parallel_size == 2
    assert cfg.training.lr == 0.25
    assert cfg.parallel.use_distributed_optimizer is True
    assert cfg.data.data_path == ["a", "b"]


def test_padded_vocab_does_not_depend_on_tp():
    """Megatron-LM pads to divisible-by x TP (513 ids: 640 at TP1, 768 at TP2); ours to divisible-by."""
    for tp in (1, 2, 4):
        cfg = build_job_config({"tensor_model_parallel_size": tp, "make_vocab_size_divisible_by": 128})
        assert get_padded_vocab_size(513, cfg) == 640 and get_padded_vocab_size(8193, cfg) == 8320
    problems = _problems(3, tensor_model_parallel_size=3, num_attention_heads=3, hidden_size=96)
    assert any(
        "--make-vocab-size-divisible-by 128 is not divisible by --tensor-model-parallel-size 3" in p for p in problems
    ), problems


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "*.*"))))
def test_every_shipped_config_parses_and_validates(path, monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg = parse_args(["--config", path])
    assert cfg.model.num_layers > 0 and (cfg.data.data_path or cfg.data.mock_data), path
    world = get_replica_size(cfg) * 2
    validate(cfg, int(os.environ.get("CONFIG_TEST_WORLD", world)), cuda=False)


# ----------------------------------------------------------------------------- typed config files


@pytest.mark.parametrize(
    "text, needle",
    [
        ('mock-data: "false"\n', "key 'mock-data' = 'false' should be a boolean"),
        ('use-distributed-optimizer: "no"\n', "key 'use-distributed-optimizer' = 'no' should be a boolean"),
        ('lr: "abc"\n', "key 'lr' = 'abc' should be a number"),
        ('hidden-size: "64"\n', "key 'hidden-size' = '64' should be an integer"),
        ("hidden-size: 64.0\n", "key 'hidden-size' = 64.0 should be an integer"),
        ("num-layers: true\n", "key 'num-layers' = True should be an integer"),
        ("normalization: layernorm\n", "should be one of LayerNorm, RMSNorm"),
        ("data-path: {a: 1}\n", None),  # a nested mapping is a section: its key is unknown
    ],
)
def test_config_file_values_are_type_checked_naming_file_and_key(tmp_path, text, needle):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config_file(str(path))
    assert str(path) in str(err.value)
    if needle:
        assert needle in str(err.value), str(err.value)


def test_config_file_type_problems_are_reported_together(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text('mock-data: "false"\nlr: "abc"\nhidden-size: "64"\nno-such: 1\n')
    with pytest.raises(ConfigError) as err:
        load_config_file(str(path))
    assert len(err.value.problems) == 4


def test_config_file_values_of_the_right_type_load(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("lr: 1\nmock-data: false\ndata-path: [0.3, a, 0.7, b]\nglobal-batch-size: null\n")
    values = load_config_file(str(path))
    assert values["lr"] == 1.0 and isinstance(values["lr"], float) and values["mock_data"] is False
    assert values["data_path"] == ["0.3", "a", "0.7", "b"] and values["global_batch_size"] is None


@pytest.mark.parametrize("suffix, text", [(".yaml", "a: [1, 2\nb: 3\n"), (".toml", "a = [1, 2\n")])
def test_config_syntax_errors_name_the_file(tmp_path, suffix, text):
    path = tmp_path / f"broken{suffix}"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"--config {path}: not valid {suffix[1:].upper()}"):
        load_config_file(str(path))


def test_bad_flag_value_is_one_config_error_not_a_usage_dump():
    with pytest.raises(ConfigError, match="argument --hidden-size: 'abc' is not a whole number: give a whole number"):
        parse_args(["--hidden-size", "abc"])


def test_help_lists_every_flag_with_its_text(capsys):
    # argparse %-formats help text: one literal "%" in a flag's help made --help a TypeError
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "+42-48% of load time" in text  # --ckpt-verify's help, percent sign and all
    for flag in ("--tensor-model-parallel-size", "--packed-sequences", "--bf16", "--fp8-format"):
        assert flag in text, flag


@pytest.mark.parametrize(
    "values, needle",
    [
        (dict(global_batch_size=0), "--global-batch-size must be a positive integer when given, got 0"),
        (dict(global_batch_size=-8), "--global-batch-size must be a positive integer when given, got -8"),
        (dict(ffn_hidden_size=0), "--ffn-hidden-size must be a positive integer when given, got 0"),
        (dict(num_attention_heads=0), "--num-attention-heads must be a positive integer, got 0"),
        (dict(seq_length=-1), "--seq-length must be a positive integer, got -1"),
        (dict(lr=-1.0, min_lr=-2.0), "--lr must be a number >= 0, got -1.0"),
        (dict(weight_decay=-0.1), "--weight-decay must be a number >= 0"),
        (dict(adam_beta2=1.0), "--adam-beta2 must be in [0, 1)"),
        # torch: "DistStoreError: wait timeout after 0ms" creating megatron-core's process groups
        (dict(distributed_timeout_minutes=0), "--distributed-timeout-minutes must be a positive integer, got 0"),
        # NaN RoPE frequencies: a NaN loss from the first step, naming no flag
        (dict(position_embedding_type="rope", rotary_base=0), "--rotary-base must be a positive integer, got 0"),
        (dict(position_embedding_type="rope", rotary_base=-10), "--rotary-base must be a positive integer, got -10"),
    ],
)
def test_sizes_and_rates_are_checked_with_the_other_problems(values, needle):
    problems = _problems(1, **values)
    assert any(needle in p for p in problems), problems


def test_zero_learning_rate_is_legitimate():
    from megatron_ext.validation import _check_positive

    cfg = build_job_config({**MOCK, "lr": 0.0, "min_lr": 0.0})
    assert _check_positive(cfg) == []
    validate(cfg, 1)  # raises ConfigError if refused


@pytest.mark.parametrize(
    "values, needle",
    [
        (dict(recompute_granularity="full"), "needs --recompute-method uniform|block and --recompute-num-layers N"),
        (
            dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=9),
            "--recompute-num-layers 9 must be between 1 and the 4 layers",
        ),
        (
            dict(recompute_method="uniform"),
            "--recompute-method and --recompute-num-layers need --recompute-granularity full",
        ),
        (dict(recompute_modules=["core_attn"]), "--recompute-modules needs --recompute-granularity selective"),
        (
            dict(recompute_granularity="selective", recompute_modules=["moe"]),
            "a dense model recomputes core_attn, layernorm, mlp",
        ),
        (
            dict(recompute_granularity="selective", recompute_modules=["mlp"]),
            "--recompute-modules mlp needs --disable-bias-linear",
        ),
        (
            dict(
                recompute_activations=True,
                recompute_granularity="full",
                recompute_method="block",
                recompute_num_layers=1,
            ),
            "--recompute-activations is selective recompute",
        ),
    ],
)
def test_recompute_flags_are_checked(values, needle):
    assert any(needle in p for p in _problems(1, **values)), _problems(1, **values)


ROPE = dict(position_embedding_type="rope")


@pytest.mark.parametrize(
    "values, needle",
    [
        # megatron-core: a shape error mid-forward (15 dimensions against 16 rotated)
        (
            dict(hidden_size=60, num_attention_heads=4),
            "the head dimension (--hidden-size 60 / --num-attention-heads 4) is 15, odd",
        ),
        # above 1 megatron-core silently rotates the whole head; 0 rotates nothing
        (dict(rotary_percent=1.5), "--rotary-percent must be in (0, 1]"),
        (dict(rotary_percent=0.0), "--rotary-percent must be in (0, 1]"),
    ],
)
def test_rope_shapes_are_checked(values, needle):
    problems = _problems(1, **ROPE, **values)
    assert any(needle in p for p in problems), problems


@pytest.mark.parametrize(
    "values",
    [
        dict(hidden_size=64, num_attention_heads=4, rotary_percent=0.5),
        dict(hidden_size=60, num_attention_heads=4, rotary_percent=0.5),
        dict(hidden_size=60, num_attention_heads=4, position_embedding_type="learned_absolute"),
    ],
)
def test_rope_shapes_that_work_pass(values):
    assert _accepted_or_problems(1, **{**ROPE, **values}) == []


def test_swiglu_default_ffn_must_split_over_tp():
    # megatron-core: "512 is not divisible by 3" (AssertionError) while building ColumnParallelLinear
    values = dict(
        tensor_model_parallel_size=3,
        hidden_size=96,
        num_attention_heads=6,
        swiglu=True,
        make_vocab_size_divisible_by=96,
    )
    problems = _problems(3, **values)
    assert any(
        "the default --ffn-hidden-size (2/3 of 4 x hidden, rounded down to a multiple of 64, as Megatron-LM) "
        "is 256, not divisible by --tensor-model-parallel-size 3: give --ffn-hidden-size" in p
        for p in problems
    ), problems
    validate(build_job_config({**MOCK, **values, "ffn_hidden_size": 258}), 3)


@pytest.mark.parametrize(
    "values, needle",
    [
        # each an AssertionError without a message from megatron-core's grad scalers
        (dict(loss_scale=-1.0), "--loss-scale must be > 0, got -1.0 (leave it out for dynamic loss scaling)"),
        (dict(loss_scale=0.0), "--loss-scale must be > 0, got 0.0"),  # megatron-core: silently dynamic
        (dict(initial_loss_scale=0.0), "--initial-loss-scale must be > 0, got 0.0"),
        (dict(min_loss_scale=0.0), "--min-loss-scale must be > 0, got 0.0"),
        (
            dict(min_loss_scale=8.0, initial_loss_scale=4.0),
            "--min-loss-scale 8.0 is larger than --initial-loss-scale 4.0",
        ),
        (dict(loss_scale_window=0), "--loss-scale-window must be a positive integer, got 0"),
        (dict(hysteresis=0), "--hysteresis must be a positive integer, got 0"),
    ],
)
def test_fp16_loss_scaling_flags_are_checked(values, needle):
    problems = _problems(1, fp16=True, **values)
    assert any(needle in p for p in problems), problems


def test_loss_scaling_flags_outside_their_use_pass():
    assert _accepted_or_problems(1, fp16=True, loss_scale=128.0, hysteresis=0) == []  # static: unused
    assert _accepted_or_problems(1, bf16=True, loss_scale=-1.0) == []  # ignored with a notice


UNIFORM = dict(recompute_granularity="full", recompute_method="uniform")


@pytest.mark.parametrize(
    "world, values, needle",
    [
        # megatron-core indexes past the chunk's last layer (IndexError mid-forward) without these
        (
            1,
            dict(num_layers=4, recompute_num_layers=3),
            "--recompute-method uniform: --recompute-num-layers 3 must divide the layers of every model chunk",
        ),
        (
            2,
            dict(
                num_layers=8,
                pipeline_model_parallel_size=2,
                num_layers_per_virtual_pipeline_stage=2,
                recompute_num_layers=4,
            ),
            "use a divisor of 2, or --recompute-method block",
        ),
        (
            2,
            dict(
                num_layers=5,
                pipeline_model_parallel_size=2,
                decoder_first_pipeline_num_layers=1,
                recompute_num_layers=2,
            ),
            "which hold 1, 4 layers here",
        ),
        (
            4,
            dict(
                num_layers=7,
                pipeline_model_parallel_size=4,
                account_for_embedding_in_pipeline_split=True,
                recompute_num_layers=2,
            ),
            "which hold 1, 2 layers here",
        ),
    ],
)
def test_uniform_recompute_groups_must_divide_each_chunk(world, values, needle):
    problems = _problems(world, global_batch_size=8, **UNIFORM, **values)
    assert any(needle in p for p in problems), problems


@pytest.mark.parametrize(
    "world, values",
    [
        (1, dict(num_layers=4, recompute_num_layers=2)),
        (
            2,
            dict(
                num_layers=8,
                pipeline_model_parallel_size=2,
                num_layers_per_virtual_pipeline_stage=2,
                recompute_num_layers=2,
            ),
        ),
        (
            4,
            dict(
                num_layers=7,
                pipeline_model_parallel_size=4,
                account_for_embedding_in_pipeline_split=True,
                recompute_num_layers=1,
            ),
        ),
    ],
)
def test_uniform_recompute_groups_that_divide_each_chunk_pass(world, values):
    assert _accepted_or_problems(world, global_batch_size=8, **UNIFORM, **values) == []


def test_recompute_activations_is_selective_core_attention():
    from megatron_ext.derived import get_recompute

    assert get_recompute(build_job_config({**MOCK, "recompute_activations": True})) == {
        "recompute_granularity": "selective",
        "recompute_modules": ["core_attn"],
    }
    assert get_recompute(build_job_config(MOCK)) == {}


@pytest.mark.parametrize(
    "values, needle",
    [
        (dict(use_torch_fsdp2=True), "--use-torch-fsdp2: FSDP is not supported"),
        (dict(use_custom_fsdp=True), "--use-custom-fsdp: FSDP is not supported"),
        (dict(optimizer_cpu_offload=True), "--optimizer-cpu-offload is not supported"),
    ],
)
def test_out_of_scope_scale_features_are_refused_by_name(values, needle):
    assert any(needle in p for p in _problems(1, **values))


def test_context_parallelism_is_accepted_by_validation():
    """CP is wired into training (issue 42): a valid CP job validates, on the CPU in fp32 and on CUDA in
    bf16; fp32 on CUDA is refused naming --bf16 (the CUDA path is flash varlen)."""
    cp = dict(context_parallel_size=2, pipeline_model_parallel_size=2, num_layers=4, seq_length=256)
    assert _accepted_or_problems(4, **cp) == []
    validate(build_job_config({**MOCK, **cp, "bf16": True}), 4, cuda=True)
    with pytest.raises(ConfigError) as err:
        validate(build_job_config({**MOCK, **cp}), 4, cuda=True)
    assert any("--context-parallel-size 2 on CUDA needs --bf16" in p for p in err.value.problems)


@pytest.mark.parametrize(
    "world, values, needle",
    [
        (
            2,
            dict(
                pipeline_model_parallel_size=2,
                num_layers=4,
                decoder_first_pipeline_num_layers=1,
                num_layers_per_virtual_pipeline_stage=1,
            ),
            "not --num-layers-per-virtual-pipeline-stage",
        ),
        (
            2,
            dict(
                pipeline_model_parallel_size=2,
                num_layers=6,
                num_virtual_stages_per_pipeline_rank=2,
                decoder_first_pipeline_num_layers=2,
                decoder_last_pipeline_num_layers=4,
            ),
            "need a middle pipeline stage",
        ),
        (
            4,
            dict(pipeline_model_parallel_size=4, num_layers=6, decoder_first_pipeline_num_layers=2),
            "leaves 4 for 3 middle stages",
        ),
        (
            4,
            dict(pipeline_model_parallel_size=4, num_layers=5, account_for_embedding_in_pipeline_split=True),
            "= 6 is not divisible by --pipeline-model-parallel-size 4",
        ),
        (
            2,
            dict(
                pipeline_model_parallel_size=2,
                num_layers=4,
                decoder_first_pipeline_num_layers=1,
                account_for_loss_in_pipeline_split=True,
            ),
            "are exclusive",
        ),
        (
            2,
            dict(pipeline_model_parallel_size=2, num_layers=4, pipeline_model_parallel_layout="Et|tL"),
            "--pipeline-model-parallel-layout is not supported",
        ),
    ],
)
def test_uneven_pipeline_splits_are_checked(world, values, needle):
    assert any(needle in p for p in _problems(world, global_batch_size=8, **values)), _problems(
        world, global_batch_size=8, **values
    )


@pytest.mark.parametrize(
    "values, needle",
    [
        (dict(profile=True), "--profile without --use-pytorch-profiler marks CUDA profiler ranges"),
        (dict(profile=True, use_pytorch_profiler=True), "writes its traces into --tensorboard-dir"),
        (
            dict(
                profile=True, use_pytorch_profiler=True, tensorboard_dir="tb", profile_step_start=5, profile_step_end=5
            ),
            "--profile-step-start 5 must be >= 0 and below --profile-step-end 5",
        ),
        (dict(use_pytorch_profiler=True), "--use-pytorch-profiler needs --profile"),
        (dict(log_timers_to_tensorboard=True), "needs --timing-log-level 1 or 2"),
        (dict(manual_gc_interval=5), "--manual-gc-interval 5 needs --manual-gc"),
    ],
)
def test_profiling_flags_are_checked(values, needle):
    assert any(needle in p for p in _problems(1, **values)), _problems(1, **values)


@pytest.mark.parametrize(
    "values, needle",
    [
        (
            dict(overlap_param_gather=True),
            "--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce",
        ),
        (
            dict(overlap_param_gather=True, overlap_grad_reduce=True),
            "--overlap-param-gather needs --use-distributed-optimizer",
        ),
        (dict(ddp_bucket_size=1000), "--ddp-bucket-size 1000 has no effect without --overlap-grad-reduce"),
        (dict(ddp_bucket_size=0, overlap_grad_reduce=True), "--ddp-bucket-size 0 must be a positive number"),
        # megatron-core: an AssertionError traceback from DistributedOptimizer after the model is built
        (dict(optimizer="sgd", use_distributed_optimizer=True), "--optimizer sgd with --use-distributed-optimizer"),
    ],
)
def test_overlap_flags_are_checked(values, needle):
    assert any(needle in p for p in _problems(1, **values)), _problems(1, **values)


def test_overlap_flags_parse_with_megatron_names():
    cfg = parse_args(
        [
            "--overlap-grad-reduce",
            "--overlap-param-gather",
            "--use-distributed-optimizer",
            "--no-align-param-gather",
            "--ddp-bucket-size",
            "4000",
            "--mock-data",
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            "128",
        ]
    )
    p = cfg.parallel
    assert (p.overlap_grad_reduce, p.overlap_param_gather, p.align_param_gather, p.ddp_bucket_size) == (
        True,
        True,
        False,
        4000,
    )
    validate(cfg, 2)


def _rank_reports(message: str, results) -> None:
    from megatron_ext.error_report import report_error_once

    results.put(report_error_once(message))


def _launch_two_ranks(message: str, results) -> None:
    """A stand-in for torchrun's agent: two workers, its children, on one host, with the run id
    every plain torchrun launch has."""
    import multiprocessing as mp

    os.environ.update(
        TORCHELASTIC_RUN_ID="none", LOCAL_WORLD_SIZE="2", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500"
    )
    ctx = mp.get_context("fork")
    workers = [ctx.Process(target=_rank_reports, args=(message, results)) for _ in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()


def test_a_config_error_is_printed_once_per_launch_and_on_every_launch():
    # the marker that keeps 8 ranks from printing one error 8 times was keyed by torchrun's run id
    # ("none" for every plain launch): the same bad command run again printed nothing at all
    import multiprocessing as mp
    import uuid

    ctx = mp.get_context("fork")
    message = f"--global-batch-size 998 is not divisible ... {uuid.uuid4().hex}"
    for launch in range(2):
        results = ctx.Queue()
        agent = ctx.Process(target=_launch_two_ranks, args=(message, results))
        agent.start()
        agent.join()
        printed = sorted(results.get(timeout=10) for _ in range(2))
        assert printed == [False, True], f"launch {launch}: {printed}"


def _rank_reports_under_torchrun(message: str, error_file: str, results) -> None:
    os.environ.update(
        TORCHELASTIC_RUN_ID="none", LOCAL_WORLD_SIZE="2", WORLD_SIZE="2", TORCHELASTIC_ERROR_FILE=error_file
    )
    _rank_reports(message, results)


def _launch_two_ranks_in_turn(message: str, error_files: list[str], results) -> None:
    """torchrun's agent with local rank 1 reporting before local rank 0, within one second."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    for local_rank in (1, 0):
        w = ctx.Process(target=_rank_reports_under_torchrun, args=(message, error_files[local_rank], results))
        w.start()
        w.join()


def test_torchruns_summary_names_the_printed_error_as_its_root_cause(tmp_path):
    # torchrun's failure summary showed "To enable traceback see ..." as the root cause of a
    # configuration error; each rank now writes its error file, and the rank that printed is the root
    # cause even when a lower local rank (torchrun's tie-break) failed in the same second
    import multiprocessing as mp
    import uuid

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    ctx = mp.get_context("fork")
    message = f"invalid configuration:\n  - --global-batch-size 3 ... {uuid.uuid4().hex}"
    files = [str(tmp_path / f"error{r}.json") for r in range(2)]
    results = ctx.Queue()
    agent = ctx.Process(target=_launch_two_ranks_in_turn, args=(message, files, results))
    agent.start()
    agent.join()
    assert [results.get(timeout=10) for _ in range(2)] == [True, False]  # local rank 1 printed
    failures = {r: ProcessFailure(local_rank=r, pid=100 + r, exitcode=2, error_file=files[r]) for r in range(2)}
    summary = ChildFailedError("pretrain_gpt.py", failures)
    assert summary.get_first_failure()[0] == 1
    text = str(summary)
    root = text.split("Root Cause (first observed failure):")[1]
    assert f"  traceback : error: invalid configuration:\n    - --global-batch-size 3 ... {message[-32:]}" in root, text
    assert "traceback : (the same error: as the root cause below, printed once above)" in text.split("Root Cause")[0]


def test_tp_splits_of_heads_groups_and_mlp_say_what_to_change():
    # "--num-query-groups 2 is not divisible by --tensor-model-parallel-size 4" stopped there
    cfg = build_job_config(
        {**MOCK, "tensor_model_parallel_size": 4, "hidden_size": 96, "num_attention_heads": 12}
        | {"group_query_attention": True, "num_query_groups": 2, "ffn_hidden_size": 102}
    )
    with pytest.raises(ConfigError) as err:
        validate(cfg, 4)
    text = "\n".join(err.value.problems)
    assert "--num-query-groups 2 is not divisible by --tensor-model-parallel-size 4: each TP rank" in text, text
    assert "--ffn-hidden-size 102 is not divisible by --tensor-model-parallel-size 4: use a multiple of 4" in text
    cfg = build_job_config({**MOCK, "hidden_size": 96, "num_attention_heads": 12} | {"group_query_attention": True})
    cfg.model.num_query_groups = 5
    with pytest.raises(ConfigError, match="divisible by --num-query-groups 5: use a number of key/value groups"):
        validate(cfg, 1)


def test_eval_iters_without_eval_interval_says_no_validation_runs():
    # Megatron-LM validates every 1000 steps by default; here --eval-interval defaults to 0, so a
    # script giving only --eval-iters silently ran no validation at all
    from megatron_ext.arguments import parse_args_with_notes

    _, notes = parse_args_with_notes(["--eval-iters", "10"])
    assert any(n.startswith("--eval-iters 10: no validation runs, --eval-interval is 0") for n in notes), notes
    for argv in (["--eval-iters", "10", "--eval-interval", "5"], [], ["--eval-iters", "0"]):
        _, notes = parse_args_with_notes(argv)
        assert not any("no validation runs" in n for n in notes), (argv, notes)


def test_settings_megatron_lm_adjusts_are_adjusted_with_a_notice():
    from megatron_ext.arguments import parse_args_with_notes

    cfg, notes = parse_args_with_notes(
        ["--sequence-parallel", "--eval-interval", "2", "--eval-iters", "0", "--loss-scale", "128", "--bf16"]
    )
    assert cfg.parallel.sequence_parallel is False and cfg.training.eval_interval == 0
    text = "\n".join(notes)
    assert "--sequence-parallel is off" in text and "--eval-iters 0: no validation" in text, text
    assert "--loss-scale: loss scaling is for --fp16 only; ignored in bf16" in text, text
    cfg, notes = parse_args_with_notes(
        [
            "--sequence-parallel",
            "--tensor-model-parallel-size",
            "2",
            "--fp16",
            "--loss-scale",
            "128",
            "--eval-interval",
            "2",
        ]
    )
    assert cfg.parallel.sequence_parallel and cfg.training.eval_interval == 2 and notes == []
    _, notes = parse_args_with_notes(["--train-data-path", "a", "--valid-data-path", "b", "--split", "90,10,0"])
    assert notes == [
        "--split 90,10,0: ignored, --train-data-path gives each split its own data (read whole; "
        "Megatron-LM ignores --split there too)"
    ], notes
    _, notes = parse_args_with_notes(["--data-path", "a", "--split", "90,10,0"])
    assert notes == [], notes
    _, notes = parse_args_with_notes(["--exit-interval", "5"])  # Megatron-LM exits, saving only with --save
    assert notes == ["--exit-interval without --save: the run stops there without saving a checkpoint"], notes


def test_query_groups_without_group_query_attention_get_a_notice():
    from megatron_ext.arguments import parse_args_with_notes

    # Megatron-LM builds plain multi-head attention then: say so rather than train it silently
    cfg, notes = parse_args_with_notes(["--num-query-groups", "2"])
    assert cfg.model.group_query_attention is False
    assert notes == [
        "--num-query-groups 2: ignored without --group-query-attention, every attention head keeps "
        "its own key/value head (as in Megatron-LM); add --group-query-attention for grouped-query "
        "attention"
    ], notes
    _, notes = parse_args_with_notes(["--num-query-groups", "2", "--group-query-attention"])
    assert notes == [], notes


@pytest.mark.parametrize("seed", [-1, 2**32])
def test_seed_outside_numpys_range_is_refused_up_front(seed):
    assert any("--seed must be in [0, 2**32 - 1]" in p for p in _problems(1, seed=seed))


def test_typos_get_the_nearest_flag_or_key(tmp_path):
    with pytest.raises(ConfigError) as err:
        parse_args(["--num-layer", "3"])
    assert "(did you mean --num-layers?)" in err.value.problems[0], err.value.problems
    assert err.value.problems[0].startswith(
        "unrecognized arguments: --num-layer (did you mean --num-layers?) 3 (python"
    ), err.value.problems
    path = tmp_path / "c.yaml"
    path.write_text("seq_lenght: 128\nlr: 1e-3\nuse-mcore-models: true\n")
    with pytest.raises(ConfigError) as err:
        load_config_file(str(path))
    text = "\n".join(err.value.problems)
    assert "unknown key 'seq_lenght' (did you mean 'seq-length'?)" in text, text
    assert "(YAML reads 1e-3 as a string: write it with a dot, e.g. 1.0e-3)" in text, text
    assert "--use-mcore-models is a Megatron-LM flag: give it on the command line" in text, text


@pytest.mark.parametrize(
    "values, needle",
    [
        (dict(exit_duration_in_mins=-1.0, save="/tmp/x"), "--exit-duration-in-mins must be > 0, got -1.0"),
        (
            dict(num_virtual_stages_per_pipeline_rank=2),
            "drop --num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank",
        ),
        (dict(bf16=True, fp16=True), "--no-bf16 turns off a --bf16 from --config"),
    ],
)
def test_more_flag_problems_name_the_fix(values, needle):
    problems = _problems(1, **values)
    assert any(needle in p for p in problems), problems


def test_a_negative_clip_grad_is_one_problem():
    assert sum("--clip-grad" in p for p in _problems(1, clip_grad=-1.0)) == 1


def test_mock_data_without_a_tokenizer_file_points_at_the_null_tokenizer():
    cfg = build_job_config(dict(mock_data=True))
    with pytest.raises(ConfigError) as err:
        validate(cfg, 1)
    assert any("--tokenizer-type NullTokenizer --vocab-size N needs no file" in p for p in err.value.problems)


def _data_path_problems(tmp_path, written: str, data_path: str) -> list[str]:
    """Problems of --data-path ``data_path`` where an empty ``written``.bin/.idx pair exists."""
    for ext in (".bin", ".idx"):
        (tmp_path / f"{written}{ext}").write_bytes(b"")
    cfg = build_job_config(dict(data_path=[str(tmp_path / data_path)], tokenizer_type="NullTokenizer", vocab_size=10))
    with pytest.raises(ConfigError) as err:
        validate(cfg, 1)
    return err.value.problems


def test_a_data_path_with_its_extension_is_told_to_drop_it(tmp_path):
    problems = _data_path_problems(tmp_path, "corpus", "corpus.bin")
    assert any(f"give the prefix without the extension: {tmp_path / 'corpus'}" in p for p in problems), problems


def test_a_data_path_missing_its_json_key_suffix_names_what_preprocess_wrote(tmp_path):
    # preprocess_data.py --output-prefix my writes my_text_document.bin/.idx, not my.bin/.idx
    problems = _data_path_problems(tmp_path, "my_text_document", "my")
    assert any(f"wrote {tmp_path / 'my_text_document'}: give that prefix" in p for p in problems), problems


def test_a_data_path_naming_a_directory_names_the_prefixes_in_it(tmp_path):
    # it said only "missing DIR.bin, DIR.idx"; a user who gave the data's directory learns the prefix form
    (tmp_path / "data").mkdir()
    problems = _data_path_problems(tmp_path / "data", "my_text_document", "")
    data = str(tmp_path / "data")
    assert any(
        f"({data} is a directory: give the prefix of a .bin/.idx pair in it: {data}/my_text_document)" in p
        for p in problems
    ), problems


def test_one_virtual_stage_per_rank_is_no_interleaving():
    # configs/default.yaml's --num-layers-per-virtual-pipeline-stage 1 at PP4 with its 4 layers: VPP 1
    # is plain 1F1B (megatron-core, told VPP = 1, asserted in every layer: "vp_stage must be provided")
    cfg = build_job_config(
        {
            **MOCK,
            "num_layers": 4,
            "pipeline_model_parallel_size": 4,
            "num_layers_per_virtual_pipeline_stage": 1,
            "global_batch_size": 8,
        }
    )
    validate(cfg, 4)
    assert get_virtual_pipeline_size(cfg) is None
    cfg = build_job_config(
        {
            **MOCK,
            "num_layers": 4,
            "pipeline_model_parallel_size": 2,
            "num_virtual_stages_per_pipeline_rank": 1,
            "global_batch_size": 8,
        }
    )
    assert get_virtual_pipeline_size(cfg) is None


def test_chunk_layer_counts_equal_megatron_cores_split():
    """get_chunk_layer_counts (which the uniform-recompute rule reads) splits every layout that
    validation accepts as megatron-core's get_num_layers_to_build does."""
    import itertools
    import types

    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    from megatron_ext.derived import get_chunk_layer_counts

    compared = 0
    for layers, pp, vps, first, last, emb, loss in itertools.product(
        range(1, 9), [2, 3, 4], [None, 2], [None, 1, 2], [None, 1, 4], [False, True], [False, True]
    ):
        values = dict(
            num_layers=layers,
            pipeline_model_parallel_size=pp,
            num_virtual_stages_per_pipeline_rank=vps,
            decoder_first_pipeline_num_layers=first,
            decoder_last_pipeline_num_layers=last,
            account_for_embedding_in_pipeline_split=emb,
            account_for_loss_in_pipeline_split=loss,
            global_batch_size=12,
        )
        cfg = build_job_config({**MOCK, **values})
        try:
            validate(cfg, pp)
        except ConfigError:
            continue
        vp = get_virtual_pipeline_size(cfg)
        tf = types.SimpleNamespace(
            pipeline_model_parallel_layout=None,
            num_layers_in_first_pipeline_stage=first,
            num_layers_in_last_pipeline_stage=last,
            account_for_embedding_in_pipeline_split=emb,
            account_for_loss_in_pipeline_split=loss,
            num_layers=layers,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vp,
        )
        theirs = [
            get_num_layers_to_build(tf, vp_stage=s if vp else None, pp_rank=r)
            for r in range(pp)
            for s in range(vp or 1)
        ]
        assert get_chunk_layer_counts(cfg) == theirs, values
        compared += 1
    assert compared > 80


# ----------------------------------------------------------------------------- --keep-last


def test_a_negative_keep_last_is_one_error_naming_the_flag():
    # -1 silently kept every checkpoint (--step-timeout-minutes' limits: test_heartbeat.py)
    cfg = parse_args(["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--keep-last", "-1"])
    with pytest.raises(ConfigError) as err:
        validate(cfg, 1)
    assert err.value.problems == [
        "--keep-last must be a number of checkpoints > 0, or 0 to keep every checkpoint; got -1"
    ], err.value.problems


def test_keep_last_zero_keeps_every_checkpoint():
    from megatron_ext.checkpoint.directory import select_checkpoints_to_delete

    cfg = parse_args(["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--keep-last", "0"])
    validate(cfg, 1)
    assert select_checkpoints_to_delete([2, 4, 6], cfg.checkpoint.keep_last) == []


# ----------------------------------------------------------------------------- each setting once


@pytest.mark.parametrize(
    "suffix, text, needle",
    [
        # PyYAML's safe_load kept the last value silently
        (".yaml", "lr: 0.1\nhidden-size: 64\nlr: 0.2\n", "key 'lr' is given twice (lines 1 and 3)"),
        (
            ".yaml",
            "training:\n  lr: 0.1\nmodel:\n  lr: 0.2\n",
            "key 'lr' is given twice ('lr' in section 'training' and 'lr' in section 'model')",
        ),
        (
            ".yaml",
            "keep-last: 1\ncheckpoint:\n  keep_last: 2\n",
            "key 'keep-last' is given twice ('keep-last' and 'keep_last' in section 'checkpoint')",
        ),
        (".yaml", "keep-last: 1\nkeep_last: 2\n", "key 'keep-last' is given twice ('keep-last' and 'keep_last')"),
        (
            ".toml",
            "[training]\nlr = 0.1\n[model]\nlr = 0.2\n",
            "key 'lr' is given twice ('lr' in section 'training' and 'lr' in section 'model')",
        ),
        # TOML refuses a key twice in one table itself; its message names the line only: it is quoted
        (".toml", "lr = 0.1\nlr = 0.2\n", "not valid TOML: Cannot overwrite a value (at line 2, column 9): `lr = 0.2`"),
    ],
)
def test_a_setting_given_twice_in_a_config_file_is_an_error_naming_key_and_file(tmp_path, suffix, text, needle):
    path = tmp_path / f"c{suffix}"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config_file(str(path))
    (problem,) = err.value.problems
    assert problem.startswith(f"--config {path}: ") and needle in problem, problem


def test_yaml_merge_keys_may_still_be_overridden(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("training:\n  <<: {lr: 0.1, hidden-size: 64}\n  lr: 0.2\n")
    assert load_config_file(str(path))["lr"] == 0.2
