"""Letters left in the dead-letter file after a move from ``state.backend: memory`` to
``redis``: ``sluice serve`` and ``sluice dlq list`` name the file and its count, and
``sluice dlq ... --file PATH`` reads it. Before, a user who switched saw Redis's letters only,
with no word of the others. Real Sluice processes, the real CLI, the fake upstream, Redis."""

from __future__ import annotations

import json

from tests.conftest import route, wait_until
from tests.redis_servers import delete_prefix, new_prefix, require_redis
from tests.test_dlq_replay import FAST_BACKOFF, cli, dead_letter, outcome


async def test_letters_left_in_the_file_after_a_move_to_redis_are_named_and_read(
        upstream, start_sluice, tmp_path):
    url = require_redis()
    prefix = new_prefix()
    letters = tmp_path / "sluice-dlq.sqlite"
    routes = [route("openai", upstream.url, retry={"attempts": 2, "backoff": FAST_BACKOFF})]
    try:
        before = await start_sluice({"dead_letter": {"path": str(letters)}, "routes": routes})
        in_file = await dead_letter(before, upstream, "pay-1")
        await before.stop()

        after = await start_sluice({
            "state": {"backend": "redis", "redis_url": url, "key_prefix": prefix},
            "dead_letter": {"path": str(letters)}, "routes": routes})
        config = str(after.config_path)
        read_it = f"sluice dlq list --file {letters} --config {config}"
        await wait_until(lambda: read_it in after.stderr(), what="the warning at start")
        assert f"dead_letter.path {letters} holds 1 dead letter " in after.stderr()
        in_redis = await dead_letter(after, upstream, "pay-2")

        # The Redis backend's list: its own letter, and a word of the file's.
        code, out, err = await outcome(await cli("dlq", "list", "--config", config))
        assert code == 0, err
        assert [line.split()[0] for line in out.splitlines()[1:]] == [in_redis]
        assert f"{letters} holds 1 dead letter " in err and read_it in err, err

        # --file reads the file, whatever state.backend says: list, show, replay.
        code, out, err = await outcome(await cli("dlq", "list", "--file", str(letters),
                                                 "--config", config))
        assert code == 0 and err == "", err
        assert [line.split()[0] for line in out.splitlines()[1:]] == [in_file]
        code, out, _ = await outcome(await cli("dlq", "show", in_file, "--file", str(letters),
                                               "--config", config))
        assert code == 0 and json.loads(out)["idempotency_key"] == "pay-1"
        sent = len(upstream.requests)
        code, out, err = await outcome(await cli("dlq", "replay", in_file, "--file",
                                                 str(letters), "--config", config))
        assert code == 0 and "HTTP 200" in out, err
        assert upstream.requests[sent].headers["Idempotency-Key"] == "pay-1"
        code, out, _ = await outcome(await cli("dlq", "show", in_file, "--file", str(letters),
                                               "--config", config))
        assert [r["status"] for r in json.loads(out)["replays"]] == [200]

        # A path with no file: an error, not an empty list (a typo in a script passed as
        # "no dead letters", a new user's trial), and not created, by purge either.
        missing = tmp_path / "none.sqlite"
        for command in ("list", "purge"):
            code, out, err = await outcome(await cli("dlq", command, "--file", str(missing),
                                                     "--config", config))
            assert (code, out, err) == (1, "", f"--file {missing}: no such file\n"), command
        assert not missing.exists()
    finally:
        delete_prefix(url, prefix)


async def test_no_word_of_the_file_when_it_holds_no_letters(upstream, start_sluice, tmp_path):
    url = require_redis()
    prefix = new_prefix()
    try:
        sluice = await start_sluice({
            "state": {"backend": "redis", "redis_url": url, "key_prefix": prefix},
            "dead_letter": {"path": str(tmp_path / "none.sqlite")},
            "routes": [route("openai", upstream.url, retry={"attempts": 2})]})
        code, _, err = await outcome(await cli("dlq", "list", "--config",
                                               str(sluice.config_path)))
        assert code == 0 and err == "", err
        assert "--file" not in sluice.stderr()
        assert not (tmp_path / "none.sqlite").exists()
    finally:
        delete_prefix(url, prefix)
