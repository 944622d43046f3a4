"""The chunk container against torch's own writer and reader."""

import io
import struct
import zipfile

import pytest
import torch

from safe_ckpt import compat
from safe_ckpt.encoding import torchzip

ALL_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
SAVEABLE = [d for d in ALL_DTYPES if compat.is_saveable_dtype(d)]
SHAPES = [(), (0,), (7,), (3, 5), (2, 3, 4), (1, 0, 5), (4, 1, 2, 3)]


def _random_tensor(dtype, shape, seed):
    n = 1
    for s in shape:
        n *= s
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n * dtype.itemsize,), generator=g, dtype=torch.uint8)
    return raw, (raw.view(dtype).reshape(shape) if n else torch.empty(shape, dtype=dtype))


def _serialization_id(archive: bytes) -> str:
    info = zipfile.ZipFile(io.BytesIO(archive)).getinfo("archive/.data/serialization_id")
    name_len, extra_len = struct.unpack_from("<HH", archive, info.header_offset + 26)
    start = info.header_offset + 30 + name_len + extra_len
    return archive[start:start + info.file_size].decode()


def test_every_dtype_torch_saves_is_covered():
    # The dtypes we refuse are exactly those torch.save itself cannot store.
    for dtype in ALL_DTYPES:
        try:
            torch.save(torch.empty(2, dtype=dtype), io.BytesIO())
            torch_can = True
        except Exception:
            torch_can = False
        if dtype in SAVEABLE:
            assert torch_can, dtype
        else:
            assert not torch_can or str(dtype).startswith("torch.q"), dtype


@pytest.mark.parametrize("crc", [False, True])
@pytest.mark.parametrize("dtype", SAVEABLE, ids=str)
def test_container_is_byte_identical_to_torch_save_and_loads(dtype, crc):
    old = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(crc)
    try:
        for i, shape in enumerate(SHAPES):
            raw, tensor = _random_tensor(dtype, shape, seed=i)
            buf = io.BytesIO()
            torch.save(tensor, buf)
            reference = buf.getvalue()
            c = torchzip.tensor_container(dtype, shape, crc32=crc, serialization_id=_serialization_id(reference))
            payload = raw.numpy().tobytes()
            ours = c.prefix + payload + c.suffix(torchzip.payload_crc32([payload]) if crc else 0)
            assert ours == reference, (dtype, shape)
            back = torch.load(io.BytesIO(ours), weights_only=True)
            assert back.dtype == dtype and tuple(back.shape) == shape
            assert back.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() == payload
    finally:
        torch.serialization.set_crc32_options(old)


def test_container_sizes_are_known_before_the_payload():
    c = torchzip.tensor_container(torch.bfloat16, (1024, 4096))
    assert c.payload_bytes == 1024 * 4096 * 2
    assert c.total_bytes == len(c.prefix) + c.payload_bytes + len(c.suffix(0x12345678))
    assert len(c.prefix) % 64 == 0  # payload starts aligned, as torch aligns record data


def test_crc_patch_only_touches_crc_fields():
    c = torchzip.tensor_container(torch.float32, (8,))
    patched = c.suffix(0xDEADBEEF)
    diff = [i for i, (a, b) in enumerate(zip(c.suffix(0), patched)) if a != b]
    assert diff and all(any(o <= i < o + 4 for o in c.crc_offsets) for i in diff)


def test_mmap_load_of_a_written_file(tmp_path):
    raw, _ = _random_tensor(torch.float16, (33, 7), seed=3)
    c = torchzip.tensor_container(torch.float16, (33, 7))
    path = tmp_path / "t.pt"
    path.write_bytes(c.prefix + raw.numpy().tobytes() + c.suffix())
    back = torch.load(path, mmap=True, weights_only=True)
    assert back.view(torch.uint8).reshape(-1).numpy().tobytes() == raw.numpy().tobytes()


def test_containers_built_once_per_shape_equal_fresh_ones_and_keep_unique_ids():
    """The per-(dtype, shape) template with a new id is byte for byte the container built from
    scratch with that id; every call gets its own id; CRC containers are built fresh."""
    from safe_ckpt.encoding.torchzip import _build_tensor_container

    for dtype, shape in [(torch.float32, (8,)), (torch.bfloat16, (1024, 4096)), (torch.int8, (3, 5, 7)),
                         (torch.float16, ()), (torch.bool, (0, 4))]:
        first = torchzip.tensor_container(dtype, shape)
        second = torchzip.tensor_container(dtype, shape)
        assert first.suffix_template != second.suffix_template  # fresh ids
        for c in (first, second):
            sid = c.suffix_template[c.serialization_id_at:c.serialization_id_at + 40].decode()
            assert sid.isdigit()
            fresh = _build_tensor_container(dtype, shape, False, sid)
            assert (c.prefix, c.suffix_template, c.crc_offsets) == (fresh.prefix, fresh.suffix_template,
                                                                    fresh.crc_offsets)
        with_crc = torchzip.tensor_container(dtype, shape, crc32=True, serialization_id="1" * 40)
        assert with_crc.serialization_id_at == -1
        with pytest.raises(ValueError):
            with_crc.with_serialization_id("2" * 40)
        with pytest.raises(ValueError):
            first.with_serialization_id("3" * 39)
