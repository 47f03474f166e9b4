"""bench/gpu_throughput.py and bench/gpu_profile.py can only measure on a GPU; their code paths (our
run on synthetic rows and packs, the transformers reference step, the side-by-side timing, the
profiler tables and the reports) run here on tiny shapes so that the benchmarks do not rot on
CPU-only machines. Their figures are not checked."""

from __future__ import annotations

import contextlib
import io

import pytest

from megatron_ext.testing import run_ranks

pytestmark = pytest.mark.distributed


def _smoke(rank: int, world_size: int) -> str:
    from bench import gpu_throughput

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = gpu_throughput.main(
            [
                "--device",
                "cpu",
                "--tiny",
                "--steps",
                "2",
                "--warmup",
                "0",
                "--only",
                "gpt2",
                "1.3b",
                "packed-llama",
                "--accumulate",
                "2",
            ]
        )
    return f"exit {code}\n{out.getvalue()}"


def test_gpu_benchmark_code_paths_run_on_tiny_shapes():
    pytest.importorskip("transformers")
    report = run_ranks(_smoke, 1, timeout=300)[0]
    assert report.startswith("exit 0"), report
    assert report.count("A/C =") == 2 and report.count("packed/unpacked real tokens/s =") == 2, report
    assert "stretch >= 0.55" in report, report
    assert "2 micro-batches per optimizer step" in report, report


def _smoke_1_3b_compiled(rank: int, world_size: int) -> str:
    """The 1.3b section with its --torch-compile row (dynamo and AOT autograd, no inductor code generation:
    minutes on a small CPU); --cuda-graph-impl local is refused on the CPU, as in training."""
    import megatron_ext.model.compile as compile_module
    from bench import gpu_throughput

    compile_module.BACKEND = "aot_eager"
    out = io.StringIO()
    argv = ["--device", "cpu", "--tiny", "--steps", "2", "--warmup", "0", "--only", "1.3b", "--torch-compile"]
    with contextlib.redirect_stdout(out):
        code = gpu_throughput.main(argv)
    return f"exit {code}\n{out.getvalue()}"


def test_the_1_3b_section_runs_its_torch_compile_row_and_prints_the_stretch_mfu():
    pytest.importorskip("transformers")
    report = run_ranks(_smoke_1_3b_compiled, 1, timeout=300)[0]
    assert report.startswith("exit 0"), report
    assert "A' ours --torch-compile" in report, report
    # the figure of ours and of the variant row, each beside issue 30's stretch
    assert report.count("stretch >= 0.55") == 2 and "A/C =" in report and "/C =" in report, report


def _profile_smoke(rank: int, world_size: int) -> str:
    from bench import gpu_profile

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = gpu_profile.main(
            [
                "--device",
                "cpu",
                "--tiny",
                "--steps",
                "1",
                "--timed-steps",
                "1",
                "--warmup",
                "1",
                "--rows",
                "3",
                "--python",
                "--accumulate",
                "2",
            ]
        )
    return f"exit {code}\n{out.getvalue()}"


def test_gpu_profile_code_paths_run_on_tiny_shapes():
    report = run_ranks(_profile_smoke, 1, timeout=300)[0]
    assert report.startswith("exit 0"), report
    assert "== unpacked: wall" in report and "== packed: wall" in report and "packed/unpacked: wall" in report, report
    assert report.count("by host time (total):") == 2, report
    assert "2 per optimizer step" in report, report
    assert report.count("Python own time") == 2 and report.count("by package:") == 2, report
    assert "operators whose self host time differs most" in report, report
    assert "Python functions whose own time differs most" in report, report


def _ablation_smoke(rank: int, world_size: int) -> dict:
    import torch

    from bench import gpu_ablation, gpu_throughput
    from megatron_ext.optim import torch_adam_optimizers

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = gpu_ablation.main(["--device", "cpu", "--tiny", "--steps", "1", "--warmup", "0", "--micro-batch", "1"])
        code += gpu_ablation.main(
            [
                "--device",
                "cpu",
                "--tiny",
                "--shape",
                "llama",
                "--steps",
                "1",
                "--warmup",
                "0",
                "--micro-batch",
                "1",
                "--only",
                "rope",
                "gqa-kernel",
            ]
        )

    def state() -> tuple:
        side = gpu_throughput.Ours(gpu_throughput.shape_for("llama", tiny=True), 1)
        gpt_model = side.run.model[0].module.module
        fused = {g["fused"] for o in torch_adam_optimizers(side.run.optimizer) for g in o.param_groups}
        found = (
            fused == {True},
            gpt_model.config.gradient_accumulation_fusion,
            type(gpt_model).__name__,
            type(gpt_model.rotary_pos_emb).__name__,
        )
        side.close()
        return found

    states = {"on": state()}
    for name in gpu_ablation.ABLATIONS:
        restore = gpu_ablation.undo(name)
        states[name] = state()
        restore()
    states["restored"] = state()
    assert torch.device("cpu") == gpu_throughput.DEVICE
    return {"report": f"exit {code}\n{out.getvalue()}", "states": states}


def test_gpu_ablation_undoes_one_change_at_a_time():
    out = run_ranks(_ablation_smoke, 1, timeout=300)[0]
    report, states = out["report"], out["states"]
    assert report.startswith("exit 0") and report.count("off/on =") == 4 and "megatron-core/ours =" in report, report
    assert "rope           n/a" in report and "gqa-kernel     n/a" in report, report  # the GPT-2 shape
    assert "repeated/enable_gqa =" in report, report
    on = (True, True, "GPTModelWithLeanCrossEntropy", "CoreAttentionRotaryEmbedding")
    assert states["on"] == states["restored"] == on
    assert states["fused-adam"] == (False, *on[1:])
    assert states["wgrad-fusion"] == (True, False, *on[2:])
    assert states["cross-entropy"] == (True, True, "GPTModel", on[3])
    assert states["rope"] == (*on[:3], "RotaryEmbedding")


