"""Start-up checks that turn silent or late failures into one named error before any work:
--load that holds no checkpoint, an unwritable --save, changed LR-schedule flags on resume, a
truncated or mismatched .bin/.idx pair, a split without documents, token ids outside the
vocabulary, a tokenizer model that does not load (no process group anywhere)."""

from __future__ import annotations

import os
import shutil
import types

import numpy as np
import pytest

from megatron_ext.checkpoint.compatibility import check_scheduler_flags
from megatron_ext.checkpoint.directory import COMPLETE_MARKER, TRACKER_FILE, probe_save_dir, resolve_load_path
from megatron_ext.checkpoint.state import check_load_flags, plan_load
from megatron_ext.config import ConfigError, build_job_config
from megatron_ext.data.indexed_check import check_indexed_dataset

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SHIPPED = os.path.join(REPO, "data", "default", "corpus_text_document")
MODEL = os.path.join(REPO, "data", "default", "tokenizer.model")


def _checkpoint(root, iteration: int) -> str:
    path = os.path.join(str(root), f"iter_{iteration:07d}")
    os.makedirs(path)
    open(os.path.join(path, COMPLETE_MARKER), "w").write("{}")
    return path


def _cfg(**checkpoint):
    return build_job_config({"mock_data": True, "tokenizer_type": "NullTokenizer", "vocab_size": 64, **checkpoint})


# ----------------------------------------------------------------------------- --load


