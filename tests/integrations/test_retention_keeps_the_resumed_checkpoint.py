"""Retention keeps the checkpoint the run loaded, as Megatron's load chose it (`--load`, `--ckpt-step`,
the tracker, `--pretrained-checkpoint`, `--finetune`), and only where it lives in the save root.
(The full Megatron-adapter run over gloo ranks: tests/integrations/test_megatron_adapters.py.)"""

from __future__ import annotations

import logging
import os
from argparse import Namespace

import pytest

from safe_ckpt.targets.directory import publish as commit
from safe_ckpt.targets.directory import root as dir_root
from safe_ckpt import names
from safe_ckpt.megatron import resume
from tests.targets.test_last_good_checkpoint_survives import _fake_checkpoint, _iters, _opts, _state


@pytest.fixture(autouse=True)
def fresh_registry():
    resume.forget()  # what a process noted is process-wide: each test starts as a new process
    yield
    resume.forget()


def _run(tmp_path, name, tracker=None):
    path = tmp_path / name
    path.mkdir()
    if tracker is not None:
        (path / names.TRACKER_FILE).write_text(tracker)
    return str(path)


def _args(**kw):
    base = dict(load=None, ckpt_step=None, finetune=False, pretrained_checkpoint=None, no_load_optim=False,
                no_load_rng=False)
    base.update(kw)
    return Namespace(**base)


def test_the_loaded_directory_is_chosen_as_megatron_chooses_it(tmp_path):
    run = _run(tmp_path, "run", "300")
    empty = _run(tmp_path, "empty")
    base = _run(tmp_path, "base", "7")
    released = _run(tmp_path, "released", "release")
    pick = resume.loaded_from_args
    assert pick(_args(load=run)) == f"{run}/iter_0000300"
    assert pick(_args(load=run, ckpt_step=100)) == f"{run}/iter_0000100"
    assert pick(_args(load=run, ckpt_step=0)) == f"{run}/iter_0000300"  # Megatron: 0 is "not given"
    # --finetune and --no-load-* leave parts unread or reset the counter: the same directory
    assert pick(_args(load=run, ckpt_step=100, finetune=True, no_load_optim=True, no_load_rng=True)) \
        == f"{run}/iter_0000100"
    assert pick(_args(load=empty)) is None
    assert pick(_args(load=empty, ckpt_step=5)) == f"{empty}/iter_0000005"
    assert pick(_args(load=empty, pretrained_checkpoint=base)) == f"{base}/iter_0000007"
    assert pick(_args(pretrained_checkpoint=base)) == f"{base}/iter_0000007"
    assert pick(_args(load=run, pretrained_checkpoint=base)) == f"{run}/iter_0000300"  # --load has one
    assert pick(_args(load=released)) == f"{released}/release"
    assert pick(_args(load=released, ckpt_step=9)) == f"{released}/release"  # as Megatron: release wins
    assert pick(_args()) is None


def test_only_loads_inside_the_save_root_are_protected(tmp_path):
    run = _run(tmp_path, "run", "300")
    (tmp_path / "alias").symlink_to(run)
    resume.note_loaded(str(tmp_path / "base" / "iter_0000007"))  # a pretrained checkpoint elsewhere
    assert resume.protected(run) == frozenset()  # and the tracker's 300 is not what was loaded
    resume.note_loaded(str(tmp_path / "alias" / "iter_0000100"))  # the save root by another name
    resume.note_loaded(str(tmp_path / "alias" / "release"))
    assert resume.protected(run) == {100}
    assert resume.protected(str(tmp_path / "base")) == {7}


def test_an_object_store_root_matches_by_store_and_prefix_not_by_spelling():
    resume.note_loaded("s3://bucket/run/iter_0000100")
    resume.note_loaded("run/iter_0000200", kvstore_spec={"driver": "memory"})
    assert resume.protected("s3://bucket/run/") == {100}  # a trailing slash names the same prefix
    assert resume.protected("s3://bucket/other") == frozenset()
    from safe_ckpt import targets
    assert resume.protected(targets.resolve("run", spec={"driver": "memory"})) == {200}
    assert resume.protected(targets.resolve("run", spec={"driver": "file", "path": "/x"})) == frozenset()
    assert resume.protected("run") == frozenset()  # a local directory of that name is another place


def test_a_process_that_never_said_what_it_loaded_keeps_the_tracker_fallback(tmp_path):
    run = _run(tmp_path, "run", "300")
    assert resume.protected(run) == {300}
    (tmp_path / "run" / names.TRACKER_FILE).write_text("310")  # its own first save moved it
    assert resume.protected(run) == {300}
    resume.note_loaded(None)  # told: a fresh start, nothing loaded
    assert resume.protected(run) == frozenset()


def test_save_state_keeps_what_note_loaded_named_not_what_the_tracker_names(tmp_path, caplog):
    from safe_ckpt.megatron import save_state
    from safe_ckpt.targets.retention import Retention

    root = str(tmp_path)
    for it in (100, 200, 300):
        _fake_checkpoint(root, it)
    dir_root.write_tracker(root, 300)
    resume.note_loaded(os.path.join(root, "iter_0000100"))  # what a load path (slime's, a future one) says
    with caplog.at_level(logging.WARNING, logger="safe_ckpt"):
        for it in (110, 120):
            save_state(_state(it), root, os.path.join(root, f"iter_{it:07d}"), str(it), options=_opts(),
                       retention=Retention(keep_last=1))
    assert _iters(root) == [f"iter_{i:07d}" for i in (100, 120, 200, 300)]
    newer = [r.getMessage() for r in caplog.records if "[200, 300]" in r.getMessage()]
    assert newer and all("iteration 100, which this run resumed from" in m for m in newer), newer


def test_a_malformed_url_is_noted_as_nothing_with_a_warning(monkeypatch, caplog):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # the save's endpoint rule applies
    resume.note_loaded("s3:///iter_0000100")  # no bucket: no save could have written it
    assert "retention protects nothing" in caplog.text
    assert resume.protected("s3://bucket/run") == frozenset()
