from __future__ import annotations

import pytest

from tierckpt import ConfigError, IntegrityError, layout
from tierckpt.policy import DurablePolicy, RetentionPolicy


@pytest.mark.parametrize(
    "path, step",
    [("run/step_100", 100), ("s3://b/p/ns/step_7/", 7), ("/a/step_1/nested/step_200", 200), ("step_0", 0),
     ("ckpt-step_3", None), ("my_step_dir/x", None), ("step_7.pt", None), ("run\\step_5", 5), ("step_012", None), ("", None)],
)
def test_step_from_path(path: str, step: int | None) -> None:
    assert layout.step_from_path(path) == step


@pytest.mark.parametrize("bad", [-1, 1.0, "3", None, True])
def test_validate_step(bad: object) -> None:
    with pytest.raises(ConfigError, match="step"):
        layout.validate_step(bad)


def test_manifest_round_trip_and_seal() -> None:
    m = layout.Manifest(namespace="n", step=4, save_id="abc", world_size=2, metadata_xxh3="00" * 16,
                        files={"__0_0.distcp": 10}, items=(layout.ItemRecord("__0_0.distcp", 0, 10, 5, "ff" * 16),))
    raw = m.to_bytes()
    assert layout.Manifest.from_bytes(raw) == m
    marker = layout.marker_bytes("abc", raw)
    assert layout.check_marker(marker, raw, where="t") == "abc"
    with pytest.raises(IntegrityError, match="does not match"):
        layout.check_marker(marker, raw.replace(b'"step":4', b'"step":5'), where="t")
    with pytest.raises(IntegrityError, match="malformed"):
        layout.Manifest.from_bytes(b"{not json")
    with pytest.raises(IntegrityError, match="upgrade"):
        layout.Manifest.from_bytes(raw.replace(b'"format_version":1', b'"format_version":99'))


def test_checksum_is_xxh3_128() -> None:
    assert layout.checksum(b"hello world") == "df8d09e93f874900a99b8775cc15b6c7"


def test_retention() -> None:
    assert RetentionPolicy(2).select_for_deletion([5, 1, 3, 4]) == [1, 3]
    assert RetentionPolicy(2).select_for_deletion([7]) == []
    assert RetentionPolicy(None).select_for_deletion([1, 2, 3]) == []
    assert RetentionPolicy.select_for_eviction([3, 9, 1]) == [1, 3]
    assert RetentionPolicy.select_for_eviction([9]) == []  # never the newest


def test_durable_policy() -> None:
    p = DurablePolicy(every_n_steps=5, has_durable_tier=True)
    assert [s for s in range(12) if p.should_save(s, None)] == [0, 5, 10]
    assert p.should_save(3, True) and not p.should_save(5, False)
    assert not DurablePolicy(0, True).should_save(10, None)
    assert not DurablePolicy(1, False).should_save(1, True)
