"""Integrations with training frameworks: slime (`slime`, installed with `--ckpt-backend safe`).
"""
