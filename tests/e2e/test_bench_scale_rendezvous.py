"""``unbroken bench scale``'s rendezvous curve at its smallest size: two agent processes and a
spare form a round with the real c10d rendezvous, lose one agent, and re-form with the spare."""

from __future__ import annotations

import pytest

from unbroken.bench import scale_rendezvous

pytestmark = pytest.mark.timeout(240)


def test_two_agents_form_lose_one_and_reform_with_the_spare() -> None:
    row = scale_rendezvous.measure(2, timeout_s=180)
    assert row["rounds"] == [0, 1]  # one round each time, agreed by every agent
    assert row["spare_joined"]
    # the loss is noticed only once the keep-alive expired; the new round comes after
    assert row["notice_s"] >= scale_rendezvous.KEEP_ALIVE_S
    assert row["reform_s"] >= row["notice_s"] > 0
    assert row["form_s"] > 0
