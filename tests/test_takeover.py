"""Owner takeover through a real daemon process: a newer owner fences the old one, whose session answers
LostOwner by name; the model stays loaded and warm for the new owner."""

from __future__ import annotations

from pathlib import Path

import pytest

from contract.errors import InvalidArgument, LostOwner, StaleFence
from contract.types import OpenSessionRequest, PrefixInput, SuffixInput, owner_fingerprint
from harness.daemon import DaemonProcess

MODEL = OpenSessionRequest(model_name="m", type="memory", path="/models/m")


def test_a_takeover_ends_the_old_owners_session_with_lost_owner(tmp_path: Path) -> None:
    with DaemonProcess(tmp_path, "memory", None, "--owner", "old", "--model", "/models/m", "--model-name", "m") as d:
        with d.client(timeout_s=20.0, owner="old") as old, d.client(timeout_s=20.0, owner="new") as new:
            sess = old.open_session(MODEL)
            m = sess.manifest(profile="t")
            sess.ensure_prefix(PrefixInput(text="the old owner's prompt", manifest=m))
            with pytest.raises(InvalidArgument):
                new.takeover(0)  # epochs start at 1
            r = new.takeover(1)
            assert r.ended_session and r.epoch == 1 and r.owner == owner_fingerprint("new")
            with pytest.raises(LostOwner):
                sess.prefill_suffix(SuffixInput(text="go", manifest=m))
            with pytest.raises(LostOwner):
                sess.ensure_prefix(PrefixInput(text="again", manifest=m))
            with pytest.raises(StaleFence):
                old.open_session(MODEL)
            with d.client(timeout_s=20.0, owner="late") as late, pytest.raises(StaleFence, match="not newer"):
                late.takeover(1)  # an epoch is taken once
            st = new.status()
            assert st.owner_instance_id == owner_fingerprint("new") and st.owner_epoch == 1
            ns = new.open_session(MODEL)  # the model stayed loaded: the new owner starts warm
            pre = ns.ensure_prefix(PrefixInput(text="the old owner's prompt", manifest=ns.manifest(profile="t")))
            assert pre.reused_tokens == pre.prefix_tokens
            ns.close()
            sess.close()
