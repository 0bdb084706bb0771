"""The key file as the operator writes it (office/keys.py), read without a server: names, roles
and models per line, every refusal naming its line, a file read only once it stops changing,
and --api-key values as admins. Keys fail closed: a file that yields no key stops start-up."""

from __future__ import annotations

import logging

import pytest

from conftest import key_file
from localserve.common.config import Settings, SettingsError
from localserve.office import keys
from localserve.office.keys import KeyHolder, load_keys, read_key_file


def test_the_key_file_names_models_after_the_key_or_the_role(tmp_path):
    path = key_file(tmp_path, "a:key-aaaaaaaa:models=small, big", "b:key:with:colons:admin",
                    "c:key-cccccccc:user:models=small", "d:key-dddddddd")
    assert read_key_file(path) == {
        "key-aaaaaaaa": KeyHolder("a", "user", frozenset({"small", "big"})),
        "key:with:colons": KeyHolder("b", "admin"),
        "key-cccccccc": KeyHolder("c", "user", frozenset({"small"})),
        "key-dddddddd": KeyHolder("d", "user")}
    empty = key_file(tmp_path, "a:key-aaaaaaaa:models=")
    with pytest.raises(SettingsError, match="models=NAME"):
        read_key_file(empty)


def test_spaces_comments_and_blank_lines_are_the_operators_layout(tmp_path):
    path = key_file(tmp_path, "# the office", "", "  alice :  key-alice-01 : admin  ",
                    "   # bob left", "carol:key-carol-01")
    assert read_key_file(path) == {"key-alice-01": KeyHolder("alice", "admin"),
                                   "key-carol-01": KeyHolder("carol", "user", None)}
    spaced = key_file(tmp_path, "dave:key-dave-0001:models= small , big ")
    assert read_key_file(spaced) == {
        "key-dave-0001": KeyHolder("dave", "user", frozenset({"small", "big"}))}


@pytest.mark.parametrize("line", ["no-colon-at-all", ":key-without-name", "erin:", "erin:1234567",
                                  "erin:1234567:admin", "erin:key-erin-01:models=,"])
def test_a_bad_line_is_refused_naming_it(tmp_path, line):
    path = key_file(tmp_path, "alice:key-alice-01", line)
    with pytest.raises(SettingsError) as refused:
        read_key_file(path)
    said = str(refused.value)
    assert f"--api-key-file {path}, line 2: expected 'name:key' or 'name:key:role'" in said
    assert "at least 8 characters" in said and "':models=NAME,NAME'" in said


def test_a_key_of_eight_characters_is_enough(tmp_path):
    assert read_key_file(key_file(tmp_path, "erin:12345678")) == {
        "12345678": KeyHolder("erin", "user")}
    assert read_key_file(key_file(tmp_path, "erin:12345678:user")) == {
        "12345678": KeyHolder("erin", "user")}


def test_two_colleagues_with_the_same_key_stop_start_up_naming_both(tmp_path):
    path = key_file(tmp_path, "alice:same-key-0001", "carol:other-key-01", "bob:same-key-0001")
    with pytest.raises(SettingsError) as refused:
        read_key_file(path)
    assert str(refused.value) == (
        f"--api-key-file {path}, line 3: 'bob' has the same key as 'alice' on line 1; each "
        f"colleague needs a key of their own (one of them would silently be the other)")


def test_a_file_without_keys_or_not_there_or_not_text_stops_start_up(tmp_path):
    with pytest.raises(SettingsError, match=r"no keys in it \(only blank or '#' lines\)"):
        read_key_file(key_file(tmp_path, "# nobody yet", ""))
    with pytest.raises(SettingsError, match="no such file"):
        read_key_file(tmp_path / "missing.txt")
    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"alice:key-alice-01\nb\xe9a:key-bea-0001\n")
    with pytest.raises(SettingsError) as refused:
        read_key_file(latin)
    assert str(refused.value) == (f"--api-key-file {latin}: not UTF-8 text (byte 20); save it "
                                  f"as UTF-8")


def test_a_file_others_can_read_is_loaded_with_a_warning(tmp_path, caplog):
    path = key_file(tmp_path, "alice:key-alice-01")
    with caplog.at_level(logging.WARNING, logger="localserve"):
        read_key_file(path)
        assert not caplog.records
        path.chmod(0o640)
        assert read_key_file(path) == {"key-alice-01": KeyHolder("alice", "user")}
    assert [r.getMessage() for r in caplog.records] == [
        f"--api-key-file {path} can be read by other users of this machine: chmod 600 {path}"]


def test_a_file_is_read_once_two_reads_agree(tmp_path, monkeypatch):
    """An editor rewriting the file in place while a SIGHUP reads it: the reading waits for
    the bytes to settle, and gives up (keeping the old keys) when they never do."""
    path = key_file(tmp_path, "alice:key-alice-01")
    versions = iter([b"ali", b"alice:key-al", b"alice:key-alice-01\n", b"alice:key-alice-01\n"])
    slept = []
    monkeypatch.setattr(keys.time, "sleep", slept.append)
    monkeypatch.setattr(type(path), "read_bytes", lambda self: next(versions))
    assert keys._settled_bytes(path) == b"alice:key-alice-01\n"
    assert slept == [0.05] * 3
    counter = iter(range(100))
    monkeypatch.setattr(type(path), "read_bytes", lambda self: str(next(counter)).encode())
    slept.clear()
    with pytest.raises(SettingsError) as refused:
        keys._settled_bytes(path, tries=4)
    assert len(slept) == 4 and str(refused.value) == (
        f"--api-key-file {path}: it kept changing while being read; send SIGHUP again once "
        f"it is saved")


def test_api_key_values_are_admins_beside_the_files_colleagues(tmp_path):
    path = key_file(tmp_path, "alice:key-alice-01")
    assert load_keys(Settings(api_keys=("first-key-01", "second-key-02"),
                              api_key_file=str(path))) == {
        "first-key-01": KeyHolder("key-1", "admin"), "second-key-02": KeyHolder("key-2", "admin"),
        "key-alice-01": KeyHolder("alice", "user")}
    assert load_keys(Settings()) == {}
