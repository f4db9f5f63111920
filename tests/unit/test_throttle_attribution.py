"""Attribution decided on host evidence: claims are checked, never believed (pure rules)."""

from __future__ import annotations

import os

from vgpu_agent.throttle.attribution import (
    MAX_MOUNTINFO_LINES,
    NONE_OF_THEM,
    Claims,
    Mark,
    attribute,
    claims_of,
    control_mount,
    parse_mountinfo,
    path_in_filesystem,
    proven_region,
)

DEV = os.makedev(254, 1)
CONTROL = "/run/vgpu/control"


def line(root: str, point: str, dev: str = "254:1") -> str:
    return f"36 35 {dev} {root} {point} ro,relatime master:1 - ext4 /dev/vda1 rw"


def test_owners_come_from_proofs_only_whatever_the_slots_claim():
    result = attribute(
        [10, 11, 12, 13],
        {10: "a", 11: "b", 12: NONE_OF_THEM, 13: None},
        {"a": Claims(frozenset({10, 11, 12, 13})), "b": Claims(frozenset({11}))},
        {},
    )
    assert result.owner == {10: "a", 11: "b"}
    # 11 is b's, 12 is in no container; 13 could not be examined: neither accepted nor refuted
    assert result.rejected == {("a", 11), ("a", 12)}
    assert result.unknown == (13,)


def test_a_namespaced_claim_is_refuted_only_when_no_process_with_that_identity_is_the_claimants():
    identities = {20: (1, 500), 21: (1, 500), 22: (7, 900)}
    proofs = {20: "a", 21: "b", 22: "b"}
    claims = {
        "a": Claims(namespaced=frozenset({(1, 500), (7, 900)})),
        "b": Claims(namespaced=frozenset({(1, 500)})),
        "c": Claims(namespaced=frozenset({(1, 500), (3, 3)})),
    }
    result = attribute([20, 21, 22], proofs, claims, identities)
    assert result.owner == {20: "a", 21: "b", 22: "b"}
    # pid 1 started at 500 in a and in b: an accident, not a lie; (7, 900) is b's; c has neither
    assert result.rejected == {("a", 22), ("c", 20), ("c", 21)}


def test_claims_from_slots_prefer_the_host_pid():
    assert claims_of([(1, 4001, 500), (2, 0, 600), (3, 0, 0)]) == Claims(
        frozenset({4001}), frozenset({(2, 600)})
    )


def test_mountinfo_lines_are_parsed_with_octal_escapes_and_bad_lines_skipped():
    text = "\n".join([
        line("/var/lib/vgpu\\040agent/regions/r1/control", CONTROL),
        "garbage",
        "36 35 x:y / /x rw - ext4 /dev/vda1 rw",
        "36 35 99999999999:1 / /x rw - ext4 /dev/vda1 rw",
        "",
    ])
    mounts = parse_mountinfo(text)
    assert [(m.dev, m.root, m.mount_point) for m in mounts] == [
        (DEV, "/var/lib/vgpu agent/regions/r1/control", CONTROL)
    ]


def test_mountinfo_read_is_bounded_in_lines():
    text = "\n".join([line("/", f"/m{i}") for i in range(MAX_MOUNTINFO_LINES + 50)])
    assert len(parse_mountinfo(text)) == MAX_MOUNTINFO_LINES


def test_the_control_mount_in_force_proves_a_region_only_with_its_exact_file_and_device():
    marks = {"r1": Mark(DEV, "/vgpu/regions/r1/control"), "r2": Mark(DEV, "/vgpu/regions/r2/control"),
             "r3": None, "r4": Mark(DEV, None)}

    def proves(text: str) -> str:
        return proven_region(control_mount(parse_mountinfo(text), CONTROL), marks)

    assert proves(line("/vgpu/regions/r1/control", CONTROL)) == "r1"
    # a file of the container's own on the same disk, in a directory named like r2's
    assert proves(line("/kubelet/pods/p/volumes/x/regions/r2/control", CONTROL)) == NONE_OF_THEM
    # another device (a tmpfs of its own), at r2's very path
    assert proves(line("/vgpu/regions/r2/control", CONTROL, dev="0:99")) == NONE_OF_THEM
    # mounted over the real one: the last mount on the path is what the process sees
    assert proves("\n".join([line("/vgpu/regions/r1/control", CONTROL),
                              line("/x/r2/control", CONTROL, dev="0:99")])) == NONE_OF_THEM
    # the region's file mounted elsewhere, a directory, a region the agent could not stat, one
    # it does not know, a file deleted since
    for text in (line("/vgpu/regions/r1/control", "/tmp/control"),
                 line("/vgpu/regions/r1", CONTROL),
                 line("/vgpu/regions/r3/control", CONTROL),
                 line("/vgpu/regions/gone/control", CONTROL),
                 line("/vgpu/regions/r1/control//deleted", CONTROL)):
        assert proves(text) == NONE_OF_THEM
    # without a known path, the name and the device decide
    assert proves(line("/anything/r4/control", CONTROL)) == "r4"
    assert proven_region(None, marks) == NONE_OF_THEM


def test_a_path_is_located_inside_its_filesystem_through_the_longest_mount_of_its_device():
    own = parse_mountinfo("\n".join([
        line("/", "/", dev="0:50"),
        line("/", "/var", dev="254:1"),
        line("/var/lib/vgpu-agent", "/var/lib/vgpu-agent", dev="254:1"),  # a hostPath bind
        line("/", "/var/lib/vgpu-agent/x", dev="0:60"),
    ]))
    path = "/var/lib/vgpu-agent/regions/r1/control"
    assert path_in_filesystem(path, DEV, own) == path
    assert path_in_filesystem("/var/other/file", DEV, own) == "/other/file"
    assert path_in_filesystem("/var", DEV, own) == "/"
    assert path_in_filesystem(path, os.makedev(9, 9), own) is None
