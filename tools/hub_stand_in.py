"""A stand-in for the Hugging Face Hub on 127.0.0.1: the few routes huggingface_hub 2.x calls to list a dataset or
model repository and download its files, enough that HF_ENDPOINT can point at it in tests.

    GET  /api/datasets/OWNER/NAME/revision/REV          the repository's info: its commit (sha)
    GET  /api/datasets/OWNER/NAME/tree/REV[/FOLDER]     the files under a folder (one page, recursive)
    HEAD /datasets/OWNER/NAME/resolve/REV/PATH          X-Repo-Commit, ETag (the sha256), Content-Length
    GET  /datasets/OWNER/NAME/resolve/REV/PATH          the bytes, or from a Range's start (206)
and the same for a model: /api/models/OWNER/NAME/..., /OWNER/NAME/resolve/REV/PATH (one set of repositories serves
both kinds). Errors carry the X-Error-Code the Hub sends (RepoNotFound, RevisionNotFound, EntryNotFound, GatedRepo),
which huggingface_hub turns into its error classes. `stall` holds a file's download after some bytes, for a kill;
`private` asks for a token; `etags`, `listed`, `revisions` and `commit` make it a hostile Hub, for the checks of
what it sends.
"""

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

COMMIT = "c0ffee" + "0" * 34


class Hub:
    """Serves `repos` ({"OWNER/NAME": {path: bytes}}); `gated` names repositories whose files need accepted terms;
    `stall` = (path, bytes) holds that file's GET after those bytes until stop(); `requests` logs what was asked,
    `tokens` the Authorization headers. `private` {"OWNER/NAME": token}: that repository is shown to that token
    only, and once one is set, a token not among them is refused as invalid (401), as the Hub refuses one it never
    issued. A hostile Hub: `etags` {path: ETag, or a list of them for its HEADs in turn} answers in place of
    the sha256, `listed` adds entries to every listing, `revisions` are the revisions it says exist (besides main
    and COMMIT), `commit` is the one the repository's info names."""

    def __init__(self, repos: dict, gated=(), stall=None):
        self.repos, self.gated, self.stall = repos, set(gated), stall
        self.etags, self.listed, self.revisions, self.commit, self.private = {}, [], set(), COMMIT, {}
        self.requests, self.tokens, self.stalled, self.release = [], set(), threading.Event(), threading.Event()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()  # stops fast

    def stop(self):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()

    def gets(self, path: str) -> list:
        """The Range headers (None: none) of every GET of a file."""
        return [r for method, p, r in self.requests if method == "GET" and p.endswith("/" + path)]


def _handler(hub: Hub):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet: the tests read hub.requests
            pass

        def do_HEAD(self):
            self._route(body=False)

        def do_GET(self):
            self._route(body=True)

        def _route(self, body: bool):
            path = urlparse(self.path).path
            hub.requests.append((self.command, unquote(path), self.headers.get("Range")))
            parts = [unquote(part) for part in path.strip("/").split("/")]  # a revision's %2F stays in its part
            if parts[:2] in (["api", "datasets"], ["api", "models"]) and len(parts) >= 6:
                self._api("/".join(parts[2:4]), parts[4], parts[5], "/".join(parts[6:]))
            elif parts[:1] == ["datasets"] and len(parts) >= 6 and parts[3] == "resolve":
                self._file("/".join(parts[1:3]), parts[4], "/".join(parts[5:]), body)
            elif parts[:1] != ["api"] and len(parts) >= 5 and parts[2] == "resolve":
                self._file("/".join(parts[:2]), parts[3], "/".join(parts[4:]), body)
            else:  # huggingface_hub's other calls (its agent-harness list) are not ours: their tokens are not logged
                self._error(404, "RepoNotFound")

        def _repo(self, repo: str, revision: str) -> dict | None:
            token = self.headers.get("Authorization")
            hub.tokens.add(token)
            if token and hub.private and token not in {f"Bearer {t}" for t in hub.private.values()}:
                return self._error(401, None, "Invalid credentials in Authorization header")  # one it never issued
            if repo in hub.private and token != f"Bearer {hub.private[repo]}":
                return self._error(404 if token else 401, "RepoNotFound")  # as for a name it does not have
            if repo not in hub.repos:
                return self._error(404, "RepoNotFound")
            if revision not in ("main", COMMIT, hub.commit, *hub.revisions):
                return self._error(404, "RevisionNotFound")
            return hub.repos[repo]

        def _api(self, repo: str, route: str, revision: str, folder: str):
            files = self._repo(repo, revision)
            if files is None:
                return
            if route == "revision":
                return self._json({"id": repo, "sha": hub.commit, "private": repo in hub.private,
                                   "gated": repo in hub.gated})
            listed = [{"type": "file", "path": p, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                      for p, data in sorted(files.items()) if not folder or p.startswith(folder + "/")] + hub.listed
            if not listed:
                return self._error(404, "EntryNotFound")
            self._json(listed)

        def _file(self, repo: str, revision: str, name: str, body: bool):
            files = self._repo(repo, revision)
            if files is None:
                return
            if repo in hub.gated:
                return self._error(403, "GatedRepo")
            if name not in files:
                return self._error(404, "EntryNotFound")
            data = files[name]
            start = int(self.headers["Range"].split("=")[1].split("-")[0]) if self.headers.get("Range") else 0
            self.send_response(206 if start else 200)
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("ETag", f'"{self._etag(name, data)}"')
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(len(data) - start))
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            if body:
                self._send(data[start:], name)

        def _etag(self, name: str, data: bytes) -> str:
            etag = hub.etags.get(name, hashlib.sha256(data).hexdigest())
            if not isinstance(etag, list):
                return etag
            asked = sum(method == "HEAD" and p.endswith("/" + name) for method, p, _ in hub.requests)
            return etag[min(asked, len(etag)) - 1]  # the last one for every HEAD after

        def _send(self, data: bytes, name: str):
            if hub.stall and hub.stall[0] == name:
                self.wfile.write(data[:hub.stall[1]])
                self.wfile.flush()
                hub.stalled.set()
                hub.release.wait()  # the client waits here until it is killed
                return
            self.wfile.write(data)

        def _json(self, obj):
            data = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command == "GET":
                self.wfile.write(data)

        def _error(self, status: int, code: str | None, message: str | None = None):
            self.send_response(status)
            if code:
                self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message or f"{code} (stand-in)")
            self.send_header("Content-Length", "0")
            self.end_headers()

    return Handler
