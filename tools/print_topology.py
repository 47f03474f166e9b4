"""Write each rank's process groups as JSON: which ranks share its TP, CP, PP, DP and DP x CP groups.

    torchrun --nproc-per-node 8 tools/print_topology.py \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 [--context-parallel-size 2] \\
        --output-dir /tmp/topo

Builds the groups exactly as ``pretrain_gpt.py`` does (``init_distributed`` +
``build_parallel_context``) but no model, so a multi-node layout can be checked in seconds:
rank N writes ``<output-dir>/rank<N>.json`` with its node (torchrun's ``GROUP_RANK``) and the
global ranks of its groups.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import warnings

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")

import torch.distributed as dist  # noqa: E402

from megatron_ext.cpu_platform import quiet_known_warnings  # noqa: E402

quiet_known_warnings()  # before megatron-core's imports: no TE/Apex warnings before an error line

from megatron_ext.cli_args import ToolParser, integer, output_dir  # noqa: E402
from megatron_ext.config import ConfigError, build_job_config  # noqa: E402
from megatron_ext.cpu_platform import select_device  # noqa: E402
from megatron_ext.launch_env import check_launch_env  # noqa: E402
from megatron_ext.parallel import (  # noqa: E402
    ParallelContext,
    build_parallel_context,
    destroy_parallel_context,
    init_distributed,
)
from megatron_ext.validation import validate  # noqa: E402


def get_rank_topology(ctx: ParallelContext, env: dict[str, str]) -> dict:
    """This rank's place in the layout; ``env`` is the torchrun worker environment."""
    return {
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "node": int(env.get("GROUP_RANK", env.get("NODE_RANK", "0"))),
        "hostname": socket.gethostname(),
        "local_rank": int(env.get("LOCAL_RANK", "0")),
        "tp_rank": ctx.tp_rank,
        "pp_rank": ctx.pp_rank,
        "dp_rank": ctx.dp_rank,
        "cp_rank": ctx.cp_rank,
        "tp_ranks": dist.get_process_group_ranks(ctx.tp_group),
        "pp_ranks": dist.get_process_group_ranks(ctx.pp_group),
        "dp_ranks": dist.get_process_group_ranks(ctx.dp_group),
        # CP: the ranks splitting one micro-batch's sequence; DP x CP: the gradient reduce (without CP: DP)
        "cp_ranks": dist.get_process_group_ranks(ctx.cp_group) if ctx.cp_group is not None else [ctx.rank],
        "dp_cp_ranks": dist.get_process_group_ranks(ctx.reduce_group),
    }


def write_topology(tp: int, pp: int, output_dir: str, cp: int = 1) -> dict:
    """Build the TP x CP x PP x DP groups of the torchrun world and write this rank's JSON."""
    # The smallest job that passes validation for this layout: the groups do not depend on it.
    cfg = build_job_config(
        {
            "tensor_model_parallel_size": tp,
            "pipeline_model_parallel_size": pp,
            "context_parallel_size": cp,
            "num_layers": pp,
            "num_attention_heads": tp,
            "hidden_size": 64 * tp,
            "mock_data": True,
            "tokenizer_type": "NullTokenizer",
            "vocab_size": 128,
        }
    )
    device = select_device()
    validate(cfg, int(os.environ.get("WORLD_SIZE", "1")), cuda=device.type == "cuda")
    init_distributed(device, cfg.parallel.distributed_timeout_minutes)
    ctx = build_parallel_context(cfg, device)
    record = get_rank_topology(ctx, dict(os.environ))
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, f"rank{ctx.rank}.json"), "w") as f:
        json.dump(record, f)
    dist.barrier()
    destroy_parallel_context()
    dist.destroy_process_group()
    return record


def main(argv: list[str] | None = None) -> None:
    parser = ToolParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tensor-model-parallel-size", type=integer(1, what="the TP size"), default=1)
    parser.add_argument("--pipeline-model-parallel-size", type=integer(1, what="the PP size"), default=1)
    parser.add_argument("--context-parallel-size", type=integer(1, what="the CP size"), default=1)
    parser.add_argument("--output-dir", type=output_dir, required=True, help="Where rank<N>.json files go.")
    args = parser.parse_args(argv)
    try:
        check_launch_env(os.environ)  # torchrun's variables, read with int() below
        write_topology(
            args.tensor_model_parallel_size,
            args.pipeline_model_parallel_size,
            args.output_dir,
            args.context_parallel_size,
        )
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
