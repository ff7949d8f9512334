"""A real S3 server on loopback for tests and benchmarks: `moto_server` (PyPI `moto[server]`) in a
child process, and `DelayProxy`, a TCP proxy in front of it that adds latency to every request and
can answer 503 SlowDown or drop connections (the faults an object store shows).

    with MotoServer() as server:                 # free loopback port; bucket created on demand
        server.create_bucket("data")
        with DelayProxy(server.port, delay_s=0.020) as proxy:
            uri = proxy.uri("data/prefix")       # s3://data/prefix?endpoint_override=127.0.0.1:PORT&scheme=http
            ...

`MotoServer.env()` gives the environment a child process needs (dummy credentials, region).

    python -m benchmarks.s3_server --bucket B [--plain-bodies] -- ARGS...

runs `python ARGS` beside a moto_server with bucket B, every `{endpoint}` in ARGS replaced by the server's
`127.0.0.1:PORT` and its credentials in the environment (`--plain-bodies`: AWS_REQUEST_CHECKSUM_CALCULATION=
when_required, so the AWS SDK inside pyarrow sends plain bodies, not the aws-chunked ones moto decodes slowly:
benchmarks.s3_ceiling); its exit status is the command's.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

from common.interrupts import run_main

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def moto_server_command() -> list[str] | None:
    """The command that starts moto's server, or None where moto[server] is not installed."""
    try:
        import moto.server  # noqa: F401 - this interpreter's moto, not another one on PATH
    except ImportError:
        return None
    return [sys.executable, "-m", "moto.server"]


def _server_env() -> dict:
    """The environment of the moto_server child: PYTHONPATH without this project's root (its
    top-level packages, common, train, ..., would shadow moto's imports) but with the rest (where
    moto may be installed, as on a machine that got it from carried wheels)."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    kept = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != repo]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if kept:
        env["PYTHONPATH"] = os.pathsep.join(kept)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def uri_for(port: int, path: str) -> str:
    return f"s3://{path}?endpoint_override=127.0.0.1:{port}&scheme=http"


class MotoServer:
    """`moto_server` on a free loopback port, stopped on exit."""

    def __init__(self):
        command = moto_server_command()
        if command is None:
            raise RuntimeError("moto[server] is not installed (pip install 'moto[server]==5.2.5')")
        self.port = free_port()
        with open(os.environ.get("MOTO_LOG", os.devnull), "ab") as log:  # the server holds its own copy
            self.proc = subprocess.Popen(
                [*command, "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=subprocess.DEVNULL,
                stderr=log,
                env=_server_env(),
                cwd=tempfile.gettempdir(),  # `-m` puts the working directory first on sys.path
            )
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("moto_server did not start")
            time.sleep(0.1)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def uri(self, path: str) -> str:
        return uri_for(self.port, path)

    def client(self):
        import botocore.session

        return botocore.session.get_session().create_client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )

    def create_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)

    @staticmethod
    def env() -> dict:
        return dict(CREDENTIALS)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> MotoServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


_SLOWDOWN = (
    b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
)
_SLOWDOWN_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code><Message>Please reduce your request '
    b"rate.</Message></Error>"
)


class DelayProxy:
    """A TCP proxy on a free loopback port in front of `target_port`.

    Each request waits `delay_s` before it is forwarded: a request starts when the client sends
    after the server last answered on that connection (HTTP/1.1 keep-alive: one request at a time
    per connection), so every request, not every connection, pays the latency. `slowdown(n)`:
    answer the next n new connections with 503 SlowDown; `down()` / `up()`: refuse (close) new
    connections and cut open ones, as a server that went away. Counts requests in `requests`."""

    def __init__(self, target_port: int, delay_s: float = 0.0):
        self.target_port, self.delay_s = target_port, delay_s
        self.requests = 0
        self._slowdowns = 0
        self._down = False
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(256)
        self.port = self._listener.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, name="delay-proxy", daemon=True).start()

    def uri(self, path: str) -> str:
        return uri_for(self.port, path)

    def slowdown(self, n: int) -> None:
        with self._lock:
            self._slowdowns += n

    def down(self) -> None:
        with self._lock:
            self._down = True
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def up(self) -> None:
        with self._lock:
            self._down = False

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        with self._lock:
            down, slow = self._down, self._slowdowns > 0
            if slow and not down:
                self._slowdowns -= 1
        if down:
            client.close()
            return
        if slow:
            with contextlib.suppress(OSError):
                client.recv(65536)
                client.sendall(_SLOWDOWN % (len(_SLOWDOWN_BODY), _SLOWDOWN_BODY))
            client.close()
            return
        try:
            server = socket.create_connection(("127.0.0.1", self.target_port))
        except OSError:
            client.close()
            return
        for s in (client, server):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            self._conns.update((client, server))
        state = {"answered": True}
        back = threading.Thread(target=self._pump, args=(server, client, state, False), daemon=True)
        back.start()
        self._pump(client, server, state, True)
        back.join()
        with self._lock:
            self._conns.difference_update((client, server))
        for s in (client, server):
            with contextlib.suppress(OSError):
                s.close()

    def _pump(self, src: socket.socket, dst: socket.socket, state: dict, upstream: bool) -> None:
        try:
            while True:
                data = src.recv(1 << 20)
                if not data:
                    break
                if upstream and state["answered"]:  # the first bytes of a new request
                    state["answered"] = False
                    with self._lock:
                        self.requests += 1
                    if self.delay_s:
                        time.sleep(self.delay_s)
                elif not upstream:
                    state["answered"] = True
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()
        self.down()

    def __enter__(self) -> DelayProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("usage: python -m benchmarks.s3_server --bucket B [--plain-bodies] -- ARGS...", file=sys.stderr)
        return 2
    cut = argv.index("--")
    p = argparse.ArgumentParser(prog="python -m benchmarks.s3_server")
    p.add_argument("--bucket", required=True)
    p.add_argument("--plain-bodies", action="store_true")
    args, command = p.parse_args(argv[:cut]), argv[cut + 1 :]
    with MotoServer() as server:
        server.create_bucket(args.bucket)
        env = {**os.environ, **server.env()}
        if args.plain_bodies:
            env["AWS_REQUEST_CHECKSUM_CALCULATION"] = "when_required"
        endpoint = f"127.0.0.1:{server.port}"
        print(f"benchmarks.s3_server: moto_server on {endpoint}, bucket {args.bucket}", flush=True)
        command = [word.replace("{endpoint}", endpoint) for word in command]
        return subprocess.run([sys.executable, *command], env=env).returncode


if __name__ == "__main__":
    raise SystemExit(run_main("benchmarks.s3_server", main))
