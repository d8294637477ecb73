"""A transport that records the engine calls kvplan makes and moves no bytes.

For tests of what kvplan decides before or around an engine call (which requests a failed call
blames, what is refused before anything is posted): the calls' shape is the observable, so
nothing is written. Tests that check bytes use the real engines (``support.engine_peers``).
"""

from __future__ import annotations

from kvplan.engines._base import Transport


class RecordingTransport(Transport):
    """Counts engine writes and blocks; the call whose first block is ``fail_at`` returns an
    engine error. It has no ``submit_async``, as a synchronous-only engine has none."""

    engine_name = "recording"

    def __init__(self, fail_at: int | None = None) -> None:
        super().__init__()
        self.fail_at = fail_at
        self.writes = 0
        self.blocks_seen = 0

    def _engine_session_id(self) -> str:
        return "recording"

    def _engine_register(self, ptrs: list[int], lens: list[int], device: str) -> int:
        return 0

    def _engine_unregister(self, ptrs: list[int]) -> int:
        return 0

    def _engine_write(self, peer: str, src: list[int], dst: list[int],
                      lengths: list[int]) -> int:
        first_block = self.blocks_seen
        self.writes += 1
        self.blocks_seen += len(src)
        return -1 if first_block == self.fail_at else 0
