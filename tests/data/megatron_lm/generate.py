"""Write the Megatron-LM checkpoints of tests/data/megatron_lm/ with Megatron-LM's own code, on the CPU.

Each case runs Megatron-LM core_v0.16.1's ``initialize_megatron``, ``setup_model_and_optimizer``
(``pretrain_gpt.model_provider``, ``--transformer-impl local``), its data iterators over the tiny
indexed corpus beside this file, one ``train_step`` and ``save_checkpoint``, in ``WORLD_SIZE``
gloo processes. Beside each checkpoint it records what a loader must reproduce, from Megatron-LM's
memory at the save (``reference.pt``): the logits of a fixed input (fp32, gathered over TP), each
parameter's Adam moments as statistics per (pipeline rank, TP rank, parameter), the next global
batch Megatron-LM's data iterator yields, the iteration and consumed samples; after the save, its own
next step on that batch (loss, grad norm). The README lists
the stand-ins for CUDA this needs; none changes what is computed or written.

    python tests/data/megatron_lm/generate.py --megatron-lm /path/to/Megatron-LM [--case NAME]

``--megatron-lm`` is a checkout of core_v0.16.1 (NVIDIA/Megatron-LM 55ac708); megatron-core itself
is the installed 0.16.1 (the same code). Needs ``pip install six psutil``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
CORPUS = os.path.join(HERE, "corpus", "corpus_text_document")
VOCAB_SIZE = 299  # NullTokenizer: 300 ids (EOD = 299); padded to 384 at TP1 and 512 at TP2 (by 128 x TP)
ARGUMENTS_FILE = "arguments_core_v0.16.1.json"  # Megatron-LM's argument groups and defaults


@dataclasses.dataclass(frozen=True)
class Case:
    tp: int
    pp: int
    dp: int
    optimizer: str  # "dp_reshardable", "fully_reshardable", "non_distributed", or "none" (release)
    style: str  # "llama" (RMSNorm, SwiGLU, RoPE, GQA, untied) or "gpt" (LayerNorm, GeLU, learned, tied)
    release: bool = False

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp


CASES = {
    "tp2pp2_dp_reshardable": Case(2, 2, 1, "dp_reshardable", "llama"),
    "tp1_dp_reshardable": Case(1, 1, 2, "dp_reshardable", "gpt"),
    "tp1_fully_reshardable": Case(1, 1, 2, "fully_reshardable", "llama"),
    "tp1_non_distributed": Case(1, 1, 1, "non_distributed", "gpt"),
    "release": Case(1, 1, 1, "none", "llama", release=True),
}

MODEL_FLAGS = {
    "llama": "--normalization RMSNorm --swiglu --disable-bias-linear --position-embedding-type rope "
    "--untie-embeddings-and-output-weights --group-query-attention --num-query-groups 2 --ffn-hidden-size 64 "
    "--max-position-embeddings 16",
    # 18 positions: the model's parameters (each aligned to 64 elements by the distributed optimizer)
    # then fill 591 x 64, no multiple of 128, so its DDP bucket is padded (to a multiple of lcm(DP, 128)):
    # the dp_reshardable state is stored at the unpadded size, which a load must use
    # (optimizer_state.megatron_bucket_sizes)
    "gpt": "--normalization LayerNorm --position-embedding-type learned_absolute --ffn-hidden-size 128 "
    "--max-position-embeddings 18",
}
COMMON_FLAGS = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    "--hidden-dropout 0 --attention-dropout 0 --init-method-std 0.02 --seed 1234 "
    "--micro-batch-size 2 --global-batch-size 8 --train-iters 10 "
    "--lr 0.01 --min-lr 0.001 --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.01 "
    "--adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 1.0 "
    "--tokenizer-type NullTokenizer --vocab-size 299 --make-vocab-size-divisible-by 128 "
    "--split 90,9,1 --eval-iters 1 --eval-interval 1000 "
    "--transformer-impl local --attention-backend unfused --no-gradient-accumulation-fusion "
    "--no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-swiglu-fusion --no-bias-dropout-fusion "
    "--no-rope-fusion --no-persist-layer-norm --use-cpu-initialization --distributed-backend gloo "
    "--ckpt-format torch_dist --save-interval 1 --log-interval 1 --num-workers 0"
)


def get_flags(case: Case) -> list[str]:
    """Megatron-LM's command line for ``case``, without its paths (``get_paths``): recorded in
    ``reference.pt``, where the tests read it."""
    flags = f"{COMMON_FLAGS} {MODEL_FLAGS[case.style]}".split()
    flags += ["--tensor-model-parallel-size", str(case.tp), "--pipeline-model-parallel-size", str(case.pp)]
    if case.optimizer in ("dp_reshardable", "fully_reshardable"):
        flags.append("--use-distributed-optimizer")
    if case.optimizer == "fully_reshardable":
        flags.append("--dist-ckpt-optim-fully-reshardable")
    if case.release:
        flags += ["--no-save-optim", "--no-save-rng"]
    return flags


def get_paths(save: str) -> list[str]:
    """The corpus, the checkpoint directory, and the dataset index cache beside it (megatron-core's
    default is beside the corpus, in this tree)."""
    return ["--data-path", CORPUS, "--save", save, "--data-cache-path", os.path.join(save, "..", "cache")]


# ----------------------------------------------------------------------------- the launcher


def build_corpus() -> None:
    """The indexed corpus every case trains on: 400 documents of 4-60 ids below 299, each ending
    with EOD (299), built with megatron-core's IndexedDatasetBuilder (fixed seed: rebuilding gives
    the same bytes)."""
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    os.makedirs(os.path.dirname(CORPUS), exist_ok=True)
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(CORPUS + ".bin", dtype=np.uint16)
    for _ in range(400):
        doc = rng.integers(0, VOCAB_SIZE, size=int(rng.integers(4, 61))).tolist() + [VOCAB_SIZE]
        builder.add_document(torch.tensor(doc, dtype=torch.int64), [len(doc)])
    builder.finalize(CORPUS + ".idx")


def run_case(name: str, megatron_lm: str, out_root: str) -> None:
    """Run ``name``'s ranks as subprocesses of this script and move the checkpoint into ``out_root``."""
    case = CASES[name]
    work = tempfile.mkdtemp(prefix=f"mlm-{name}-")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([megatron_lm, REPO]),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(29500 + sum(map(ord, name)) % 1000),
        "WORLD_SIZE": str(case.world_size),
        "OMP_NUM_THREADS": "1",
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", name, "--work", work],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            cwd=megatron_lm,
        )
        for rank in range(case.world_size)
    ]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"case {name}: ranks exited with {codes}; the work directory is {work}")
    target = os.path.join(out_root, name)
    shutil.rmtree(target, ignore_errors=True)
    shutil.move(os.path.join(work, "ckpt"), target)
    shutil.move(os.path.join(work, "reference.pt"), os.path.join(target, "reference.pt"))
    shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--megatron-lm", help="a checkout of Megatron-LM core_v0.16.1")
    parser.add_argument("--case", action="append", choices=sorted(CASES), help="default: all")
    parser.add_argument("--out", default=HERE)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--dump-arguments", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.dump_arguments:
        from generate_worker import dump_arguments  # noqa: PLC0415 - needs Megatron-LM on the path

        dump_arguments(args.dump_arguments)
        return
    if args.worker:
        from generate_worker import run_worker  # noqa: PLC0415 - needs Megatron-LM on the path

        case = CASES[args.worker]
        run_worker(case, get_flags(case), get_paths(os.path.join(args.work, "ckpt")), args.work)
        return
    if not args.megatron_lm:
        parser.error("--megatron-lm PATH is needed")
    if not os.path.exists(CORPUS + ".bin"):
        build_corpus()
    megatron_lm = os.path.abspath(args.megatron_lm)
    os.makedirs(args.out, exist_ok=True)
    subprocess.run(
        [sys.executable, __file__, "--dump-arguments", os.path.join(args.out, ARGUMENTS_FILE)],
        env={**os.environ, "PYTHONPATH": os.pathsep.join([megatron_lm, REPO])},
        cwd=megatron_lm,
        check=True,
    )
    for name in args.case or sorted(CASES):
        run_case(name, megatron_lm, args.out)
        print(f"wrote {os.path.join(args.out, name)}", flush=True)
    json.dump(sorted(CASES), sys.stdout)


if __name__ == "__main__":
    main()
