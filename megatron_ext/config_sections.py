"""The typed configuration's sections: one small dataclass per section (parallel, model, data,
training, logging, checkpoint) with Megatron-LM's flag names; each field's ``help`` is its flag's
help text. ``config.py`` assembles them into ``JobConfig`` and re-exports them.

Invariant: this module imports nothing of ours.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def _f(default: Any, help: str, **extra: Any) -> Any:
    """A dataclass field carrying its flag's help text."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **extra})
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class ParallelConfig:
    """How the world is split: TP x PP x DP, virtual pipeline stages, optimizer sharding."""

    tensor_model_parallel_size: int = _f(
        1, "Tensor-parallel size (ranks of a TP group are consecutive, inside a node)."
    )
    pipeline_model_parallel_size: int = _f(1, "Pipeline-parallel size (stages span nodes).")
    num_layers_per_virtual_pipeline_stage: int | None = _f(
        None, "Layers per virtual pipeline stage (interleaved 1F1B; 0 = off)."
    )
    num_virtual_stages_per_pipeline_rank: int | None = _f(
        None, "Virtual pipeline stages per pipeline rank (interleaved 1F1B)."
    )
    decoder_first_pipeline_num_layers: int | None = _f(
        None, "Uneven split: layers of the first pipeline stage (the rest are split evenly)."
    )
    decoder_last_pipeline_num_layers: int | None = _f(
        None, "Uneven split: layers of the last pipeline stage (the rest are split evenly)."
    )
    account_for_embedding_in_pipeline_split: bool = _f(
        False, "Count the input embedding as one layer when splitting layers over pipeline stages."
    )
    account_for_loss_in_pipeline_split: bool = _f(
        False, "Count the output layer and loss as one layer when splitting layers over pipeline stages."
    )
    pipeline_model_parallel_layout: str | None = _f(
        None, "Megatron-LM's explicit layer layout: not supported (refused); use the flags above."
    )
    pipeline_schedule: str | None = _f(
        None,
        "Pipeline schedule (ours; torch.distributed.pipelining's names, case-insensitive): 1F1B or Interleaved1F1B (megatron-core's), or a zero-bubble one on our runtime: ZBH1 (one chunk per rank, 1F1B's memory), InterleavedZeroBubble (with --num-virtual-stages-per-pipeline-rank), ZBVZeroBubble (2 chunks per rank in a V, implied; 1F1B's memory). Default: Interleaved1F1B with virtual stages, else 1F1B. docs/pipeline.md says which to pick.",
    )
    microbatch_group_size_per_vp_stage: int | None = _f(
        None, "Contiguous micro-batches per virtual stage in the interleaved schedule (default: PP)."
    )
    use_distributed_optimizer: bool = _f(False, "Shard optimizer state over data-parallel ranks (ZeRO-1).")
    sequence_parallel: bool = _f(
        False,
        "Megatron sequence parallelism: norms, dropout and residuals on a 1/TP slice of the sequence (needs TP > 1).",
    )
    overlap_grad_reduce: bool = _f(False, "Overlap the DP gradient reduce with the backward pass.")
    overlap_param_gather: bool = _f(
        False,
        "Overlap the distributed optimizer's parameter all-gather with the next forward pass (needs --use-distributed-optimizer and --overlap-grad-reduce).",
    )
    align_param_gather: bool = _f(
        True,
        "With --overlap-param-gather, dispatch every pipeline stage's all-gathers together at the schedule's start (Megatron-LM's default; --no-align-param-gather dispatches them from each bucket's first use).",
        negative_flag=True,
    )
    grad_reduce_in_bf16: bool = _f(
        False,
        "DDP gradient buffers in bf16, not fp32 (Megatron-LM's; needs --bf16): weight gradients accumulate over micro-batches and are reduced over data-parallel ranks in bf16 (half the buffer memory and reduce traffic; each sum rounded to bf16's 8 significant bits, so the token-sum loss's gradients agree with fp32 buffers to about 1% per element, not exactly). The optimizer still steps fp32 main parameters.",
    )
    ddp_bucket_size: int | None = _f(
        None,
        "Elements per DDP gradient bucket of the first pipeline stage's first model chunk, the only one bucketed, as in Megatron-LM (with --overlap-grad-reduce; default megatron-core's, max(4e7, 1e6 x DP)).",
    )
    distributed_timeout_minutes: int = _f(10, "Timeout of collective operations, in minutes.")
    context_parallel_size: int = _f(
        1,
        "Context parallelism: each micro-batch's sequence split over this many ranks (long context; docs/context-parallel.md). Keys and values are all-gathered over the CP group, queries stay local; packed documents are split head-tail per document, other rows head-tail per row. World = TP x CP x PP x DP.",
    )
    cp_comm_type: list[str] = _f(
        ["all_gather"],
        "How context-parallel attention communicates: all_gather (K/V all-gathered, the only one here; 'allgather' accepted), one value or one per layer. Megatron-LM's default is p2p (a ring); p2p and a2a are not supported.",
        nargs="+",
    )
    use_torch_fsdp2: bool = _f(False, "FSDP2 (Megatron-LM's flag): not supported; refused.")
    use_custom_fsdp: bool = _f(False, "Megatron-core's custom FSDP (Megatron-LM's flag): not supported; refused.")
    optimizer_cpu_offload: bool = _f(
        False, "Optimizer state offload to the CPU (Megatron-LM's flag): not supported; refused."
    )
    step_timeout_minutes: float | None = _f(
        None,
        "Stall watchdog (ours): a rank whose training step or evaluation batch lasts longer prints where it "
        "is, every rank whose progress stopped (rank, stage, host, phase, micro-batch; from per-rank heartbeats in "
        "the job's store) and its Python stacks, and exits 1 (default off; set it below "
        "--distributed-timeout-minutes and above the longest step).",
    )
    save_timeout_minutes: float | None = _f(
        None,
        "Stall watchdog (ours): the same for a checkpoint save (a synchronous save; with --async-save the "
        "snapshot and the publication), which may last much longer than a step (default off; set it below "
        "--distributed-timeout-minutes).",
    )
    rehearse: bool = _f(
        False,
        "Rehearse the job on this machine instead of running it (ours): for WORLD_SIZE ranks (required, as torchrun sets it; LOCAL_WORLD_SIZE ranks per node, else NPROC_PER_NODE, else 8), with no process group or GPU: every flag and the layout checked as a launch checks them, the process-group map (TP, PP, DP groups, each rank's node; a TP group across nodes is an error), each distinct model chunk built once on the meta device (parameters per rank, the embedding's and output layer's pipeline ranks, uneven splits), weight, gradient and optimizer-state bytes per rank (not activations), the samples each DP rank reads in its first step; prints a summary, exit status 0 when all holds, 2 otherwise (docs/planning.md).",
    )
    gpu_memory_gib: float | None = _f(
        None,
        "With --rehearse (ours; tools/plan_layout.py's flag): the GPUs' memory in GiB. A predicted peak above it (the planner's memory model: state, activations at the schedule's peak, temporaries, margin) is an error naming the largest term, the cheapest change that keeps the layout and the planner's best layout for the world. Without it the prediction is printed only. Without --rehearse: a warning, nothing checked.",
    )
    device: str = _f(
        "auto",
        "Where ranks run (ours, not Megatron-LM's): auto (the local GPU when CUDA is available, else the CPU with gloo), cpu (force the CPU/gloo path even on a GPU machine) or cuda.",
        choices=["auto", "cpu", "cuda"],
    )


