"""Parameter counts of a job's model, exact, without building it whole and without process groups.

``count_parameters(cfg, vocab_size)`` builds each distinct model chunk of the layout (one per
pipeline stage and virtual stage: its layers, and the embedding or the output layer where it holds
them) with megatron-core's GPTModel and our layer spec, as ``model/gpt.py`` builds them, on the
``meta`` device: no memory, no process group, a fraction of a second even for GPT-3 175B (a real
build of it asks for about 700 GB; under our CPU platform megatron-core's ``use_cpu_initialization
=False`` path allocates real CPU memory whatever the default device, so the count builds with
``use_cpu_initialization=True``, which allocates where the ``meta`` default device says).

Each chunk is built at tensor-parallel size 1 (whole matrices; with our padding the model does not
depend on TP) and what one TP rank holds is derived from megatron-core's own marks
(``tensor_model_parallel``: split over TP, else replicated). Context parallelism changes no
parameter (CP ranks hold the same ones): the count resolves the layout for one replica (TP x CP x PP
ranks, DP 1) and builds at the job's CP size, through our core attention
(``model/attention.VarlenDotProductAttention``, which builds megatron-core's ``DotProductAttention``
on a CP 1 copy of the config: upstream's asserts CP 1), so any CP size counts as CP 1 does. The tied output layer of the last
stage (``--untie-embeddings-and-output-weights`` off and the first and last stages apart) is a copy
of the word embeddings: in the chunk's memory, not in the model's count.

Used by the reference-config test (tests/unit/test_reference_configs.py) and meant for a layout
planner (issue 32): ``ParameterCount.per_pp_rank`` is what one rank of each pipeline rank holds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging

import torch

from megatron_ext.config import JobConfig
from megatron_ext.derived import get_replica_size, get_stage_placement, get_virtual_pipeline_size, resolve_config
from megatron_ext.model.gpt import build_layer_spec, build_transformer_config, gpt_model_class
from megatron_ext.model.norm import TorchNorm
from megatron_ext.pipeline.placement import get_stage_index


@dataclasses.dataclass(frozen=True)
class ChunkCount:
    """One model chunk: pipeline rank ``pp_rank``'s local chunk ``vp_stage``, running ``stage``."""

    stage: int  # 0 .. PP x VPP - 1, in the order a micro-batch's forward runs them
    pp_rank: int
    vp_stage: int
    num_layers: int
    parameters: int  # the model's parameters in this chunk, all TP ranks together (a tied output copy not counted)
    per_tp_rank: int  # what one TP rank holds of it (a tied output copy counted: it is in memory)


@dataclasses.dataclass(frozen=True)
class ParameterCount:
    total: int  # the model's parameters (Megatron-LM's and Hugging Face's count)
    tp_size: int
    chunks: tuple[ChunkCount, ...]  # by pipeline rank, then local chunk

    def per_pp_rank(self) -> list[int]:
        """Parameters one rank of each pipeline rank holds (all its chunks, its 1/TP share)."""
        out = [0] * (max(c.pp_rank for c in self.chunks) + 1)
        for c in self.chunks:
            out[c.pp_rank] += c.per_tp_rank
        return out


class _OneRankGroup:
    """A process group of one rank for megatron-core's ``get_pg_size``/``get_pg_rank`` (the chunks
    are built whole, at TP 1, whether or not a real process group exists)."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def _one_rank_groups():
    from megatron.core.process_groups_config import ProcessGroupCollection

    pgs = ProcessGroupCollection()
    for name in ("tp", "pp", "mp", "cp", "tp_cp", "embd", "pos_embd"):
        setattr(pgs, name, _OneRankGroup())
    return pgs


class _NoTieWarning(logging.Filter):
    """Drops megatron-core's warning that a tied model built without process groups leaves its
    output layer unsynchronised with the embedding: true, and expected, for a count (a real run
    always has the groups)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Distributed processes aren't initialized" not in record.getMessage()


@contextlib.contextmanager
def _quiet_tie_warning():
    logger = logging.getLogger("megatron.core.models.common.language_module.language_module")
    quiet = _NoTieWarning()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def count_parameters(cfg: JobConfig, vocab_size: int) -> ParameterCount:
    """The exact parameter count of ``cfg``'s model over a tokenizer of ``vocab_size`` ids (padded
    as a run pads them: --make-vocab-size-divisible-by), chunk by chunk as its layout splits it.
    ``cfg`` must be valid (``validation.validate``); nothing is allocated, no process group used."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    p = cfg.parallel
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    vpp = get_virtual_pipeline_size(cfg)
    resolved = resolve_config(cfg, get_replica_size(cfg), vocab_size)  # one replica: TP x CP x PP, DP 1
    tf_config = dataclasses.replace(
        build_transformer_config(cfg, resolved, torch.device("cpu")),
        tensor_model_parallel_size=1,
        sequence_parallel=False,
        # allocate on the default device (meta below), and mark the TP-split parameters
        use_cpu_initialization=True,
        perform_initialization=True,
    )
    layer_spec = build_layer_spec(cfg.model, torch.device("cpu"))
    m = cfg.model
    tied = not m.untie_embeddings_and_output_weights
    groups = _one_rank_groups()
    last = pp * (vpp or 1) - 1

    @functools.cache
    def count_chunk(num_layers: int, pre: bool, post: bool) -> tuple[int, int]:
        with torch.device("meta"), _quiet_tie_warning():
            chunk = gpt_model_class()(
                config=tf_config,
                transformer_layer_spec=TransformerBlockSubmodules(
                    layer_specs=[layer_spec] * num_layers, layer_norm=TorchNorm
                ),
                vocab_size=resolved.padded_vocab_size,
                max_sequence_length=m.max_position_embeddings or m.seq_length,
                # (a tied last stage apart from the first allocates its output weight all the same; built
                # untied, as megatron-core without process groups takes every chunk for the first stage)
                pre_process=pre,
                post_process=post,
                share_embeddings_and_output_weights=tied and pre,
                position_embedding_type=m.position_embedding_type,
                rotary_base=m.rotary_base,
                rotary_percent=m.rotary_percent,
                rope_scaling=m.use_rope_scaling,
                rope_scaling_factor=m.rope_scaling_factor,
                pg_collection=groups,
                vp_stage=0 if vpp else None,  # (only numbers the layers)
            )
        held = sum(
            prm.numel() // tp if getattr(prm, "tensor_model_parallel", False) else prm.numel()
            for prm in chunk.parameters()
        )
        whole = sum(
            prm.numel()
            for name, prm in chunk.named_parameters()
            if not (tied and post and not pre and name == "output_layer.weight")
        )
        return whole, held

    chunks = []
    for pp_rank in range(pp):
        for vp_stage in range(vpp or 1):
            stage = get_stage_index(pp_rank, vp_stage, pp, vpp or 1, get_stage_placement(cfg))
            # a stage holds the layers the loop placement gives it, whichever rank runs it (model/v_placement.py)
            loop_vp = stage // pp if vpp else None
            layers = get_num_layers_to_build(tf_config, loop_vp, stage % pp)
            whole, held = count_chunk(layers, stage == 0, stage == last)
            chunks.append(ChunkCount(stage, pp_rank, vp_stage, layers, whole, held))
    return ParameterCount(sum(c.parameters for c in chunks), tp, tuple(chunks))