def _rope_bench(rank: int, world_size: int) -> str:
    from bench import rope

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = rope.main(
            ["--steps", "2", "--warmup", "1", "--seq-length", "64", "--micro-batch", "1", "--num-layers", "2"]
        )
    return f"exit {code}\n{out.getvalue()}"


def test_rope_bench_counts_fewer_kernels_for_the_same_logits():
    """bench/rope.py's code paths; its kernel counts are deterministic (its times are not checked)."""
    import re

    report = run_ranks(_rope_bench, 1, timeout=300)[0]
    assert report.startswith("exit 0"), report
    assert "(logits equal: True)" in report, report
    ratios = [float(x) for x in re.findall(r"kernels ([0-9.]+)x", report)]
    assert len(ratios) == 2 and all(r < 1.0 for r in ratios), report
    assert re.search(r"ours\s+\d+ kernels \(0 cos\)", report) and re.search(
        r"megatron-core\s+\d+ kernels \(4 cos\)", report
    ), report


def _packed_host_smoke(rank: int, world_size: int) -> str:
    from bench import packed_host

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = packed_host.main(["--layers", "2", "--seq", "128", "--steps", "1"])
    return f"exit {code}\n{out.getvalue()}"


def test_packed_host_bench_takes_the_varlen_branch_on_the_cpu():
    report = run_ranks(_packed_host_smoke, 1, timeout=300)[0]
    assert report.startswith("exit 0") and "packed/unpacked: wall" in report, report
    assert "varlen-branch forwards: 0" not in report and "varlen-branch forwards: " in report, report


def test_padding_bench_steps_every_mode():
    """bench/padding.py (README: 'Measured in bench/padding.py') builds the step-data builder
    (data/step_data.StepDataBuilder) itself: one step of each padding mode on its 4 pipeline ranks, tiny compute."""
    from bench import padding

    rows = padding.LognormalRows(300.0, 1.0, padding.SEQ)
    res = run_ranks(padding.throughput_rank, padding.PP, "unpacked", 1, 0.001, rows, timeout=600)
    for mode in padding.MODES:
        (step,) = res[0][mode]
        assert step["useful"] > 0 and step["slots"] >= step["useful"], (mode, step)


def _memory_smoke(rank: int, world_size: int) -> dict:
    from bench import gpu_memory, gpu_throughput
    from megatron_ext.config import build_job_config
    from megatron_ext.planning.predict import predict_memory

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = gpu_memory.main(["--device", "cpu", "--tiny", "--micro-batches", "2"])
    shape = gpu_throughput.shape_for("llama", tiny=True)
    predicted = {}
    for variant, flags in gpu_memory.VARIANTS.items():  # the run's flags; NullTokenizer: vocabulary = flag + 1
        values = gpu_throughput.job_values(shape, 1, False, **flags)
        predicted[variant] = predict_memory(build_job_config(values), 1, values["vocab_size"] + 1)[0]
    return {"report": f"exit {code}\n{out.getvalue()}", "predicted": predicted}


def _number(text: str) -> int:
    return int(text.replace(",", ""))


def test_gpu_memory_bench_prints_the_prediction_and_measures_saved_bytes_on_the_cpu():
    """bench/gpu_memory.py --device cpu --tiny: per variant (no recompute, selective, full) its printed
    prediction is predict_memory's for the run's flags, the state it measured is the predicted state
    (exact: no bucket padding at this size) and the peak saved bytes are within 5% of the predicted
    activations; the CUDA-only figure is said to be absent."""
    import re

    out = run_ranks(_memory_smoke, 1, timeout=300)[0]
    report = out["report"]
    assert report.startswith("exit 0") and "2 micro-batches per step" in report, report
    blocks = report.split("\n== ")[1:]
    assert [b.split("\n")[0] for b in blocks] == ["none", "selective", "full"], report
    for block in blocks:
        want = out["predicted"][block.split("\n")[0]]
        terms = re.search(
            r"predicted +state ([\d,]+) .*\| activations ([\d,]+) \| temporaries ([\d,]+) \| margin ([\d,]+) "
            r"\| total ([\d,]+) bytes",
            block,
        )
        assert terms, block
        expected = (want.state.total, want.activations, want.temporaries, want.margin, want.total)
        assert [_number(t) for t in terms.groups()] == [round(x) for x in expected], block
        state = _number(re.search(r"state +measured ([\d,]+)", block).group(1))
        assert state == want.state.total, block
        saved = _number(re.search(r"saved +measured peak ([\d,]+)", block).group(1))
        assert abs(want.activations / saved - 1) <= 0.05, block
        assert "allocated   n/a" in block, block
    full, none = (out["predicted"][v].activations for v in ("full", "none"))
    assert full < 0.6 * none  # the variants differ: full recompute keeps each layer's input only


def test_the_1_3b_mfu_is_printed_beside_the_target_and_issue_30s_stretch():
    from bench.gpu_throughput import describe_mfu

    assert describe_mfu(496.5, 989.0) == "MFU 0.502 (target >= 0.50, issue 30's stretch >= 0.55: not met)"
    assert describe_mfu(550.0, 989.0).endswith("stretch >= 0.55: met)")
    assert describe_mfu(1.0, None).startswith("MFU - (no bf16 peak known")