@dataclass
class ModelConfig:
    """GPT shape. GPT-2 style by default; Llama style with RMSNorm, --swiglu, rope, GQA."""

    num_layers: int = _f(4, "Number of transformer layers.")
    hidden_size: int = _f(128, "Hidden size.")
    ffn_hidden_size: int | None = _f(
        None,
        "MLP hidden size (default 4 x hidden, or with --swiglu 2/3 of that rounded down to a multiple of 64, as Megatron-LM).",
    )
    num_attention_heads: int = _f(4, "Attention heads.")
    group_query_attention: bool = _f(False, "Use grouped-query attention (with --num-query-groups).")
    num_query_groups: int | None = _f(None, "Key/value head groups under --group-query-attention.")
    kv_channels: int | None = _f(
        None, "Dimension of each attention head (default --hidden-size / --num-attention-heads; Qwen3-0.6B: 128)."
    )
    qk_layernorm: bool = _f(
        False, "A norm (--normalization) over each head's queries and keys, before RoPE (Qwen3; megatron-core's)."
    )
    seq_length: int = _f(256, "Sequence length of a training sample.")
    max_position_embeddings: int | None = _f(
        None, "Positions of the learned absolute embedding (default: --seq-length)."
    )
    position_embedding_type: str = _f(
        "learned_absolute", "learned_absolute or rope.", choices=["learned_absolute", "rope"]
    )
    rotary_base: int = _f(10000, "RoPE theta.")
    rotary_percent: float = _f(1.0, "Fraction of each head's dimensions rotated by RoPE.")
    use_rope_scaling: bool = _f(
        False,
        "Llama-3.1 RoPE frequency scaling (megatron-core's: low/high frequency factors 1 and 4, original context 8192).",
    )
    rope_scaling_factor: float = _f(8.0, "The factor of --use-rope-scaling (Llama-3.1: 8, Llama-3.2: 32).")
    add_qkv_bias: bool = _f(False, "Biases on the query/key/value projection only (Qwen2), with --disable-bias-linear.")
    normalization: str = _f("LayerNorm", "LayerNorm or RMSNorm.", choices=["LayerNorm", "RMSNorm"])
    norm_epsilon: float = _f(1e-5, "Epsilon of the norms.")
    apply_layernorm_1p: bool = _f(
        False,
        "Zero-centred norm weights (Megatron-LM's; megatron-core's layernorm_zero_centered_gamma): every LayerNorm/RMSNorm scales by 1 + gamma, gamma initialised to 0. Like every 1-D parameter, gamma gets no weight decay (megatron-core 0.16.1's param groups). The Hugging Face conversion adds/subtracts the 1.",
    )
    swiglu: bool = _f(False, "SwiGLU MLP (Llama).")
    disable_bias_linear: bool = _f(False, "No biases in linear layers (Llama).")
    untie_embeddings_and_output_weights: bool = _f(False, "Separate output layer instead of the tied input embedding.")
    init_method_std: float = _f(0.02, "Std of the normal initialisation.")
    hidden_dropout: float = _f(0.0, "Dropout on hidden states (Megatron-LM's default: 0.1).")
    attention_dropout: float = _f(
        0.0,
        "Dropout on attention probabilities (Megatron-LM's default: 0.1; packed sequences on GPUs then leave the flash varlen kernel).",
    )
    recompute_activations: bool = _f(
        False, "Megatron-LM's alias of --recompute-granularity selective (core attention)."
    )
    recompute_granularity: str | None = _f(
        None,
        "Activation recomputation: full (whole layers, with --recompute-method and --recompute-num-layers) or selective (the --recompute-modules of every layer).",
        choices=["full", "selective"],
    )
    recompute_method: str | None = _f(
        None,
        "With full recompute: uniform (every layer, in groups of --recompute-num-layers) or block (the first --recompute-num-layers layers of each pipeline stage).",
        choices=["uniform", "block"],
    )
    recompute_num_layers: int | None = _f(
        None,
        "With full recompute: layers per recomputed group (uniform) or layers recomputed per pipeline stage (block).",
    )
    recompute_modules: list[str] = _f(
        [], "With selective recompute: any of core_attn (default), layernorm, mlp.", nargs="*"
    )
    make_vocab_size_divisible_by: int = _f(
        128,
        "Pad the vocabulary to a multiple of this (whatever the TP size, unlike Megatron-LM, which multiplies it by TP: every layout then trains the same model); --tensor-model-parallel-size must divide it.",
    )
    transformer_impl: str = _f(
        "auto",
        "Layer spec: local (torch), transformer_engine, or auto (TE when importable and CUDA is used).",
        choices=["auto", "local", "transformer_engine"],
    )


