"""Engines run as a user of their own (``engine.user``): their own uid and group and no other, no capability, the
engine's own home; the appliance refuses to start where that user could read a secret file, or where it cannot run
engines as that user. The spawning tests need root (they switch users) and skip elsewhere."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import aiohttp
import psutil
import pytest

from appliance.engine import capabilities, ports
from appliance.engine.capabilities import missing_for_engine_user
from appliance.engine.contract import ReplicaState
from appliance.engine.identity import EngineUser
from appliance.engine.placement import Placement
from appliance.engine.replica import ReplicaSpec, SupervisedReplica
from appliance.serve import check_engine_user
from appliance.settings import ConfigError, Settings, load_settings
from tests.engine.support import FAKE_ENGINE, free_port, run, wait_for

ENGINE_USER = "nobody"


def _runs_as(user: EngineUser) -> bool:
    """Whether ``user`` can run this interpreter (root can switch to it; the venv is readable to it)."""
    if os.geteuid() != 0:
        return False
    try:
        done = subprocess.run([sys.executable, "-c", "import aiohttp"], capture_output=True, timeout=60, cwd="/",
                              **user.popen_options())
    except OSError:
        return False
    return done.returncode == 0


needs_root = pytest.mark.skipif(not _runs_as(EngineUser.lookup(ENGINE_USER)),
                                reason="needs root, and a 'nobody' that can run this interpreter")


def _status(pid: int) -> dict[str, str]:
    return dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                if ":\t" in line)


def test_the_setting_names_an_existing_unprivileged_user() -> None:
    assert Settings(engine={"user": ENGINE_USER}).engine.user == ENGINE_USER
    assert Settings(engine={"user": ""}).engine.user is None  # blank, as compose passes an unset variable
    with pytest.raises(ConfigError, match="no user 'no-such-user-here'"):
        load_settings(engine={"user": "no-such-user-here"})
    with pytest.raises(ConfigError, match="is root"):
        load_settings(engine={"user": "0"})


def test_what_starting_engines_as_another_user_takes() -> None:
    setuid_setgid_kill = 1 << 5 | 1 << 6 | 1 << 7
    assert missing_for_engine_user({"CapEff": setuid_setgid_kill}) == []
    assert missing_for_engine_user({"CapEff": 1 << 6}) == ["CAP_SETUID", "CAP_KILL"]
    assert missing_for_engine_user({}) == ["CAP_SETUID", "CAP_SETGID", "CAP_KILL"]


def test_a_listener_of_the_engines_uid_counts_when_their_sockets_cannot_be_read(tmp_path, monkeypatch) -> None:
    """An appliance without CAP_SYS_PTRACE cannot read another user's /proc/<pid>/fd: the kernel's socket list
    decides (here a /proc/net table written for the test)."""
    table = tmp_path / "tcp"
    table.write_text("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout"
                     " inode\n"
                     "   0: 0100007F:1FA4 00000000:0000 0A 00000000:00000000 00:00000000 00000000 65534  0 4242 1 0\n"
                     "   1: 0100007F:1FA5 0100007F:9C40 01 00000000:00000000 00:00000000 00000000  1000  0 4243 1 0\n"
                     "   2: 0100007F:9C40 0100007F:1FA4 01 00000000:00000000 00:00000000 00000000  1000  0 4244 1 0\n")
    assert ports.table_listeners(0x1FA4, (table,)) == {4242: 65534}  # not the connection to it (line 2)
    assert ports.table_listeners(0x1FA5, (table,)) == {}  # established, not listening
    monkeypatch.setattr(ports, "listening_sockets", lambda port: ports.table_listeners(port, (table,)))

    def denied(pid: int, links: object) -> bool:
        raise PermissionError(13, "Permission denied", f"/proc/{pid}/fd")

    monkeypatch.setattr(ports, "holds_any", denied)
    me = os.getpid()
    assert ports.tree_listens_on(me, 0x1FA4, owner_uid=65534)
    assert not ports.tree_listens_on(me, 0x1FA4, owner_uid=1000)  # someone else's listener: not ours
    assert not ports.tree_listens_on(me, 0x1FA4)  # the appliance's own user: its sockets are always readable
    assert not ports.tree_listens_on(me, 0x1FA5, owner_uid=1000)  # nothing listens there


@needs_root
def test_an_engine_runs_as_its_own_user_with_no_other_group_no_capability_and_no_way_to_the_secrets(
        tmp_path: Path) -> None:
    user = EngineUser.lookup(ENGINE_USER)
    secret = tmp_path / "admin-token"
    secret.write_text("s3cret-admin\n")
    secret.chmod(0o600)
    port = free_port()
    command = [sys.executable, "-m", "appliance.engine.launch", "--", sys.executable, FAKE_ENGINE, str(port)]
    spec = ReplicaSpec(index=0, port=port, command=command, env={}, placement=Placement("cpu", cores=(0,)),
                       log_path=tmp_path / "engine-0.log", start_timeout_seconds=60, stop_timeout_seconds=1.0,
                       user=user)

    async def scenario(session: aiohttp.ClientSession) -> None:
        replica = SupervisedReplica(spec)
        replica.start(session)
        try:
            await wait_for(lambda: replica.status.state is ReplicaState.READY, timeout=60)
            launcher = psutil.Process(replica.status.pid)
            for process in (launcher, *launcher.children(recursive=True)):
                status = _status(process.pid)
                assert status["Uid"].split() == [str(user.uid)] * 4, process.cmdline()
                assert status["Gid"].split() == [str(user.gid)] * 4 and status["Groups"].strip() == ""
                for name in ("CapEff", "CapPrm", "CapInh", "CapAmb"):
                    assert int(status[name], 16) == 0, (name, process.cmdline())
                environ = Path(f"/proc/{process.pid}/environ").read_bytes()
                assert f"HOME={user.home}\0".encode() in environ
            # What code in the engine could reach, tried as the engine's user: neither the secret file (0600, the
            # appliance's) nor the appliance's environment.
            appliance_env = Path(f"/proc/{os.getpid()}/environ")
            assert user.readable([secret, appliance_env]) == []
            assert user.readable([Path(FAKE_ENGINE)]) == [Path(FAKE_ENGINE)]  # the probe does read what it may
        finally:
            await replica.stop()

    run(scenario)


@needs_root
def test_the_appliance_refuses_to_start_where_the_engine_user_could_read_a_secret() -> None:
    with tempfile.TemporaryDirectory() as folder:  # under /tmp, which every user may search (pytest's is 0700)
        root = Path(folder)
        root.chmod(0o755)
        token = root / "admin-token"
        token.write_text("s3cret\n")
        token.chmod(0o644)
        settings = load_settings(engine={"user": ENGINE_USER}, admin_token_file=token, state_dir=root / "state",
                                 collectors={"enabled": True})
        with pytest.raises(ConfigError, match=f"engine.user {ENGINE_USER} can read {token}"):
            check_engine_user(settings)
        token.chmod(0o600)
        check_engine_user(settings)  # 0600: the appliance's own
        model = root / "model"
        model.mkdir(mode=0o700)
        (model / "config.json").write_text("{}")
        with pytest.raises(ConfigError, match=f"engine.user {ENGINE_USER} cannot read the model"):
            check_engine_user(settings.model_copy(update={"model": model}))
        model.chmod(0o755)
        check_engine_user(settings.model_copy(update={"model": model}))
        stats = root / "state" / "engine-stats"
        assert stats.stat().st_mode & 0o7777 == 0o1733  # engines write their statistics, only the appliance lists


def test_the_appliance_refuses_to_start_where_it_cannot_run_engines_as_that_user(monkeypatch) -> None:
    monkeypatch.setattr("appliance.serve.missing_for_engine_user", lambda: ["CAP_SETUID", "CAP_KILL"])
    monkeypatch.setattr(EngineUser, "is_current", False)
    with pytest.raises(ConfigError, match="lacks CAP_SETUID, CAP_KILL"):
        check_engine_user(Settings(engine={"user": ENGINE_USER}))
    check_engine_user(Settings())  # no engine.user: nothing to check


@pytest.mark.skipif(os.geteuid() != 0 or not Path("/usr/bin/setpriv").exists(), reason="needs root and setpriv")
def test_a_launcher_gives_up_the_capabilities_it_inherited() -> None:
    """The image's entrypoint gives the appliance CAP_SETUID, CAP_SETGID and CAP_KILL as ambient capabilities; an
    engine started as another user would inherit them (a uid change between two non-root users keeps them)."""
    probe = ("from appliance.engine.capabilities import capability_sets, drop_all\n"
             "before = capability_sets()['CapAmb']\nok = drop_all()\n"
             "print(before, ok, sum(capability_sets()[n] for n in ('CapEff', 'CapPrm', 'CapInh', 'CapAmb')))")
    done = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                           "--inh-caps=-all,+setuid,+setgid,+kill", "--ambient-caps=-all,+setuid,+setgid,+kill",
                           sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                          cwd=Path(capabilities.__file__).parents[2])
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(1 << 5 | 1 << 6 | 1 << 7), "True", "0"]
