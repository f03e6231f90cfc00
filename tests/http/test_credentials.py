"""A rotated secret is accepted for its overlap window, then refused; a revoked one at once."""

from __future__ import annotations

from appliance.http.credentials import ADMIN, API_KEYS, METRICS, Credentials, Keyring, digest


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def accepts(keyring: Keyring, role: str, value: str) -> bool:
    return digest(value) in keyring.current().accepted(role)


def test_a_replaced_token_is_accepted_within_the_overlap_then_refused():
    clock = Clock()
    keyring = Keyring(Credentials(admin_token="old", metrics_token="m-old"), clock)
    keyring.rotate(Credentials(admin_token="new", metrics_token="m-old"), overlap_seconds=300)
    assert accepts(keyring, ADMIN, "new") and accepts(keyring, ADMIN, "old")
    assert keyring.current().current(ADMIN) == ("new",)  # what is configured, apart from what is tolerated
    clock.now += 299
    assert accepts(keyring, ADMIN, "old")
    clock.now += 2
    assert not accepts(keyring, ADMIN, "old") and accepts(keyring, ADMIN, "new")
    assert keyring.current().retired == ()
    assert accepts(keyring, METRICS, "m-old")  # an unchanged token is simply current


def test_no_overlap_refuses_the_replaced_value_at_once():
    keyring = Keyring(Credentials(admin_token="old"), Clock())
    keyring.rotate(Credentials(admin_token="new"), overlap_seconds=0)
    assert not accepts(keyring, ADMIN, "old") and accepts(keyring, ADMIN, "new")


def test_a_second_rotation_does_not_extend_the_first_window():
    clock = Clock()
    keyring = Keyring(Credentials(admin_token="a"), clock)
    keyring.rotate(Credentials(admin_token="b"), overlap_seconds=100)
    clock.now += 60
    keyring.rotate(Credentials(admin_token="c"), overlap_seconds=100)
    assert accepts(keyring, ADMIN, "a") and accepts(keyring, ADMIN, "b")
    clock.now += 41  # a's window (100 s from the first reload) is over, b's is not
    assert not accepts(keyring, ADMIN, "a") and accepts(keyring, ADMIN, "b") and accepts(keyring, ADMIN, "c")


def test_a_value_configured_again_is_current_not_retired():
    keyring = Keyring(Credentials(admin_token="a"), Clock())
    keyring.rotate(Credentials(admin_token="b"), overlap_seconds=100)
    keyring.rotate(Credentials(admin_token="a"), overlap_seconds=100)
    assert [r.value for r in keyring.current().retired] == ["b"]


def test_keep_revokes_what_it_refuses():
    """An API key whose tenant was removed is revoked, not rotated: the composition root says so through keep."""
    keyring = Keyring(Credentials(api_keys=("k-kept", "k-revoked")), Clock())
    keyring.rotate(Credentials(api_keys=("k-new",)), overlap_seconds=300,
                   keep=lambda role, value: role != API_KEYS or value == "k-kept")
    assert accepts(keyring, API_KEYS, "k-kept") and accepts(keyring, API_KEYS, "k-new")
    assert not accepts(keyring, API_KEYS, "k-revoked")


def test_a_reload_with_no_overlap_ends_every_window_at_once():
    """The way to drop a leaked value that an earlier rotation still tolerates."""
    keyring = Keyring(Credentials(admin_token="leaked"), Clock())
    keyring.rotate(Credentials(admin_token="b"), overlap_seconds=300)
    keyring.rotate(Credentials(admin_token="c"), overlap_seconds=0)
    assert not accepts(keyring, ADMIN, "leaked") and not accepts(keyring, ADMIN, "b") and accepts(keyring, ADMIN, "c")