@dataclass
class DataConfig:
    """Where tokens come from."""

    data_path: list[str] = _f([], "Indexed dataset prefixes, optionally weighted: 'w1 prefix1 w2 prefix2'.", nargs="*")
    data_args_path: str | None = _f(
        None, "A file holding what --data-path would ([w1] prefix1 [w2 prefix2 ...]; Megatron-LM)."
    )
    train_data_path: list[str] = _f(
        [], "The training blend ([w1] prefix1 ...), read whole (no --split); Megatron-LM.", nargs="*"
    )
    valid_data_path: list[str] = _f([], "The validation blend ([w1] prefix1 ...), read whole.", nargs="*")
    test_data_path: list[str] = _f(
        [], "The test blend ([w1] prefix1 ...), read whole (not read by training).", nargs="*"
    )
    per_split_data_args_path: str | None = _f(
        None, 'A JSON file {"train": "[w1] prefix1 ...", "valid": ..., "test": ...} (Megatron-LM).'
    )
    split: str = _f("969,30,1", "Train,valid,test split weights of each dataset.")
    mock_data: bool = _f(
        False,
        "Synthetic data (megatron-core MockGPTDataset), no files (--no-mock-data turns a config file's off, e.g. configs/llama3-8b.yaml's, to give --data-path).",
        negative_flag=True,
    )
    tokenizer_type: str = _f(
        "SentencePieceTokenizer",
        "NullTokenizer, SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer (a sentencepiece model as Megatron-LM core_v0.16.1 reads the type), HuggingFaceTokenizer (a local tokenizer directory), GPT2BPETokenizer (--vocab-file, --merge-file; inferred from them when neither --tokenizer-type nor --tokenizer-model is given, as Megatron-LM's pretrain_gpt.py defaults to it) or TikTokenizer (Megatron's tiktoken .json; needs the tiktoken package).",
    )
    tokenizer_model: str | None = _f(
        None,
        "Sentencepiece .model, a local Hugging Face tokenizer directory (nothing is downloaded), or TikTokenizer's .json vocabulary.",
    )
    vocab_file: str | None = _f(None, "GPT2BPETokenizer: vocab.json.")
    merge_file: str | None = _f(None, "GPT2BPETokenizer: merges.txt.")
    vocab_size: int | None = _f(
        None,
        "Vocabulary size for NullTokenizer (EOD is the id vocab_size); for TikTokenizer the vocabulary with its special tokens (default 131072, as megatron-core).",
    )
    tiktoken_pattern: str | None = _f(
        None,
        "TikTokenizer: the pre-tokenizer's split pattern, v1 or v2 (megatron-core's default: v2).",
        choices=["v1", "v2"],
    )
    tiktoken_num_special_tokens: int = _f(
        1000, "TikTokenizer: ids reserved for special tokens before the vocabulary's ranks (Megatron-LM's default)."
    )
    tiktoken_special_tokens: list[str] = _f(
        [],
        "TikTokenizer: the special tokens' names, first ids first; must include <unk> <s> </s> <mask> <pad> <cls> <sep> (the default list).",
        nargs="*",
    )
    data_cache_path: str | None = _f(None, "Where megatron-core caches its sample indices (default: beside the data).")
    packed_sequences: bool = _f(
        False,
        "Pack whole documents into each sample of at most --seq-length tokens (THD, cu_seqlens, no attention across documents); a micro-batch joins its --micro-batch-size packs into one THD sequence.",
        negative_flag=True,
    )
    packing_strategy: str = _f(
        "best_fit",
        "Packer for --packed-sequences: sequential (corpus order) or best_fit (fewest pad tokens).",
        choices=["sequential", "best_fit"],
    )
    one_document_per_row: bool = _f(
        False, "One document per sample row, unpacked (variable-length rows, SFT-like), padded per step."
    )
    reset_position_ids: bool = _f(
        False, "megatron-core's GPTDataset windows: position ids restart after each EOD token (Megatron-LM)."
    )
    reset_attention_mask: bool = _f(
        False,
        "megatron-core's GPTDataset windows: no attention across an EOD token (Megatron-LM); realised as THD document boundaries, never a dense [s, s] mask.",
    )
    data_prefetch: bool = _f(
        True,
        "Build the next step's data (read, pack, pad, copy to the device) in a background thread while the current step runs (--no-data-prefetch: in the step).",
        negative_flag=True,
    )
    num_workers: int = _f(
        0,
        "Worker processes reading samples (torch DataLoader, per rank); 0 reads them in the training process (its prefetch thread). Megatron-LM's default 2 would be 16 processes for 8 ranks on a 2-core machine.",
    )
    eod_mask_loss: bool = _f(
        False,
        "Mask the loss of positions whose input token is EOD (Megatron-LM). With --packed-sequences / --one-document-per-row it holds already: a document's last token (its EOD) predicts nothing.",
    )
    sequence_padding: str | None = _f(
        None,
        "static (to --seq-length), negotiated (one MAX over the pipeline per step) or variable (megatron-core variable_seq_lengths handshake). Default: negotiated with packed/variable-length samples, else static.",
        choices=["static", "negotiated", "variable"],
    )
    pad_to_multiple_of: int = _f(
        64, "Round negotiated/variable lengths up to a multiple of this (--seq-length must be one)."
    )
    document_pad_multiple: int | None = _f(
        None,
        "Pad every packed document to a multiple of this many tokens (pads at the document's end: labels ignored, positions continue). Context parallelism needs a multiple of 2 x --context-parallel-size (the default then; 1 without CP). A data setting of its own: the packs, and so what each step reads, depend on it and not on the CP size; recorded in checkpoints and in the packing cache key.",
    )
    pad_length_bucket: str = _f(
        "multiple",
        "How negotiated/variable lengths round up (ours): multiple (to --pad-to-multiple-of: up to seq/multiple lengths) or power-of-two (to --pad-to-multiple-of times a power of two, capped at the longest length: a handful of shapes, for --torch-compile and CUDA graphs, at up to 2x the padding).",
        choices=["multiple", "power-of-two"],
    )


