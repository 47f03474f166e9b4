"""One rank of ``generate.py``: Megatron-LM's own training code, one step, its save, and the reference.

Runs inside Megatron-LM's source tree (on ``sys.path``). The stand-ins below make its CUDA calls run
on the CPU; each is listed in README.md with why it changes nothing that is computed or saved.
"""

from __future__ import annotations

import importlib
import os
import sys
import types
from functools import partial

import torch


def apply_stand_ins() -> None:
    """CUDA stand-ins for Megatron-LM's training code on a CPU-only machine (README.md)."""
    from megatron_ext.checkpoint.writer import InProcessTorchDistSaveStrategy
    from megatron_ext.cpu_platform import apply_cpu_platform

    apply_cpu_platform(torch.device("cpu"))  # our layer: CUDA device arguments -> CPU, stream stubs, CPU RNG tracker
    # Megatron-LM initializes model parallelism and seeds megatron-core's RNG tracker only "if device_count > 0"
    torch.cuda.device_count = lambda: 1
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()  # saved as its cuda_rng_state
    torch.cuda.set_rng_state = lambda state, *a, **k: None
    torch.cuda.memory_allocated = lambda *a, **k: 0
    torch.cuda.max_memory_allocated = lambda *a, **k: 0

    # megatron-core's batch-invariant kernels import triton (not installed: no GPU); Megatron-LM's
    # initialize imports the module for --batch-invariant-mode only, which these runs do not give
    stub = types.ModuleType("megatron.core.transformer.custom_layers.batch_invariant_kernels")
    stub.enable_batch_invariant_mode = _refuse_batch_invariant_mode
    sys.modules[stub.__name__] = stub

    import megatron.core.datasets.utils as dataset_utils
    import megatron.legacy.fused_kernels as fused_kernels
    import megatron.training.arguments as mlm_arguments
    import megatron.training.checkpointing as mlm_checkpointing

    # its TP checks ask the GPU's architecture (CUDA_DEVICE_MAX_CONNECTIONS advice below Blackwell)
    mlm_arguments.get_device_arch_version = lambda: 9
    dataset_utils.compile_helpers = lambda: None  # the pip package's compiled helpers_cpp is used
    fused_kernels.load = lambda args: None  # CUDA kernels; the unfused paths are selected by flags
    # megatron-core's torch_dist writer forks writers through a multiprocessing Manager, which hangs
    # on CPU (docs/megatron-core-on-cpu.md); ours writes the same files in-process
    mlm_checkpointing.get_default_save_sharded_strategy = lambda *a, **k: InProcessTorchDistSaveStrategy()


def _refuse_batch_invariant_mode() -> None:
    raise RuntimeError("--batch-invariant-mode needs triton and a GPU")


def run_worker(case, flags: list[str], paths: list[str], work: str) -> None:
    apply_stand_ins()
    sys.argv = ["pretrain_gpt.py", *flags, *paths]
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.training import get_args
    from megatron.training.checkpointing import save_checkpoint
    from megatron.training.initialize import initialize_megatron, set_jit_fusion_options
    from megatron.training.training import (
        build_train_valid_test_data_iterators,
        setup_model_and_optimizer,
        train_step,
    )

    # Megatron-LM's own pretrain_gpt.py and gpt_builders.py (its tree is first on sys.path, before ours)
    pretrain_gpt = importlib.import_module("pretrain_gpt")
    gpt_builder = importlib.import_module("gpt_builders").gpt_builder

    pretrain_gpt.train_valid_test_datasets_provider.is_distributed = True  # as its __main__ does
    initialize_megatron(allow_no_cuda=True, get_embedding_ranks=pretrain_gpt.get_embedding_ranks)
    set_jit_fusion_options()
    args = get_args()
    model, optimizer, scheduler = setup_model_and_optimizer(
        partial(pretrain_gpt.model_provider, gpt_builder), ModelType.encoder_or_decoder
    )
    config = model[0].config
    train_iter, _, _ = build_train_valid_test_data_iterators(pretrain_gpt.train_valid_test_datasets_provider)
    train_step(
        pretrain_gpt.forward_step, train_iter, model, optimizer, scheduler, config, get_forward_backward_func(), 0
    )
    args.consumed_train_samples += args.global_batch_size
    args.iteration = 1

    from generate_reference import build_reference, record_next_step

    reference, read = build_reference(case, args, model, optimizer, train_iter)
    save_checkpoint(1, model, optimizer, scheduler, 0, release=case.release)
    forward_backward = get_forward_backward_func()
    next_step = record_next_step(
        lambda data: train_step(
            pretrain_gpt.forward_step, data, model, optimizer, scheduler, config, forward_backward, 1
        ),
        read,
        train_iter,
    )
    if torch.distributed.get_rank() == 0:
        reference["next_step"] = next_step
        reference["flags"] = flags  # Megatron-LM's command line without the paths
        torch.save(reference, os.path.join(work, "reference.pt"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def dump_arguments(path: str) -> None:
    """Megatron-LM's command-line arguments, as ``{"groups": {title: [dest, ...]}, "defaults": {dest:
    default}}`` (JSON; values JSON cannot hold as their str): what ``megatron_ext/checkpoint/megatron_lm.py``'s
    map of its settings is checked against."""
    import argparse
    import json

    apply_stand_ins()
    from megatron.training.arguments import add_megatron_arguments

    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    groups = {}
    for group in parser._action_groups:
        dests = sorted({a.dest for a in group._group_actions if a.dest != "help"})
        if dests:
            groups.setdefault(group.title, []).extend(dests)
    defaults = {a.dest: a.default for a in parser._actions if a.dest != "help"}
    with open(path, "w") as f:
        json.dump({"groups": groups, "defaults": defaults}, f, indent=1, sort_keys=True, default=str)
        f.write("\n")
