"""``choose_path``: staged or direct per request, from the agreement, the mode and
``Template.transfer_advice`` with the engine's costs."""

from __future__ import annotations

import pytest

from kvplan import ConfigError, Request, TransferCost
from kvplan.staging import DirectFallback, StagingAgreement, choose_path
from support.staging_rounds import mla_fragmented_case

AGREED = StagingAgreement((0x1000, 1 << 20), (0x9000, 1 << 20), 2, "0.1.0")
#: An engine whose blocks are dear (Mooncake TCP's ~30 us each) and copies cheap.
DEAR_BLOCKS = TransferCost(per_block_s=30e-6, network_bytes_per_s=2e9, copy_bytes_per_s=10e9)
#: An engine whose blocks are nearly free and copies slow: staging only adds copies.
CHEAP_BLOCKS = TransferCost(per_block_s=1e-9, network_bytes_per_s=2e9, copy_bytes_per_s=1e8)


def test_the_advice_decides_where_both_peers_agreed() -> None:
    _, _, template, src, dst = mla_fragmented_case()
    staged = choose_path(template, (src, dst), DEAR_BLOCKS, AGREED)
    assert staged.staged and staged.advice is not None
    assert staged.advice.choice == template.transfer_advice(src, dst, DEAR_BLOCKS).choice
    assert staged.advice.direct_blocks == 1200 and "staged:" in staged.why
    direct = choose_path(template, Request(src, dst), CHEAP_BLOCKS, AGREED)
    assert direct.path == "direct" and direct.advice is not None
    assert direct.advice.choice == "direct"


def test_no_agreement_off_always_and_no_costs() -> None:
    _, _, template, src, dst = mla_fragmented_case()
    why = DirectFallback("the peer sent no kvplan staging capabilities")
    assert choose_path(template, (src, dst), DEAR_BLOCKS, why).why == why.reason
    assert choose_path(template, (src, dst), DEAR_BLOCKS, None).path == "direct"
    assert choose_path(template, (src, dst), DEAR_BLOCKS, AGREED, mode="off").path == "direct"
    always = choose_path(template, (src, dst), CHEAP_BLOCKS, AGREED, mode="always")
    assert always.staged and always.advice is None
    none = choose_path(template, (src, dst), None, AGREED)
    assert none.path == "direct" and "no measured engine costs" in none.why
    with pytest.raises(ConfigError, match="mode=.sometimes."):
        choose_path(template, (src, dst), None, AGREED, mode="sometimes")
