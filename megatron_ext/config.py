"""Typed job configuration, with Megatron-LM's flag names, validated in one place.

Each section is a small dataclass; each field's ``help`` is its flag's help text. The flag of a
field is ``--`` + its name with dashes (``tensor_model_parallel_size`` ->
``--tensor-model-parallel-size``). Config files (YAML or TOML) use the same names, with dashes or
underscores; flags given on the command line override them; unknown keys are an error.

``validate(cfg, world_size)`` checks every rule that a layout, a batch or a model shape must
satisfy and reports all problems at once, each naming the flags, the values and the fix. It is
pure: it runs before any process group, file or model is created.
"""

from __future__ import annotations

import dataclasses
import glob
import math
import os
from dataclasses import dataclass, field
from typing import Any

from megatron_ext.pipeline.validate import (
    check_pipeline_schedule, check_schedule_name, get_schedule_chunks, uses_our_runtime,
)


def _f(default: Any, help: str, **extra: Any) -> Any:
    """A dataclass field carrying its flag's help text."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **extra})
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class ParallelConfig:
    """How the world is split: TP x PP x DP, virtual pipeline stages, optimizer sharding."""

    tensor_model_parallel_size: int = _f(1, "Tensor-parallel size (ranks of a TP group are consecutive, inside a node).")
    pipeline_model_parallel_size: int = _f(1, "Pipeline-parallel size (stages span nodes).")
    num_layers_per_virtual_pipeline_stage: int | None = _f(None, "Layers per virtual pipeline stage (interleaved 1F1B; 0 = off).")
    num_virtual_stages_per_pipeline_rank: int | None = _f(None, "Virtual pipeline stages per pipeline rank (interleaved 1F1B).")
    decoder_first_pipeline_num_layers: int | None = _f(None, "Uneven split: layers of the first pipeline stage (the rest are split evenly).")
    decoder_last_pipeline_num_layers: int | None = _f(None, "Uneven split: layers of the last pipeline stage (the rest are split evenly).")
    account_for_embedding_in_pipeline_split: bool = _f(False, "Count the input embedding as one layer when splitting layers over pipeline stages.")
    account_for_loss_in_pipeline_split: bool = _f(False, "Count the output layer and loss as one layer when splitting layers over pipeline stages.")
    pipeline_model_parallel_layout: str | None = _f(None, "Megatron-LM's explicit layer layout: not supported (refused); use the flags above.")
    pipeline_schedule: str | None = _f(None, "Pipeline schedule (ours; torch.distributed.pipelining's names, case-insensitive): 1F1B or Interleaved1F1B (megatron-core's), or a zero-bubble one on our runtime: ZBH1 (one chunk per rank, 1F1B's memory), InterleavedZeroBubble (with --num-virtual-stages-per-pipeline-rank), ZBVZeroBubble (2 chunks per rank in a V, implied; 1F1B's memory). Default: Interleaved1F1B with virtual stages, else 1F1B. docs/pipeline.md says which to pick.")
    microbatch_group_size_per_vp_stage: int | None = _f(None, "Contiguous micro-batches per virtual stage in the interleaved schedule (default: PP).")
    use_distributed_optimizer: bool = _f(False, "Shard optimizer state over data-parallel ranks (ZeRO-1).")
    sequence_parallel: bool = _f(False, "Megatron sequence parallelism: norms, dropout and residuals on a 1/TP slice of the sequence (needs TP > 1).")
    overlap_grad_reduce: bool = _f(False, "Overlap the DP gradient reduce with the backward pass.")
    overlap_param_gather: bool = _f(False, "Overlap the distributed optimizer's parameter all-gather with the next forward pass (needs --use-distributed-optimizer and --overlap-grad-reduce).")
    align_param_gather: bool = _f(True, "With --overlap-param-gather, dispatch every pipeline stage's all-gathers together at the schedule's start (Megatron-LM's default; --no-align-param-gather dispatches them from each bucket's first use).", negative_flag=True)
    ddp_bucket_size: int | None = _f(None, "Elements per DDP gradient bucket of the first pipeline stage's first model chunk, the only one bucketed, as in Megatron-LM (with --overlap-grad-reduce; default megatron-core's, max(4e7, 1e6 x DP)).")
    distributed_timeout_minutes: int = _f(10, "Timeout of collective operations, in minutes.")
    context_parallel_size: int = _f(1, "Context parallelism: only 1 (not supported yet; refused otherwise).")
    use_torch_fsdp2: bool = _f(False, "FSDP2 (Megatron-LM's flag): not supported; refused.")
    use_custom_fsdp: bool = _f(False, "Megatron-core's custom FSDP (Megatron-LM's flag): not supported; refused.")
    optimizer_cpu_offload: bool = _f(False, "Optimizer state offload to the CPU (Megatron-LM's flag): not supported; refused.")
    step_timeout_minutes: float | None = _f(
        None, "Stall watchdog (ours): a rank whose training step or evaluation batch lasts longer prints where it "
        "is, every rank whose progress stopped (rank, stage, host, phase, micro-batch; from per-rank heartbeats in "
        "the job's store) and its Python stacks, and exits 1 (default off; set it below "
        "--distributed-timeout-minutes and above the longest step).")
    save_timeout_minutes: float | None = _f(
        None, "Stall watchdog (ours): the same for a checkpoint save (a synchronous save; with --async-save the "
        "snapshot and the publication), which may last much longer than a step (default off; set it below "
        "--distributed-timeout-minutes).")
    device: str = _f("auto", "Where ranks run (ours, not Megatron-LM's): auto (the local GPU when CUDA is available, else the CPU with gloo), cpu (force the CPU/gloo path even on a GPU machine) or cuda.", choices=["auto", "cpu", "cuda"])


@dataclass
class ModelConfig:
    """GPT shape. GPT-2 style by default; Llama style with RMSNorm, --swiglu, rope, GQA."""

    num_layers: int = _f(4, "Number of transformer layers.")
    hidden_size: int = _f(128, "Hidden size.")
    ffn_hidden_size: int | None = _f(None, "MLP hidden size (default 4 x hidden, or with --swiglu 2/3 of that rounded down to a multiple of 64, as Megatron-LM).")
    num_attention_heads: int = _f(4, "Attention heads.")
    group_query_attention: bool = _f(False, "Use grouped-query attention (with --num-query-groups).")
    num_query_groups: int | None = _f(None, "Key/value head groups under --group-query-attention.")
    seq_length: int = _f(256, "Sequence length of a training sample.")
    max_position_embeddings: int | None = _f(None, "Positions of the learned absolute embedding (default: --seq-length).")
    position_embedding_type: str = _f("learned_absolute", "learned_absolute or rope.", choices=["learned_absolute", "rope"])
    rotary_base: int = _f(10000, "RoPE theta.")
    rotary_percent: float = _f(1.0, "Fraction of each head's dimensions rotated by RoPE.")
    use_rope_scaling: bool = _f(False, "Llama-3.1 RoPE frequency scaling (megatron-core's: low/high frequency factors 1 and 4, original context 8192).")
    rope_scaling_factor: float = _f(8.0, "The factor of --use-rope-scaling (Llama-3.1: 8, Llama-3.2: 32).")
    add_qkv_bias: bool = _f(False, "Biases on the query/key/value projection only (Qwen2), with --disable-bias-linear.")
    normalization: str = _f("LayerNorm", "LayerNorm or RMSNorm.", choices=["LayerNorm", "RMSNorm"])
    norm_epsilon: float = _f(1e-5, "Epsilon of the norms.")
    swiglu: bool = _f(False, "SwiGLU MLP (Llama).")
    disable_bias_linear: bool = _f(False, "No biases in linear layers (Llama).")
    untie_embeddings_and_output_weights: bool = _f(False, "Separate output layer instead of the tied input embedding.")
    init_method_std: float = _f(0.02, "Std of the normal initialisation.")
    hidden_dropout: float = _f(0.0, "Dropout on hidden states (Megatron-LM's default: 0.1).")
    attention_dropout: float = _f(0.0, "Dropout on attention probabilities (Megatron-LM's default: 0.1; packed sequences on GPUs then leave the flash varlen kernel).")
    recompute_activations: bool = _f(False, "Megatron-LM's alias of --recompute-granularity selective (core attention).")
    recompute_granularity: str | None = _f(None, "Activation recomputation: full (whole layers, with --recompute-method and --recompute-num-layers) or selective (the --recompute-modules of every layer).", choices=["full", "selective"])
    recompute_method: str | None = _f(None, "With full recompute: uniform (every layer, in groups of --recompute-num-layers) or block (the first --recompute-num-layers layers of each pipeline stage).", choices=["uniform", "block"])
    recompute_num_layers: int | None = _f(None, "With full recompute: layers per recomputed group (uniform) or layers recomputed per pipeline stage (block).")
    recompute_modules: list[str] = _f([], "With selective recompute: any of core_attn (default), layernorm, mlp.", nargs="*")
    make_vocab_size_divisible_by: int = _f(128, "Pad the vocabulary to a multiple of this (whatever the TP size, unlike Megatron-LM, which multiplies it by TP: every layout then trains the same model); --tensor-model-parallel-size must divide it.")
    transformer_impl: str = _f("auto", "Layer spec: local (torch), transformer_engine, or auto (TE when importable and CUDA is used).", choices=["auto", "local", "transformer_engine"])


@dataclass
class DataConfig:
    """Where tokens come from."""

    data_path: list[str] = _f([], "Indexed dataset prefixes, optionally weighted: 'w1 prefix1 w2 prefix2'.", nargs="*")
    data_args_path: str | None = _f(None, "A file holding what --data-path would ([w1] prefix1 [w2 prefix2 ...]; Megatron-LM).")
    train_data_path: list[str] = _f([], "The training blend ([w1] prefix1 ...), read whole (no --split); Megatron-LM.", nargs="*")
    valid_data_path: list[str] = _f([], "The validation blend ([w1] prefix1 ...), read whole.", nargs="*")
    test_data_path: list[str] = _f([], "The test blend ([w1] prefix1 ...), read whole (not read by training).", nargs="*")
    per_split_data_args_path: str | None = _f(None, "A JSON file {\"train\": \"[w1] prefix1 ...\", \"valid\": ..., \"test\": ...} (Megatron-LM).")
    split: str = _f("969,30,1", "Train,valid,test split weights of each dataset.")
    mock_data: bool = _f(False, "Synthetic data (megatron-core MockGPTDataset), no files.")
    tokenizer_type: str = _f("SentencePieceTokenizer", "NullTokenizer, SentencePieceTokenizer, GPTSentencePieceTokenizer, HuggingFaceTokenizer (a local tokenizer directory) or GPT2BPETokenizer (--vocab-file, --merge-file).")
    tokenizer_model: str | None = _f(None, "Sentencepiece .model, or a local Hugging Face tokenizer directory (nothing is downloaded).")
    vocab_file: str | None = _f(None, "GPT2BPETokenizer: vocab.json.")
    merge_file: str | None = _f(None, "GPT2BPETokenizer: merges.txt.")
    vocab_size: int | None = _f(None, "Vocabulary size for NullTokenizer (EOD is the id vocab_size).")
    data_cache_path: str | None = _f(None, "Where megatron-core caches its sample indices (default: beside the data).")
    packed_sequences: bool = _f(False, "Pack whole documents into each sample of at most --seq-length tokens (THD, cu_seqlens, no attention across documents); a micro-batch joins its --micro-batch-size packs into one THD sequence.", negative_flag=True)
    packing_strategy: str = _f("best_fit", "Packer for --packed-sequences: sequential (corpus order) or best_fit (fewest pad tokens).", choices=["sequential", "best_fit"])
    one_document_per_row: bool = _f(False, "One document per sample row, unpacked (variable-length rows, SFT-like), padded per step.")
    reset_position_ids: bool = _f(False, "megatron-core's GPTDataset windows: position ids restart after each EOD token (Megatron-LM).")
    reset_attention_mask: bool = _f(False, "megatron-core's GPTDataset windows: no attention across an EOD token (Megatron-LM); realised as THD document boundaries, never a dense [s, s] mask.")
    data_prefetch: bool = _f(True, "Build the next step's data (read, pack, pad, copy to the device) in a background thread while the current step runs (--no-data-prefetch: in the step).", negative_flag=True)
    num_workers: int = _f(0, "Worker processes reading samples (torch DataLoader, per rank); 0 reads them in the training process (its prefetch thread). Megatron-LM's default 2 would be 16 processes for 8 ranks on a 2-core machine.")
    eod_mask_loss: bool = _f(False, "Mask the loss of positions whose input token is EOD (Megatron-LM). With --packed-sequences / --one-document-per-row it holds already: a document's last token (its EOD) predicts nothing.")
    sequence_padding: str | None = _f(None, "static (to --seq-length), negotiated (one MAX over the pipeline per step) or variable (megatron-core variable_seq_lengths handshake). Default: negotiated with packed/variable-length samples, else static.", choices=["static", "negotiated", "variable"])
    pad_to_multiple_of: int = _f(64, "Round negotiated/variable lengths up to a multiple of this (--seq-length must be one).")


DEFAULT_TRAIN_ITERS = 100


@dataclass
class TrainingConfig:
    """Batch, schedule, optimizer and loss."""

    micro_batch_size: int = _f(1, "Samples per micro-batch per DP rank.")
    global_batch_size: int | None = _f(None, "Samples per step over all DP ranks (default: micro-batch x DP).")
    train_iters: int | None = _f(None, f"Training steps (default {DEFAULT_TRAIN_ITERS} unless --train-samples).")
    train_samples: int | None = _f(None, "Run length in samples instead of --train-iters (Megatron-LM): steps = samples // global batch, and the LR/WD schedule is given in samples (--lr-warmup-samples, --lr-decay-samples, --lr-wsd-decay-samples).")
    seed: int = _f(1234, "Random seed (initial weights depend only on it and each parameter's name and shape).")
    optimizer: str = _f("adam", "adam (AdamW, decoupled weight decay) or sgd (not with --use-distributed-optimizer, which shards Adam only).", choices=["adam", "sgd"])
    lr: float = _f(3e-4, "Peak learning rate.")
    min_lr: float = _f(0.0, "Learning rate at the end of the decay.")
    lr_warmup_iters: int = _f(0, "Linear warm-up steps.")
    lr_decay_iters: int | None = _f(None, "Decay steps (default: --train-iters).")
    lr_warmup_samples: int = _f(0, "Linear warm-up in samples (with --train-samples).")
    lr_decay_samples: int | None = _f(None, "Decay length in samples (with --train-samples; default: --train-samples).")
    lr_warmup_fraction: float | None = _f(None, "Warm-up as a fraction of the decay length (instead of --lr-warmup-iters/-samples).")
    lr_decay_style: str = _f("cosine", "constant, linear, cosine (ours; Megatron-LM's default is linear), inverse-square-root or WSD (warmup-stable-decay: --lr-wsd-decay-iters/-samples at the end of the decay length, shaped by --lr-wsd-decay-style).", choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"])
    lr_wsd_decay_style: str = _f("exponential", "Shape of the WSD decay phase.", choices=["exponential", "linear", "cosine", "minus_sqrt"])
    lr_wsd_decay_iters: int | None = _f(None, "Length of the WSD decay phase in steps (--lr-decay-style WSD with --train-iters).")
    lr_wsd_decay_samples: int | None = _f(None, "Length of the WSD decay phase in samples (--lr-decay-style WSD with --train-samples).")
    rampup_batch_size: list[str] = _f([], "Megatron-LM's batch-size ramp-up: not supported (refused; use a constant --global-batch-size).", nargs="*")
    weight_decay: float = _f(0.01, "Weight decay.")
    adam_beta1: float = _f(0.9, "Adam beta1.")
    adam_beta2: float = _f(0.999, "Adam beta2.")
    adam_eps: float = _f(1e-8, "Adam epsilon.")
    clip_grad: float = _f(1.0, "Clip the global gradient norm to this (0 disables).")
    calculate_per_token_loss: bool = _f(True, "Token-sum loss: divide by valid tokens of the whole global batch (default on; --no-calculate-per-token-loss: mean of per-micro-batch means, as older Megatron-LM runs).", negative_flag=True)
    check_for_nan_in_loss_and_grad: bool = _f(True, "Skip, on every rank, an update whose loss or gradients are not finite, and count it in 'nan iterations' (default on; --no-check-for-nan-in-loss-and-grad applies such updates, as before).", negative_flag=True)
    max_nan_iterations: int = _f(3, "Stop (exit 1, no checkpoint written) after this many consecutive non-finite iterations (ours).")
    eval_interval: int = _f(0, "Evaluate on the validation split every N steps (0: never).")
    eval_iters: int = _f(100, "Validation batches (global batches) per evaluation (default 100, as Megatron-LM).")
    bf16: bool = _f(False, "bf16 mixed precision: bf16 weights and activations (megatron-core Float16Module), fp32 main parameters, gradients and loss. Runs on the CPU too, slowly.", negative_flag=True)
    gradient_accumulation_fusion: bool = _f(True, "Accumulate each weight gradient into its fp32 gradient buffer inside the GEMM (megatron-core's fused path, through torch's addmm with out_dtype where Apex is missing; default on, as in Megatron-LM; --no-gradient-accumulation-fusion: a bf16 gradient added by DDP's hook).", negative_flag=True)
    fp16: bool = _f(False, "fp16 mixed precision with megatron-core's loss scaler (dynamic unless --loss-scale).")
    loss_scale: float | None = _f(None, "Static loss scale for --fp16 (default: dynamic).")
    initial_loss_scale: float = _f(2.0 ** 32, "Initial dynamic loss scale (--fp16).")
    min_loss_scale: float = _f(1.0, "Smallest dynamic loss scale (--fp16).")
    loss_scale_window: int = _f(1000, "Steps without overflow before the dynamic loss scale grows (--fp16).")
    hysteresis: int = _f(2, "Overflows tolerated before the dynamic loss scale shrinks (--fp16).")
    empty_unused_memory_level: int = _f(0, "Return cached CUDA memory to the driver: 1 after each forward-backward, 2 also after the optimizer step (as Megatron-LM; costs time; nothing on CPU).", choices=[0, 1, 2])


@dataclass
class LoggingConfig:
    """What is printed and recorded."""

    log_interval: int = _f(100, "Print a log line every N steps (and at the last; default 100, as Megatron-LM).")
    tensorboard_dir: str | None = _f(None, "Write TensorBoard scalars here.")
    tensorboard_log_interval: int = _f(1, "Write each N-th iteration's lm loss, learning rate and grad norm to TensorBoard/wandb (default 1, as Megatron-LM; written at each log line, without another all-reduce); throughput and timers at log lines.")
    wandb_project: str | None = _f(None, "Weights & Biases project (WANDB_MODE=offline works).")
    wandb_exp_name: str | None = _f(None, "Weights & Biases run name.")
    wandb_save_dir: str | None = _f(None, "Weights & Biases directory.")
    pp_timeline: str | None = _f(None, "Record a per-rank pipeline timeline (forward/backward/optimizer spans) under this directory.")
    timing_log_level: int = _f(0, "Step timers in the log line: 0 none, 1 data / forward-backward / optimizer, 2 also grad-reduce (synchronises CUDA at each timer: leave 0 for throughput runs).", choices=[0, 1, 2])
    log_timers_to_tensorboard: bool = _f(False, "Write the step timers to TensorBoard too.")
    log_memory_to_tensorboard: bool = _f(False, "Write memory (CUDA allocated/reserved, or the CPU's max RSS) to TensorBoard at each log line.")
    profile: bool = _f(False, "Profile iterations --profile-step-start to --profile-step-end: with --use-pytorch-profiler a torch.profiler trace per rank into --tensorboard-dir, else CUDA profiler ranges for nsys (CUDA only).")
    use_pytorch_profiler: bool = _f(False, "With --profile: use torch.profiler (traces in --tensorboard-dir).")
    profile_step_start: int = _f(10, "First profiled iteration.")
    profile_step_end: int = _f(12, "Iteration at which profiling stops.")
    profile_ranks: list[str] = _f(["0"], "Global ranks that profile.", nargs="*")
    manual_gc: bool = _f(False, "Disable Python's automatic garbage collection during training; collect every --manual-gc-interval iterations on every rank.")
    manual_gc_interval: int = _f(0, "Iterations between manual collections (0: never).")


@dataclass
class CheckpointConfig:
    """Distributed checkpoints."""

    save: str | None = _f(None, "Directory to save checkpoints to.")
    save_interval: int | None = _f(None, "Save every N steps (and at the end).")
    load: str | None = _f(None, "Directory to resume from (its newest complete checkpoint).")
    keep_last: int | None = _f(None, "Keep only the newest N complete checkpoints (never deletes the newest).")
    no_load_optim: bool = _f(False, "Load model weights only (fresh optimizer).")
    finetune: bool = _f(False, "Load the model weights of --load only: iteration, optimizer, LR schedule and RNG start afresh.")
    pretrained_checkpoint: str | None = _f(None, "Weights to fine-tune from (as --finetune) when --load holds no checkpoint yet; a later restart resumes from --load.")
    no_load_rng: bool = _f(False, "Do not restore the checkpoint's random-number states (they are re-seeded from --seed).")
    ckpt_step: int | None = _f(None, "Load this iteration of --load instead of its newest complete checkpoint.")
    exit_on_missing_checkpoint: bool = _f(False, "With --load: a directory holding no checkpoint is an error even when it is --save.")
    override_opt_param_scheduler: bool = _f(False, "On resume, this run's LR/WD schedule and Adam flags (--lr, --min-lr, --adam-beta1/2, --adam-eps) win over the checkpoint's in every parameter group, from the first resumed step.")
    use_checkpoint_opt_param_scheduler: bool = _f(False, "On resume, the checkpoint's LR/WD schedule and Adam betas/eps win over this run's flags.")
    ckpt_verify: bool = _f(False, "Check every item --load reads against the checksum its marker records (ours). Off by default: measured +9-34% of load time from the page cache here (bench/checkpoint.py), over the 5% budget; the coordinator files and the shard sizes are always checked.", negative_flag=True)
    ckpt_fallback_on_corruption: bool = _f(False, "When the checkpoint --load names is damaged (checksum mismatch, unreadable file), load the previous complete one instead of stopping (ours).")
    ckpt_reader: str = _f("direct", "How --load reads tensor bytes: direct (ours, straight into the model and optimizer tensors) or megatron (megatron-core's stock torch_dist reader). Same files either way.", choices=["direct", "megatron"])
    async_save: bool = _f(False, "Write checkpoints in a background thread while training goes on: the save step copies this rank's share of the checkpoint into host memory (kept for the next save), the checkpoint is published at the first step boundary after every rank finished writing; the last save of a run and a save before an exit stay synchronous.")
    exit_signal_handler: bool = _f(False, "On SIGTERM/SIGINT: all ranks agree at the next step boundary, save, exit 0.")
    exit_interval: int | None = _f(None, "Save and exit after the step whose number is a multiple of N.")
    exit_duration_in_mins: float | None = _f(None, "Save and exit once the run has lasted this many minutes.")


@dataclass
class JobConfig:
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def to_flat_dict(self) -> dict[str, Any]:
        return {k: v for section in self.sections() for k, v in dataclasses.asdict(section).items()}

    def sections(self) -> list[Any]:
        return [getattr(self, f.name) for f in dataclasses.fields(self)]


SECTION_TYPES: dict[str, type] = {
    "parallel": ParallelConfig,
    "model": ModelConfig,
    "data": DataConfig,
    "training": TrainingConfig,
    "logging": LoggingConfig,
    "checkpoint": CheckpointConfig,
}


def get_field_section() -> dict[str, str]:
    """Field name -> section name, over every section."""
    return {f.name: s for s, cls in SECTION_TYPES.items() for f in dataclasses.fields(cls)}


class ConfigError(ValueError):
    """A problem a user can cause and fix (flags, config files, data, tokenizer, checkpoint
    directories): every one found, one per line, each naming the flag or file and the fix. The
    entry point prints it once as an ``error:`` block and exits 2, without a traceback."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("invalid configuration:\n" + "\n".join(f"  - {p}" for p in self.problems))

    def __reduce__(self):  # from a worker process with its problems intact (not re-split per character)
        return type(self), (self.problems,)


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
            os.close(os.open(os.path.join(tempfile.gettempdir(), f"megatron_ext-error-{digest}"),
                             os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        except OSError:
            pass  # no temporary directory: print rather than stay silent
    print(f"error: {message}", file=sys.stderr, flush=True)
    return True


def build_job_config(values: dict[str, Any]) -> JobConfig:
    """Build a JobConfig from flat ``{field_name: value}``; unknown names are an error."""
    where = get_field_section()
    unknown = sorted(k for k in values if k not in where)
    if unknown:
        raise ConfigError([f"unknown setting '{k}' (no flag --{k.replace('_', '-')})" for k in unknown])
    per_section: dict[str, dict[str, Any]] = {s: {} for s in SECTION_TYPES}
    for k, v in values.items():
        per_section[where[k]][k] = v
    cfg = JobConfig(**{s: SECTION_TYPES[s](**kw) for s, kw in per_section.items()})
    if cfg.training.train_iters is None and cfg.training.train_samples is None:
        cfg.training.train_iters = DEFAULT_TRAIN_ITERS
    return cfg


# ----------------------------------------------------------------------------- derived values


def get_data_parallel_size(cfg: JobConfig, world_size: int) -> int:
    p = cfg.parallel
    return world_size // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size)


def get_virtual_pipeline_size(cfg: JobConfig) -> int | None:
    """Virtual stages per pipeline rank, or None without interleaving (one virtual stage per rank,
    e.g. a config's --num-layers-per-virtual-pipeline-stage 1 with 4 layers at PP 4: megatron-core
    would otherwise be told VPP = 1 and assert that every layer names its virtual stage)."""
    p, m = cfg.parallel, cfg.model
    vpp = get_schedule_chunks(cfg)  # the V schedules imply 2 chunks per rank
    # 0 means "not set", so that a flag can switch off a config file's interleaving
    if p.num_virtual_stages_per_pipeline_rank:
        vpp = p.num_virtual_stages_per_pipeline_rank
    elif p.num_layers_per_virtual_pipeline_stage:
        vpp = m.num_layers // (p.pipeline_model_parallel_size * p.num_layers_per_virtual_pipeline_stage)
    return vpp if vpp is not None and vpp > 1 else None


def get_stage_placement(cfg: JobConfig) -> str:
    """"v" when --pipeline-schedule names a V-shaped schedule (ZBV, DualPipeV), else "loop"
    (``pipeline/placement.py``)."""
    from megatron_ext.pipeline.names import get_schedule_placement

    name = cfg.parallel.pipeline_schedule
    return get_schedule_placement(name) if name else "loop"


def get_chunk_layer_counts(cfg: JobConfig) -> list[int] | None:
    """Transformer layers of each model chunk, (pipeline rank, virtual stage) in order, as
    megatron-core's ``get_num_layers_to_build`` splits them (even, first/last or accounted
    splits); None when the layout flags do not split the layers (reported by ``_check_layout``)."""
    p, layers = cfg.parallel, cfg.model.num_layers
    pp, v = p.pipeline_model_parallel_size, get_virtual_pipeline_size(cfg) or 1
    if pp <= 0 or layers <= 0:
        return None
    first, last = p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers
    emb, loss = bool(p.account_for_embedding_in_pipeline_split), bool(p.account_for_loss_in_pipeline_split)
    if first is not None or last is not None:
        middle_layers = layers - (first or 0) - (last or 0)
        middle_stages = pp - (first is not None) - (last is not None)
        if middle_layers < 0 or (middle_stages > 0 and middle_layers % middle_stages):
            return None
        per_stage = [middle_layers // middle_stages if middle_stages > 0 else 0] * pp
        if first is not None:
            per_stage[0] = first
        if last is not None:
            per_stage[-1] = last
    else:
        units = layers + emb + loss
        if units % pp:
            return None
        per_stage = [units // pp] * pp
    if any(n % v for n in per_stage):
        return None
    counts = [n // v for n in per_stage for _ in range(v)]
    counts[0] -= emb  # the embedding and the loss counted as layers take a layer's place
    counts[-1] -= loss
    return counts if min(counts) >= 0 else None


def get_global_batch_size(cfg: JobConfig, world_size: int) -> int:
    t = cfg.training
    return t.global_batch_size or t.micro_batch_size * get_data_parallel_size(cfg, world_size)


def get_train_iters(cfg: JobConfig, world_size: int) -> int:
    """Training steps: --train-iters, or --train-samples // global batch (as Megatron-LM)."""
    t = cfg.training
    if t.train_samples is not None:
        return t.train_samples // get_global_batch_size(cfg, world_size)
    return t.train_iters


def resolve_train_iters(cfg: JobConfig, world_size: int) -> None:
    """The one derived value written back into the config: with --train-samples, ``train_iters``
    becomes the step count it implies, so that the loop, the logs and the data builder count
    steps alike. Called once by ``run.build_training_run``."""
    cfg.training.train_iters = get_train_iters(cfg, world_size)


@dataclass(frozen=True)
class ScheduleSteps:
    """megatron-core's OptimizerParamScheduler lengths, in samples."""

    lr_warmup_steps: float  # not rounded with --lr-warmup-fraction, as in Megatron-LM
    lr_decay_steps: int
    wd_incr_steps: int
    wsd_decay_steps: int | None


def get_schedule_steps(cfg: JobConfig, global_batch_size: int, train_iters: int) -> ScheduleSteps:
    """The schedule in samples, as Megatron-LM's ``get_optimizer_param_scheduler`` computes it:
    from iteration flags times the global batch, or from the sample flags with --train-samples; a
    warm-up fraction is of the decay length, not rounded (Megatron-LM passes
    ``lr_warmup_fraction * lr_decay_steps`` to the scheduler as it is)."""
    t = cfg.training
    if t.train_samples is None:
        decay = (t.lr_decay_iters or train_iters) * global_batch_size
        wd_incr = train_iters * global_batch_size
        wsd = t.lr_wsd_decay_iters * global_batch_size if t.lr_wsd_decay_iters is not None else None
        warmup = t.lr_warmup_iters * global_batch_size
    else:
        decay = t.lr_decay_samples or t.train_samples
        wd_incr = t.train_samples
        wsd = t.lr_wsd_decay_samples
        warmup = t.lr_warmup_samples
    if t.lr_warmup_fraction is not None:
        warmup = t.lr_warmup_fraction * decay
    return ScheduleSteps(warmup, decay, wd_incr, wsd if t.lr_decay_style == "WSD" else None)


def get_num_microbatches(cfg: JobConfig, world_size: int) -> int:
    """Micro-batches per step on each DP rank."""
    dp = get_data_parallel_size(cfg, world_size)
    return get_global_batch_size(cfg, world_size) // (cfg.training.micro_batch_size * dp)


def get_padded_vocab_size(vocab_size: int, cfg: JobConfig) -> int:
    """The vocabulary rounded up to --make-vocab-size-divisible-by, whatever the layout.

    Megatron-LM multiplies the multiple by TP, so a TP2 run would pad 513 ids to 768 and one process
    to 640: different models (the padded rows take part in the softmax). Ours does not; validation
    requires TP to divide the multiple, so the padded vocabulary always splits over TP."""
    multiple = cfg.model.make_vocab_size_divisible_by
    return int(math.ceil(vocab_size / multiple) * multiple)


def get_num_query_groups(cfg: JobConfig) -> int:
    m = cfg.model
    return m.num_query_groups if m.group_query_attention and m.num_query_groups else m.num_attention_heads


def uses_variable_lengths(cfg: JobConfig) -> bool:
    return cfg.data.packed_sequences or cfg.data.one_document_per_row


def get_params_dtype(cfg: JobConfig):
    """The dtype of weights and activations: bf16, fp16 or fp32."""
    import torch

    if cfg.training.bf16:
        return torch.bfloat16
    return torch.float16 if cfg.training.fp16 else torch.float32


RECOMPUTE_MODULES = ("core_attn", "layernorm", "mlp")  # the dense model's (megatron-core also has MoE/MLA ones)


def get_recompute(cfg: JobConfig) -> dict[str, Any]:
    """megatron-core's TransformerConfig recompute fields for this job (--recompute-activations is
    selective recompute of core attention, as in Megatron-LM)."""
    m = cfg.model
    granularity = m.recompute_granularity or ("selective" if m.recompute_activations else None)
    if granularity is None:
        return {}
    out: dict[str, Any] = {"recompute_granularity": granularity}
    if granularity == "full":
        out.update(recompute_method=m.recompute_method, recompute_num_layers=m.recompute_num_layers)
    else:
        out["recompute_modules"] = list(m.recompute_modules) or ["core_attn"]
    return out


def uses_document_boundaries(cfg: JobConfig) -> bool:
    """Micro-batches carry THD document boundaries: packed documents, or GPTDataset windows split
    at their EOD tokens (--reset-attention-mask / --reset-position-ids)."""
    d = cfg.data
    return d.packed_sequences or ((d.reset_attention_mask or d.reset_position_ids) and not d.one_document_per_row)


def get_max_microbatch_length(cfg: JobConfig) -> int:
    """A micro-batch's longest possible length: --seq-length, or, with THD boundaries, its b
    samples joined."""
    packs = cfg.training.micro_batch_size if uses_document_boundaries(cfg) else 1
    return cfg.model.seq_length * packs


def get_sequence_padding(cfg: JobConfig) -> str:
    if cfg.data.sequence_padding:
        return cfg.data.sequence_padding
    return "negotiated" if uses_variable_lengths(cfg) else "static"


# ----------------------------------------------------------------------------- validation


def precision_name(bf16: bool, fp16: bool) -> str:
    """The training precision of the --bf16/--fp16 flags: bf16, fp16 or fp32."""
    return "bf16" if bf16 else "fp16" if fp16 else "fp32"


def adjust_like_megatron(cfg: JobConfig) -> list[str]:
    """Settings Megatron-LM adjusts rather than refuses, adjusted the same way in ``cfg``; returns
    one notice line for each (printed at start-up)."""
    notes = []
    p, t = cfg.parallel, cfg.training
    if p.sequence_parallel and p.tensor_model_parallel_size == 1:
        p.sequence_parallel = False  # Megatron-LM: sequence parallelism is off without TP
        notes.append("--sequence-parallel is off: it splits activations over the tensor-parallel ranks, "
                     "and --tensor-model-parallel-size is 1 (Megatron-LM turns it off too)")
    m = cfg.model
    if m.num_query_groups is not None and not m.group_query_attention:
        notes.append(f"--num-query-groups {m.num_query_groups}: ignored without --group-query-attention, every "
                     f"attention head keeps its own key/value head (as in Megatron-LM); add --group-query-attention "
                     f"for grouped-query attention")
    if t.eval_interval and t.eval_iters == 0:
        t.eval_interval = 0  # Megatron-LM: no validation without validation batches
        notes.append("--eval-iters 0: no validation (--eval-interval is ignored)")
    c = cfg.checkpoint
    for flag, value in (("--exit-signal-handler", c.exit_signal_handler), ("--exit-interval", c.exit_interval),
                        ("--exit-duration-in-mins", c.exit_duration_in_mins)):
        if value and not c.save:  # Megatron-LM: exits, and saves only with --save
            notes.append(f"{flag} without --save: the run stops there without saving a checkpoint")
    d = cfg.data
    per_split = [flag for flag, given in (("--train-data-path", d.train_data_path),
                                          ("--per-split-data-args-path", d.per_split_data_args_path)) if given]
    if per_split and d.split != DataConfig.__dataclass_fields__["split"].default:
        notes.append(f"--split {d.split}: ignored, {per_split[0]} gives each split its own data "
                     f"(read whole; Megatron-LM ignores --split there too)")
    if not t.fp16:
        given = [f"--{name.replace('_', '-')}" for name in
                 ("loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis")
                 if getattr(t, name) != TrainingConfig.__dataclass_fields__[name].default]
        if given:
            notes.append(f"{', '.join(given)}: loss scaling is for --fp16 only; ignored in "
                         f"{precision_name(t.bf16, t.fp16)}")
    return notes


def validate(cfg: JobConfig, world_size: int, cuda: bool = False) -> None:
    """Raise ConfigError listing every problem; pure (no process group, no file written)."""
    problems = (
        _check_positive(cfg)
        + _check_layout(cfg, world_size)
        + _check_model(cfg, world_size)
        + _check_batch(cfg, world_size)
        + _check_schedule(cfg)
        + _check_pipeline_schedule(cfg, world_size)
        + _check_v_split(cfg)
        + _check_data(cfg)
        + _check_device(cfg, cuda)
        + _check_loss_scaling(cfg)
        + _check_stall_limits(cfg)
    )
    if problems:
        raise ConfigError(problems)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check_positive(cfg: JobConfig) -> list[str]:
    """Sizes that cannot be zero, optional sizes that must be positive when given, rates >= 0."""
    p, m, t, d = cfg.parallel, cfg.model, cfg.training, cfg.data
    sizes = [
        ("tensor_model_parallel_size", p), ("pipeline_model_parallel_size", p), ("num_layers", m),
        ("hidden_size", m), ("num_attention_heads", m), ("seq_length", m), ("micro_batch_size", t),
        ("log_interval", cfg.logging), ("tensorboard_log_interval", cfg.logging), ("make_vocab_size_divisible_by", m),
        ("pad_to_multiple_of", d), ("max_nan_iterations", t),
        ("distributed_timeout_minutes", p),  # 0: torch's process-group creation times out at once
        ("rotary_base", m),  # 0 or below: NaN RoPE frequencies, a NaN loss from the first step
    ]
    optional_sizes = [("global_batch_size", t), ("ffn_hidden_size", m), ("num_query_groups", m),
                      ("max_position_embeddings", m), ("lr_decay_iters", t), ("vocab_size", d), ("train_iters", t),
                      ("train_samples", t), ("lr_decay_samples", t), ("lr_wsd_decay_iters", t),
                      ("lr_wsd_decay_samples", t)]
    rates = [("lr", t), ("min_lr", t), ("weight_decay", t), ("adam_eps", t), ("clip_grad", t),
             ("init_method_std", m), ("norm_epsilon", m)]
    out = [f"{_flag(n)} must be a positive integer, got {getattr(s, n)!r}"
           for n, s in sizes if not (type(getattr(s, n)) is int and getattr(s, n) > 0)]
    out += [f"{_flag(n)} must be a positive integer when given, got {getattr(s, n)!r}"
            for n, s in optional_sizes if getattr(s, n) is not None and not (type(getattr(s, n)) is int and getattr(s, n) > 0)]
    out += [f"{_flag(n)} must be a number >= 0, got {getattr(s, n)!r}"
            for n, s in rates if not (isinstance(getattr(s, n), (int, float)) and getattr(s, n) >= 0)]
    for name in ("adam_beta1", "adam_beta2"):
        if not 0.0 <= getattr(t, name) < 1.0:
            out.append(f"{_flag(name)} must be in [0, 1), got {getattr(t, name)}")
    return out


def _check_stall_limits(cfg: JobConfig) -> list[str]:
    """The watchdog's limits: positive and finite (0, -1 and nan used to turn it off silently or end
    rank 0 in iteration 1), and below the collective timeout, which would otherwise end the run first
    with a message that names no rank."""
    p, out = cfg.parallel, []
    for name in ("step_timeout_minutes", "save_timeout_minutes"):
        value = getattr(p, name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
            out.append(f"{_flag(name)} must be a positive number of minutes, got {value!r} (leave it out to turn the "
                       f"watchdog off)")
        elif isinstance(p.distributed_timeout_minutes, int) and value >= p.distributed_timeout_minutes:
            out.append(f"{_flag(name)} {value:g} must be below --distributed-timeout-minutes "
                       f"{p.distributed_timeout_minutes}, or the collective timeout ends a stalled run first, naming "
                       f"no rank: lower it, or raise --distributed-timeout-minutes")
    return out


def _check_loss_scaling(cfg: JobConfig) -> list[str]:
    """--fp16's loss-scale flags, which megatron-core's grad scalers assert on (an AssertionError
    with no message after the model is built); without --fp16 they are ignored with a notice."""
    t = cfg.training
    if not t.fp16:
        return []
    if t.loss_scale is not None:
        if not t.loss_scale > 0:  # megatron-core reads 0 as "dynamic", below 0 it asserts
            return [f"--loss-scale must be > 0, got {t.loss_scale} (leave it out for dynamic loss scaling)"]
        return []
    out = [f"{_flag(name)} must be > 0, got {getattr(t, name)}"
           for name in ("initial_loss_scale", "min_loss_scale") if not getattr(t, name) > 0]
    if not out and t.min_loss_scale > t.initial_loss_scale:
        out.append(f"--min-loss-scale {t.min_loss_scale} is larger than --initial-loss-scale {t.initial_loss_scale}")
    out += [f"{_flag(name)} must be a positive integer, got {getattr(t, name)}"
            for name in ("loss_scale_window", "hysteresis") if not getattr(t, name) > 0]
    return out


def _check_layout(cfg: JobConfig, world_size: int) -> list[str]:
    p, m = cfg.parallel, cfg.model
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    if tp <= 0 or pp <= 0 or m.num_layers <= 0:
        return []
    out = []
    if world_size % (tp * pp):
        out.append(
            f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
            f"--pipeline-model-parallel-size {pp} = {tp * pp}: launch a multiple of {tp * pp} "
            f"processes or change TP/PP"
        )
    lps = p.num_layers_per_virtual_pipeline_stage or None  # 0: not set
    vps = p.num_virtual_stages_per_pipeline_rank or None
    if uses_uneven_split(cfg):
        out += _check_uneven_split(cfg, pp, lps, vps)
    elif lps is not None and vps is not None and lps * vps * pp != m.num_layers:
        out.append(
            f"--num-layers-per-virtual-pipeline-stage {lps} and --num-virtual-stages-per-pipeline-rank "
            f"{vps} disagree: with --pipeline-model-parallel-size {pp} they give {lps * vps * pp} layers, "
            f"--num-layers is {m.num_layers}; give only one of the two"
        )
    elif lps is not None and (lps <= 0 or m.num_layers % (pp * lps)):
        out.append(
            f"--num-layers {m.num_layers} is not divisible by --pipeline-model-parallel-size {pp} x "
            f"--num-layers-per-virtual-pipeline-stage {lps} = {pp * lps}: choose a layers-per-stage "
            f"that divides {m.num_layers // pp if m.num_layers % pp == 0 else m.num_layers} "
        )
    elif vps is not None and (vps <= 0 or m.num_layers % (pp * vps)):
        out.append(
            f"--num-layers {m.num_layers} is not divisible by --pipeline-model-parallel-size {pp} x "
            f"--num-virtual-stages-per-pipeline-rank {vps} = {pp * vps}"
        )
    elif m.num_layers % pp:
        out.append(
            f"--num-layers {m.num_layers} is not divisible by --pipeline-model-parallel-size {pp}: "
            f"use a multiple of {pp} layers"
        )
    vpp = get_virtual_pipeline_size(cfg) if not out else None
    if vpp is not None and vpp > 1 and pp == 1:
        out.append(
            f"interleaved schedule ({vpp} virtual stages per pipeline rank) needs "
            f"--pipeline-model-parallel-size > 1, got 1: drop --num-layers-per-virtual-pipeline-stage / "
            f"--num-virtual-stages-per-pipeline-rank"
        )
    return out


def _check_v_split(cfg: JobConfig) -> list[str]:
    """Uneven splits under the V placement. megatron-core defines them per pipeline *rank* of the loop
    placement (the first rank's layers shared by its chunks, the last rank's likewise) and checks
    them so in TransformerConfig; under V the first and the last *stage* are both on rank 0, where
    they would have to mean stage 0 and stage 2p-1. Refused until the layer numbering of the V
    placement (model/v_placement.py) learns that split."""
    if get_stage_placement(cfg) != "v" or not uses_uneven_split(cfg):
        return []
    return [f"--pipeline-schedule {cfg.parallel.pipeline_schedule} places the first and the last pipeline stage on "
            f"rank 0; --decoder-first/last-pipeline-num-layers and --account-for-embedding/loss-in-pipeline-split "
            f"split layers per rank of megatron-core's loop placement and are not supported with it: drop them (an "
            f"even split), or use ZBH1 / InterleavedZeroBubble"]


def uses_uneven_split(cfg: JobConfig) -> bool:
    p = cfg.parallel
    return (p.decoder_first_pipeline_num_layers is not None or p.decoder_last_pipeline_num_layers is not None
            or p.account_for_embedding_in_pipeline_split or p.account_for_loss_in_pipeline_split
            or bool(p.pipeline_model_parallel_layout))


def _check_uneven_split(cfg: JobConfig, pp: int, lps: int | None, vps: int | None) -> list[str]:
    """megatron-core's rules for uneven pipeline splits (it checks them in TransformerConfig, with
    messages that name no flag), with Megatron-LM's: VPP only through the number of virtual stages."""
    p, layers = cfg.parallel, cfg.model.num_layers
    first, last = p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers
    accounts = p.account_for_embedding_in_pipeline_split or p.account_for_loss_in_pipeline_split
    out = []
    if p.pipeline_model_parallel_layout:
        out.append("--pipeline-model-parallel-layout is not supported: use --decoder-first/last-pipeline-num-layers "
                   "or --account-for-embedding/loss-in-pipeline-split")
    if pp < 2:
        return out + ["uneven pipeline splits need --pipeline-model-parallel-size > 1"]
    if lps is not None:
        return out + ["uneven pipeline splits take virtual stages as --num-virtual-stages-per-pipeline-rank, not "
                      "--num-layers-per-virtual-pipeline-stage (as in Megatron-LM)"]
    v = vps or 1
    if (first is not None or last is not None) and accounts:
        return out + ["--decoder-first/last-pipeline-num-layers and --account-for-embedding/loss-in-pipeline-split "
                      "are exclusive: give one way of splitting"]
    if accounts:
        units = layers + p.account_for_embedding_in_pipeline_split + p.account_for_loss_in_pipeline_split
        if units % (pp * v):
            out.append(f"--num-layers {layers} plus the embedding/loss counted as layers = {units} is not divisible "
                       f"by --pipeline-model-parallel-size {pp} x virtual stages {v} = {pp * v}")
        return out
    middle_layers, middle_stages = layers, pp
    for flag, n in (("--decoder-first-pipeline-num-layers", first), ("--decoder-last-pipeline-num-layers", last)):
        if n is None:
            continue
        if n <= 0 or n % v:
            out.append(f"{flag} {n} must be a positive multiple of the {v} virtual stages per pipeline rank")
        middle_layers, middle_stages = middle_layers - n, middle_stages - 1
    if v > 1 and middle_stages == 0:
        out.append("with virtual stages, --decoder-first-pipeline-num-layers and --decoder-last-pipeline-num-layers "
                   "need a middle pipeline stage (megatron-core 0.16.1 divides by the middle stages): raise "
                   "--pipeline-model-parallel-size or give one of the two")
    elif middle_layers < 0 or bool(middle_layers) != bool(middle_stages) or (
            middle_stages and middle_layers % (middle_stages * v)):
        out.append(f"--num-layers {layers} minus the first/last stages' layers leaves {middle_layers} for "
                   f"{middle_stages} middle stages x {v} virtual stages: they must split evenly (and exist "
                   f"together)")
    return out


def _check_model(cfg: JobConfig, world_size: int) -> list[str]:
    m, tp = cfg.model, cfg.parallel.tensor_model_parallel_size
    out = []
    if m.num_attention_heads > 0 and m.hidden_size % m.num_attention_heads:
        out.append(
            f"--hidden-size {m.hidden_size} is not divisible by --num-attention-heads "
            f"{m.num_attention_heads}"
        )
    if tp > 0 and m.make_vocab_size_divisible_by > 0 and m.make_vocab_size_divisible_by % tp:
        out.append(
            f"--make-vocab-size-divisible-by {m.make_vocab_size_divisible_by} is not divisible by "
            f"--tensor-model-parallel-size {tp}: the padded vocabulary is split over TP; use a multiple "
            f"of {tp} (ours pads the same at every TP size, unlike Megatron-LM's divisible-by x TP)"
        )
    if tp > 0 and m.num_attention_heads % tp:
        out.append(
            f"--num-attention-heads {m.num_attention_heads} is not divisible by "
            f"--tensor-model-parallel-size {tp}: use a TP size that divides the heads"
        )
    if m.group_query_attention:
        g = m.num_query_groups
        if not g or g <= 0:
            out.append("--group-query-attention needs --num-query-groups N (N > 0)")
        else:
            if m.num_attention_heads % g:
                out.append(f"--num-attention-heads {m.num_attention_heads} is not divisible by --num-query-groups {g}")
            if tp > 0 and g % tp:
                out.append(f"--num-query-groups {g} is not divisible by --tensor-model-parallel-size {tp}")
    ffn = m.ffn_hidden_size
    if ffn is not None and tp > 0 and ffn % tp:
        out.append(f"--ffn-hidden-size {ffn} is not divisible by --tensor-model-parallel-size {tp}")
    if ffn is None and m.swiglu and m.hidden_size > 0:
        from megatron_ext.model.gpt import resolve_ffn_hidden_size

        default = resolve_ffn_hidden_size(None, m.hidden_size, True)
        what = (f"--swiglu with --hidden-size {m.hidden_size}: the default --ffn-hidden-size (2/3 of 4 x hidden, "
                f"rounded down to a multiple of 64, as Megatron-LM) is {default}")
        if default == 0:
            out.append(f"{what}; give --ffn-hidden-size")
        elif tp > 0 and default % tp:
            # megatron-core: an AssertionError traceback from ColumnParallelLinear while building the MLP
            out.append(f"{what}, not divisible by --tensor-model-parallel-size {tp}: give --ffn-hidden-size, a "
                       f"multiple of {tp}")
    if m.position_embedding_type == "learned_absolute":
        max_pos = m.max_position_embeddings or m.seq_length
        if max_pos < m.seq_length:
            out.append(
                f"--seq-length {m.seq_length} exceeds --max-position-embeddings {max_pos}: raise "
                f"--max-position-embeddings or use --position-embedding-type rope"
            )
    if m.position_embedding_type == "rope":
        if not 0.0 < m.rotary_percent <= 1.0:
            # megatron-core rotates the whole head above 1 (silently 1.0) and nothing at 0
            out.append(f"--rotary-percent must be in (0, 1] (the fraction of each head's dimensions RoPE rotates), "
                       f"got {m.rotary_percent}")
        elif m.num_attention_heads > 0 and m.hidden_size % m.num_attention_heads == 0:
            head = m.hidden_size // m.num_attention_heads
            if head % 2 and int(head * m.rotary_percent) == head:
                # megatron-core builds ceil(d / 2) frequency pairs: d + 1 rotated dimensions, a shape error
                # mid-forward
                out.append(f"--position-embedding-type rope rotates dimension pairs, but the head dimension "
                           f"(--hidden-size {m.hidden_size} / --num-attention-heads {m.num_attention_heads}) "
                           f"is {head}, odd: choose an even head dimension (or --rotary-percent below 1)")
    if m.use_rope_scaling and m.position_embedding_type != "rope":
        out.append("--use-rope-scaling scales rotary embeddings: add --position-embedding-type rope")
    if m.use_rope_scaling and not m.rope_scaling_factor > 0:
        out.append(f"--rope-scaling-factor must be > 0, got {m.rope_scaling_factor}")
    if m.add_qkv_bias and not m.disable_bias_linear:
        out.append("--add-qkv-bias adds biases to the query/key/value projection only: it needs "
                   "--disable-bias-linear (without it every linear layer has biases already)")
    out += _check_recompute(cfg)
    for name in ("hidden_dropout", "attention_dropout"):
        v = getattr(m, name)
        if not 0.0 <= v < 1.0:
            out.append(f"--{name.replace('_', '-')} must be in [0, 1), got {v}")
    return out


def _check_recompute(cfg: JobConfig) -> list[str]:
    m, pp = cfg.model, cfg.parallel.pipeline_model_parallel_size
    out = []
    if m.recompute_activations and m.recompute_granularity == "full":
        out.append("--recompute-activations is selective recompute: drop it or --recompute-granularity full")
    granularity = m.recompute_granularity or ("selective" if m.recompute_activations else None)
    full_flags = m.recompute_method is not None or m.recompute_num_layers is not None
    if granularity == "full":
        reported = len(out)
        if m.recompute_method is None or m.recompute_num_layers is None:
            out.append("--recompute-granularity full needs --recompute-method uniform|block and --recompute-num-layers N")
        elif pp > 0 and m.num_layers % pp == 0 and not uses_uneven_split(cfg):
            per_stage = m.num_layers // pp
            if not 1 <= m.recompute_num_layers <= per_stage:
                out.append(f"--recompute-num-layers {m.recompute_num_layers} must be between 1 and the {per_stage} "
                           f"layers of a pipeline stage (--num-layers {m.num_layers} / --pipeline-model-parallel-size {pp})")
        if (m.recompute_method == "uniform" and m.recompute_num_layers is not None and m.recompute_num_layers > 0
                and len(out) == reported):
            # megatron-core checkpoints layers [i, i + N) of each model chunk and indexes past its last
            # layer (IndexError mid-forward) when N does not divide the chunk's layers
            counts = get_chunk_layer_counts(cfg)
            bad = sorted({c for c in counts or [] if c % m.recompute_num_layers})
            if bad:
                sizes = sorted(set(counts))
                out.append(f"--recompute-method uniform: --recompute-num-layers {m.recompute_num_layers} must divide the "
                           f"layers of every model chunk (a pipeline stage, or a virtual stage with interleaving), "
                           f"which hold {', '.join(map(str, sizes))} layers here (megatron-core would index past a "
                           f"chunk's last layer): use a divisor of {math.gcd(*counts)}, or --recompute-method block")
        if m.recompute_modules:
            out.append("--recompute-modules applies to --recompute-granularity selective, not full")
    elif full_flags:
        out.append("--recompute-method and --recompute-num-layers need --recompute-granularity full")
    if m.recompute_modules and granularity != "full":
        if granularity is None:
            out.append("--recompute-modules needs --recompute-granularity selective")
        if "mlp" in m.recompute_modules and not m.disable_bias_linear:
            out.append("--recompute-modules mlp needs --disable-bias-linear: megatron-core 0.16.1 recomputes "
                       "the MLP through a checkpoint that returns linear_fc2's bias parameter, and its backward "
                       "then recurses forever; recompute core_attn/layernorm, or use --recompute-granularity full")
        unknown = [x for x in m.recompute_modules if x not in RECOMPUTE_MODULES]
        if unknown:
            out.append(f"--recompute-modules {' '.join(unknown)}: a dense model recomputes "
                       f"{', '.join(RECOMPUTE_MODULES)} (megatron-core's MoE/MLA modules do not apply)")
    return out


def _check_batch(cfg: JobConfig, world_size: int) -> list[str]:
    p, t = cfg.parallel, cfg.training
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    if tp <= 0 or pp <= 0 or world_size % (tp * pp) or t.micro_batch_size <= 0 or (
            t.global_batch_size is not None and t.global_batch_size <= 0):
        return []  # reported by _check_positive
    dp = world_size // (tp * pp)
    gbs = get_global_batch_size(cfg, world_size)
    if gbs % (t.micro_batch_size * dp):
        return [
            f"--global-batch-size {gbs} is not divisible by --micro-batch-size {t.micro_batch_size} x "
            f"data-parallel size {dp} = {t.micro_batch_size * dp}: use a multiple of "
            f"{t.micro_batch_size * dp}"
        ]
    out = []
    if t.train_samples is not None and t.train_samples > 0 and t.train_samples < gbs:
        out.append(f"--train-samples {t.train_samples} is less than one global batch ({gbs} samples)")
    vpp = get_virtual_pipeline_size(cfg)
    if vpp is not None and vpp > 1 and pp > 1 and not uses_our_runtime(cfg):  # megatron-core's own rule
        out += _check_interleaved_microbatches(
            get_num_microbatches(cfg, world_size), pp, p.microbatch_group_size_per_vp_stage or pp,
            gbs, t.micro_batch_size, dp,
        )
    return out


def _check_pipeline_schedule(cfg: JobConfig, world_size: int) -> list[str]:
    """--pipeline-schedule with the layout (``pipeline/validate.py``), once the layout itself is valid."""
    p = cfg.parallel
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    if tp <= 0 or pp <= 0 or world_size % (tp * pp) or _check_layout(cfg, world_size):
        return check_schedule_name(cfg)  # the rest once the layout is valid
    m = get_num_microbatches(cfg, world_size) if cfg.training.micro_batch_size > 0 else None
    return check_pipeline_schedule(cfg, get_virtual_pipeline_size(cfg), m)


def _check_interleaved_microbatches(m: int, pp: int, n: int, gbs: int, mbs: int, dp: int) -> list[str]:
    """megatron-core's interleaved-schedule rule, which it checks only mid-schedule."""
    what = (
        f"{m} micro-batch{'' if m == 1 else 'es'} per step (--global-batch-size {gbs} / (--micro-batch-size {mbs} x "
        f"data-parallel {dp}))"
    )
    if not pp <= n <= m:
        return [
            f"interleaved schedule: {what} must be at least --pipeline-model-parallel-size {pp} "
            f"(and at least --microbatch-group-size-per-vp-stage {n}): raise --global-batch-size to "
            f"{max(pp, n) * mbs * dp} or more"
        ]
    if 0 < m % n < pp:
        return [
            f"interleaved schedule: {what} leaves a last group of {m % n} < PP {pp} when grouped by "
            f"{n}: use a multiple of {n} micro-batches (--global-batch-size a multiple of {n * mbs * dp})"
        ]
    return []


def _check_run_length(t: TrainingConfig) -> list[str]:
    """--train-iters or --train-samples, and a schedule counted in the same unit (Megatron-LM's
    rules), with the lengths megatron-core asserts on named first."""
    if t.train_iters is not None and t.train_samples is not None:
        return [f"--train-iters {t.train_iters} and --train-samples {t.train_samples} are exclusive: give the run "
                f"length one way"]
    out = []
    by_samples = t.train_samples is not None
    pairs = [("--lr-warmup-iters", t.lr_warmup_iters or None, "--lr-warmup-samples", t.lr_warmup_samples or None),
             ("--lr-decay-iters", t.lr_decay_iters, "--lr-decay-samples", t.lr_decay_samples),
             ("--lr-wsd-decay-iters", t.lr_wsd_decay_iters, "--lr-wsd-decay-samples", t.lr_wsd_decay_samples)]
    for iter_flag, iters, sample_flag, samples in pairs:
        if by_samples and iters is not None:
            out.append(f"{iter_flag} {iters} counts steps but --train-samples counts the run in samples: use "
                       f"{sample_flag}")
        if not by_samples and samples is not None:
            out.append(f"{sample_flag} {samples} needs --train-samples (with --train-iters use {iter_flag})")
    unit, total = ("samples", t.train_samples) if by_samples else ("iters", t.train_iters)
    decay = (t.lr_decay_samples if by_samples else t.lr_decay_iters) or total
    warmup = t.lr_warmup_samples if by_samples else t.lr_warmup_iters
    if t.lr_warmup_fraction is not None:
        if t.lr_warmup_iters or t.lr_warmup_samples:
            out.append("--lr-warmup-fraction and --lr-warmup-iters/--lr-warmup-samples are exclusive: give the "
                       "warm-up one way")
        if not 0.0 <= t.lr_warmup_fraction < 1.0:
            out.append(f"--lr-warmup-fraction must be in [0, 1), got {t.lr_warmup_fraction}")
        warmup = t.lr_warmup_fraction * decay if decay else 0
    if warmup < 0 or (decay and warmup >= decay):
        # the decay length defaults to the run's: name the flag the user gave
        given_decay = t.lr_decay_samples if by_samples else t.lr_decay_iters
        decay_flag = (f"--lr-decay-{unit} {decay}" if given_decay else
                      f"--lr-decay-{unit} {decay} (not given: it defaults to --train-{unit} {total})")
        out.append(f"--lr-warmup-{unit} {warmup} must lie in [0, {decay_flag}) (megatron-core's scheduler needs a "
                   f"warm-up shorter than the decay): shorten the warm-up or lengthen the decay")
    if t.lr_decay_style == "WSD":
        wsd = t.lr_wsd_decay_samples if by_samples else t.lr_wsd_decay_iters
        if wsd is None:
            out.append(f"--lr-decay-style WSD needs --lr-wsd-decay-{unit} N (the decay phase's length)")
        elif decay and wsd > decay:
            out.append(f"--lr-wsd-decay-{unit} {wsd} is longer than --lr-decay-{unit} {decay}")
    if t.rampup_batch_size:
        out.append(f"--rampup-batch-size {' '.join(t.rampup_batch_size)}: batch-size ramp-up is not supported; "
                   f"use a constant --global-batch-size")
    return out


def _check_schedule(cfg: JobConfig) -> list[str]:
    t = cfg.training
    out = []
    if t.min_lr > t.lr:
        out.append(f"--min-lr {t.min_lr} is larger than --lr {t.lr}")
    out += _check_run_length(t)
    if t.eval_interval < 0 or t.eval_iters < 0:
        out.append("--eval-interval and --eval-iters must be >= 0")
    if not 0 <= t.seed < 2 ** 32:
        out.append(f"--seed must be in [0, 2**32 - 1] (numpy's range, which the data sampling uses), got {t.seed}")
    c = cfg.checkpoint
    if c.save_interval is not None and (c.save_interval <= 0 or not c.save):
        out.append("--save-interval needs --save DIR and a positive interval")
    if c.async_save and not c.save:
        out.append("--async-save writes the checkpoints of --save in the background: give --save DIR")
    if c.override_opt_param_scheduler and c.use_checkpoint_opt_param_scheduler:
        out.append("--override-opt-param-scheduler and --use-checkpoint-opt-param-scheduler are exclusive: "
                   "say which schedule wins with one of them")
    if c.exit_duration_in_mins is not None and c.exit_duration_in_mins <= 0:
        out.append(f"--exit-duration-in-mins must be > 0, got {c.exit_duration_in_mins}")
    return out


def _check_data(cfg: JobConfig) -> list[str]:
    d = cfg.data
    out = []
    blends = None
    try:
        blends = get_data_blends(cfg)
    except ConfigError as exc:
        out += exc.problems
    if d.mock_data and blends is not None:
        out.append(f"--mock-data and {blends.source} are exclusive: give one")
    if not d.mock_data and blends is None and not out:
        out.append("no data: give --data-path PREFIX (an indexed .bin/.idx pair; or --train-data-path ...) or --mock-data")
    from megatron_ext.data.indexed_check import check_indexed_dataset
    from megatron_ext.data.tokenizers import check_tokenizer_flags

    tokenizer_problems = check_tokenizer_flags(d.tokenizer_type, d.tokenizer_model, d.vocab_size, d.vocab_file,
                                               d.merge_file)
    if d.mock_data and tokenizer_problems and not d.tokenizer_model:
        tokenizer_problems = [p + " (with --mock-data, --tokenizer-type NullTokenizer --vocab-size N needs no file)"
                              for p in tokenizer_problems]
    out += tokenizer_problems
    if d.num_workers < 0:
        out.append(f"--num-workers {d.num_workers} must be >= 0 (0: samples are read in the training process)")
    if d.one_document_per_row and (d.reset_attention_mask or d.reset_position_ids):
        out.append("--reset-attention-mask/--reset-position-ids split GPTDataset windows at EOD; "
                   "--one-document-per-row rows hold one document already: drop them")

    for prefix in dict.fromkeys(blends.prefixes if blends else []):
        missing = [prefix + ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
        if missing:
            hint = ""
            written = sorted(glob.glob(glob.escape(prefix) + "_*_document.bin"))
            if prefix.endswith((".bin", ".idx")) and os.path.isfile(prefix[:-4] + ".bin"):
                hint = f" (give the prefix without the extension: {prefix[:-4]})"
            elif written:  # preprocess_data.py --output-prefix P writes P_{json key}_document.bin/.idx
                hint = (f" (preprocess_data.py --output-prefix {prefix} wrote "
                        f"{', '.join(w[:-4] for w in written)}: give that prefix)")
            out.append(f"{blends.source} {prefix}: missing {', '.join(missing)}{hint}")
        else:
            out += [f"{blends.source} {prefix}: {p}" for p in check_indexed_dataset(prefix)]
    if blends is not None and blends.per_split is not None:
        if cfg.training.eval_interval > 0 and blends.per_split[1] is None:
            out.append(f"--eval-interval {cfg.training.eval_interval} needs a validation blend: give "
                       f"--valid-data-path (or 'valid' in --per-split-data-args-path), or --eval-interval 0")
        return out + _check_packing(cfg)
    out += _check_packing(cfg)
    split = [s for s in d.split.replace("/", ",").split(",") if s.strip()]
    try:
        weights = [float(s) for s in split]
        if not weights or min(weights) < 0 or sum(weights) <= 0:
            raise ValueError
    except ValueError:
        out.append(f"--split '{d.split}' must be comma-separated non-negative weights like 969,30,1")
        weights = []
    if cfg.training.eval_interval > 0 and weights and not d.mock_data and (len(weights) < 2 or weights[1] == 0):
        out.append(
            f"--eval-interval {cfg.training.eval_interval} needs a validation split, but --split "
            f"'{d.split}' gives it no weight"
        )
    return out


def _check_packing(cfg: JobConfig) -> list[str]:
    d, m = cfg.data, cfg.model
    out = []
    if d.packed_sequences and d.one_document_per_row:
        out.append("--packed-sequences and --one-document-per-row are exclusive: give one")
    if uses_variable_lengths(cfg):
        flag = "--packed-sequences" if d.packed_sequences else "--one-document-per-row"
        if d.mock_data:
            out.append(f"{flag} needs documents: give --data-path (not --mock-data)")
    if get_sequence_padding(cfg) != "static":
        k = d.pad_to_multiple_of
        if k <= 0 or m.seq_length % k:
            out.append(
                f"--seq-length {m.seq_length} is not a multiple of --pad-to-multiple-of {k}: padded "
                f"lengths are rounded up to the multiple and must never exceed --seq-length"
            )
        if cfg.parallel.sequence_parallel and k % cfg.parallel.tensor_model_parallel_size:
            out.append(f"--pad-to-multiple-of {k} must be a multiple of --tensor-model-parallel-size with --sequence-parallel")
    elif cfg.parallel.sequence_parallel and m.seq_length % cfg.parallel.tensor_model_parallel_size:
        out.append(f"--seq-length {m.seq_length} must be a multiple of --tensor-model-parallel-size "
                   f"{cfg.parallel.tensor_model_parallel_size} with --sequence-parallel (each rank holds an equal slice)")
    return out


def check_data_tokenizer(cfg: JobConfig, identity: dict) -> None:
    """ConfigError naming each data prefix whose ``PREFIX.tokenizer.json`` (written by
    tools/preprocess_data.py) records another tokenizer than this run's ``identity``."""
    from megatron_ext.data.indexed_check import check_tokenizer_record

    blends = None if cfg.data.mock_data else get_data_blends(cfg)
    problems = [f"{blends.source} {p}" for prefix in dict.fromkeys(blends.prefixes if blends else [])
                for p in check_tokenizer_record(prefix, identity)]
    if problems:
        raise ConfigError(problems)


def get_data_blends(cfg: JobConfig):
    """The run's ``DataBlends`` (data/blends.py) from its data flags; None for no data flag."""
    from megatron_ext.data.blends import resolve_data_blends

    d = cfg.data
    return resolve_data_blends(d.data_path, d.data_args_path, d.train_data_path, d.valid_data_path,
                               d.test_data_path, d.per_split_data_args_path)


def _check_overlap(cfg: JobConfig) -> list[str]:
    p = cfg.parallel
    out = []
    if p.use_distributed_optimizer and cfg.training.optimizer != "adam":
        # megatron-core asserts it in DistributedOptimizer.__init__, after the model is built
        out.append(f"--optimizer {cfg.training.optimizer} with --use-distributed-optimizer: megatron-core 0.16.1's "
                   f"distributed optimizer shards Adam only: use --optimizer adam or drop --use-distributed-optimizer")
    if p.overlap_param_gather and not (p.use_distributed_optimizer and p.overlap_grad_reduce):
        out.append("--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce (as in Megatron-LM)")
    if p.ddp_bucket_size is not None and p.ddp_bucket_size <= 0:
        out.append(f"--ddp-bucket-size {p.ddp_bucket_size} must be a positive number of elements")
    elif p.ddp_bucket_size is not None and not p.overlap_grad_reduce:
        out.append(f"--ddp-bucket-size {p.ddp_bucket_size} has no effect without --overlap-grad-reduce: add it or drop "
                   f"--ddp-bucket-size")
    return out


def _check_profiling(cfg: JobConfig, cuda: bool) -> list[str]:
    lg = cfg.logging
    out = []
    if lg.profile:
        if lg.use_pytorch_profiler and not lg.tensorboard_dir:
            out.append("--use-pytorch-profiler writes its traces into --tensorboard-dir: give one")
        if not lg.use_pytorch_profiler and not cuda:
            out.append("--profile without --use-pytorch-profiler marks CUDA profiler ranges for nsys, which needs "
                       "CUDA: add --use-pytorch-profiler on the CPU")
        if not 0 <= lg.profile_step_start < lg.profile_step_end:
            out.append(f"--profile-step-start {lg.profile_step_start} must be >= 0 and below --profile-step-end "
                       f"{lg.profile_step_end}")
        if not all(r.strip().isdigit() for r in lg.profile_ranks):
            out.append(f"--profile-ranks {' '.join(lg.profile_ranks)}: give global rank numbers")
    elif lg.use_pytorch_profiler:
        out.append("--use-pytorch-profiler needs --profile")
    if lg.timing_log_level not in (0, 1, 2):
        out.append(f"--timing-log-level {lg.timing_log_level}: use 0, 1 or 2")
    if lg.log_timers_to_tensorboard and not lg.timing_log_level:
        out.append("--log-timers-to-tensorboard needs --timing-log-level 1 or 2")
    if lg.manual_gc_interval < 0 or (lg.manual_gc_interval and not lg.manual_gc):
        out.append(f"--manual-gc-interval {lg.manual_gc_interval} needs --manual-gc (and >= 0)")
    return out


def _check_device(cfg: JobConfig, cuda: bool) -> list[str]:
    p = cfg.parallel
    out = _check_profiling(cfg, cuda) + _check_overlap(cfg)
    if p.context_parallel_size != 1:
        out.append(f"--context-parallel-size {p.context_parallel_size}: context parallelism is not supported yet "
                   f"(use 1; long sequences: pack documents with --packed-sequences, recompute with "
                   f"--recompute-granularity)")
    for flag, value in (("--use-torch-fsdp2", p.use_torch_fsdp2), ("--use-custom-fsdp", p.use_custom_fsdp)):
        if value:
            out.append(f"{flag}: FSDP is not supported; shard the optimizer state with --use-distributed-optimizer "
                       f"(ZeRO-1) and the model with --tensor/--pipeline-model-parallel-size")
    if p.optimizer_cpu_offload:
        out.append("--optimizer-cpu-offload is not supported: shard the optimizer state with --use-distributed-optimizer")
    if cfg.training.bf16 and cfg.training.fp16:
        out.append("--bf16 and --fp16 are exclusive: give one (--no-bf16 turns off a --bf16 from --config)")
    if cfg.model.transformer_impl == "transformer_engine" and not cuda:
        out.append("--transformer-impl transformer_engine needs CUDA: use local or auto on CPU")
    return out
