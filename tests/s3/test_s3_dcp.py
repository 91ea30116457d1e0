"""tierckpt with ``durable_url="s3://..."``: the DCP plug-ins, the Checkpointer's background drain,
retention on S3, and plain s3torchconnector reading what tierckpt wrote."""

from __future__ import annotations

import shutil
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.helpers.state import zeros_like_state
from tierckpt import CheckpointConfig, Checkpointer, TieredStorageReader, TieredStorageWriter, layout
from tierckpt.config import S3Settings
from tierckpt.runtime import RankRuntime

pytestmark = pytest.mark.s3

MIB = 1 << 20
SETTINGS = S3Settings(part_size=5 * MIB, max_concurrency=4, max_attempts=4, retry_deadline_s=20)


def make_state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {
            "w": torch.randn(1536, 1024, generator=g),  # 6 MiB: a multipart upload, ranged reads
            "b": torch.randn(333, generator=g).to(torch.bfloat16),
        },
        "ids": torch.randint(0, 1 << 40, (1000,), generator=g),
        "step": step,
    }


def assert_equal(got: Any, want: Any) -> None:
    if isinstance(want, dict):
        assert sorted(got) == sorted(want)
        for k in want:
            assert_equal(got[k], want[k])
    elif isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and torch.equal(got, want)
    else:
        assert got == want


@pytest.fixture
def config(s3_env: dict[str, str], bucket: str, memory_dir: str) -> CheckpointConfig:
    return CheckpointConfig(namespace="run1", memory_dir=memory_dir, durable_url=f"s3://{bucket}/ckpt", s3=SETTINGS)


@pytest.fixture
def fresh_memory() -> Any:
    """A memory root for a 'replacement node' that never saw the saves."""
    made: list[str] = []

    def make() -> str:
        made.append(tempfile.mkdtemp(prefix="tierckpt-s3test-new-", dir="/dev/shm"))
        return made[-1]

    yield make
    for path in made:
        shutil.rmtree(path, ignore_errors=True)


def test_dcp_plugins_save_to_memory_and_s3_then_load_from_s3_alone(config: CheckpointConfig, fresh_memory: Any) -> None:
    state = make_state(3)
    rt = RankRuntime(config, 0)
    try:
        writer = TieredStorageWriter(config, step=3, durable=True, _runtime=rt)
        dcp.save(state, storage_writer=writer)
        durable = rt.durable
        assert durable is not None and [s.step for s in durable.list_steps()] == [3]
        assert [s.step for s in rt.memory.list_steps()] == [3]
    finally:
        rt.close()
    other = config.replace(memory_dir=fresh_memory())  # memory wiped: only S3 holds step 3
    reader = TieredStorageReader(other)
    target = zeros_like_state(state)
    dcp.load(target, storage_reader=reader)
    assert reader.step == 3 and set(reader.tiers_used.values()) == {"durable"}
    assert_equal(target, state)


def test_checkpointer_drains_to_s3_and_a_new_node_loads_from_it(config: CheckpointConfig, fresh_memory: Any) -> None:
    with Checkpointer(config) as ck:
        for step in (10, 20):
            ck.save(step, make_state(step))
        ck.wait()
        assert [(s.step, sorted(s.tiers)) for s in ck.steps()] == [(10, ["durable", "memory"]), (20, ["durable", "memory"])]
    shutil.rmtree(config.memory_dir)  # the node is gone
    with Checkpointer(config.replace(memory_dir=fresh_memory())) as ck:
        target = zeros_like_state(make_state(0))
        assert ck.load(target) == 20
        assert ck.last_load["tiers"] == ["durable"]
        assert_equal(target, make_state(20))
        older = zeros_like_state(make_state(0))
        assert ck.load(older, step=10) == 10
        assert_equal(older, make_state(10))


def test_s3torchconnector_reads_a_tierckpt_step_bitwise(config: CheckpointConfig, bucket: str) -> None:
    s3tc = pytest.importorskip("s3torchconnector")
    from s3torchconnector.dcp import S3StorageReader

    state = make_state(5)
    with Checkpointer(config) as ck:
        ck.save(5, state, durable=True).result(60)
    target = zeros_like_state(state)
    reader = S3StorageReader("us-east-1", f"s3://{bucket}/ckpt/run1/step_5",
                             s3client_config=s3tc.S3ClientConfig(force_path_style=True))
    dcp.load(target, storage_reader=reader)  # plain DCP: no tierckpt code on this path
    assert_equal(target, state)


def test_durable_retention_on_s3_removes_markers_before_data(config: CheckpointConfig) -> None:
    config = config.replace(durable_steps_retained=2)
    deletes: list[list[str]] = []
    with Checkpointer(config) as ck:
        durable = ck.runtime.durable
        assert durable is not None
        durable.client.meta.events.register(  # type: ignore[attr-defined]
            "before-parameter-build.s3.DeleteObjects",
            lambda params, **_: deletes.append([o["Key"].rsplit("/", 2)[-2:] for o in params["Delete"]["Objects"]]),
        )
        for step in (1, 2, 3, 4):
            ck.save(step, {"x": torch.full((100,), float(step))}, durable=True).result(60)
        assert [s.step for s in durable.list_steps(include_uncommitted=True)] == [3, 4]
    assert [b for b in deletes if b] == [
        [["step_1", "COMMITTED"]], [["step_1", n] for n in (".metadata", "__0_0.distcp", "manifest.json")],
        [["step_2", "COMMITTED"]], [["step_2", n] for n in (".metadata", "__0_0.distcp", "manifest.json")],
    ]


