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
        frame = sys._current_frames().get(main.ident)
        while frame is not None:
            if frame.f_code.co_name == "wait" and "handle" in frame.f_code.co_filename:
                return True
            frame = frame.f_back
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
