"""End to end on a real S3 API (moto), AWS_ENDPOINT_URL set: a run whose --load and --save are a
bucket's root, or a prefix in it, resumes from iteration 100; retention (keep_last=1) keeps it."""
from argparse import Namespace
import pytest
from safe_ckpt.megatron import resume, training
from tests.helpers.s3server import s3_server  # noqa: F401
from tests.targets.test_last_good_checkpoint_survives import _state


@pytest.mark.parametrize("told", ["args", "url"])
@pytest.mark.parametrize("root", ["s3://bkt", "s3://bkt/run"])
def test_resumed_checkpoint_at_a_bucket_root_survives_retention(s3_server, monkeypatch, root, told):
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    s3_server.bucket("bkt")
    resume.forget()
    training.save_state(_state(1), root, f"{root}/iter_0000100", "100")     # an earlier run
    resume.forget()                                                          # this process starts
    args = Namespace(load=root, save=root, ckpt_step=None, finetune=False, pretrained_checkpoint=None,
                     no_load_optim=False, no_load_rng=False)
    if told == "args":
        training.note_loaded_from_args(args)                                 # it resumed from 100
    else:  # a load path that names the URL it read, as the user gave it
        resume.note_loaded(f"{root}/iter_0000100")
    keep = training.Retention(keep_last=1)
    for it in (200, 300):
        training.save_state(_state(it), root, f"{root}/iter_{it:07d}", str(it), retention=keep)
    prefix = root[len("s3://bkt"):].strip("/")
    keys = s3_server.keys("bkt", prefix)
    iters = sorted({k.split("/")[-2] for k in keys if "iter_" in k})
    resume.forget()
    assert "iter_0000100" in iters, iters
