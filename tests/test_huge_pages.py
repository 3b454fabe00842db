"""memory/huge_pages.py: the packed weights' shared buffer."""

import gc
import os
import mmap

import pytest
import torch

from radixrt.memory import huge_pages


def test_copies_are_equal_in_order_aligned_and_independent_of_the_originals():
    generator = torch.Generator().manual_seed(0)
    originals = [torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)
                 for shape in [(100,), (3, 70_000), (0,), (1,), (4, 4, 64)]]  # fmt: skip
    expected = [tensor.clone() for tensor in originals]
    copies = huge_pages.side_by_side(originals)
    assert copies[0].data_ptr() % huge_pages.HUGE_PAGE == 0
    end = copies[0].data_ptr()
    for copy, want in zip(copies, expected):
        assert copy.shape == want.shape and torch.equal(copy, want)
        if copy.numel():  # (torch gives an empty view no address)
            assert copy.data_ptr() == end, "side by side, in order, each on the next 64-byte boundary"
        end += -(-copy.numel() // huge_pages.ALIGNMENT) * huge_pages.ALIGNMENT
    originals[1].zero_()
    del originals
    gc.collect()
    assert all(torch.equal(copy, want) for copy, want in zip(copies, expected))
    copies[3].fill_(7)  # the buffer is the copies' own, writable
    assert copies[3].item() == 7 and torch.equal(copies[4], expected[4])


def test_nothing_to_copy_gives_nothing():
    assert huge_pages.side_by_side([]) == []
    (empty,) = huge_pages.side_by_side([torch.empty(0, dtype=torch.uint8)])
    assert empty.numel() == 0


@pytest.mark.parametrize(
    "bad, message",
    [
        (torch.zeros(8, dtype=torch.int32), r"tensors\[1\]: expected a contiguous uint8 CPU tensor, got torch.int32"),
        (torch.zeros(8, 8, dtype=torch.uint8).t(), r"tensors\[1\]: .*\(not contiguous\)"),
    ],
)
def test_other_tensors_are_refused_by_position(bad, message):
    with pytest.raises(ValueError, match=message):
        huge_pages.side_by_side([torch.zeros(4, dtype=torch.uint8), bad])


def test_a_kernel_that_refuses_huge_pages_still_gets_its_copies(monkeypatch):
    """Where madvise refuses the advice (EINVAL without transparent huge pages), the copies are
    made on ordinary pages: loading a model must not fail for it."""
    monkeypatch.setattr(mmap, "MADV_HUGEPAGE", 0x7FFF, raising=False)  # advice no kernel knows
    tensor = torch.arange(200, dtype=torch.uint8)
    (copy,) = huge_pages.side_by_side([tensor])
    assert torch.equal(copy, tensor)


def anon_huge_bytes(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            inside = start <= address < end
        elif inside and fields[0] == "AnonHugePages:":
            return int(fields[1]) * 1024
    return 0


def test_settled_weights_keep_their_bytes_and_move_onto_huge_pages_where_the_kernel_can():
    """Written on small pages, then moved in the background (`settle`): the bytes a step reads
    never change, and where the kernel collapses ranges (Linux 6.1, transparent huge pages on)
    the buffer ends on huge pages."""
    data = torch.randint(0, 256, (8 * huge_pages.HUGE_PAGE,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    placed = huge_pages.SideBySide([data.numel()])
    copy = placed.place(data)
    thread = huge_pages.settle()
    assert thread is not None and huge_pages.settle() is None, "each buffer is settled once"
    thread.join(timeout=120)
    assert not thread.is_alive()
    assert torch.equal(copy, data)
    try:
        enabled = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
        release = tuple(int(part) for part in os.uname().release.split(".")[:2])
    except (OSError, ValueError):
        pytest.skip("no transparent huge pages to check here")
    if "[never]" in enabled or release < (6, 1):
        pytest.skip("this kernel collapses no ranges onto huge pages")
    assert anon_huge_bytes(copy.data_ptr()) >= 4 * huge_pages.HUGE_PAGE
