"""A local HTTP server for the download tests: in-memory files on 127.0.0.1, each request recorded."""
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import List, Optional

import pytest

# urllib honours *_proxy variables: requests to the local server must never go through one.
NO_PROXY = {"no_proxy": "127.0.0.1,localhost", "NO_PROXY": "127.0.0.1,localhost"}


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's naming)
        self.server.requests.append(self.path)
        content = self.server.files.get(self.path)
        if content is None:
            self.send_error(404, "Not Found")
            return
        declared = self.server.declared_lengths.get(self.path, len(content))
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(declared))
        self.end_headers()
        self.wfile.write(content)  # fewer bytes than declared: the connection then closes early

    def log_message(self, *args):  # keep pytest's output clean
        pass


class LocalServer:
    """A ThreadingHTTPServer on 127.0.0.1:<free port>; `default_name` is the file name when none is given."""

    def __init__(self, default_name: str = "file") -> None:
        self.default_name = default_name
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.httpd.daemon_threads = True
        self.httpd.files, self.httpd.requests, self.httpd.declared_lengths = {}, [], {}
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    @property
    def requests(self) -> List[str]:
        return self.httpd.requests

    def serve(self, data: bytes, name: Optional[str] = None, declared_length: int = 0) -> str:
        """Serves data at /name (with a false Content-Length if declared_length is set); returns its URL."""
        name = name or self.default_name
        self.httpd.files[f"/{name}"] = data
        if declared_length:
            self.httpd.declared_lengths[f"/{name}"] = declared_length
        return self.url(name)

    def url(self, name: Optional[str] = None) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/{name or self.default_name}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


@pytest.fixture(autouse=True)
def no_proxy_for_localhost(monkeypatch):
    """Used with `from local_http import no_proxy_for_localhost` in a test module: autouse there."""
    for key, value in NO_PROXY.items():
        monkeypatch.setenv(key, value)
