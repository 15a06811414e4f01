"""Parsing of Redis URLs into a target (no I/O)."""

from __future__ import annotations

import pytest

from redisconn.target import RedisTarget


def test_single_nodes_keep_their_url_for_redis_py() -> None:
    t = RedisTarget.parse("redis://127.0.0.1:6379/2?health_check_interval=5")
    assert (t.kind, t.tls, t.url) == ("single", False, "redis://127.0.0.1:6379/2?health_check_interval=5")
    assert RedisTarget.parse("rediss://h:6380/0").tls is True


def test_cluster_lists_its_seed_nodes() -> None:
    t = RedisTarget.parse("redis+cluster://a:7000,b:7001,[::1]:7002,c")
    assert t.kind == "cluster" and not t.tls
    assert t.nodes == (("a", 7000), ("b", 7001), ("::1", 7002), ("c", 6379))
    assert RedisTarget.parse("rediss+cluster://a:7000").tls is True


def test_sentinel_names_its_service_and_database() -> None:
    t = RedisTarget.parse("redis+sentinel://user:p%40ss@s1:26379,s2/mymaster/3")
    assert t.kind == "sentinel"
    assert t.nodes == (("s1", 26379), ("s2", 26379))
    assert (t.service, t.db, t.username, t.password) == ("mymaster", 3, "user", "p@ss")
    assert RedisTarget.parse("redis+sentinel://s1:26379/fg").db == 0


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://h:1", "unknown scheme"),
        ("h:6379", "unknown scheme"),
        ("redis+cluster://a:7000/1", "no path"),
        ("redis+cluster://a:7000?x=1", "no query"),
        ("redis+cluster://a:70000", "bad port"),
        ("redis+cluster://a:7000,:7001", "empty host"),
        ("redis+sentinel://s1:26379", "service_name"),
        ("redis+sentinel://s1:26379/fg/x", "must be a number"),
    ],
)
def test_bad_urls_say_what_is_wrong(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RedisTarget.parse(url)


def test_errors_never_show_the_password() -> None:
    with pytest.raises(ValueError) as info:
        RedisTarget.parse("redis+cluster://u:secret@a:notaport")
    assert "secret" not in str(info.value)