def test_load_of_a_missing_or_empty_directory_is_an_error_naming_load(tmp_path):
    with pytest.raises(ConfigError, match=r"--load .*/nope does not exist"):
        check_load_flags(_cfg(load=str(tmp_path / "nope")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"--load .*/empty holds no complete checkpoint"):
        check_load_flags(_cfg(load=str(tmp_path / "empty")))


def _megatron_lm_save(root) -> None:
    """A directory as Megatron-LM's --save leaves it: iter_XXXXXXX without our complete.json, its tracker."""
    (root / "iter_0000100" / "mp_rank_00").mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text("100")


def test_a_legacy_megatron_lm_checkpoint_is_refused_whatever_save_is(tmp_path):
    # issue 43: with --load = --save (Megatron-LM's example scripts) the run warned once, trained from
    # scratch beside the user's checkpoints and pointed their tracker at its own iteration
    root = tmp_path / "mlm"
    _megatron_lm_save(root)
    for save in (None, str(root), str(tmp_path / "other")):
        with pytest.raises(ConfigError) as err:
            check_load_flags(_cfg(load=str(root), **({"save": save} if save else {})))
        (problem,) = err.value.problems
        assert problem.startswith(f"--load {root}: iter_0000100 is a legacy --ckpt-format torch checkpoint"), problem
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "100"


def test_a_save_holding_megatron_lm_checkpoints_is_refused_unless_the_run_continues_from_them(tmp_path):
    # a run that only saves there would train over them
    root = tmp_path / "mlm"
    _megatron_lm_save(root)
    (root / "release").mkdir()
    for load in (None, str(tmp_path / "other")):
        with pytest.raises(ConfigError) as err:
            check_load_flags(_cfg(save=str(root), **({"load": load} if load else {})))
        (problem,) = err.value.problems
        assert problem.startswith(f"--save {root} holds Megatron-LM checkpoints (iter_0000100, release)"), problem
        assert f"add --load {root} to continue from them" in problem


def test_a_megatron_lm_checkpoint_is_planned_with_its_padded_vocabulary(tmp_path):
    # Megatron-LM padded 300 ids to 512 rows at TP2; this run's own padding would give 384
    root = tmp_path / "mlm"
    shutil.copytree(os.path.join(REPO, "tests", "data", "megatron_lm", "tp2pp2_dp_reshardable"), root)
    plan, line = plan_load(_cfg(load=str(root), save=str(root)))
    assert plan.padded_vocab == (512, "megatron-lm") and plan.path == str(root) and not plan.weights_only
    assert line.startswith(f"> --save {root} holds Megatron-LM checkpoints: ours are saved beside them"), line
    assert "latest_checkpointed_iteration.txt is left as it is (naming '1')" in line


def test_load_equal_to_save_starts_from_scratch_with_one_line_unless_told_otherwise(tmp_path):
    root = str(tmp_path / "ckpt")
    message = check_load_flags(_cfg(load=root, save=root))
    assert "starting from scratch" in message and root in message
    with pytest.raises(ConfigError, match="--exit-on-missing-checkpoint"):
        check_load_flags(_cfg(load=root, save=root, exit_on_missing_checkpoint=True))
    _checkpoint(tmp_path / "ckpt", 4)
    assert check_load_flags(_cfg(load=root, save=root, exit_on_missing_checkpoint=True)) is None


def test_save_holding_checkpoints_without_load_warns_that_the_run_starts_from_scratch(tmp_path):
    # running the README's default job twice: the second run neither resumes nor says so
    root = str(tmp_path / "ckpt")
    assert check_load_flags(_cfg(save=root)) is None  # a new --save: nothing to say
    _checkpoint(tmp_path / "ckpt", 40)
    _checkpoint(tmp_path / "ckpt", 80)
    message = check_load_flags(_cfg(save=root))
    assert message.startswith(f"WARNING: --save {root} already holds checkpoints (newest: iteration 80)"), message
    assert f"add --load {root} to resume" in message
    assert check_load_flags(_cfg(save=root, load=root)) is None  # resuming: nothing to warn about


def test_load_of_one_iteration_directory_loads_that_iteration(tmp_path):
    older = _checkpoint(tmp_path, 6)
    _checkpoint(tmp_path, 8)
    assert resolve_load_path(older) == ((6, older), None)
    assert resolve_load_path(str(tmp_path))[0][0] == 8
    assert check_load_flags(_cfg(load=older)) is None


def test_pointer_naming_a_missing_iteration_warns_which_one_loads(tmp_path):
    _checkpoint(tmp_path, 6)
    (tmp_path / TRACKER_FILE).write_text("8")
    (found, warning) = resolve_load_path(str(tmp_path))
    assert found[0] == 6 and "names iteration 8" in warning and "loading iteration 6 instead" in warning
    (tmp_path / TRACKER_FILE).write_text("6")
    assert resolve_load_path(str(tmp_path))[1] is None


def test_pointer_behind_the_newest_checkpoint_warns_and_names_ckpt_step(tmp_path):
    # e.g. a converter's iteration 0 written beside a run's checkpoints, or a pointer edited back
    _checkpoint(tmp_path, 6)
    _checkpoint(tmp_path, 8)
    (tmp_path / TRACKER_FILE).write_text("6")
    (found, warning) = resolve_load_path(str(tmp_path))
    assert found[0] == 8 and "names iteration 6" in warning and "--ckpt-step 6" in warning, warning
    assert resolve_load_path(str(tmp_path), step=6) == ((6, str(tmp_path / "iter_0000006")), None)


# ----------------------------------------------------------------------------- --save


def test_unwritable_save_is_named_at_start_up(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")  # a file where the directory should be
    with pytest.raises(ConfigError, match=r"--save .*/file/ckpt is not a writable directory"):
        probe_save_dir(str(blocker / "ckpt"))
    probe_save_dir(str(tmp_path / "fresh" / "ckpt"))
    assert os.listdir(tmp_path / "fresh" / "ckpt") == []  # created, probe removed


def test_a_data_cache_path_that_is_a_file_stops_the_entry_point_before_any_work(tmp_path):
    # it used to fail after the model was built, inside megatron-core's or our index cache writer
    import pretrain_gpt

    blocker = tmp_path / "cache"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match=r"--data-cache-path .*/cache is a file, not a directory"):
        pretrain_gpt.main(
            [
                "--mock-data",
                "--tokenizer-type",
                "NullTokenizer",
                "--vocab-size",
                "100",
                "--device",
                "cpu",
                "--data-cache-path",
                str(blocker),
            ]
        )


def _sentinel_handler(signum, frame):  # the caller's own handler: main must give it back, whatever it is
    raise AssertionError(f"signal {signum} reached the test's sentinel handler")


@pytest.mark.parametrize("sigint", ["sentinel", "ignored"])
def test_a_start_up_error_gives_sigterm_and_ctrl_c_back_to_the_caller(tmp_path, sigint):
    """--exit-signal-handler makes SIGTERM and SIGINT only set a flag from the first line of
    ``main``; an entry point that returned or raised left them so: the caller (a test process,
    a notebook) could no longer be stopped by Ctrl-C or SIGTERM, and everything it forked later
    inherited that. ``main`` gives the previous handlers back on every exit path: the caller's own
    (sentinels here), and an ignored SIGINT stays ignored (a job started with ``nohup`` or ``&``
    starts so; asserting Python's default handler failed the suite run in the background)."""
    import signal

    import pretrain_gpt

    blocker = tmp_path / "cache"
    blocker.write_text("x")
    before = {signal.SIGTERM: _sentinel_handler, signal.SIGINT: _sentinel_handler}
    if sigint == "ignored":
        before[signal.SIGINT] = signal.SIG_IGN
    saved = {signum: signal.signal(signum, handler) for signum, handler in before.items()}
    try:
        with pytest.raises(ConfigError, match=r"--data-cache-path"):
            pretrain_gpt.main(
                [
                    "--mock-data",
                    "--tokenizer-type",
                    "NullTokenizer",
                    "--vocab-size",
                    "100",
                    "--device",
                    "cpu",
                    "--exit-signal-handler",
                    "--data-cache-path",
                    str(blocker),
                ]
            )
        after = {signum: signal.getsignal(signum) for signum in before}
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)
    assert after == before


