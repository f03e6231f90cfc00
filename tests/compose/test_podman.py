"""The compose harness' podman checks, without podman: the network backend is named, and anything but netavark is
refused before a container starts, with the fix in the message (a machine without netavark ran the stack on CNI,
where Prometheus could not resolve `alertmanager`)."""

from __future__ import annotations

import tomllib

import pytest

from tests.compose import podman


def test_the_harness_configuration_names_netavark(tmp_path) -> None:
    conf = tomllib.loads(podman.containers_conf(tmp_path / "containers.conf").read_text())
    assert conf["network"]["network_backend"] == "netavark"


@pytest.mark.parametrize("backend", ["cni", "", "cni\n"])
def test_a_backend_without_name_resolution_is_refused_with_the_fix(backend: str) -> None:
    problem = podman.network_backend_problem(backend)
    assert problem is not None and "apt-get install netavark aardvark-dns" in problem


def test_netavark_passes() -> None:
    assert podman.network_backend_problem("netavark\n") is None


def test_missing_helpers_are_a_reason_not_to_run(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(podman, "PODMAN_HELPERS", tmp_path)
    monkeypatch.setattr(podman.shutil, "which", lambda name: f"/usr/bin/{name}")
    reason = podman.cannot_run_reason()
    assert reason is not None and "netavark" in reason and "scripts/setup-tools" in reason


class FakeStore(podman.Podman):
    """podman's image store as `images --filter dangling=true` and `rmi` see it: an image is dangling when it has
    no tag and no child."""

    def __init__(self, workdir, parents: dict[str, str | None], tagged: set[str]) -> None:
        super().__init__(workdir)
        self.parents, self.tagged = dict(parents), set(tagged)

    def __call__(self, *args: str, check: bool = True, timeout: float | None = 120):
        import subprocess
        if args[0] == "images":
            children = {parent for parent in self.parents.values() if parent}
            dangling = [i for i in self.parents if i not in self.tagged and i not in children]
            return subprocess.CompletedProcess(args, 0, "\n".join(f"sha256:{i}" for i in dangling), "")
        assert args[0] == "rmi"
        for image in args[1:]:
            self.parents.pop(image)
        return subprocess.CompletedProcess(args, 0, "", "")


def image(n: int) -> str:
    return f"{n:02x}" * 32


def test_the_layers_a_build_used_are_read_from_its_output(tmp_path) -> None:
    output = (f"[4/6] STEP 4/4: RUN pip install\n--> Using cache {image(1)}\n--> {image(1)[:12]}\n"
              f"[6/6] STEP 5/20: COPY appliance /src/appliance\n--> {image(2)[:12]}\n"
              f"Successfully tagged localhost/appliance:cpu\n{image(3)}\n"
              "RUN echo deadbeefcafe\ndeadbeefcafe0\n")
    store = podman.Podman(tmp_path)
    store.remember_layers("appliance:cpu", output)
    assert (tmp_path / "layers-appliance-cpu.ids").read_text().split() == sorted(
        {image(1), image(1)[:12], image(2)[:12], image(3)})


def test_prune_removes_what_no_latest_build_used_and_keeps_every_tag_and_its_cache(tmp_path) -> None:
    # 1 <- 2 <- 3 (tagged, today's build); 1 <- 4 (today's engine stage: untagged, childless, reused by the build);
    # 1 <- 5 <- 6 (yesterday's image of the tag, now untagged) and 7 (yesterday's engine stage).
    store = FakeStore(tmp_path, {image(1): None, image(2): image(1), image(3): image(2), image(4): image(1),
                                 image(5): image(1), image(6): image(5), image(7): None}, tagged={image(3)})
    store.remember_layers("appliance:cpu", f"--> Using cache {image(4)}\n--> {image(2)[:12]}\n{image(3)}\n")
    assert store.prune_images() == 3
    assert set(store.parents) == {image(1), image(2), image(3), image(4)}
    assert store.prune_images() == 0
