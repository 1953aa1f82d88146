"""Crash torture (lab/torture.py), short and bounded: clients write and read back continuously while
random nodes -- leaders included -- are SIGKILLed and restarted; afterwards, once repair has settled, every
acknowledged write reads back right from every replica and no read during the run returned wrong bytes.

The longer soak: ``python -m lab.torture --seed S --seconds T`` .
Set TORTURE_SEED to replay the random-seed case.
"""
from __future__ import annotations

import json
import os
import random

from lab import torture

SECONDS = float(os.environ.get("TORTURE_SECONDS", "25"))


def _check(res: dict) -> None:
    print(torture.summary(res))
    assert not res["wrong_reads"], f"reads returned wrong bytes: {json.dumps(res['wrong_reads'][:5])}"
    assert not res["verify_errors"], f"after repair: {json.dumps(res['verify_errors'][:5])}"
    assert res["ok"], torture.summary(res)
    assert res["kills"] >= 3, torture.summary(res)
    assert res["acked_writes"] >= 20, torture.summary(res)


def test_torture_fixed_seed(tmp_path):
    res = torture.main_sync(seed=20251122, seconds=SECONDS, clients=3, root=str(tmp_path), log=print)
    _check(res)
    assert res["leader_kills"] >= 1


def test_torture_random_seed(tmp_path):
    seed = int(os.environ.get("TORTURE_SEED") or random.SystemRandom().randrange(1 << 31))
    print(f"torture seed {seed} (replay: TORTURE_SEED={seed} pytest tests/test_torture.py -k random)")
    res = torture.main_sync(seed=seed, seconds=SECONDS, clients=3, root=str(tmp_path), log=print)
    _check(res)
