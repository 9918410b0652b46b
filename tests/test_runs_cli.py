"""``sluice runs`` against admin ports that misbehave (a hostile trial): a token that cannot
be sent, a redirect, a trickle, an answer of another shape, a password in ``--admin``.
Each hostile port is a real socket server on loopback; the CLI is run as in test_runs.py."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp
import pytest
import yaml

import proxy.runs_cli
from proxy.cli import main as cli_main
from tests.conftest import route

SECRET = "TOPSECRET-admin-token"
#: Bytes the trickling port sends, one per TRICKLE_GAP_S: it ends long after the CLI's
#: deadline in the test, and ends, so the CLI before the fix failed rather than hung.
TRICKLE_BYTES = 150
TRICKLE_GAP_S = 0.2


class HostilePort:
    """A loopback server answering every connection with ``answer(conn)``; what each
    connection sent first is kept in ``received``."""

    def __init__(self, answer: Callable[[socket.socket], None]) -> None:
        self.answer = answer
        self.received: list[bytes] = []
        self.conns: list[socket.socket] = []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            try:
                self.received.append(conn.recv(65536))
                self.answer(conn)
            except OSError:
                pass

    def close(self) -> None:
        self.sock.close()
        for conn in self.conns:
            conn.close()


@pytest.fixture
def hostile() -> Iterator[Callable[[Callable[[socket.socket], None]], HostilePort]]:
    ports: list[HostilePort] = []

    def start(answer: Callable[[socket.socket], None]) -> HostilePort:
        ports.append(HostilePort(answer))
        return ports[-1]

    yield start
    for port in ports:
        port.close()


def json_200(body: bytes) -> Callable[[socket.socket], None]:
    def answer(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                     b"%d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
    return answer


def test_a_token_file_with_a_second_line_is_a_config_error_quoting_no_token(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """It passed check-config, then `runs cancel` printed it in http.client's refusal."""
    (tmp_path / "token.txt").write_text(f"{SECRET}\n# rotated 2026-12-01\n")
    config = tmp_path / "sluice.yaml"
    config.write_text(yaml.safe_dump({
        "server": {"listen": "127.0.0.1:8080", "admin_listen": "127.0.0.1:9901"},
        "admin": {"token_file": "token.txt"},
        "routes": [route("a", "http://127.0.0.1:9", "http")]}))
    assert cli_main(["check-config", str(config)]) != 0
    said = capsys.readouterr()
    assert "admin.token_file: the file it names holds whitespace or a control character" in \
        said.err + said.out
    assert SECRET not in said.err + said.out


def test_runs_cancel_refuses_an_env_token_with_a_newline_and_never_prints_it(
        hostile, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    port = hostile(json_200(b"{}"))
    monkeypatch.setenv("SLUICE_ADMIN_TOKEN", f"{SECRET}\nx")
    assert cli_main(["runs", "cancel", "r1", "--admin", port.url]) == 1
    err = capsys.readouterr().err
    assert "SLUICE_ADMIN_TOKEN holds whitespace or a control character" in err
    assert SECRET not in err
    assert port.received == []  # refused before sending anything


def test_runs_never_prints_the_text_of_a_refused_header(
        hostile, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Whatever slips past the token check: http.client's ValueError quotes the header."""
    port = hostile(json_200(b"{}"))
    monkeypatch.setattr(proxy.runs_cli, "token", lambda config: f"{SECRET}\nx")
    assert cli_main(["runs", "cancel", "r1", "--admin", port.url]) == 1
    err = capsys.readouterr().err
    assert "could not be made (ValueError)" in err and SECRET not in err
    assert "is no admin port's URL" not in err  # the URL was not at fault


def test_runs_cancel_follows_no_redirect_and_sends_the_token_nowhere_else(
        hostile, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    elsewhere = hostile(json_200(b"{}"))
    location = f"{elsewhere.url}/stolen".encode()
    redirecting = hostile(lambda conn: conn.sendall(
        b"HTTP/1.1 302 Found\r\nLocation: " + location
        + b"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"))
    monkeypatch.setenv("SLUICE_ADMIN_TOKEN", SECRET)
    assert cli_main(["runs", "cancel", "r1", "--admin", redirecting.url]) == 1
    err = capsys.readouterr().err
    assert "answered 302 (a redirect): sluice does not follow one" in err
    assert elsewhere.received == []
    assert any(SECRET.encode() in sent for sent in redirecting.received)


def test_runs_gives_up_on_a_trickling_admin_port_at_its_deadline(
        hostile, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """One byte at a time, each well within the per-read timeout: `runs list` never ended."""
    def trickle(conn: socket.socket) -> None:
        for byte in (b"HTTP/1.1 200 OK\r\nX-Pad: " + b"a" * TRICKLE_BYTES)[:TRICKLE_BYTES]:
            conn.sendall(bytes([byte]))
            time.sleep(TRICKLE_GAP_S)

    port = hostile(trickle)
    monkeypatch.setattr(proxy.runs_cli, "TIMEOUT_S", 1.0)  # far below the trickle's 30 s
    assert cli_main(["runs", "list", "--admin", port.url]) == 1
    assert f"the admin port at {port.url} did not answer within 1s" in capsys.readouterr().err


@pytest.mark.parametrize("body", [b"{}", b'{"runs": 3}', b"[]"])
def test_an_answer_of_another_shape_is_said_so_not_a_traceback(
        hostile, body: bytes, capsys: pytest.CaptureFixture[str]) -> None:
    port = hostile(json_200(body))
    assert cli_main(["runs", "list", "--admin", port.url]) == 1
    assert "the admin port's answer at" in capsys.readouterr().err


def test_an_answer_that_is_no_json_is_said_so(
        hostile, capsys: pytest.CaptureFixture[str]) -> None:
    # A review: an HTML 200 was "the request ... could not be made (JSONDecodeError)".
    port = hostile(json_200(b"<html>hello</html>"))
    assert cli_main(["runs", "list", "--admin", port.url]) == 1
    assert "is not what Sluice serves (not JSON)" in capsys.readouterr().err


def test_a_token_outside_ascii_is_refused_before_anything_is_sent(
        hostile, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # A review: "could not be made (UnicodeEncodeError)"; no HTTP header can carry it.
    port = hostile(json_200(b"{}"))
    monkeypatch.setenv("SLUICE_ADMIN_TOKEN", "tok\u20acn")
    assert cli_main(["runs", "cancel", "r1", "--admin", port.url]) == 1
    assert "a character outside ASCII in the token" in capsys.readouterr().err
    assert port.received == []


def test_a_password_in_admin_is_not_echoed(capsys: pytest.CaptureFixture[str]) -> None:
    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # a closed port: refused
    assert cli_main(["runs", "list", "--admin", f"http://u:PASSWORD@127.0.0.1:{port}"]) == 1
    err = capsys.readouterr().err
    assert "cannot reach the admin port at http://u:<redacted>@127.0.0.1" in err
    assert "PASSWORD" not in err


async def test_the_server_refuses_cancels_when_its_env_token_holds_a_newline(
        upstream, start_sluice) -> None:
    sluice = await start_sluice({"routes": [route("tools", upstream.url, "http")]},
                                env={"SLUICE_ADMIN_TOKEN": f"{SECRET}\nx"})
    async with aiohttp.ClientSession() as s, s.post(
            f"{sluice.admin_url}/admin/runs/r/cancel",
            headers={"Authorization": f"Bearer {SECRET}"}) as r:
        error = (await r.json())["error"]
    assert r.status == 403
    assert error.startswith("SLUICE_ADMIN_TOKEN holds whitespace or a control character")
    assert SECRET not in error
