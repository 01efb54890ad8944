"""Collectives listen on the interface that holds the node's address (workers/netif.py)."""

from __future__ import annotations

import pytest

from elastrain.workers.netif import interface_with, pin_collectives_to


def test_the_interface_holding_an_address_is_found() -> None:
    assert interface_with("127.0.0.1") == "lo"
    assert interface_with("203.0.113.77") is None  # TEST-NET-3: on no interface here


def test_pinning_names_the_interface_unless_the_operator_did(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        # set, then deleted: monkeypatch then restores whatever was there, the value the
        # function under test writes included.
        monkeypatch.setenv(name, "placeholder")
        monkeypatch.delenv(name)
    assert pin_collectives_to("127.0.0.1") == "lo"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth9")
    assert pin_collectives_to("127.0.0.1") is None