DEFAULT_TRAIN_ITERS = 100


@dataclass
class TrainingConfig:
    """Batch, schedule, optimizer and loss."""

    micro_batch_size: int = _f(1, "Samples per micro-batch per DP rank.")
    global_batch_size: int | None = _f(None, "Samples per step over all DP ranks (default: micro-batch x DP).")
    decrease_batch_size_if_needed: bool = _f(
        False,
        "Megatron-LM's: when --global-batch-size (or a ramp-up's batch) is not divisible by --micro-batch-size x data-parallel size, run the largest multiple of it instead of refusing (e.g. a job restarted on fewer GPUs: 10 at micro-batch 1 on 4 ranks runs 8). Consumed samples, the LR schedule and the logs count the running batch; a --train-samples run ends within one batch of the samples it planned. Still refused below one micro-batch per rank; not with --step-batch-size-schedule (as Megatron-LM main).",
    )
    train_iters: int | None = _f(None, f"Training steps (default {DEFAULT_TRAIN_ITERS} unless --train-samples).")
    train_samples: int | None = _f(
        None,
        "Run length in samples instead of --train-iters (Megatron-LM): steps = samples // global batch, and the LR/WD schedule is given in samples (--lr-warmup-samples, --lr-decay-samples, --lr-wsd-decay-samples).",
    )
    seed: int = _f(1234, "Random seed (initial weights depend only on it and each parameter's name and shape).")
    optimizer: str = _f(
        "adam",
        "adam (AdamW, decoupled weight decay) or sgd (not with --use-distributed-optimizer, which shards Adam only).",
        choices=["adam", "sgd"],
    )
    lr: float = _f(3e-4, "Peak learning rate.")
    min_lr: float = _f(0.0, "Learning rate at the end of the decay.")
    lr_warmup_iters: int = _f(0, "Linear warm-up steps.")
    lr_decay_iters: int | None = _f(None, "Decay steps (default: --train-iters).")
    lr_warmup_samples: int = _f(0, "Linear warm-up in samples (with --train-samples).")
    lr_decay_samples: int | None = _f(None, "Decay length in samples (with --train-samples; default: --train-samples).")
    lr_warmup_fraction: float | None = _f(
        None, "Warm-up as a fraction of the decay length (instead of --lr-warmup-iters/-samples)."
    )
    lr_decay_style: str = _f(
        "cosine",
        "constant, linear, cosine (ours; Megatron-LM's default is linear), inverse-square-root or WSD (warmup-stable-decay: --lr-wsd-decay-iters/-samples at the end of the decay length, shaped by --lr-wsd-decay-style).",
        choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
    )
    lr_wsd_decay_style: str = _f(
        "exponential", "Shape of the WSD decay phase.", choices=["exponential", "linear", "cosine", "minus_sqrt"]
    )
    lr_wsd_decay_iters: int | None = _f(
        None, "Length of the WSD decay phase in steps (--lr-decay-style WSD with --train-iters)."
    )
    lr_wsd_decay_samples: int | None = _f(
        None, "Length of the WSD decay phase in samples (--lr-decay-style WSD with --train-samples)."
    )
    rampup_batch_size: list[str] = _f(
        [],
        "START INCREMENT SAMPLES: Megatron-LM's batch-size ramp-up (core_v0.16.1, megatron-core's RampupBatchsizeNumMicroBatchesCalculator): the global batch starts at START and grows by INCREMENT every SAMPLES / ((--global-batch-size - START) / INCREMENT) consumed samples, reaching --global-batch-size after SAMPLES samples. With --train-samples only (the run and its LR schedule are counted in samples); every batch of the ramp must divide by --micro-batch-size x data-parallel size.",
        nargs="*",
    )
    step_batch_size_schedule: str | None = _f(
        None,
        "Megatron-LM main's step batch-size schedule (its replacement of --rampup-batch-size), e.g. \"0:16 2.4B:320 12B:1536\": the global batch is that of the last THRESHOLD:BATCH entry whose threshold, in tokens (samples x --seq-length; suffixes K, M, B, T), has been consumed. The first threshold is 0; evaluation reads the last entry's batch. With --train-samples only and without --global-batch-size or --rampup-batch-size (as Megatron-LM main; it accepts --train-iters but its LR schedule then counts --micro-batch-size x DP samples per step, so we refuse it).",
    )
    decoupled_lr: float | None = _f(
        None,
        "Peak learning rate of the word embedding and the output layer (Megatron-LM's; megatron-core's OptimizerConfig.decoupled_lr: their own parameter group on the same schedule shape). Default: --lr.",
    )
    decoupled_min_lr: float | None = _f(
        None,
        "Final learning rate of the --decoupled-lr parameters (Megatron-LM's; default --min-lr); needs --decoupled-lr.",
    )
    weight_decay: float = _f(0.01, "Weight decay.")
    adam_beta1: float = _f(0.9, "Adam beta1.")
    adam_beta2: float = _f(0.999, "Adam beta2.")
    adam_eps: float = _f(1e-8, "Adam epsilon.")
    clip_grad: float = _f(1.0, "Clip the global gradient norm to this (0 disables).")
    calculate_per_token_loss: bool = _f(
        True,
        "Token-sum loss: divide by valid tokens of the whole global batch (default on; --no-calculate-per-token-loss: mean of per-micro-batch means, as older Megatron-LM runs).",
        negative_flag=True,
    )
    check_for_nan_in_loss_and_grad: bool = _f(
        True,
        "Skip, on every rank, an update whose loss or gradients are not finite, and count it in 'nan iterations' (default on; --no-check-for-nan-in-loss-and-grad applies such updates, as before).",
        negative_flag=True,
    )
    max_nan_iterations: int = _f(
        3, "Stop (exit 1, no checkpoint written) after this many consecutive non-finite iterations (ours)."
    )
    eval_interval: int = _f(0, "Evaluate on the validation split every N steps (0: never).")
    eval_iters: int = _f(100, "Validation batches (global batches) per evaluation (default 100, as Megatron-LM).")
    full_validation: bool = _f(
        False,
        "Each evaluation reads the whole validation split, every sample exactly once (one epoch, from its first sample; a last partial global batch is filled with fully masked samples), instead of --eval-iters global batches (ignored, 0 too). As Megatron-LM's, which reads it num_microbatches times over (same mean); only megatron-core GPTDataset windows (not --packed-sequences/--one-document-per-row), an unweighted validation blend.",
    )
    multiple_validation_sets: bool = _f(
        False,
        "Each prefix of --valid-data-path (or 'valid' of --per-split-data-args-path, no weights) is its own validation set, evaluated and logged separately ('validation-K loss', K = its place in the list). Needs --full-validation, as in Megatron-LM 0.16.1.",
    )
    skip_spiky_loss_factor: float | None = _f(
        None,
        "Ours (not Megatron-LM's --check-for-spiky-loss, which re-runs a step): skip, on every rank, an update whose global loss exceeds this factor times the largest loss of the last --skip-spiky-loss-window applied steps, exactly as a non-finite step is skipped (no update, the data move on), counted in 'number of skipped iterations' and logged with the rank and micro-batch of the largest loss. Off by default (None).",
    )
    skip_spiky_loss_window: int = _f(
        100,
        "Ours: the applied steps whose largest loss is --skip-spiky-loss-factor's reference; the guard is armed once it holds that many (after a resume too).",
    )
    check_weight_hash_across_dp_replicas_interval: int | None = _f(
        None,
        "Megatron-LM's: before the first step and every N steps (after the optimizer step, pending parameter all-gathers completed), compare an exact digest of every parameter across the data-parallel (x context-parallel) replicas; a mismatch stops the run with exit code 3, naming the iteration, the parameters, the ranks and the newest checkpoint at or before the last check that passed, which --keep-last keeps and an automatic restart resumes from (docs/failures.md). Off by default.",
    )
    bf16: bool = _f(
        False,
        "bf16 mixed precision: bf16 weights and activations (megatron-core Float16Module), fp32 main parameters, gradients and loss. Runs on the CPU too, slowly.",
        negative_flag=True,
    )
    gradient_accumulation_fusion: bool = _f(
        True,
        "Accumulate each weight gradient into its fp32 gradient buffer inside the GEMM (megatron-core's fused path, through torch's addmm with out_dtype where Apex is missing; default on, as in Megatron-LM; --no-gradient-accumulation-fusion: a bf16 gradient added by DDP's hook).",
        negative_flag=True,
    )
    fp16: bool = _f(False, "fp16 mixed precision with megatron-core's loss scaler (dynamic unless --loss-scale).")
    loss_scale: float | None = _f(None, "Static loss scale for --fp16 (default: dynamic).")
    initial_loss_scale: float = _f(2.0**32, "Initial dynamic loss scale (--fp16).")
    min_loss_scale: float = _f(1.0, "Smallest dynamic loss scale (--fp16).")
    loss_scale_window: int = _f(1000, "Steps without overflow before the dynamic loss scale grows (--fp16).")
    hysteresis: int = _f(2, "Overflows tolerated before the dynamic loss scale shrinks (--fp16).")
    torch_compile: bool = _f(
        False,
        "Compile each chunk's transformer block whole (each layer alone under full recompute or sequence parallelism), in place, with torch.compile (ours; off by default until a GPU shows it helps): parameter names and checkpoints are those of eager runs; packed micro-batches reach the layers in bounded shapes (docs/gpus.md).",
    )
    torch_compile_cpp_wrapper: bool = _f(
        False,
        "With --torch-compile: inductor's C++ wrapper (torch._inductor.config.cpp_wrapper) runs each compiled graph's kernels from C++ instead of a generated Python module (ours): fewer Python calls per micro-batch (Llama style, 4 layers, CPU: ~210 of ~1,940), at a C++ compile per graph; on CUDA it launches the Triton kernels from C++ too, untested on a GPU here (docs/gpus.md).",
    )
    cuda_graph_impl: str = _f(
        "none",
        "CUDA graphs (Megatron-LM's flag): local captures each transformer layer whole with megatron-core's CudaGraphManager (CUDA only; refused with --recompute-granularity full, whose recomputed layers run outside the graphs); transformer_engine needs Transformer Engine.",
        choices=["none", "local", "transformer_engine"],
    )
    cuda_graph_scope: str = _f(
        "full",
        "What --cuda-graph-impl local captures: full (each whole transformer layer, the default and the only scope that runs here); full_iteration (Megatron-LM's whole forward-backward step) is refused as not wired yet, and attn, mlp and the other per-module scopes need Transformer Engine.",
        choices=["full", "full_iteration", "attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba"],
    )
    cuda_graph_warmup_steps: int = _f(
        3, "Eager steps before megatron-core captures a layer's CUDA graph (Megatron-LM's default 3)."
    )
    cuda_graph_max_documents: int | None = _f(
        None,
        "Packed micro-batches under --cuda-graph-impl local (ours): cu_seqlens is padded to this many documents so that every micro-batch has the one shape megatron-core's captured layers replay. Default: a power of two >= seq-length x micro-batch-size / 128, at least 16. A micro-batch with more documents stops the run naming this flag.",
    )
    empty_unused_memory_level: int = _f(
        0,
        "Return cached CUDA memory to the driver: 1 after each forward-backward, 2 also after the optimizer step (as Megatron-LM; costs time; nothing on CPU).",
        choices=[0, 1, 2],
    )


