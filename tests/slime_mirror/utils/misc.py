import importlib


def load_function(path):
    module_path, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module_path), attr)