# ----------------------------------------------------------------------------- LR schedule on resume


def _scheduler(**values):
    base = dict(
        max_lr=3e-4,
        min_lr=0.0,
        lr_decay_style="cosine",
        lr_warmup_steps=80,
        lr_decay_steps=800,
        start_wd=0.01,
        end_wd=0.01,
        wd_incr_steps=800,
        wd_incr_style="constant",
    )
    return types.SimpleNamespace(**{**base, **values})


def test_changed_schedule_flags_on_resume_name_both_values():
    saved = vars(_scheduler())
    # a longer --train-iters (no --lr-decay-iters): one line naming the run's length, not two
    # naming megatron-core's lr_decay_steps and wd_incr_steps
    (problem,) = check_scheduler_flags(saved, _scheduler(lr_decay_steps=1600, wd_incr_steps=1600), _cfg(), 8)
    # the checkpoint's in samples only: its global batch size may not be this run's
    # (a run's length in samples is also --global-batch-size's: the line names both)
    assert problem.startswith(
        "the run's length (--train-iters x --global-batch-size, or --train-samples): the "
        "checkpoint's schedule runs over 800 samples, this run's over 1600 samples "
        "(200 iterations)"
    ), problem
    assert "--override-opt-param-scheduler" in problem and "_steps" not in problem
    # with --lr-decay-iters given, the decay length is that flag's
    problems = check_scheduler_flags(
        saved, _scheduler(lr_decay_steps=1600, wd_incr_steps=1600), _cfg(lr_decay_iters=200), 8
    )
    assert any(
        p.startswith(
            "--lr-decay-iters or --lr-decay-samples (default the run's length): the checkpoint's "
            "decay length is 800 samples, this run's flags give 1600 samples (200 iterations)"
        )
        for p in problems
    ), problems
    assert any("weight-decay schedule length is 800 samples" in p for p in problems), problems
    # a --lr-warmup-fraction warm-up is a fraction of samples (checkpoints before it was unrounded hold 5)
    (warmup,) = check_scheduler_flags({**saved, "lr_warmup_steps": 5}, _scheduler(lr_warmup_steps=5.6), _cfg(), 8)
    assert "warm-up length is 5 samples, this run's flags give 5.6 samples (0.7 iterations)" in warmup, warmup
    assert any("--lr: " in p for p in check_scheduler_flags(saved, _scheduler(max_lr=1e-3), _cfg(), 8))
    assert check_scheduler_flags(saved, _scheduler(), _cfg(), 8) == []
    for flag in ("override_opt_param_scheduler", "use_checkpoint_opt_param_scheduler"):
        assert check_scheduler_flags(saved, _scheduler(max_lr=1.0), _cfg(**{flag: True}), 8) == []


# ----------------------------------------------------------------------------- data files


@pytest.fixture
def copy(tmp_path):
    def make(bin_bytes=None, idx_bytes=None) -> str:
        prefix = str(tmp_path / "c")
        (tmp_path / "c.bin").write_bytes(bin_bytes if bin_bytes is not None else open(SHIPPED + ".bin", "rb").read())
        (tmp_path / "c.idx").write_bytes(idx_bytes if idx_bytes is not None else open(SHIPPED + ".idx", "rb").read())
        return prefix

    return make


def test_shipped_dataset_passes():
    from megatron_ext.data.indexed_check import check_tokenizer_record
    from megatron_ext.data.tokenizers import build_tokenizer

    assert check_indexed_dataset(SHIPPED) == []
    assert os.path.isfile(SHIPPED + ".tokenizer.json")  # and it names the shipped tokenizer
    assert check_tokenizer_record(SHIPPED, build_tokenizer("SentencePieceTokenizer", MODEL).identity()) == []