@dataclass
class LoggingConfig:
    """What is printed and recorded."""

    log_interval: int = _f(100, "Print a log line every N steps (and at the last; default 100, as Megatron-LM).")
    tensorboard_dir: str | None = _f(None, "Write TensorBoard scalars here.")
    tensorboard_log_interval: int = _f(
        1,
        "Write each N-th iteration's lm loss, learning rate and grad norm to TensorBoard/wandb (default 1, as Megatron-LM; written at each log line, without another all-reduce); throughput and timers at log lines.",
    )
    wandb_project: str | None = _f(None, "Weights & Biases project (WANDB_MODE=offline works).")
    wandb_exp_name: str | None = _f(None, "Weights & Biases run name.")
    wandb_save_dir: str | None = _f(None, "Weights & Biases directory.")
    pp_timeline: str | None = _f(
        None, "Record a per-rank pipeline timeline (forward/backward/optimizer spans) under this directory."
    )
    timing_log_level: int = _f(
        0,
        "Step timers in the log line: 0 none, 1 data / forward-backward / optimizer, 2 also grad-reduce (synchronises CUDA at each timer: leave 0 for throughput runs).",
        choices=[0, 1, 2],
    )
    log_timers_to_tensorboard: bool = _f(False, "Write the step timers to TensorBoard too.")
    log_straggler: bool = _f(
        False,
        "Report the slowest and fastest ranks at each log line (Megatron-LM's flag; its detector needs CUDA, ours times each rank's own work on CPUs too: compute in the forward/backward steps, optimizer, data wait, from the step timers, CUDA events on GPUs) and name, with node, pipeline stage and DP rank, every rank that held the others up by more than --straggler-threshold of a step: slow (own work over its stage's median) or stopped (its process did not run, whatever it was doing: a thread of each rank sees its wake-ups come late): one all-gather of 12 numbers per rank at log steps only (docs/failures.md).",
    )
    straggler_minmax_count: int = _f(
        1, "With --log-straggler: how many slowest and fastest ranks each report lists (Megatron-LM's flag)."
    )
    straggler_threshold: float = _f(
        0.2,
        "With --log-straggler (ours): a rank whose own work per step (compute + optimizer + data) exceeds the median of its pipeline stage's other ranks (all other ranks when it is alone in its stage) by more than this fraction of the median step, in this log interval and one of the two before, or that did not run for more than this fraction of the median step (at once or per step), is named (0.2: a fifth of a step).",
    )
    log_memory_to_tensorboard: bool = _f(
        False, "Write memory (CUDA allocated/reserved, or the CPU's max RSS) to TensorBoard at each log line."
    )
    tensorboard_queue_size: int = _f(
        1000,
        "TensorBoard events held in memory before a write forces a flush to disk (SummaryWriter's max_queue; default 1000, as Megatron-LM; TensorBoard also flushes every 2 minutes).",
    )
    log_loss_scale_to_tensorboard: bool = _f(
        True,
        "Write the loss scale ('loss scale': --fp16's dynamic or static scale, 1.0 otherwise) to TensorBoard/wandb at each log line (default on, as Megatron-LM, which writes it each --tensorboard-log-interval iteration; reading --fp16's scale each iteration would be a device sync). --no-log-loss-scale-to-tensorboard turns it off.",
        negative_flag=True,
    )
    log_validation_ppl_to_tensorboard: bool = _f(
        False,
        "Also write each validation perplexity, exp(min(20, loss)) as the validation line prints it, as 'lm loss validation ppl' (with --multiple-validation-sets 'lm loss validation-K ppl'), as Megatron-LM.",
    )
    log_params_norm: bool = _f(
        False,
        "Compute the global L2 norm of the parameters at each log line ('params norm' on the line and in TensorBoard/wandb), as Megatron-LM's calc_params_l2_norm: every parameter once whatever the layout (TP duplicates and the tied output copy left out; under --bf16 the fp32 main parameters where the distributed optimizer holds them); one or two all-reduces at log lines only (Megatron-LM computes it every iteration).",
    )
    log_num_zeros_in_grad: bool = _f(
        False,
        "Count the zeros in the step's gradients ('num zeros' on the log line and each --tensorboard-log-interval iteration in TensorBoard/wandb; megatron-core's OptimizerConfig.log_num_zeros_in_grad). The optimizer step is then megatron-core's own, with its host reads (a few per step), instead of ours with one device-to-host copy per step.",
    )
    log_world_size_to_tensorboard: bool = _f(
        False, "Write the number of ranks ('world size') to TensorBoard/wandb at each log line (Megatron-LM's)."
    )
    profile: bool = _f(
        False,
        "Profile iterations --profile-step-start to --profile-step-end: with --use-pytorch-profiler a torch.profiler trace per rank into --tensorboard-dir, else CUDA profiler ranges for nsys (CUDA only).",
    )
    use_pytorch_profiler: bool = _f(False, "With --profile: use torch.profiler (traces in --tensorboard-dir).")
    profile_step_start: int = _f(10, "First profiled iteration.")
    profile_step_end: int = _f(12, "Iteration at which profiling stops.")
    profile_ranks: list[str] = _f(["0"], "Global ranks that profile.", nargs="*")
    manual_gc: bool = _f(
        False,
        "Disable Python's automatic garbage collection during training; collect every --manual-gc-interval iterations on every rank.",
    )
    manual_gc_interval: int = _f(0, "Iterations between manual collections (0: never).")


