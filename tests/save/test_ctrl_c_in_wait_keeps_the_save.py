"""Ctrl-C while the caller waits on an async save's handle: the save goes on, a second `wait()`
waits for it and returns its result, and the checkpoint is published. (On Python 3.11 a
`Thread.join` cut short by KeyboardInterrupt marks the thread stopped for good; a handle that
waited through `join` then reported the running save as done and the exit handler did not wait.)

The interrupt is sent by the save's own finishing step, once the main thread is seen blocked
inside `wait()`, and that step goes on only when the test says so: no timing involved."""

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent('''
    import os, signal, sys, threading, time
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    import safe_ckpt
    from safe_ckpt.saving import job as job_mod

    go = threading.Event()
    real_finish = job_mod.SaveJob.finish
    main = threading.main_thread()

    def main_waits_in_handle():
        # blocked: the handle's wait() calling into threading's waits, not still opening a window
        frame, callee = sys._current_frames().get(main.ident), None
        while frame is not None:
            if frame.f_code.co_name in ("wait", "_wait") and frame.f_code.co_filename.endswith("handle.py"):
                return callee is not None and callee.f_code.co_filename.endswith("threading.py")
            frame, callee = frame.f_back, frame
        return False

    def finish(self, *args, **kwargs):
        deadline = time.monotonic() + 60
        while not main_waits_in_handle():  # bounded: the main thread is about to call wait()
            if time.monotonic() > deadline:
                raise RuntimeError("the main thread never waited")
            time.sleep(0.001)
        os.kill(os.getpid(), signal.SIGINT)
        if not go.wait(60):
            raise RuntimeError("the test never let the save go on")
        return real_finish(self, *args, **kwargs)

    job_mod.SaveJob.finish = finish
    w = torch.randn(4096, generator=torch.Generator().manual_seed(41))
    state = {"w": ShardedTensor.from_rank_offsets("w", w), "iteration": 3}
    handle = safe_ckpt.async_save(state, sys.argv[1])
    try:
        handle.wait()
        print("NO-INTERRUPT")
    except KeyboardInterrupt:
        print("interrupted; done:", handle.done(), flush=True)
    go.set()
    result = handle.wait(60)
    print("second wait:", type(result).__name__, flush=True)
    loaded = safe_ckpt.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros_like(w))}, sys.argv[1])
    print("loaded bit-exact:", torch.equal(loaded["w"].view(torch.int32), w.view(torch.int32)), flush=True)
''')


def test_ctrl_c_in_wait_leaves_the_save_running_and_a_second_wait_gets_its_result(tmp_path):
    script = tmp_path / "interrupt.py"
    script.write_text(SCRIPT)
    target = str(tmp_path / "iter_0000003")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [os.getcwd(), os.environ.get("PYTHONPATH")] if p))
    out = subprocess.run([sys.executable, str(script), target], capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "interrupted; done: False" in out.stdout, out.stdout + out.stderr
    assert "second wait: SaveResult" in out.stdout, out.stdout + out.stderr
    assert "loaded bit-exact: True" in out.stdout, out.stdout + out.stderr
    assert os.path.exists(os.path.join(target, ".metadata"))


FORK_SCRIPT = textwrap.dedent('''
    import os, sys, threading
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    import safe_ckpt
    from safe_ckpt.saving import job as job_mod

    go, started = threading.Event(), threading.Event()
    real_finish = job_mod.SaveJob.finish

    def finish(self, *args, **kwargs):
        started.set()
        if not go.wait(120):
            raise RuntimeError("never let go")
        return real_finish(self, *args, **kwargs)

    job_mod.SaveJob.finish = finish
    w = torch.randn(1024, generator=torch.Generator().manual_seed(43))
    handle = safe_ckpt.async_save({"w": ShardedTensor.from_rank_offsets("w", w)}, sys.argv[1])
    assert started.wait(60)
    pid = os.fork()
    if pid == 0:
        sys.exit(0)  # the child runs the exit handlers: the parent's save is not the child's to wait for
    done_pid, status = os.waitpid(pid, 0)
    print("child exit status:", os.waitstatus_to_exitcode(status), flush=True)
    go.set()
    print("parent save:", type(handle.wait(60)).__name__, flush=True)
''')


def test_a_child_forked_during_an_async_save_exits_without_waiting_for_the_parents_save(tmp_path):
    script = tmp_path / "fork.py"
    script.write_text(FORK_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [os.getcwd(), os.environ.get("PYTHONPATH")] if p))
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "ck")], capture_output=True, text=True,
                         timeout=240, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "child exit status: 0" in out.stdout and "parent save: SaveResult" in out.stdout, out.stdout + out.stderr


NO_THREAD_SCRIPT = textwrap.dedent('''
    import sys, threading
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    import safe_ckpt
    from safe_ckpt.saving import handle as handle_mod

    real_start = threading.Thread.start

    def refusing(self):
        if self.name == "safe_ckpt-finish":
            raise RuntimeError("can't start new thread")
        return real_start(self)

    threading.Thread.start = refusing
    w = torch.randn(256, generator=torch.Generator().manual_seed(44))
    try:
        safe_ckpt.async_save({"w": ShardedTensor.from_rank_offsets("w", w)}, sys.argv[1])
    except RuntimeError as exc:
        print("refused:", exc, flush=True)
    with handle_mod._inflight_lock:
        print("in flight:", len(handle_mod._inflight), flush=True)
''')


def test_a_save_whose_finishing_thread_cannot_start_is_not_waited_for_at_exit(tmp_path):
    """The exit handler waits for saves in flight; one whose finishing thread never started is not
    in flight, so the process exits (it used to wait for ever)."""
    script = tmp_path / "nothread.py"
    script.write_text(NO_THREAD_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [os.getcwd(), os.environ.get("PYTHONPATH")] if p))
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "ck")], capture_output=True, text=True,
                         timeout=120, env=env)
    assert "refused: can't start new thread" in out.stdout and "in flight: 0" in out.stdout, out.stdout + out.stderr
