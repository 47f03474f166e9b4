"""Device-to-host synchronisations per training step (issue 30): at most one on the training thread.

Counted with ``megatron_ext.training.sync_counter.SyncCounter`` (a TorchFunctionMode on the calling
thread; on this CPU build it counts the calls that read a tensor into Python, where a GPU would wait:
``item``, ``tolist``, ``bool``/``float``/``int`` of a tensor, ``.cpu()``/``.to("cpu")``, ...). What is
counted: steady-state iterations of the real loop (``training/loop.train_one``: data taken from the
prefetcher, the step, the non-finite bookkeeping, the exit decision), at TP = PP = DP = 1, 2
micro-batches per step, ``--log-interval`` past the counted steps (a log line reads its losses: one
more, every --log-interval steps), the NaN guard on (the default) unless a case turns it off. The
prefetch thread's copies are its own (by design) and not counted. Before issue 30 the same count was
3 + m (m micro-batches): megatron-core's ``if num_tokens > 0``, ``found_inf.item()`` (--bf16),
``total_norm.item()`` and a ``.to("cpu")`` per micro-batch, plus the exit agreement's ``tolist`` with
--exit-signal-handler; then 2 with --no-check-for-nan-in-loss-and-grad (the norm's ``.item()``) and 3
with --fp16 (found-inf's too). A positive control injects known reads into the same loop.
"""

from __future__ import annotations

import threading

import pytest
import torch

from megatron_ext.testing import MarkovDataset, PackedMarkovDataset, build_tiny_run, run_ranks, tiny_values

pytestmark = pytest.mark.distributed

STEPS = 3


def _count(rank, world_size, overrides, inject=False, packed=False):
    from megatron_ext.training import step
    from megatron_ext.training.loop import LogWindow, train_one
    from megatron_ext.training.sync_counter import SyncCounter

    if inject:  # the positive control: three known reads per step on the training thread
        stack = step.stack_reported_losses

        def stack_and_read(reports):
            stacked = stack(reports)
            stacked.sum().item(), stacked.tolist(), stacked.cpu()
            return stacked

        step.stack_reported_losses = stack_and_read

    values = tiny_values(
        **{
            **dict(num_layers=2, global_batch_size=4, micro_batch_size=2, train_iters=100, log_interval=1000),
            **overrides,
        }
    )
    run = build_tiny_run(values, PackedMarkovDataset(32, pad_multiple=4) if packed else MarkovDataset(32, mask_every=1))
    window, history = LogWindow(), []
    train_one(run, window, history)  # warm-up: the first step builds what later steps reuse
    with SyncCounter() as counter:
        for _ in range(STEPS):
            assert train_one(run, window, history)
    if run.exit_decider.handler is not None:
        run.exit_decider.handler.restore()
    if run.prefetcher is not None:
        run.prefetcher.close()
    return dict(counter.by_site), [float(x) for x in window.iteration_losses[-1]]


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        dict(exit_signal_handler=True),
        dict(bf16=True),
        dict(log_straggler=True),
        dict(skip_spiky_loss_factor=10.0, skip_spiky_loss_window=2),  # decided on the device
        dict(check_for_nan_in_loss_and_grad=False),  # upstream: the norm's .item() besides the copy
        dict(bf16=True, check_for_nan_in_loss_and_grad=False),
        dict(bf16=True, use_distributed_optimizer=True),
        dict(fp16=True, initial_loss_scale=2.0**8),  # upstream: found-inf's and the norm's .item(); no overflow
    ],
    ids=[
        "fp32",
        "exit-signal-handler",
        "bf16",
        "log-straggler",  # only at log steps
        "spike-guard",
        "no-nan-check",
        "bf16-no-nan-check",
        "bf16-distributed-optimizer",
        "fp16",
    ],
)
def test_one_sync_per_step_on_the_training_thread(overrides):
    by_site, last = run_ranks(_count, 1, overrides)[0]
    assert sum(by_site.values()) <= STEPS, by_site
    assert all("(fetch_to_host)" in site for site in by_site), by_site  # the optimizer step's one copy
    assert sum(by_site.values()) == STEPS, by_site  # (the copy is there: the counter sees the loop)
    assert last[1] > 0 and last[0] > 0  # the step's [loss sum, valid tokens] still reach the host


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_one_sync_per_step_under_context_parallelism(packed):
    """CP 2 (2 ranks): the CP plan of each micro-batch is host work on host data (the layout's pieces),
    the data split happens in the prefetch thread, the loss and token shares travel in the step's one
    copy: still one read per step on each CP rank's training thread."""
    overrides = dict(context_parallel_size=2, pad_to_multiple_of=16)
    if packed:
        overrides.update(packed_sequences=True, micro_batch_size=1)  # g = 2c = 4 by default
    for by_site, last in run_ranks(_count, 2, overrides, False, packed):
        assert sum(by_site.values()) == STEPS and all("(fetch_to_host)" in site for site in by_site), by_site
        assert last[1] > 0 and last[0] > 0  # this CP rank's share of the step's [loss sum, valid tokens]


def test_the_counter_counts_known_reads_in_the_loop():
    """Positive control for the test above: the same loop, with an ``.item()``, a ``.tolist()`` and a
    ``.cpu()`` added to each step on the training thread, counts each once per step where it is made."""
    by_site, _ = run_ranks(_count, 1, {}, True)[0]
    injected = {site.split(" @ ")[0]: n for site, n in by_site.items() if "(stack_and_read)" in site}
    assert injected == {"item": STEPS, "tolist": STEPS, "cpu": STEPS}, by_site
    assert sum(by_site.values()) == 4 * STEPS, by_site


def test_the_counter_counts_only_its_own_thread():
    from megatron_ext.training.sync_counter import SyncCounter

    t = torch.ones(3)
    with SyncCounter() as counter:
        worker = threading.Thread(target=lambda: (t.sum().item(), t.tolist(), t.cpu()))
        worker.start()
        worker.join()
        t.to(torch.device("cpu"))  # a move to where another tensor lives: not a read
    assert counter.by_site == {}
    with SyncCounter() as counter:
        t.sum().item(), t.tolist(), t.cpu(), t.to("cpu")
    assert sorted(site.split(" @ ")[0] for site in counter.by_site) == ["cpu", "item", "to(cpu)", "tolist"]
    assert counter.total == 4
