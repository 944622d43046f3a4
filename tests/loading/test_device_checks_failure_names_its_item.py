"""Review demonstration (CPU): `split.DeviceChecks.finish`, when the read-back of one device's sums
fails, names that device's item, and its streams' waits do not replace the failure. The check
stream is a stand-in mirroring `torch.cuda.Stream.synchronize` (no CUDA here); a meta tensor's
`.cpu()` stands in for a device whose sums cannot be read back."""

import types

import pytest
import torch

from safe_ckpt.loading import split


class _Stream:  # torch.cuda.Stream's one method `finish` calls
    def __init__(self, fails: bool) -> None:
        self.fails = fails

    def synchronize(self) -> None:
        if self.fails:
            raise RuntimeError("CUDA error: an illegal memory access was encountered (stand-in)")


def _item(fqn: str):
    read = types.SimpleNamespace(fqn=fqn, checksum=types.SimpleNamespace(checksum=1),
                                 frame=types.SimpleNamespace(prefix_bytes=0, suffix_bytes=0))
    return types.SimpleNamespace(read=read, grid=types.SimpleNamespace(from_summed=lambda host: None),
                                 hasher=None, value=lambda: 1)


class _Checker:
    key = None
    r = types.SimpleNamespace(count=lambda **kw: None)

    def check(self, read, hasher):
        raise AssertionError("no mismatch in this test")


def test_a_failed_read_back_names_its_own_item_and_stays_the_failure():
    checks = split.DeviceChecks({})
    cpu, meta = torch.device("cpu"), torch.device("meta")
    checks._streams = {cpu: _Stream(False), meta: _Stream(True)}
    checks._items = [(_item("fine.on.device0"), torch.ones(3)),
                     (_item("lost.on.device1"), torch.ones(3, device="meta"))]
    checker = _Checker()
    with pytest.raises(BaseException) as info:
        checks.finish(checker, compare=True)
    assert checker.key != "fine.on.device0", "the failure would name an item whose check passed"
    assert isinstance(info.value, NotImplementedError), f"the read-back's failure was replaced by {info.value!r}"