def test_truncated_bin_idx_and_garbage_are_named(copy):
    whole_bin, whole_idx = open(SHIPPED + ".bin", "rb").read(), open(SHIPPED + ".idx", "rb").read()
    (p,) = check_indexed_dataset(copy(bin_bytes=whole_bin[:-3]))
    assert "c.bin has" in p and "truncated" in p
    (p,) = check_indexed_dataset(copy(idx_bytes=whole_idx[:-100]))
    assert "c.idx has" in p and "truncated" in p
    (p,) = check_indexed_dataset(copy(idx_bytes=b"not an index"))
    assert "c.idx is not a megatron-core index" in p
    (p,) = check_indexed_dataset(copy(bin_bytes=whole_bin + b"xx"))
    assert "longer than its index describes" in p


def test_validation_reports_a_truncated_pair_with_the_flag(copy):
    from megatron_ext.validation import validate

    prefix = copy(bin_bytes=open(SHIPPED + ".bin", "rb").read()[:1000])
    cfg = build_job_config(
        {"data_path": [prefix], "tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": MODEL}
    )
    with pytest.raises(ConfigError, match=f"--data-path {prefix}: .*c.bin has 1000 bytes"):
        validate(cfg, 1)


def _small_dataset(tmp_path, num_docs: int) -> str:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "small")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(num_docs):
        builder.add_document(rng.integers(0, 100, 300).astype(np.uint16), [300])
    builder.finalize(prefix + ".idx")
    return prefix


def test_a_split_without_documents_is_never_requested_or_is_named(tmp_path):
    """79 documents and --split 969,30,1: the test split is empty. megatron-core's GPTDataset
    would loop forever building it; it is never built (nothing reads it). An empty validation
    split with --eval-interval is an error naming --split and the counts."""
    from megatron_ext.data.builder import build_train_valid_datasets
    from megatron_ext.data.tokenizers import build_tokenizer

    prefix = _small_dataset(tmp_path, 79)
    tok = build_tokenizer("NullTokenizer", vocab_size=127)
    values = {
        "data_path": [prefix],
        "tokenizer_type": "NullTokenizer",
        "vocab_size": 127,
        "seq_length": 64,
        "train_iters": 4,
        "split": "969,30,1",
        "data_cache_path": str(tmp_path / "cache"),
    }
    train, valid = build_train_valid_datasets(build_job_config(values), tok, 8)
    assert len(train) >= 32 and valid is None
    with pytest.raises(ConfigError, match=r"--split 999,1,0 .*valid gets none"):
        build_train_valid_datasets(build_job_config({**values, "split": "999,1,0", "eval_interval": 2}), tok, 8)
    with pytest.raises(ConfigError, match=r"--split 999,1,0 leaves valid of .* \(79 documents\)"):
        build_train_valid_datasets(
            build_job_config({**values, "split": "999,1,0", "eval_interval": 2, "packed_sequences": True}), tok, 8
        )


def test_token_ids_outside_the_vocabulary_name_file_and_documents(tmp_path):
    from megatron_ext.data.microbatch import fetch_step_samples
    from megatron_ext.data.packed_dataset import build_packed_datasets

    prefix = _small_dataset(tmp_path, 20)  # ids < 100
    train, _, _ = build_packed_datasets(prefix, [1.0, 0.0, 0.0], 256, "best_fit", 0, [8, 0, 0], str(tmp_path))
    assert fetch_step_samples(train, [[0, 1]], vocab_size=100)
    with pytest.raises(
        ConfigError,
        match=r"token id 9\d is outside the tokenizer's vocabulary \[0, 90\) in "
        r".*small.bin, documents? \d",
    ):
        fetch_step_samples(train, [[0, 1]], vocab_size=90)


def test_a_tokenizer_model_that_does_not_load_names_the_flag(tmp_path):
    from megatron_ext.data.tokenizers import build_tokenizer

    bad = tmp_path / "bad.model"
    bad.write_text("not a model")
    with pytest.raises(ConfigError, match=f"--tokenizer-model {bad} is not a sentencepiece model"):
        build_tokenizer("SentencePieceTokenizer", str(bad))
    shutil.copy(MODEL, tmp_path / "good.model")
    assert build_tokenizer("SentencePieceTokenizer", str(tmp_path / "good.model")).vocab_size > 0


