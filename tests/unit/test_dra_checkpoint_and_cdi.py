"""The prepared-claims checkpoint (round trip, corruption) and the CDI spec files."""

import json

import pytest

from vgpu_agent.dra import cdi
from vgpu_agent.dra.checkpoint import (
    Checkpoint,
    CheckpointError,
    PreparedClaim,
    ReportedDevice,
    decode,
    encode,
)
from vgpu_agent.dra.grant import ClaimRef

UID = "00000000-0000-4000-8000-000000000001"
DRIVER = "gpu.vgpu.io"


def prepared(uid=UID):
    return PreparedClaim(
        ClaimRef("ns", "train", uid),
        "000000000001-abcdef12",
        cdi.spec_name(DRIVER, uid),
        (ReportedDevice(("gpu",), "node-a", "gpu-0", "s1", ("nvidia.com/gpu=GPU-1", "x")),),
        {"GPU-1": (10 << 30, 30)},
    )


def test_round_trip_keeps_every_field():
    claims = {UID: prepared(), "u2": prepared("u2")}
    assert decode(encode(claims), "f") == claims


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(version=2), "version 2, this agent reads 1"),
        (lambda d: d["claims"][UID].update(allocId="other"), "checksum does not match"),
        (lambda d: d.update(checksum="0"), "checksum does not match"),
    ],
)
def test_edited_files_are_refused(edit, message):
    doc = json.loads(encode({UID: prepared()}))
    edit(doc)
    with pytest.raises(CheckpointError, match=message):
        decode(json.dumps(doc).encode(), "f")


def test_wrong_shapes_and_uids_are_refused_even_with_a_matching_checksum():
    def resigned(body):
        from vgpu_agent.dra.checkpoint import _digest

        text = json.dumps(body, sort_keys=True, separators=(",", ":"))
        return json.dumps({"version": 1, "checksum": _digest(text), "claims": body}).encode()

    good = json.loads(encode({UID: prepared()}))["claims"]
    wrong_uid = {"another": good[UID]}
    with pytest.raises(CheckpointError, match="claim another holds uid"):
        decode(resigned(wrong_uid), "f")
    bad_consumed = {UID: {**good[UID], "consumed": {"GPU-1": ["10", 30]}}}
    with pytest.raises(CheckpointError, match="consumed GPU-1"):
        decode(resigned(bad_consumed), "f")
    missing = {UID: {k: v for k, v in good[UID].items() if k != "devices"}}
    with pytest.raises(CheckpointError, match="KeyError"):
        decode(resigned(missing), "f")
    with pytest.raises(CheckpointError, match="not JSON"):
        decode(b"\xff{", "f")


def test_checkpoint_file_round_trip_and_corrupt_file_set_aside(tmp_path):
    path = tmp_path / "d" / "checkpoint.json"
    checkpoint = Checkpoint(path)
    assert checkpoint.load() == {}  # no file: no claims
    checkpoint.claims[UID] = prepared()
    checkpoint.save()
    assert Checkpoint(path).load() == {UID: prepared()}
    assert not list(path.parent.glob(".*"))  # the temp file was renamed into place
    path.write_bytes(path.read_bytes()[:-20])  # torn
    assert Checkpoint(path).load() == {}
    assert [p.name.split("-")[0] for p in path.parent.iterdir()] == ["checkpoint.json.corrupt"]


def test_cdi_names_and_uids():
    assert cdi.device_id(DRIVER, UID) == f"{DRIVER}/claim={UID}"
    assert cdi.claim_uid_of(f"{DRIVER}/claim={UID}", DRIVER) == UID
    assert cdi.claim_uid_of(f"other.io/claim={UID}", DRIVER) is None
    assert cdi.claim_uid_of(f"{DRIVER}/claim=", DRIVER) is None
    assert cdi.claim_uid_of(f"{DRIVER}/claim=a/b", DRIVER) is None


def test_spec_document_and_atomic_write(tmp_path):
    spec = cdi.claim_spec(
        DRIVER, UID, {"B": "2", "A": "1"}, [("/run/vgpu", "/h/r", False), ("/c", "/h/c", True)]
    )
    assert spec["cdiVersion"] == "0.6.0" and spec["kind"] == f"{DRIVER}/claim"
    (device,) = spec["devices"]
    assert device["name"] == UID
    assert device["containerEdits"]["env"] == ["A=1", "B=2"]
    assert [m["options"][0] for m in device["containerEdits"]["mounts"]] == ["rw", "ro"]
    name = cdi.spec_name(DRIVER, UID)
    path = cdi.write_spec(tmp_path / "cdi", name, spec)
    assert json.loads(path.read_text()) == spec
    assert oct(path.stat().st_mode & 0o777) == "0o644"
    (tmp_path / "cdi" / f".{cdi.spec_name(DRIVER, 'u2')}.tmp").write_text("{")
    (tmp_path / "cdi" / "nvidia.yaml").write_text("")
    assert cdi.our_specs(tmp_path / "cdi", DRIVER) == {UID: name, "u2": f".{DRIVER}-claim_u2.json.tmp"}
    assert cdi.remove_spec(tmp_path / "cdi", name) is True
    assert cdi.remove_spec(tmp_path / "cdi", name) is False
    assert cdi.our_specs(tmp_path / "missing", DRIVER) == {}
