"""Device-to-host synchronisations per training step (issue 30): at most one on the training thread.

Counted with ``megatron_ext.training.sync_counter.SyncCounter`` (a TorchFunctionMode on the calling
thread; on this CPU build it counts the calls that read a tensor into Python, where a GPU would wait:
``item``, ``tolist``, ``bool``/``float``/``int`` of a tensor, ``.cpu()``/``.to("cpu")``, ...). What is
counted: steady-state iterations of the real loop (``training/loop.train_one``: data taken from the
prefetcher, the step, the non-finite bookkeeping, the exit decision), at TP = PP = DP = 1, 2
micro-batches per step, ``--log-interval`` past the counted steps (a log line reads its losses: one
more, every --log-interval steps), the NaN guard on (the default). The prefetch thread's copies are
its own (by design) and not counted. Before issue 30 the same count was 3 + m (m micro-batches):
megatron-core's ``if num_tokens > 0``, ``found_inf.item()`` (--bf16), ``total_norm.item()`` and a
``.to("cpu")`` per micro-batch, plus the exit agreement's ``tolist`` with --exit-signal-handler.
"""

from __future__ import annotations

import pytest

from megatron_ext.testing import MarkovDataset, build_tiny_run, run_ranks, tiny_values

pytestmark = pytest.mark.distributed

STEPS = 3


def _count(rank, world_size, overrides):
    from megatron_ext.training.loop import LogWindow, train_one
    from megatron_ext.training.sync_counter import SyncCounter

    values = tiny_values(
        num_layers=2, global_batch_size=4, micro_batch_size=2, train_iters=100, log_interval=1000, **overrides
    )
    run = build_tiny_run(values, MarkovDataset(32, mask_every=1))
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
    ],
    ids=["fp32", "exit-signal-handler", "bf16", "log-straggler", "spike-guard"],  # --log-straggler: only at log steps
)
def test_one_sync_per_step_on_the_training_thread(overrides):
    by_site, last = run_ranks(_count, 1, overrides)[0]
    assert sum(by_site.values()) <= STEPS, by_site
    assert all("(fetch_to_host)" in site for site in by_site), by_site  # the optimizer step's one copy
    assert last[1] > 0 and last[0] > 0  # the step's [loss sum, valid tokens] still reach the host