@dataclass
class CheckpointConfig:
    """Distributed checkpoints."""

    save: str | None = _f(
        None,
        "Directory to save checkpoints to. A save finding non-finite weights on any rank is refused (nothing written or deleted) and stops the run, exit status 1, naming the last good checkpoint.",
    )
    save_interval: int | None = _f(None, "Save every N steps (and at the end).")
    load: str | None = _f(None, "Directory to resume from (its newest complete checkpoint).")
    save_hf: bool = _f(
        False,
        "Also write a Hugging Face model (ours) at the run's last save: <save>/hf/iter_XXXXXXX with config.json, safetensors shards (each pipeline stage its own, split over its TP ranks, with model.safetensors.index.json) and the tokenizer's files (a local HuggingFaceTokenizer directory's, copied; for a SentencePiece BPE model a tokenizer.json giving the same ids; a note naming the tokenizer otherwise), for Llama/Qwen2/Qwen3-style models (--normalization RMSNorm --swiglu --disable-bias-linear --position-embedding-type rope). Loads with transformers' AutoModelForCausalLM.from_pretrained. The checkpoint is written first; an export that fails is a warning and training goes on.",
    )
    save_hf_interval: int | None = _f(
        None,
        "With --save-hf: also export at every save whose iteration is a multiple of N (ours).",
    )
    keep_last: int | None = _f(
        None,
        "Keep only the newest N complete checkpoints (never deletes the newest; default, and 0: keep all); also the newest N --save-hf exports.",
    )
    no_load_optim: bool = _f(False, "Load model weights only (fresh optimizer).")
    finetune: bool = _f(
        False, "Load the model weights of --load only: iteration, optimizer, LR schedule and RNG start afresh."
    )
    pretrained_checkpoint: str | None = _f(
        None,
        "Weights to fine-tune from (as --finetune) when --load holds no checkpoint yet; a later restart resumes from --load.",
    )
    no_load_rng: bool = _f(
        False, "Do not restore the checkpoint's random-number states (they are re-seeded from --seed)."
    )
    ckpt_step: int | None = _f(None, "Load this iteration of --load instead of its newest complete checkpoint.")
    exit_on_missing_checkpoint: bool = _f(
        False, "With --load: a directory holding no checkpoint is an error even when it is --save."
    )
    override_opt_param_scheduler: bool = _f(
        False,
        "On resume, this run's LR/WD schedule and Adam flags (--lr, --min-lr, --adam-beta1/2, --adam-eps) win over the checkpoint's in every parameter group, from the first resumed step. Megatron-LM's spelling --override-opt_param-scheduler works too.",
        aliases=("--override-opt_param-scheduler",),
    )
    use_checkpoint_opt_param_scheduler: bool = _f(
        False,
        "On resume, the checkpoint's LR/WD schedule and Adam betas/eps win over this run's flags. Megatron-LM's spelling --use-checkpoint-opt_param-scheduler works too.",
        aliases=("--use-checkpoint-opt_param-scheduler",),
    )
    ckpt_verify: bool = _f(
        False,
        "Hash every stored item --load uses (whole, also when a reshard reads part of it; byte items such as the RNG state included) and compare it with the checksum its marker records; a mismatch is a damaged checkpoint named with file and byte range (ours). Off by default: at 1 GiB per rank it cost +42-48% of load time from the page cache and +24-49% from disk (python -m bench.checkpoint --readers), over the 5% budget; coordinator files, shard sizes and safe unpickling are always checked.",
        negative_flag=True,
    )
    ckpt_fallback_on_corruption: bool = _f(
        False,
        "When the checkpoint --load names is damaged (a checksum mismatch, a missing or truncated shard, an unreadable coordinator file), load the previous complete one instead of stopping (ours); a file refused as possibly tampered with stops the run.",
    )
    async_save: bool = _f(
        False,
        "Write checkpoints in a background thread while training goes on: the save step copies this rank's share of the checkpoint into host memory (kept for the next save), the checkpoint is published at the first step boundary after every rank finished writing; the last save of a run and a save before an exit stay synchronous.",
    )
    exit_signal_handler: bool = _f(False, "On SIGTERM/SIGINT: all ranks agree at the next step boundary, save, exit 0.")
    exit_interval: int | None = _f(None, "Save and exit after the step whose number is a multiple of N.")
    exit_duration_in_mins: float | None = _f(None, "Save and exit once the run has lasted this many minutes.")
