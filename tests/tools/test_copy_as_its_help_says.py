"""`safe-ckpt copy` as its help says: a save root's tracker is followed and named; paths print as
typed; a local DST is published in one rename (a failure leaves it as it was); --replace leaves
DST holding exactly the copied checkpoint, on a directory and on a kvstore."""

import os

import pytest
import torch

import safe_ckpt
from tests.tools.test_cli_edges import OPTS, _cli, _save_root, _state


def _files(path):
    return {n: open(os.path.join(path, n), "rb").read() for n in os.listdir(path)}


def _loads_bit_exact(path, seed):
    import torch.distributed.checkpoint as dcp

    out = {"w": torch.empty(60, 40), "b": torch.empty(17, dtype=torch.bfloat16)}
    dcp.load(out, checkpoint_id=path, no_dist=True)
    ref = _state(seed)
    for key in out:
        assert torch.equal(out[key].view(torch.uint8), ref[key].data.view(torch.uint8)), key


def test_copy_of_a_save_root_follows_its_tracker_and_prints_paths_as_typed(tmp_path, monkeypatch):
    _save_root(tmp_path, [3, 5])
    monkeypatch.chdir(tmp_path)
    rc, out, err = _cli("copy", "run", "back")
    assert rc == 0, err
    assert err == "followed latest_checkpointed_iteration.txt (5) to run/iter_0000005\n", err
    assert out.startswith("copied run/iter_0000005 to back: 6 files, ") and out.endswith(" KiB\n"), out
    assert "file://" not in out + err and str(tmp_path) not in out + err
    assert _files("back") == _files("run/iter_0000005")
    _loads_bit_exact("back", 5)


def test_replace_leaves_exactly_the_copied_checkpoint(tmp_path):
    src = str(tmp_path / "ck")
    safe_ckpt.save(_state(1), src, options=safe_ckpt.SaveOptions(**OPTS))
    dst = tmp_path / "dst"
    (dst / "sub").mkdir(parents=True)
    (dst / "notes.txt").write_text("mine")
    (dst / "sub" / "more.txt").write_text("mine too")
    assert _cli("copy", src, str(dst))[0] == 1  # refused without the flag, nothing changed
    assert sorted(os.listdir(dst)) == ["notes.txt", "sub"]
    rc, out, err = _cli("copy", "--replace", src, str(dst))
    assert rc == 0, err
    assert _files(str(dst)) == _files(src)  # no foreign file, no subdirectory left
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")], os.listdir(tmp_path)
    assert _cli("verify", str(dst))[0] == 0
    _loads_bit_exact(str(dst), 1)


def test_copy_over_a_checkpoint_replaces_it_and_a_failed_copy_leaves_it_whole(tmp_path, monkeypatch):
    old, new, dst = (str(tmp_path / n) for n in ("old", "new", "dst"))
    safe_ckpt.save(_state(1), old, options=safe_ckpt.SaveOptions(**OPTS))
    safe_ckpt.save(_state(2), new, options=safe_ckpt.SaveOptions(**OPTS))
    assert _cli("copy", old, dst)[0] == 0
    before = _files(dst)
    # the third file read fails: the data files share their names with the checkpoint at DST
    reads = []
    from safe_ckpt.targets.directory.copying import LocalSource
    real = LocalSource.read

    def failing(self, name):
        reads.append(name)
        if len(reads) == 3:
            raise OSError(5, "Input/output error")
        return real(self, name)

    monkeypatch.setattr(LocalSource, "read", failing)
    rc, out, err = _cli("copy", new, dst)
    assert rc == 1 and out == "" and f"cannot read {new}/{reads[-1]} from the source" in err, err
    assert _files(dst) == before  # untouched
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")], os.listdir(tmp_path)
    monkeypatch.undo()
    rc, _, err = _cli("copy", new, dst)  # a checkpoint at DST is replaced without the flag
    assert rc == 0, err
    assert _files(dst) == _files(new)
    _loads_bit_exact(dst, 2)


def test_copy_onto_itself_is_refused(tmp_path):
    src = str(tmp_path / "ck")
    safe_ckpt.save(_state(1), src, options=safe_ckpt.SaveOptions(**OPTS))
    rc, out, err = _cli("copy", src, src + "/")
    assert rc == 2 and err == f"safe-ckpt copy: error: {src}/: the destination is the checkpoint being copied\n"


def test_replace_on_a_kvstore_leaves_exactly_the_copied_checkpoint(tmp_path):
    pytest.importorskip("tensorstore")
    from safe_ckpt.sinks.tensorstore import KvTarget, open_sink

    src = str(tmp_path / "ck")
    safe_ckpt.save(_state(4), src, options=safe_ckpt.SaveOptions(**OPTS))
    url = "memory://copies/dst"  # one process's store: the command runs in this process
    sink = open_sink(KvTarget(url))
    sink.write_file("notes.txt", b"mine")
    sink.write_file("deeper/x.txt", b"mine too")
    rc, _, err = _cli("copy", src, url)
    assert rc == 1 and err.endswith("refusing to replace it. Remove them, or pass --replace\n"), err
    assert "SaveOptions" not in err
    rc, out, err = _cli("copy", "--replace", src, url)
    assert rc == 0 and out.startswith(f"copied {src} to memory://copies/dst/: 6 files"), out + err
    assert sorted(sink.list_tree()) == sorted(os.listdir(src))
    assert {n: sink.read(n) for n in sink.list()} == _files(src)
    back = str(tmp_path / "back")
    assert _cli("copy", url, back)[0] == 0
    _loads_bit_exact(back, 4)


def test_copy_over_a_kvstore_checkpoint_prints_no_import_noise(tmp_path):
    from tests.tools.test_cli_edges import _cli_process

    src = str(tmp_path / "ck")
    safe_ckpt.save(_state(3), src, options=safe_ckpt.SaveOptions(**OPTS))
    url = f"file://{tmp_path}/bucket/ck"
    for _ in range(2):  # the second replaces the first, reading its index
        done = _cli_process("copy", src, url)
        assert done.returncode == 0 and done.stderr == "", done.stderr


def test_replace_never_replaces_a_save_that_is_running(tmp_path):
    pytest.importorskip("tensorstore")
    from safe_ckpt.targets.objectstore import publish as kvcommit
    from safe_ckpt.sinks.tensorstore import KvTarget, open_sink

    src = str(tmp_path / "ck")
    safe_ckpt.save(_state(5), src, options=safe_ckpt.SaveOptions(**OPTS))
    url = "memory://copies/running"
    sink = open_sink(KvTarget(url))
    kvcommit.claim(sink, "0123456789abcdef")  # a save of this prefix, alive in this process
    try:
        rc, out, err = _cli("copy", "--replace", src, url)
    finally:
        kvcommit.release("0123456789abcdef")
    assert rc == 1 and out == "" and err == (
        "safe-ckpt copy: another save of memory://copies/running/ is running (save 0123456789abcdef); copy there "
        "once it has finished\n"), err
    assert sink.list() == [kvcommit.owner_key("0123456789abcdef")]
