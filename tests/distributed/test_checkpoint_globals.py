"""The allowlists hold what our saves write, and no more: every pickle of real checkpoints reads through them.

One forked 2-rank world trains a tiny model for one step and saves it with our own save path at
four layouts: TP2 in bf16 with the distributed optimizer, PP2 x VPP2, DP2 in fp16 with the
distributed optimizer, DP2 in fp32 without it. Then, in the test process:
- a recording unpickler lists every global each ``.metadata`` names: together they are exactly
  ``unpickler.METADATA_GLOBALS`` (less the PosixPath only torch's own ``dcp.save`` records:
  tests/unit/test_ckpt_reader.py reads one) plus the dtypes the runs used, so the list is neither
  guessed wide nor too narrow for some layout;
- every ``common.pt`` and every stored item (tensors and byte items) loads with torch's own
  weights-only globals only (megatron-core's 16 removed for the read);
- the tools' load (``state.load_full_tensors``: our reader, every item verified) gives every tensor.
"""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from megatron_ext.parallel import destroy_parallel_context
from megatron_ext.testing import MarkovDataset, build_tiny_run, run_ranks, tiny_values
from megatron_ext.training.loop import train

pytestmark = pytest.mark.distributed

LAYOUTS = {
    "tp2 bf16 distributed optimizer": dict(tensor_model_parallel_size=2, bf16=True, use_distributed_optimizer=True),
    "pp2 vpp2": dict(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1),
    "dp2 fp16 distributed optimizer": dict(fp16=True, use_distributed_optimizer=True),
    "dp2": {},
}


def _save_world(rank: int, world_size: int, root: str) -> None:
    for name, flags in LAYOUTS.items():
        values = tiny_values(num_layers=4, global_batch_size=4, train_iters=1, save=os.path.join(root, name), **flags)
        train(build_tiny_run(values, MarkovDataset(32)))
        destroy_parallel_context()


class _Recorder(pickle.Unpickler):
    """Lists the globals a pickle names (only ever given the files this test's own saves wrote)."""

    def __init__(self, stream, found: set):
        super().__init__(stream)
        self.found = found

    def find_class(self, module: str, name: str):
        self.found.add((module, name))
        return super().find_class(module, name)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, str]:
    root = str(tmp_path_factory.mktemp("globals"))
    run_ranks(_save_world, 2, root, timeout=300)
    return {name: os.path.join(root, name, "iter_0000001") for name in LAYOUTS}


def test_the_metadata_allowlist_is_what_our_saves_write(saved):
    from megatron_ext.checkpoint.unpickler import METADATA_GLOBALS

    found: set = set()
    for ckpt in saved.values():
        with open(os.path.join(ckpt, ".metadata"), "rb") as f:
            _Recorder(f, found).load()
    dtypes = {(m, n) for m, n in found if m == "torch" and isinstance(getattr(torch, n), torch.dtype)}
    assert dtypes == {("torch", "float32"), ("torch", "bfloat16"), ("torch", "float16")}
    assert found - dtypes == METADATA_GLOBALS - {("pathlib", "PosixPath")}


def test_every_file_we_write_loads_with_torch_s_own_globals_only(saved):
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from megatron_ext.checkpoint.reader import VerifyingFileSystemReader, load_torch_archive, read_common
    from megatron_ext.checkpoint.state import load_full_tensors

    registered = torch.serialization.get_safe_globals()
    for name, ckpt in saved.items():
        assert read_common(ckpt)["checkpoint_version"], name
        metadata = VerifyingFileSystemReader(ckpt).read_metadata()
        kinds = set()
        for index, info in metadata.storage_data.items():
            with open(os.path.join(ckpt, info.relative_path), "rb") as f:
                f.seek(info.offset)
                load_torch_archive(f.read(info.length), f"{name} {index.fqn}", verified=True)
            kinds.add(isinstance(metadata.state_dict_metadata[index.fqn], BytesStorageMetadata))
        assert kinds == {True, False}, name  # byte items (RNG states, _extra_state) and tensors
        tensors = load_full_tensors(ckpt)
        expected = {k for k, md in metadata.state_dict_metadata.items() if hasattr(md, "size")}
        assert set(tensors) == expected and expected, name
    assert set(torch.serialization.get_safe_globals()) == set(registered)  # back after each read
