"""planning/meter.SavedBytesMeter: live bytes by label (what waits for the backward now, not what was
ever saved: the calibration's attribution), the peak, and ``hold`` (what a deferred W keeps outside
autograd), against tensor sizes computed by hand."""

from __future__ import annotations

import torch

from megatron_ext.planning.meter import SavedBytesMeter


def test_by_label_counts_live_bytes_and_hold_counts_a_storage_once():
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    meter = SavedBytesMeter(lin.parameters())
    handles = meter.attribute(lin, "lin")
    x = torch.randn(8, 4, requires_grad=True)
    nbytes = 8 * 4 * 4  # one [8, 4] fp32 tensor
    with meter.track():
        y = lin(x)  # saves its input x (the weight is a parameter: excluded)
        z = y.sin()  # saves its input y, outside the labelled module
        assert dict(meter.by_label) == {"lin": nbytes, "": nbytes}
        assert meter.live == meter.peak == 2 * nbytes
        del z  # its graph goes, and with it the sin's save of y
        assert dict(meter.by_label) == {"lin": nbytes, "": 0}
        token = meter.hold(y.detach())  # (detached: a view's grad_fn would keep y's graph alive)
        again = meter.hold(y.detach()[:2])  # a view of the same storage: counted once
        assert meter.live == 2 * nbytes
        del y  # the linear's graph goes: x is no longer saved, y's storage is still held
        assert meter.live == nbytes and dict(meter.by_label) == {"lin": 0, "": nbytes}
        del token, again
        assert meter.live == 0 and meter.peak == 2 * nbytes
    for h in handles:
        h.remove()
