"""A PackedSequence keeps its type through the device stage: its batch_sizes stays on the CPU.

PackedSequence's constructor refuses a batch_sizes anywhere but on the CPU, as its own ``.to()``
and torch's pin_memory know; moving every field made the batch arrive as a plain tuple (seen on
a real GPU: ``test_torch_compat.py::test_a_packed_sequence_moved_to_the_gpu_keeps_its_type``).
"""

from __future__ import annotations

import torch
from test_device import FakeBackend
from torch.nn.utils.rnn import PackedSequence, pack_sequence

from aioloader._device import DeviceStage


def packed() -> PackedSequence:
    rows = [torch.arange(n, dtype=torch.float32) + 10 * n for n in (4, 2, 3)]
    return pack_sequence(rows, enforce_sorted=False)


async def test_a_packed_sequence_arrives_as_one_with_batch_sizes_left_on_the_cpu() -> None:
    backend = FakeBackend(auto_complete_after=1)
    stage = DeviceStage("cuda", backend=backend)
    sequence = packed()
    label = torch.tensor([1, 0, 1])
    batch = {"seq": sequence, "label": label}
    out = await stage.start(batch, 0).wait()
    seq = out["seq"]
    assert type(seq) is PackedSequence
    assert seq.batch_sizes is sequence.batch_sizes  # not copied anywhere
    assert torch.equal(seq.data, sequence.data)
    assert seq.sorted_indices is not None
    assert sequence.sorted_indices is not None
    assert torch.equal(seq.sorted_indices, sequence.sorted_indices)
    assert torch.equal(out["label"], label)
    # data, both index tensors and the label went through copies; batch_sizes did not.
    assert len(backend.entries("copy")) == 4
    stage.close()
