"""A worker's load moves only through the steps of its lifecycle (pdxfer.vllm.worker.load)."""

from __future__ import annotations

import pytest

from pdxfer.vllm.metadata import LoadSpec
from pdxfer.vllm.worker.load import Load, LoadPhase, LoadPhaseError


def _load() -> Load:
    spec = LoadSpec(req_id="r1", lock_id="L", num_tokens=256, reads=(), lock_expires_at=0.0,
                    blocks=(), holders=())
    return Load(spec, [], 0.0, 0)


def test_every_path_of_a_load_is_a_step_it_has() -> None:
    for path in ([LoadPhase.READING, LoadPhase.VALIDATING, LoadPhase.DONE],
                 [LoadPhase.VALIDATING, LoadPhase.FAILED],  # no connection: straight to the release
                 [LoadPhase.READING, LoadPhase.FAILED],
                 [LoadPhase.READING, LoadPhase.VALIDATING, LoadPhase.REPULLING, LoadPhase.SUPERSEDED],
                 [LoadPhase.READING, LoadPhase.VALIDATING, LoadPhase.REPULLING, LoadPhase.FAILED]):
        load = _load()
        for phase in path:
            load.enter(phase)
        assert load.phase is path[-1]


@pytest.mark.parametrize("path", [
    [LoadPhase.READING, LoadPhase.VALIDATING, LoadPhase.DONE, LoadPhase.VALIDATING],  # reported twice
    [LoadPhase.READING, LoadPhase.FAILED, LoadPhase.DONE],  # a failed load counted as loaded
    [LoadPhase.READING, LoadPhase.DONE],  # loaded without the master's word on the lock
    [LoadPhase.READING, LoadPhase.REPULLING],  # re-pulled before this round's release said what counts
    [LoadPhase.READING, LoadPhase.VALIDATING, LoadPhase.REPULLING, LoadPhase.SUPERSEDED, LoadPhase.DONE],
])
def test_a_step_the_lifecycle_lacks_is_refused(path) -> None:
    load = _load()
    for phase in path[:-1]:
        load.enter(phase)
    with pytest.raises(LoadPhaseError, match=f"{path[-2].value} -> {path[-1].value}"):
        load.enter(path[-1])
    assert load.phase is path[-2]
