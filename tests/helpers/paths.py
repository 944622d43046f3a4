"""Paths of the repository the tests run from (tests sit one or two folders below its root)."""

import os

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(TESTS)
BENCHMARKS = os.path.join(REPO, "benchmarks")
SCRIPTS = os.path.join(REPO, "scripts")
STAND_INS = os.path.join(TESTS, "stand_ins")
STAND_INS_TMS = os.path.join(TESTS, "stand_ins_tms")
SLIME_MIRROR = os.path.join(TESTS, "slime_mirror")