def test_token_ids_outside_the_vocabulary_name_documents_on_the_gptdataset_path(tmp_path):
    """megatron-core GPTDataset windows: the error names the .bin and the documents of the window."""
    from megatron_ext.data.gpt_datasets import build_gpt_datasets
    from megatron_ext.data.microbatch import fetch_step_samples
    from megatron_ext.data.tokenizers import build_tokenizer

    tok = build_tokenizer("SentencePieceTokenizer", MODEL)
    train, _, _ = build_gpt_datasets(
        tok,
        64,
        [16, 1, 1],
        data_path=[SHIPPED],
        split="98,2,0",
        path_to_cache=str(tmp_path),
        create_attention_mask=False,
    )
    assert fetch_step_samples(train, [[0, 1]], vocab_size=tok.vocab_size)
    with pytest.raises(
        ConfigError,
        match=r"outside the tokenizer's vocabulary \[0, 50\) in .*corpus_text_document"
        r".bin, documents? \d+.* \(sample 0\)",
    ):
        fetch_step_samples(train, [[0]], vocab_size=50)


def test_load_plan_for_finetune_pretrained_step_and_rng(tmp_path):
    from megatron_ext.checkpoint.state import plan_load

    root = tmp_path / "run"
    _checkpoint(root, 2)
    _checkpoint(root, 4)
    plan, message = plan_load(_cfg(load=str(root)))
    assert (plan.path, plan.step, plan.weights_only, plan.load_rng, message) == (str(root), None, False, True, None)
    assert plan_load(_cfg(load=str(root), ckpt_step=2))[0].step == 2
    with pytest.raises(ConfigError, match=r"--ckpt-step 3: .* \(complete ones: \[2, 4\]\)"):
        plan_load(_cfg(load=str(root), ckpt_step=3))
    with pytest.raises(ConfigError, match="--ckpt-step needs --load"):
        plan_load(_cfg(ckpt_step=2))
    plan, _ = plan_load(_cfg(load=str(root), finetune=True))
    assert plan.weights_only and not plan.load_rng
    assert not plan_load(_cfg(load=str(root), no_load_rng=True))[0].load_rng
    # a fresh --load (also --save) falls back to --pretrained-checkpoint, weights only
    fresh = str(tmp_path / "fresh")
    plan, message = plan_load(_cfg(load=fresh, save=fresh, pretrained_checkpoint=str(root)))
    assert plan.path == str(root) and plan.weights_only and "fine-tuning from --pretrained-checkpoint" in message
    with pytest.raises(ConfigError, match="--pretrained-checkpoint .* holds no complete checkpoint"):
        plan_load(_cfg(pretrained_checkpoint=str(tmp_path / "nothing")))


def test_the_schedule_line_shows_the_schedulers_values_not_the_flags():
    """After --use-checkpoint-opt-param-scheduler the scheduler holds the checkpoint's schedule:
    the line printed after the load must show it (it showed the flags')."""
    from types import SimpleNamespace

    from megatron_ext.config import build_job_config
    from megatron_ext.run import describe_schedule

    cfg = build_job_config(
        dict(mock_data=True, tokenizer_type="NullTokenizer", vocab_size=128, lr=1e-3, min_lr=1e-4, train_iters=6)
    )
    checkpoints = SimpleNamespace(
        max_lr=3e-4, min_lr=3e-5, lr_decay_style="linear", lr_warmup_steps=4, lr_decay_steps=16, wsd_decay_steps=None
    )
    line = describe_schedule(SimpleNamespace(cfg=cfg, scheduler=checkpoints, global_batch_size=8), "schedule X")
    assert line == (
        "> schedule X: 6 steps x 8 samples | lr 0.0003 -> 3e-05, warm-up 4 samples, linear decay over 16 samples"
    ), line


def test_a_save_path_that_is_a_file_says_so_without_free_space(tmp_path):
    # it said "(File exists: PATH (PATH has N MiB free))": neither the cause nor what to change
    blocker = tmp_path / "ckpt"
    blocker.write_text("x")
    with pytest.raises(ConfigError) as err:
        probe_save_dir(str(blocker))
    assert err.value.problems == [
        f"--save {blocker} is a file, not a directory: give a directory this job can create and write"
    ]
    with pytest.raises(ConfigError) as err:
        probe_save_dir(str(blocker / "sub"))  # a parent is a file: the OS's reason, no free-space figure
    assert "Not a directory" in str(err.value) and "MiB free" not in str(err.value), err.value
