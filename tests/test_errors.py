"""The error table is part of the wire contract: codes never change."""

from __future__ import annotations

import pytest

from contract import errors
from contract.errors import REGISTRY, RETIRED, ModeldError, from_wire

PINNED = {
    1: "ModeldError",
    11: "StaleFence",
    12: "LostOwner",
    20: "SessionClosed",
    21: "ContextOverflow",
    22: "ManifestMismatch",
    23: "SnapshotRejected",
    24: "OffsetDrift",
    30: "ModelBusy",
    31: "ModelNotActive",
    32: "ModelSwitchRequired",
    33: "ModelLoadFailed",
    34: "InsufficientMemory",
    35: "SlotGenerationStale",
    36: "BackendMismatch",
    37: "ModelNotFound",
    40: "UnsupportedFeature",
    50: "InvalidArgument",
    60: "BadFrame",
    61: "UnsupportedProtocolVersion",
    62: "UnknownOperation",
    63: "FrameTooLarge",
    70: "Cancelled",
    80: "Internal",
    90: "Unavailable",
    91: "DaemonTimeout",
    92: "ShuttingDown",
    93: "EngineUnresponsive",
}


#: codes no class carries any more; never handed to another class
PINNED_RETIRED = {
    10: "NotOwner",
}


def test_codes_are_pinned() -> None:
    assert {code: cls.__name__ for code, cls in REGISTRY.items()} == PINNED
    assert RETIRED == PINNED_RETIRED
    assert not set(RETIRED) & set(REGISTRY)


def test_a_retired_code_reads_as_the_base_error() -> None:
    """An old peer's NotOwner must not come back as whatever class a later code table gives 10."""
    err = from_wire({"code": 10, "message": "not the owner"})
    assert type(err) is ModeldError and err.message == "not the owner"
    assert not hasattr(errors, "NotOwner")


def test_seed_sentinels_exist() -> None:
    for name in (
        "StaleFence", "SessionClosed", "ContextOverflow", "ModelBusy", "ModelNotActive",
        "ModelSwitchRequired", "ModelLoadFailed", "InsufficientMemory", "SlotGenerationStale",
        "BackendMismatch", "UnsupportedFeature",
    ):
        assert issubclass(getattr(errors, name), ModeldError)


@pytest.mark.parametrize("cls", list(REGISTRY.values()))
def test_round_trip_keeps_class_message_and_details(cls: type[ModeldError]) -> None:
    err = cls("something specific", num_ctx=4096, names=["a"])
    back = from_wire(err.to_wire())
    assert type(back) is cls
    assert back.message == "something specific"
    assert back.details == {"num_ctx": 4096, "names": ["a"]}
    assert cls.__doc__ and cls.__doc__.strip(), "every error says what happened"


def test_categories() -> None:
    assert issubclass(errors.StaleFence, errors.OwnerError)
    assert issubclass(errors.ContextOverflow, errors.SessionError)
    assert issubclass(errors.ModelBusy, errors.SlotError)
    assert issubclass(errors.DaemonTimeout, errors.Unavailable)
    assert errors.ModelBusy.recoverable and errors.Unavailable.recoverable
    assert not errors.ModelLoadFailed.recoverable


def test_unknown_code_degrades_to_base() -> None:
    err = from_wire({"code": 9999, "message": "from the future"})
    assert type(err) is ModeldError and err.message == "from the future"
    assert type(from_wire({"code": "x"})) is ModeldError