def test_an_uncommitted_s3_step_is_never_loaded(config: CheckpointConfig, fresh_memory: Any, s3_client: Any, bucket: str) -> None:
    with Checkpointer(config) as ck:
        ck.save(1, make_state(1), durable=True).result(60)
        ck.save(2, make_state(2), durable=True).result(60)
    s3_client.delete_object(Bucket=bucket, Key=f"ckpt/run1/step_2/{layout.MARKER}")  # torn: as if the commit died
    with Checkpointer(config.replace(memory_dir=fresh_memory())) as ck:
        target = zeros_like_state(make_state(0))
        assert ck.load(target) == 1
        assert_equal(target, make_state(1))


def test_cli_lists_and_verifies_s3_steps_and_catches_a_flipped_byte(
    config: CheckpointConfig, fresh_memory: Any, s3_client: Any, bucket: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from tierckpt import cli

    with Checkpointer(config) as ck:
        ck.save(4, make_state(4), durable=True).result(60)
    argv = ["--namespace", "run1", "--memory-dir", fresh_memory(), "--durable-url", config.durable_url or ""]
    assert cli.main([*argv, "ls"]) == 0
    out = capsys.readouterr().out
    assert f"s3://{bucket}/ckpt/run1/step_4" in out and "committed" in out
    assert cli.main([*argv, "verify", "4"]) == 0
    key = "ckpt/run1/step_4/__0_0.distcp"
    data = bytearray(s3_client.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0xFF  # same size, one byte off: only checksums can tell
    s3_client.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    capsys.readouterr()
    assert cli.main([*argv, "verify", "4"]) == 4
    assert "BAD" in capsys.readouterr().out


# -- loads: bounded memory, byte ranges, safe objects (issue 9, issue 10) ------------------------
def _gets(client: Any) -> list[tuple[str, int]]:
    """Every GET the client sends from now on, as (key, bytes asked for), recorded as it is sent."""
    seen: list[tuple[str, int]] = []

    def record(request: Any, **_: Any) -> None:
        if request.method == "GET" and "Range" in request.headers:
            value = request.headers["Range"]
            lo, hi = (value.decode() if isinstance(value, bytes) else value).removeprefix("bytes=").split("-")
            seen.append((request.url.rsplit("/", 1)[-1].split("?")[0], int(hi) - int(lo) + 1))

    client.meta.events.register("before-send.s3", record)
    return seen


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def test_an_s3_load_holds_only_a_window_of_its_files(config: CheckpointConfig, fresh_memory: Any) -> None:
    """Peak resident memory (anonymous and shared, the kernel's high-water mark) during the load."""
    state = {f"t{i}": torch.randn(4 * MIB, generator=torch.Generator().manual_seed(i)) for i in range(4)}  # 4 x 16 MiB
    with Checkpointer(config) as ck:
        ck.save(1, state, durable=True).result(120)
    with Checkpointer(config.replace(memory_dir=fresh_memory())) as ck:
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        with pytest.warns(UserWarning, match="does not load: t1, t2, t3"):
            ck.load({"t0": torch.zeros(4 * MIB)}, step=1)  # warm: the S3 client and the threads exist
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        before = _status_bytes("VmRSS")
        assert ck.load(target) == 1
        extra = _status_bytes("VmHWM") - before
        assert ck.last_load["tiers"] == ["durable"]
    assert all(torch.equal(target[k], state[k]) for k in state)
    # the old reader downloaded the whole 64 MiB file before copying it (extra = 64 MiB);
    # now each record goes straight into its tensor
    assert extra < 16 * MIB, f"{extra / MIB:.1f} MiB extra for a 64 MiB load"


def test_an_s3_partial_load_gets_only_the_ranges_it_needs(config: CheckpointConfig, fresh_memory: Any) -> None:
    state = make_state(7)
    with Checkpointer(config) as ck:
        ck.save(7, state, durable=True).result(120)
    with Checkpointer(config.replace(memory_dir=fresh_memory())) as ck:
        durable = ck.runtime.durable
        assert durable is not None
        gets = _gets(durable.client)  # type: ignore[attr-defined]
        target = {"ids": torch.zeros(1000, dtype=torch.int64)}
        with pytest.warns(UserWarning, match="does not load"):
            assert ck.load(target) == 7
        assert torch.equal(target["ids"], state["ids"])
        manifest = layout.Manifest.from_bytes(durable.read_file(7, layout.MANIFEST))
    ids = [r for r in manifest.items if r.file == "__0_0.distcp" and 8000 <= r.length < 12000]
    assert len(ids) == 1  # the record of "ids" (1000 int64 and its header)
    assert [g for g in gets if g[0] == "__0_0.distcp"] == [("__0_0.distcp", ids[0].length)]  # one GET of it, no more


def test_a_malicious_object_on_s3_is_refused(config: CheckpointConfig, fresh_memory: Any, tmp_path: Any) -> None:
    import os

    marker = tmp_path / "pwned"

    class Evil:
        def __deepcopy__(self, memo: Any) -> Any:
            return self

        def __reduce__(self) -> Any:
            return (os.system, (f"touch {marker}",))

    with Checkpointer(config) as ck:
        ck.save(1, {"w": torch.ones(4), "obj": Evil()}, durable=True).result(60)
    from tierckpt import UnsafeObjectError

    with Checkpointer(config.replace(memory_dir=fresh_memory())) as ck:
        with pytest.raises(UnsafeObjectError, match="'obj' references posix.system"):
            ck.load({"w": torch.zeros(4), "obj": None})
    assert not marker.exists()
