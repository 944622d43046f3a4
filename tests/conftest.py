import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (run on the GPU machine)")
    config.addinivalue_line("markers", "soak: long randomized fault soak (off by default; --soak)")
    config.addinivalue_line("markers", "slow: the benchmark harness as a whole command (alone, through torchrun or "
                                       "as Ray actors), and waits that last a default deadline "
                                       "(off by default, to keep the suite within CI's time; --slow)")


def pytest_addoption(parser):
    parser.addoption("--soak", action="store_true", default=False, help="run the soak tests")
    parser.addoption("--slow", action="store_true", default=False, help="run the slow launcher tests")


def pytest_collection_modifyitems(config, items):
    import torch

    has_cuda = torch.cuda.is_available()
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))
        if "soak" in item.keywords and not config.getoption("--soak"):
            item.add_marker(pytest.mark.skip(reason="soak test: pass --soak"))
        if "slow" in item.keywords and not config.getoption("--slow"):
            item.add_marker(pytest.mark.skip(reason="slow launcher test: pass --slow"))
